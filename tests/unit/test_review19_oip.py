"""Review 19 of the Open Inference Protocol surface (manager/api/oip.py, protos/): Triton calls that stock
tools make and the service answered UNIMPLEMENTED.

- ModelStatistics (tritonclient's `get_inference_statistics`, perf_analyzer's server-side figures):
  per model, the ModelInfer calls the service answered: successes and failures with their time from
  arrival to answer, the queue wait (admission and a cold start's load) and the device host's compute
  time of each success, and the time of the last call.
- ModelConfig (tritonclient's `get_model_config`, which perf_analyzer calls before it sends anything):
  name, platform, max_batch_size 0 (the declared shapes are the full shapes a request sends) and the
  declared inputs and outputs with their Triton data types.
- ModelMetadata of a model whose factory module cannot be imported (expected to fail; the fix is in
  workers/adapters/safetensors_module.py, see `TestAModelWhoseFactoryCannotBeImported`).

Real components: the service's gRPC server on a free port over in-process device hosts with
configs/local-cpu.yaml's voice model and safetensors-module models whose factory is a module put in
`sys.modules` here; `tritonclient` runs in a child process (its generated `inference` messages and the
service's cannot share one protobuf descriptor pool)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from live_helpers import CONFIG, grpc_service, on_port_0, served_world_config
from torch import nn

from manager.api.oip import WORLD_PLATFORM
from manager.api.server import Frontends, build_server
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers.st_io import write_safetensors

FACTORIES = "residency_review19_oip_factories"
ABSENT = "residency_review19_absent_factories"
"""A factory module that is not importable until a test puts it in `sys.modules`."""
LRU = "policy: {name: lru-keepalive}"  # nothing prewarmed: a model loads for its first request


class _Lin(nn.Module):
    """x FP32 [-1, 4] -> y FP32 [-1, 2]."""

    residency_inputs = (("x", "FP32", (-1, 4)),)
    residency_outputs = (("y", "FP32", (-1, 2)),)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc(x)
        return y


def _model_line(name: str, factory: str, path: Path) -> str:
    return (
        f"  - {{name: {name}, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,\n"
        "     load_seconds: {disk: 0.1, host: 0.05},\n"
        f'     source: {{factory: "{factory}", path: "{path}"}}}}\n'
    )


@pytest.fixture
def factories() -> Iterator[None]:
    mod = types.ModuleType(FACTORIES)
    mod.lin = _Lin  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    yield
    sys.modules.pop(FACTORIES, None)
    sys.modules.pop(ABSENT, None)


def _config(tmp: Path, **server: Any) -> Config:
    """local-cpu's voice; `lin` (a real checkpoint); `gone` (its checkpoint missing: every load of it
    fails, after admission); `bad` (its factory module not importable)."""
    ck = tmp / "lin.safetensors"
    write_safetensors(_Lin().state_dict(), ck)
    lines = (
        _model_line("lin", f"{FACTORIES}:lin", ck)
        + _model_line("gone", f"{FACTORIES}:lin", tmp / "missing.safetensors")
        + _model_line("bad", f"{ABSENT}:lin", ck)
    )
    text = CONFIG.read_text().replace("policy: {name: residency}", lines + LRU)
    (tmp / "c.yaml").write_text(text)
    base = load_config(tmp / "c.yaml")
    cfg = on_port_0(base, tmp)
    return cfg.model_copy(
        update={
            "models": [m for m in cfg.models if m.name in ("voice", "lin", "gone", "bad")],
            "server": cfg.server.model_copy(update=server),
        }
    )


@contextlib.asynccontextmanager
async def stub_of(config: Config) -> AsyncIterator[tuple[pb_grpc.GRPCInferenceServiceStub, LiveManager, int]]:
    async with (
        grpc_service(config) as (port, manager, _, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        yield stub, manager, port


def voice(n: int = 1024, datatype: str = "FP32") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice")
    r.inputs.add(name="audio", datatype=datatype, shape=[n])
    r.raw_input_contents.append(np.zeros(n, np.float32).tobytes())
    return r


def lin(model: str = "lin") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model)
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    return r


async def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _durations(s: pb.InferStatistics) -> dict[str, tuple[int, bool]]:
    """Each of an InferStatistics' durations as (count, ns > 0)."""
    return {f.name: (getattr(s, f.name).count, getattr(s, f.name).ns > 0) for f in s.DESCRIPTOR.fields}


