"""Review 19 of the admin Stats reply (protos/residency_proto/v1/residency.proto): a request that failed
after admission, before it ran (its model's load failed, or did not finish in time), was counted in
`LiveManager.failed` and the requests metric (outcome `error`), but not in Stats, which said `requests`
(those that ran) and `rejected` (those admission refused) only: such a failure showed nowhere in
`residency stats`. Now StatsResponse has `errors` (field 10, a backward-compatible addition).

Real components: the service's gRPC server on a free port over in-process device hosts, a
safetensors-module model whose checkpoint file is missing (every load of it fails)."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from live_helpers import CONFIG, grpc_service, on_port_0
from torch import nn

from manager.config import Config, load_config
from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

FACTORIES = "residency_review19_stats_factories"


@pytest.fixture
def factories() -> Iterator[None]:
    mod = types.ModuleType(FACTORIES)
    mod.lin = lambda: nn.Linear(4, 2)  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    yield
    sys.modules.pop(FACTORIES, None)


def _config(tmp: Path) -> Config:
    """local-cpu's voice and `gone`, whose checkpoint is missing; nothing prewarmed."""
    gone = (
        "  - {name: gone, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,\n"
        "     load_seconds: {disk: 0.1, host: 0.05},\n"
        f'     source: {{factory: "{FACTORIES}:lin", path: "{tmp / "missing.safetensors"}"}}}}\n'
    )
    text = CONFIG.read_text().replace("policy: {name: residency}", gone + "policy: {name: lru-keepalive}")
    (tmp / "c.yaml").write_text(text)
    cfg = on_port_0(load_config(tmp / "c.yaml"), tmp)
    return cfg.model_copy(update={"models": [m for m in cfg.models if m.name in ("voice", "gone")]})


def test_stats_response_keeps_its_fields_and_adds_errors() -> None:
    """Backward compatible: the earlier fields keep their numbers and types; `errors` (review 19) and
    `cancelled` (review 29) are new numbers."""
    fields = {f.name: (f.number, f.type) for f in pb.StatsResponse.DESCRIPTOR.fields}
    i64, dbl, msg = FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_MESSAGE
    assert fields == {
        "requests": (1, i64), "cold_starts": (2, i64), "load_wait_s": (3, dbl), "evictions": (4, i64),
        "thrash": (5, i64), "rejected": (6, i64), "budget_violations": (7, i64), "wait_p99_s": (8, msg),
        "resident_bytes": (9, msg), "errors": (10, i64), "cancelled": (11, i64), "failed_runs": (12, i64),
    }  # fmt: skip
    old = pb.StatsResponse(requests=3, rejected=1)
    assert pb.StatsResponse.FromString(old.SerializeToString()).errors == 0  # an older server's reply


def test_stats_counts_a_request_whose_load_failed(tmp_path: Path, factories: None) -> None:
    async def main() -> None:
        async with (
            grpc_service(_config(tmp_path)) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            request = oip.ModelInferRequest(model_name="gone")
            request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(  # type: ignore[no-untyped-call]
                    request, timeout=60
                )
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            stub = pb_grpc.ResidencyStub(channel)  # type: ignore[no-untyped-call]
            stats = await stub.Stats(pb.StatsRequest(), timeout=30)
            assert (stats.errors, stats.requests, stats.rejected) == (1, 0, 0)
            assert stats.errors == manager.failed

    asyncio.run(main())
