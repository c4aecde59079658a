"""A BF16 output says BF16 inside the service too (15th review: workers/protocol.py, workers/host.py,
workers/adapters/base.py, manager/api/oip.py); each test failed before its fix.

numpy has no bfloat16: a safetensors module's BF16 output leaves it as its bit patterns in a uint16
array, and the device host labelled that output UINT16 in its `InferResult`. Only the OIP layer,
reading the model's declared outputs, sent it as BF16: whatever read a worker's result without the
declaration (logs, the CLI's demos, tests) saw UINT16, and a model that truly answers UINT16 could
not be told from it. Now the host labels it BF16 (bits as they were) and says so
(`carriers_labelled`); the OIP layer relabels only an older host's result, which lacks the flag.
Real components: a real safetensors-module model over its checkpoint file, the device host (alone
and with dynamic batching), and the service's gRPC server over in-process device hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
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

from manager.api.server import build_server
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import host as host_mod
from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

FACTORIES = "residency_review15_bf16_label_factories"

# bit patterns a float detour or a byte-order slip would change: +-0, 1.0, -1.5, +-inf, a quiet and a
# signalling NaN, the smallest subnormal, the largest finite value, and plain others
BITS = np.array(
    [0x0000, 0x8000, 0x3F80, 0xBFC0, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x7F7F, 0x4049, 0xABCD],
    np.uint16,
).reshape(4, 3)


class _Both(nn.Module):
    """A bf16 module with a BF16 output (`same`: its input as it came) and a real UINT16 one (`count`:
    the same bit patterns read as 16-bit unsigned integers)."""

    residency_inputs = (("x", "BF16", (-1, 3)),)
    residency_outputs = (("same", "BF16", (-1, 3)), ("count", "UINT16", (-1, 3)))

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x.view(torch.int16).to(torch.int32) & 0xFFFF


class _Uint16Only(nn.Module):
    """A module whose one output is truly UINT16 (its FP32 input as 16-bit integers)."""

    residency_inputs = (("x", "FP32", (-1, 3)),)
    residency_outputs = (("y", "UINT16", (-1, 3)),)

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.one).to(torch.int32)


@pytest.fixture
def factories(tmp_path: Path) -> Iterator[Path]:
    mod = types.ModuleType(FACTORIES)
    mod.both = _Both  # type: ignore[attr-defined]
    mod.uint16 = _Uint16Only  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    write_safetensors(_Both().state_dict(), tmp_path / "both.safetensors")
    write_safetensors(_Uint16Only().state_dict(), tmp_path / "uint16.safetensors")
    yield tmp_path
    sys.modules.pop(FACTORIES, None)


def _host(tmp: Path, name: str, max_batch: int = 1) -> DeviceHost:
    source = {"factory": f"{FACTORIES}:{name}", "path": str(tmp / f"{name}.safetensors")}
    host = DeviceHost("cpu0", "cpu", node="test")
    done = host.apply(P.Load(P.ModelSpec(name, "safetensors-module", source, max_batch=max_batch)), "load")
    assert done.ok, done.error
    return host


def le(bits: np.ndarray) -> bytes:
    return bits.astype("<u2").tobytes()


# ---------------------------------------------------------------------------------------------------
# the device host's result


class TestDeviceHost:
    def test_a_bf16_output_says_bf16_with_its_bits_and_a_uint16_output_says_uint16(
        self, factories: Path
    ) -> None:
        r = _host(factories, "both").infer("both", {"x": BITS.copy()})
        assert r.ok, r.error
        assert r.outputs["same"] == ("BF16", (4, 3), le(BITS))  # was: ("UINT16", ...)
        assert r.outputs["count"] == ("UINT16", (4, 3), le(BITS))  # the same bytes, truly UINT16
        assert r.carriers_labelled
        # read back without any declaration: the bit patterns, in their carrier
        assert np.array_equal(P.output_array(r.outputs["same"]), BITS)  # was: ValueError (BF16)

    def test_batched_requests_each_say_bf16(self, factories: Path) -> None:
        host = _host(factories, "both", max_batch=4)
        got = host.infer_many([("both", {"x": BITS[i : i + 1].copy()}) for i in range(4)])
        for i, r in enumerate(got):
            assert r.ok, r.error
            assert r.outputs["same"] == ("BF16", (1, 3), le(BITS[i : i + 1]))  # was: UINT16
            assert r.outputs["count"] == ("UINT16", (1, 3), le(BITS[i : i + 1]))
            assert r.carriers_labelled

    def test_a_module_whose_output_is_truly_uint16_stays_uint16(self, factories: Path) -> None:
        x = np.array([[1, 2, 65535]], np.float32)
        r = _host(factories, "uint16").infer("uint16", {"x": x})
        assert r.ok, r.error
        assert r.outputs["y"] == ("UINT16", (1, 3), le(np.array([[1, 2, 65535]])))

    def test_the_label_survives_pickling_as_results_cross_to_the_manager(self, factories: Path) -> None:
        r = _host(factories, "both").infer("both", {"x": BITS.copy()})
        back = pickle.loads(pickle.dumps(r))
        assert back.outputs["same"][0] == "BF16" and back.carriers_labelled


class TestEncode:
    def test_a_bf16_carrier_is_labelled_bf16_bytes_little_endian(self) -> None:
        assert P.encode_output(BITS, "BF16") == ("BF16", (4, 3), le(BITS))
        assert P.encode_output(BITS.astype(">u2"), "BF16") == ("BF16", (4, 3), le(BITS))
        assert P.encode_output(BITS) == ("UINT16", (4, 3), le(BITS))  # unlabelled: its numpy dtype

    def test_a_bf16_label_on_another_dtype_is_refused_naming_both(self) -> None:
        with pytest.raises(ValueError, match=r"BF16 output is held as uint16.*not float32"):
            P.encode_output(np.zeros(3, np.float32), "BF16")
        with pytest.raises(ValueError, match=r"'FP32' is not a datatype numpy holds in a carrier"):
            P.encode_output(np.zeros(3, np.float32), "FP32")

    def test_the_host_answers_a_mislabelled_output_internal_naming_it(self) -> None:
        r = host_mod._answer("m", {"y": np.zeros(3, np.float32)}, {"y": "BF16"}, 0.0, 0.0)
        assert not r.ok and r.error_code == P.INTERNAL
        assert (
            "model 'm'" in (r.error or "")
            and "output 'y'" in (r.error or "")
            and "float32" in (r.error or "")
        )


def test_an_older_hosts_result_lacks_the_flag() -> None:
    """A result pickled by an older host has no `carriers_labelled`: it reads False."""
    new = P.InferResult("m", True, outputs={"y": P.encode_output(BITS)}, carriers_labelled=True)
    old = P.InferResult.__new__(P.InferResult)
    old.__dict__.update({k: v for k, v in new.__dict__.items() if k != "carriers_labelled"})
    assert pickle.loads(pickle.dumps(old)).carriers_labelled is False


# ---------------------------------------------------------------------------------------------------
# the service: BF16 over the wire, as before; UINT16 stays UINT16; an older host's UINT16 label is
# still sent as BF16

CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}
host: {{memory: 4GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
models:
  - {{name: both, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.05, host: 0.01}}, pin: true,
     source: {{factory: "{mod}:both", path: "{tmp}/both.safetensors"}}}}
server: {{listen: "127.0.0.1:0"}}
store: {{url: "sqlite:///{tmp}/state.db", journal: "{tmp}/requests.journal"}}
"""


