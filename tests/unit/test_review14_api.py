"""Found in the 14th review of the gRPC surface; each test failed before its fix. Real components:
the service's gRPC server on a free port over in-process device hosts and the real voice model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_helpers import local_config
from test_review13_api import rpc_error, serving, voice_request

from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc


def test_a_model_that_raises_is_internal_not_unavailable(tmp_path: Path) -> None:
    """A model whose code raised (or a batch that may have run, its answer lost: the data channel
    broke after it was sent) was answered UNAVAILABLE, which clients' retry policies retry: a
    stateful model (the voice detector keeps state) would run the request a second time. Now it is
    INTERNAL, with the model's error in the details; the next request runs as usual."""
    cfg = local_config(tmp_path, ("voice",))

    async def main() -> None:
        async with serving(cfg) as (channel, _manager, pool):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(voice_request())  # loaded, and answered
            r = pool.hosts["cpu0"].models["voice"]
            real = r.adapter.infer

            def broken(runnable: Any, inputs: Any) -> Any:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            r.adapter.infer = broken
            e = await rpc_error(stub.ModelInfer(voice_request()))
            assert e.code() == grpc.StatusCode.INTERNAL, e
            assert "illegal memory access" in (e.details() or "")
            r.adapter.infer = real
            assert (await stub.ModelInfer(voice_request())).outputs

    asyncio.run(main())


@pytest.mark.parametrize("code", ["worker_died", "load_timeout"])
def test_a_host_that_could_not_run_it_is_still_unavailable(code: str) -> None:
    """Only 'it ran and failed' changed: a host that could not run the request stays UNAVAILABLE."""
    from manager.live_sessions import worker_error

    assert type(worker_error(code, "x")).__name__ == "WorkerUnavailable"
