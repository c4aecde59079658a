"""BF16 tensors through the Open Inference Protocol (14th review: manager/api/convert.py, oip.py,
workers/adapters/safetensors_module.py); each test failed before its fix.

ModelMetadata advertised a safetensors-module model's declared BF16 inputs and outputs, but a BF16
input was refused ("unsupported datatype 'BF16'") and a BF16 output was sent as FP32. NumPy has no
bfloat16 (and `ml_dtypes` is no dependency of the service): inside the service a BF16 tensor is its
bit patterns in a uint16 array, which the module gets as torch.bfloat16 and the client as BF16 raw
bytes (2 per element, little-endian). Real components: the service's gRPC server on a free port over
in-process device hosts, a real safetensors-module model (a bf16 module over its checkpoint file),
the device host's dynamic batching, and `tritonclient` in a child process (its generated `inference`
messages and the service's cannot share one protobuf descriptor pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from manager.api.convert import decode_input
from manager.api.server import build_server
from manager.config import Config, load_config
from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

FACTORIES = "residency_review14_bf16_factories"
CALLS: list[int] = []
"""The rows of each forward of a `_Bf16` module (in-process hosts: the test reads them)."""

# bit patterns that a float32 detour or a byte-order slip would change: +-0, 1.0, -1.5, +-inf, a
# quiet and a signalling NaN, the smallest subnormal, the largest finite value, and plain others
BITS = np.array(
    [0x0000, 0x8000, 0x3F80, 0xBFC0, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x7F7F, 0x4049, 0xABCD],
    np.uint16,
).reshape(4, 3)


class _Bf16(nn.Module):
    """A bf16 module (its one parameter is bf16): `same` is its input as it came, `doubled` its input
    times its parameter (2), computed in bf16, and `is_bf16` whether the input came as torch.bfloat16."""

    residency_inputs = (("x", "BF16", (-1, 3)),)
    residency_outputs = (("same", "BF16", (-1, 3)), ("doubled", "BF16", (-1, 3)), ("is_bf16", "BOOL", (-1,)))

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 2.0, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        CALLS.append(int(x.shape[0]))
        return x.clone(), x * self.scale, torch.full((x.shape[0],), x.dtype == torch.bfloat16)


class _Fp32Out(nn.Module):
    """A float32 module declaring a BF16 input and output: the input comes in its dtype (exactly:
    every bf16 is a float32) and its float32 answer goes out rounded to bf16."""

    residency_inputs = (("x", "BF16", (-1, 3)),)
    residency_outputs = (("y", "BF16", (-1, 3)),)

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.one + 2.0**-10  # 1.0 + 2**-10 is no bf16: it rounds


class _Fp8(nn.Module):
    """Declares an output datatype the service neither decodes nor sends."""

    residency_outputs = (("y", "FP8", (-1, 3)),)

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.one


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


DOUBLED = bits_of(bf16(BITS) * torch.full((1,), 2.0, dtype=torch.bfloat16))


@pytest.fixture
def factories(tmp_path: Path) -> Iterator[Path]:
    """The factory module registered, and each model's checkpoint; yields the folder."""
    mod = types.ModuleType(FACTORIES)
    mod.bf16 = _Bf16  # type: ignore[attr-defined]
    mod.fp32_out = _Fp32Out  # type: ignore[attr-defined]
    mod.fp8 = _Fp8  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    write_safetensors(_Bf16().state_dict(), tmp_path / "bf16.safetensors")
    write_safetensors(_Fp32Out().state_dict(), tmp_path / "fp32.safetensors")
    write_safetensors(_Fp8().state_dict(), tmp_path / "fp8.safetensors")
    CALLS.clear()
    yield tmp_path
    sys.modules.pop(FACTORIES, None)


CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}
host: {{memory: 4GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
models:
  - {{name: bf16, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.05, host: 0.01}}, pin: true, max_batch: 4,
     source: {{factory: "{mod}:bf16", path: "{tmp}/bf16.safetensors"}}}}
server: {{listen: "127.0.0.1:0"}}
store: {{url: "sqlite:///{tmp}/state.db", journal: "{tmp}/requests.journal"}}
"""


def config(tmp: Path) -> Config:
    (tmp / "c.yaml").write_text(CONFIG.format(mod=FACTORIES, tmp=tmp))
    return load_config(tmp / "c.yaml")


@contextlib.asynccontextmanager
async def serving(
    cfg: Config,
) -> AsyncIterator[tuple[int, pb_grpc.GRPCInferenceServiceStub, LiveManager]]:
    """The service's gRPC server on a free port over in-process hosts: its port, a stub, the manager."""
    pool = create_pool(cfg, in_process=True)
    manager = LiveManager(cfg, pool)
    server, port, _ = await build_server(cfg, manager)
    await server.start()
    await manager.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield port, pb_grpc.GRPCInferenceServiceStub(channel), manager  # type: ignore[no-untyped-call]
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