def config(tmp: Path) -> Config:
    (tmp / "c.yaml").write_text(CONFIG.format(mod=FACTORIES, tmp=tmp))
    return load_config(tmp / "c.yaml")


@contextlib.asynccontextmanager
async def serving(cfg: Config) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    pool = create_pool(cfg, in_process=True)
    manager = LiveManager(cfg, pool)
    server, port, _ = await build_server(cfg, manager)
    await server.start()
    await manager.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


def request(bits: np.ndarray) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="both", id="r")
    r.inputs.add(name="x", datatype="BF16", shape=list(bits.shape))
    r.raw_input_contents.append(le(bits))
    return r


def wire(resp: pb.ModelInferResponse) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        o.name: (o.datatype, list(o.shape), raw)
        for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)
    }


def _old_answer(
    model: str, out: dict[str, np.ndarray], carried: dict[str, str], took: float, held: float
) -> P.InferResult:
    """What an older host answered: every output labelled by its numpy dtype, and no flag."""
    outputs = {k: P.encode_output(v) for k, v in out.items()}
    old = P.InferResult(model, True, outputs=outputs, seconds=took, hold_seconds=held)
    state = {k: v for k, v in old.__dict__.items() if k != "carriers_labelled"}
    legacy = P.InferResult.__new__(P.InferResult)
    legacy.__dict__.update(state)
    back: P.InferResult = pickle.loads(pickle.dumps(legacy))
    return back


@pytest.mark.parametrize("older_host", [False, True], ids=["this-host", "older-host"])
def test_the_wire_says_bf16_and_uint16_as_declared(
    factories: Path, monkeypatch: pytest.MonkeyPatch, older_host: bool
) -> None:
    if older_host:
        monkeypatch.setattr(host_mod, "_answer", _old_answer)

    async def main() -> dict[str, Any]:
        async with serving(config(factories)) as stub:
            return wire(await stub.ModelInfer(request(BITS), timeout=60))

    got = asyncio.run(main())
    assert got["same"] == ("BF16", [4, 3], le(BITS))
    assert got["count"] == ("UINT16", [4, 3], le(BITS))