class TestModelStatistics:
    """tritonclient's get_inference_statistics was UNIMPLEMENTED "Method not found!"."""

    def test_successes_failures_and_their_times_per_model(self, tmp_path: Path, factories: None) -> None:
        async def main() -> None:
            async with stub_of(_config(tmp_path)) as (stub, manager, _):
                before = manager.clock()
                for _ in range(2):
                    await stub.ModelInfer(voice(), timeout=60)
                code, _ = await code_of(stub.ModelInfer(voice(datatype="FP64"), timeout=60))
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                code, details = await code_of(stub.ModelInfer(lin("gone"), timeout=60))
                assert code == grpc.StatusCode.UNAVAILABLE and "missing.safetensors" in details

                (v,) = (
                    await stub.ModelStatistics(pb.ModelStatisticsRequest(name="voice"), timeout=30)
                ).model_stats
                assert (v.name, v.version, v.inference_count, v.execution_count) == ("voice", "1", 2, 2)
                assert v.last_inference >= int(before * 1000)
                assert _durations(v.inference_stats) == {
                    "success": (2, True),  # arrival to answer
                    "fail": (1, True),  # the one refused INVALID_ARGUMENT
                    "queue": (2, True),  # admission and its wait
                    "compute_input": (0, False),
                    "compute_infer": (2, True),  # the device host's forward
                    "compute_output": (0, False),
                    "cache_hit": (0, False),
                    "cache_miss": (0, False),
                }
                (g,) = (
                    await stub.ModelStatistics(pb.ModelStatisticsRequest(name="gone"), timeout=30)
                ).model_stats
                assert (g.inference_count, g.execution_count) == (0, 0)
                assert (g.inference_stats.success.count, g.inference_stats.fail.count) == (0, 1)
                # every model, the ones never asked for included (all zeros), in the config's order
                every = await stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=30)
                assert [(s.name, s.version) for s in every.model_stats] == [
                    ("voice", "1"), ("lin", "1"), ("gone", "1"), ("bad", "1")
                ]  # fmt: skip
                assert every.model_stats[0] == v
                never = every.model_stats[1]
                assert (never.last_inference, never.inference_count, never.execution_count) == (0, 0, 0)
                assert set(_durations(never.inference_stats).values()) == {(0, False)}
                one = await stub.ModelStatistics(
                    pb.ModelStatisticsRequest(name="voice", version="1"), timeout=30
                )
                assert list(one.model_stats) == [v]

        asyncio.run(main())

    def test_an_unknown_model_or_version_is_not_found_by_name(self, tmp_path: Path, factories: None) -> None:
        async def main() -> None:
            async with stub_of(_config(tmp_path)) as (stub, _, _):
                code, details = await code_of(stub.ModelStatistics(pb.ModelStatisticsRequest(name="nope")))
                assert code == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in details
                ask = pb.ModelStatisticsRequest(name="voice", version="2")
                code, details = await code_of(stub.ModelStatistics(ask))
                assert (code, details) == (
                    grpc.StatusCode.NOT_FOUND,
                    "model 'voice' has no version '2'; versions: 1",
                )

        asyncio.run(main())

    def test_a_call_through_a_front_end_counts_as_a_direct_one(self, tmp_path: Path, factories: None) -> None:
        """ModelInfer through a front end is served by the fast path's servicer, ModelStatistics by the
        manager's gRPC server: both see the same figures."""
        cfg = _config(tmp_path, frontends=1)

        async def main() -> None:
            pool = create_pool(cfg, in_process=True)
            manager = LiveManager(cfg, pool)
            fronts = Frontends(cfg, manager)
            async with contextlib.AsyncExitStack() as stack:
                stack.callback(pool.close)
                backend, _, _ = await build_server(cfg, manager, listen=fronts.backend)
                stack.push_async_callback(manager.stop)
                stack.push_async_callback(backend.stop, None)
                await backend.start()
                stack.push_async_callback(fronts.stop)
                port = await fronts.start()
                await manager.start()
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                    await stub.ModelInfer(voice(), timeout=60)
                    await stub.ModelInfer(lin(), timeout=60)
                    got = await stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=30)
                    counts = {s.name: s.inference_stats.success.count for s in got.model_stats}
                    assert counts == {"voice": 1, "lin": 1, "gone": 0, "bad": 0}

        asyncio.run(main())