def request(bits: np.ndarray, rid: str = "r") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="bf16", id=rid)
    r.inputs.add(name="x", datatype="BF16", shape=list(bits.shape))
    r.raw_input_contents.append(bits.astype("<u2").tobytes())
    return r


def outputs(resp: pb.ModelInferResponse) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        o.name: (o.datatype, list(o.shape), raw)
        for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)
    }


# ---------------------------------------------------------------------------------------------------
# decoding: BF16 raw bytes are the input's bit patterns; typed contents have no BF16 field


class TestDecode:
    def test_bf16_raw_bytes_decode_to_their_bit_patterns(self) -> None:
        a = decode_input("x", "BF16", [4, 3], BITS.astype("<u2").tobytes(), None)
        assert a.dtype == np.uint16 and a.shape == (4, 3)  # was: InvalidRequest, unsupported datatype
        assert np.array_equal(a, BITS)

    def test_a_wrong_length_is_refused_by_name(self) -> None:
        with pytest.raises(InvalidRequest, match=r"input 'x': 23 raw bytes, expected 24 \(12 x BF16"):
            decode_input("x", "BF16", [4, 3], b"\0" * 23, None)

    def test_typed_contents_are_refused_naming_raw_input_contents(self) -> None:
        contents = pb.InferTensorContents(fp32_contents=[1.0, 2.0])
        with pytest.raises(InvalidRequest) as e:
            decode_input("x", "BF16", [2], None, contents)
        msg = str(e.value)
        assert "input 'x'" in msg and "raw_input_contents" in msg and "BF16" in msg


# ---------------------------------------------------------------------------------------------------
# the service: what ModelMetadata says is what ModelInfer does


