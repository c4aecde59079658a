"""Found in the 14th review of the gRPC surface; each test failed before its fix. Real components:
the service's gRPC server on a free port over in-process device hosts and the real voice model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


def test_a_world_client_that_always_has_its_next_pose_waiting_is_stopped_at_once(tmp_path: Path) -> None:
    """Found by the README audit: at a stop, a world stream whose client always had its next pose
    waiting kept stepping (the read was ready, so it won over the stop) through the stop's whole
    grace, and then ended with gRPC's own "Cancelling all calls", not naming the session to resume.
    A stop now wins over a message already there. (End to end, in one process, the stop mostly won
    the race already: this guards the behaviour; the next test makes the race certain.)"""
    from live_helpers import served_world_config as world_config
    from test_review12_api import serving as serving_world

    from residency_proto.v1 import residency_pb2 as rpb
    from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

    cfg = world_config(tmp_path)

    async def main() -> None:
        async with serving_world(cfg) as (channel, _manager, server):
            call = rpb_grpc.WorldSessionStub(channel).Run()
            await call.write(rpb.WorldInput(start=rpb.WorldStart(model="world")))
            opened = await call.read()
            for i in range(30):  # the client's poses are all there before the stop
                await call.write(rpb.WorldInput(action=rpb.WorldAction(x=float(i))))
            assert (await call.read()).segment == 0
            server.world_stopping.set()  # as `serve` does when it stops
            segments = 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while True:
                    await call.read()
                    segments += 1
            assert segments <= 1, f"{segments} more segments stepped after the stop"
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            details = e.value.details() or ""
            assert "the server is stopping" in details
            assert f"resume_session_id={opened.session_id!r})" in details

    asyncio.run(main())


def test_a_stop_wins_over_a_message_already_there() -> None:
    """The race behind the test above, made certain: with the stop set and the client's next
    message ready in the same turn of the loop, `_next` handed out the message (so the session
    stepped on); now it ends the stream."""
    from manager.api.world import ServerStopping, WorldSessionServicer

    async def ready() -> AsyncIterator[str]:
        for i in range(3):
            yield f"pose {i}"

    async def main() -> None:
        servicer = WorldSessionServicer(manager=None)  # type: ignore[arg-type]  # (_next uses none)
        it = aiter(ready())
        assert await servicer._next(it) == "pose 0"  # type: ignore[arg-type,comparison-overlap]
        servicer.stopping.set()
        with pytest.raises(ServerStopping):
            await servicer._next(it)  # type: ignore[arg-type]

    asyncio.run(main())