class TestModelConfig:
    """tritonclient's get_model_config (perf_analyzer's first call) was UNIMPLEMENTED "Method not found!"."""

    def test_the_declared_tensors_as_triton_data_types(self, tmp_path: Path, factories: None) -> None:
        async def main() -> None:
            async with stub_of(_config(tmp_path)) as (stub, _, _):
                for version in ("", "1"):
                    c = (
                        await stub.ModelConfig(pb.ModelConfigRequest(name="lin", version=version), timeout=30)
                    ).config
                    assert (c.name, c.platform, c.max_batch_size) == (
                        "lin",
                        "residency/safetensors-module",
                        0,
                    )
                    assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in c.input] == [
                        ("x", "TYPE_FP32", [-1, 4])
                    ]
                    assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in c.output] == [
                        ("y", "TYPE_FP32", [-1, 2])
                    ]
                c = (await stub.ModelConfig(pb.ModelConfigRequest(name="voice"), timeout=30)).config
                assert (c.name, c.platform) == ("voice", "residency/silero-vad")
                assert [(t.name, t.data_type, list(t.dims)) for t in c.input] == [
                    ("audio", pb.TYPE_FP32, [-1])
                ]
                code, details = await code_of(stub.ModelConfig(pb.ModelConfigRequest(name="nope")))
                assert code == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in details
                code, details = await code_of(
                    stub.ModelConfig(pb.ModelConfigRequest(name="lin", version="3"))
                )
                assert (code, details) == (
                    grpc.StatusCode.NOT_FOUND,
                    "model 'lin' has no version '3'; versions: 1",
                )

        asyncio.run(main())

    def test_bytes_is_type_string(self) -> None:
        """Triton's config names OIP's BYTES TYPE_STRING; every other datatype is TYPE_<datatype>."""
        from manager.api.oip import data_type

        assert data_type("BYTES") == pb.TYPE_STRING
        for d in ("BOOL", "UINT8", "INT64", "FP16", "BF16", "FP64"):
            assert pb.DataType.Name(data_type(d)) == f"TYPE_{d}"
        assert data_type("COMPLEX64") == pb.TYPE_INVALID

    def test_a_world_model_declares_no_tensors(self, tmp_path: Path) -> None:
        async def main() -> None:
            async with stub_of(served_world_config(tmp_path, LRU + "\n")) as (stub, _, _):
                c = (await stub.ModelConfig(pb.ModelConfigRequest(name="world"), timeout=30)).config
                assert (c.name, c.platform, list(c.input), list(c.output)) == (
                    "world",
                    WORLD_PLATFORM,
                    [],
                    [],
                )

        asyncio.run(main())


TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

c = tc.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
i = tc.InferInput("x", [1, 4], "FP32")
i.set_data_from_numpy(np.ones((1, 4), np.float32))
c.infer("lin", [i])
out = {
    "stats": c.get_inference_statistics("lin", as_json=True),
    "all": [s["name"] for s in c.get_inference_statistics(as_json=True)["model_stats"]],
    "config": c.get_model_config("lin", as_json=True),
}
try:
    c.get_inference_statistics("nope")
except InferenceServerException as e:
    out["nope"] = [e.status(), e.message()]