class TestOverGrpc:
    def test_metadata_and_infer_agree_and_bits_round_trip(self, factories: Path) -> None:
        async def main() -> None:
            async with serving(config(factories)) as (_, stub, _):
                meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="bf16"), timeout=30)
                assert [(t.name, t.datatype) for t in meta.inputs] == [("x", "BF16")]
                assert [(t.name, t.datatype) for t in meta.outputs] == [
                    ("same", "BF16"),
                    ("doubled", "BF16"),
                    ("is_bf16", "BOOL"),
                ]
                resp = await stub.ModelInfer(request(BITS, "one"), timeout=60)  # was: INVALID_ARGUMENT
                got = outputs(resp)
                assert got["same"] == ("BF16", [4, 3], BITS.astype("<u2").tobytes())  # was: FP32
                assert got["doubled"] == ("BF16", [4, 3], DOUBLED.astype("<u2").tobytes())
                assert got["is_bf16"] == ("BOOL", [4], b"\x01" * 4)  # the module got torch.bfloat16

        asyncio.run(main())

    def test_typed_contents_are_refused_invalid_argument(self, factories: Path) -> None:
        async def main() -> None:
            async with serving(config(factories)) as (_, stub, _):
                r = pb.ModelInferRequest(model_name="bf16")
                r.inputs.add(name="x", datatype="BF16", shape=[1, 3]).contents.fp32_contents.extend([1, 2, 3])
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ModelInfer(r, timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "raw_input_contents" in (e.value.details() or "")

        asyncio.run(main())

    def test_concurrent_requests_each_get_their_own_rows(self, factories: Path) -> None:
        """max_batch 4, calls off the event loop: concurrent requests may be stacked into one call (the
        device host's test below makes sure of it); each answer is its own."""
        rows = [np.roll(BITS.reshape(-1), i)[:3].reshape(1, 3) for i in range(12)]

        async def main() -> None:
            async with serving(config(factories)) as (_, stub, manager):
                await stub.ModelInfer(request(rows[0]), timeout=60)  # the load
                manager._infer_s["bf16"] = 1.0  # as a slow model's: its calls go to a thread, and batch
                CALLS.clear()
                got = await asyncio.gather(
                    *(stub.ModelInfer(request(x, f"r{i}"), timeout=60) for i, x in enumerate(rows))
                )
                assert sum(CALLS) == len(rows)  # each row ran once, in whatever stacks
                for i, (x, resp) in enumerate(zip(rows, got, strict=True)):
                    assert resp.id == f"r{i}"
                    assert outputs(resp)["same"] == ("BF16", [1, 3], x.astype("<u2").tobytes())

        asyncio.run(main())


# ---------------------------------------------------------------------------------------------------
# the device host: dynamic batching stacks the bit patterns; a float32 module's BF16 output rounds


def _load(tmp: Path, name: str, factory: str, max_batch: int = 4) -> tuple[DeviceHost, P.CommandResult]:
    source = {"factory": f"{FACTORIES}:{factory}", "path": str(tmp / f"{factory.split('_')[0]}.safetensors")}
    host = DeviceHost("cpu0", "cpu", node="test")
    return host, host.apply(
        P.Load(P.ModelSpec(name, "safetensors-module", source, max_batch=max_batch)), "load"
    )


def _host(tmp: Path, name: str, factory: str, max_batch: int = 4) -> DeviceHost:
    host, done = _load(tmp, name, factory, max_batch)
    assert done.ok, done.error
    return host


class TestDeviceHost:
    def test_a_batch_of_bf16_requests_is_one_call_with_each_requests_own_bits(self, factories: Path) -> None:
        host = _host(factories, "bf16", "bf16")
        items = [{"x": BITS[i : i + 1].copy()} for i in range(4)]
        CALLS.clear()
        got = host.infer_many([("bf16", x) for x in items])
        assert CALLS == [4]  # stacked: one call of four rows
        for i, r in enumerate(got):  # (the host labels bf16 bits BF16, carried as uint16)
            assert r.ok, r.error
            assert r.outputs["same"][0] == r.outputs["doubled"][0] == "BF16"
            assert r.outputs["same"][1:] == ((1, 3), BITS[i : i + 1].astype("<u2").tobytes())
            assert r.outputs["doubled"][1:] == ((1, 3), DOUBLED[i : i + 1].astype("<u2").tobytes())
            assert r.outputs["is_bf16"] == ("BOOL", (1,), b"\x01")

    def test_a_float32_modules_bf16_output_is_rounded_to_bf16(self, factories: Path) -> None:
        host = _host(factories, "fp32", "fp32_out", max_batch=1)
        one = np.array([[0x3F80, 0x4000, 0xC040]], np.uint16)  # 1.0, 2.0, -3.0
        r = host.infer("fp32", {"x": one})
        assert r.ok, r.error
        want = bits_of((bf16(one).float() + 2.0**-10).to(torch.bfloat16))
        assert r.outputs["y"][1:] == ((1, 3), want.astype("<u2").tobytes())  # was: float32 bytes

    def test_a_datatype_the_service_cannot_send_is_refused_at_the_load(self, factories: Path) -> None:
        """ModelMetadata advertised FP8, and every request for the model then failed."""
        _, done = _load(factories, "fp8", "fp8")
        assert not done.ok and done.error_code == P.FACTORY_FAILED  # was: loaded
        assert "'y' as 'FP8'" in (done.error or "") and "BF16" in (done.error or "")


# ---------------------------------------------------------------------------------------------------
# tritonclient: sends an ml_dtypes.bfloat16 array, reads BF16 back with as_numpy

TRITON_CLIENT = r"""
import json, sys
import ml_dtypes
import numpy as np
import tritonclient.grpc as tc

bits = np.array(json.loads(sys.argv[2]), np.uint16)
c = tc.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
meta = c.get_model_metadata("bf16")
x = tc.InferInput("x", list(bits.shape), "BF16")
x.set_data_from_numpy(bits.view(ml_dtypes.bfloat16))
res = c.infer("bf16", [x])
out = {"meta": [[t.name, t.datatype] for t in meta.inputs]}
for name in ("same", "doubled"):
    a = res.as_numpy(name)
    out[name] = [str(a.dtype), a.view(np.uint16).tolist()]
out["is_bf16"] = res.as_numpy("is_bf16").tolist()
c.close()
print(json.dumps(out))
"""


def test_tritonclient_sends_and_reads_bf16(factories: Path) -> None:
    async def main() -> dict[str, Any]:
        async with serving(config(factories)) as (port, _, _):
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", TRITON_CLIENT, str(port), json.dumps(BITS.tolist())],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            got: dict[str, Any] = json.loads(done.stdout)
            return got

    got = asyncio.run(main())
    assert got["meta"] == [["x", "BF16"]]
    assert got["same"] == ["bfloat16", BITS.tolist()]
    assert got["doubled"] == ["bfloat16", DOUBLED.tolist()]
    assert got["is_bf16"] == [True] * 4