c.close()
print(json.dumps(out))
"""


def test_tritonclient_reads_the_statistics_and_the_config(tmp_path: Path, factories: None) -> None:
    result: dict[str, Any] = {}

    async def main() -> None:
        async with stub_of(_config(tmp_path)) as (_, _, port):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", TRITON_CLIENT, str(port),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, stderr.decode()[-3000:]
            result.update(json.loads(stdout))

    asyncio.run(main())
    (s,) = result["stats"]["model_stats"]
    assert (s["name"], s["version"], s["inference_count"], s["execution_count"]) == ("lin", "1", "1", "1")
    assert s["inference_stats"]["success"]["count"] == "1"
    assert int(s["inference_stats"]["compute_infer"]["ns"]) > 0
    assert result["all"] == ["voice", "lin", "gone", "bad"]
    config = result["config"]["config"]
    assert (config["name"], config["platform"]) == ("lin", "residency/safetensors-module")
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["-1", "4"]}]
    assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": ["-1", "2"]}]
    status, message = result["nope"]
    assert status == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in message


class TestAModelWhoseFactoryCannotBeImported:
    """ModelMetadata answered guessed tensors (`input` FP32 [-1, -1] -> `output`), kept for good (the
    manager's describer keeps a successful answer per spec): a client building its request from the
    metadata sent a tensor the model does not have, and a request with the model's real inputs was
    refused INVALID_ARGUMENT "has no input" even after the module was put in place. Expected:
    UNAVAILABLE naming the import failure (as Triton answers a model that failed to load), and the
    module's own tensors once it imports."""

    def test_metadata_says_why_then_the_declared_tensors(self, tmp_path: Path, factories: None) -> None:
        async def main() -> None:
            async with stub_of(_config(tmp_path)) as (stub, _, _):
                code, details = await code_of(stub.ModelMetadata(pb.ModelMetadataRequest(name="bad")))
                assert code == grpc.StatusCode.UNAVAILABLE
                assert f"cannot import factory module {ABSENT!r}" in details
                code, details = await code_of(stub.ModelInfer(lin("bad"), timeout=60))
                assert code == grpc.StatusCode.UNAVAILABLE and ABSENT in details
                mod = types.ModuleType(ABSENT)
                mod.lin = _Lin  # type: ignore[attr-defined]
                sys.modules[ABSENT] = mod  # the module put in place
                meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="bad"), timeout=30)
                assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4])]

        asyncio.run(main())


TRITON_FIELDS = r"""
import json, sys
from tritonclient.grpc import model_config_pb2, service_pb2

out = {}
for name in json.loads(sys.argv[1]):
    fd = service_pb2 if name in service_pb2.DESCRIPTOR.message_types_by_name else model_config_pb2
    d = fd.DESCRIPTOR.message_types_by_name[name]
    out[name] = {f.name: [f.number, f.type, f.is_repeated, (f.message_type or f.enum_type or d).full_name]
                 for f in d.fields}
dtypes = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
out["DataType"] = {v.name: v.number for v in dtypes.values}
print(json.dumps(out))
"""
NEW_MESSAGES = [
    "ModelConfigRequest", "ModelConfigResponse", "ModelConfig", "ModelInput", "ModelOutput",
    "ModelStatisticsRequest", "ModelStatisticsResponse", "ModelStatistics", "InferStatistics",
    "StatisticDuration", "InferBatchStatistics", "MemoryUsage", "InferResponseStatistics",
]  # fmt: skip


def test_the_new_messages_are_tritons_on_the_wire() -> None:
    """Every field of the messages added for ModelConfig and ModelStatistics has the name, number, type
    and cardinality of Triton's (tritonclient's descriptors): ModelConfig is cut to the fields served."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", TRITON_FIELDS, json.dumps(NEW_MESSAGES)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    triton = json.loads(done.stdout)
    for name in NEW_MESSAGES:
        d = pb.DESCRIPTOR.message_types_by_name[name]
        ours = {
            f.name: [f.number, f.type, f.is_repeated, (f.message_type or f.enum_type or d).full_name]
            for f in d.fields
        }
        assert ours == {k: v for k, v in triton[name].items() if k in ours}, name
        if not name.startswith("ModelConfig") and name not in ("ModelInput", "ModelOutput"):
            assert ours.keys() == triton[name].keys(), name  # the statistics messages are whole
    assert {v.name: v.number for v in pb.DataType.DESCRIPTOR.values} == triton["DataType"]
    services = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    assert (services["ModelConfig"].input_type.name, services["ModelConfig"].output_type.name) == (
        "ModelConfigRequest",
        "ModelConfigResponse",
    )
    assert (services["ModelStatistics"].input_type.name, services["ModelStatistics"].output_type.name) == (
        "ModelStatisticsRequest",
        "ModelStatisticsResponse",
    )
