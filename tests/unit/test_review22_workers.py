"""Review 22, a read of the last sessions' changes to the device hosts' model loading:

- A file cut short during its read was named by its descriptor ("3: file ended after ..."), since
  the reader opens it through `open_regular`.
- A FIFO among a sentence-transformers model's JSON files held its load, and every later load of the
  model, as one at `model.safetensors` did before.
- A load into host RAM put the checkpoint through fewer checks than a load to the device (a mix of
  float dtypes out of range passed, and failed at the promote); two checkpoint errors did not name
  the file.
- A factory module without its callable (a typo), fixed on disk, was never read again.
- A zero-element tensor whose sizes multiply past int64 escaped the checks as an INTERNAL error.
- A TorchScript load into host RAM took any file, which failed only at its promote."""

from __future__ import annotations

import os
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from live_helpers import in_time
from safetensors.torch import save_file
from torch import nn

from workers import protocol as P
from workers import st_io
from workers.demo import write_tiny_mlp
from workers.host import DeviceHost


def _host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="test")


def test_a_file_cut_short_during_its_read_is_named_by_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.zeros(1024)}, str(path))
    parse = st_io._parse

    def parse_then_cut(f: object, p: Path) -> st_io.Header:
        header = parse(f, p)
        os.truncate(path, path.stat().st_size - 100)  # cut short once its header was read
        return header

    monkeypatch.setattr(st_io, "_parse", parse_then_cut)
    with pytest.raises(st_io.CheckpointError, match=f"^{path}: file ended after 4024 of 4096 data bytes"):
        st_io.read_safetensors(path)


def test_a_fifo_among_a_sentence_transformers_models_files_is_refused_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "minilm"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"")
    spec = P.ModelSpec("emb", "sentence-transformers", {"path": str(folder)})
    host = _host()
    for op in ("load", "load again"):  # (before: the second waited behind the first's abandoned read)
        r = in_time(lambda op=op: host.apply(P.Load(spec, "host"), op))
        assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
        assert f"{folder / 'config.json'}: is a FIFO, not a model file" in r.error, r.error


def _factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = tmp_path / f"{name}.py"
    module.write_text(text)
    return module


def test_a_read_into_host_ram_refuses_a_mix_of_float_dtypes_out_of_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _factory(
        tmp_path,
        monkeypatch,
        "review22_linear",
        "from torch import nn\ndef make():\n    return nn.Linear(64, 4)\n",
    )
    path = tmp_path / "mixed.safetensors"
    save_file({"weight": torch.zeros(4, 64, dtype=torch.float16), "bias": torch.full((4,), 1e10)}, str(path))
    spec = P.ModelSpec("lin", "safetensors-module", {"factory": "review22_linear:make", "path": str(path)})
    for tier in ("host", "gpu"):  # refused alike, naming the file (a host read took it before)
        r = _host().apply(P.Load(spec, tier), f"to {tier}")  # type: ignore[arg-type]
        assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), (tier, r.error)
        assert f"model 'lin': {path}: the checkpoint mixes float dtypes" in r.error, r.error
    fits = tmp_path / "fits.safetensors"
    save_file({"weight": torch.zeros(4, 64, dtype=torch.float16), "bias": torch.ones(4)}, str(fits))
    spec = P.ModelSpec("lin", "safetensors-module", {"factory": "review22_linear:make", "path": str(fits)})
    host = _host()
    r = host.apply(P.Load(spec, "host"), "to host")
    assert r.ok and r.to_tier == "host", r.error
    r = host.apply(P.Promote("lin"), "promote")
    assert r.ok, r.error


def test_a_checkpoint_without_a_parameter_names_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.register_buffer('table', torch.empty(2, device='meta'))\n"
        "        self.lin = nn.Linear(2, 2)\n\n\ndef make():\n    return M()\n"
    )
    _factory(tmp_path, monkeypatch, "review22_buffer", text)
    path = tmp_path / "lin.safetensors"
    save_file({"lin.weight": torch.zeros(2, 2), "lin.bias": torch.zeros(2)}, str(path))
    spec = P.ModelSpec("m", "safetensors-module", {"factory": "review22_buffer:make", "path": str(path)})
    for tier in ("host", "gpu"):
        r = _host().apply(P.Load(spec, tier), f"to {tier}")  # type: ignore[arg-type]
        assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), (tier, r.error)
        assert f"model 'm': {path}: no weights in the checkpoint for ['table']" in r.error, r.error


def test_a_factory_module_without_its_callable_is_read_again_once_fixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _factory(tmp_path, monkeypatch, "review22_typo", "from workers.demo import tiny_mlp as mkae\n")
    path = write_tiny_mlp(tmp_path / "tiny.safetensors", 8)
    spec = P.ModelSpec(
        "m",
        "safetensors-module",
        {"factory": "review22_typo:tiny_mlp", "path": str(path), "kwargs": {"width": 8}},
    )
    host = _host()
    r = host.apply(P.Load(spec), "load")
    assert (r.ok, r.error_code) == (False, P.FACTORY_FAILED) and "is not a callable" in r.error, r.error
    module.write_text("from workers.demo import tiny_mlp\n# fixed\n")
    r = host.apply(P.Load(spec), "load once fixed")
    assert r.ok, r.error


def test_a_zero_element_tensor_whose_sizes_overflow_is_a_bad_checkpoint(tmp_path: Path) -> None:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "overflow.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(st_io.CheckpointError, match=r"tensor 'w': shape .*: its sizes multiply past 2\*\*63"):
        st_io.read_safetensors(path)
    empty = tmp_path / "empty.safetensors"  # a zero-element tensor of ordinary sizes is a tensor
    save_file({"w": torch.zeros(3, 0)}, str(empty))
    tensors, _ = st_io.read_safetensors(empty)
    assert tensors["w"].shape == (3, 0)


def test_a_torchscript_read_into_host_ram_must_be_an_archive(tmp_path: Path) -> None:
    def load(path: Path) -> P.CommandResult:
        spec = P.ModelSpec("ts", "torchscript", {"path": str(path), "input_shape": [2], "output_shape": [2]})
        return _host().apply(P.Load(spec, "host"), "to host")

    text = tmp_path / "notes.pt"
    text.write_text("hello, not an archive\n" * 100)
    r = load(text)
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert f"{text}: not a TorchScript archive: not a zip archive" in r.error, r.error
    other_zip = tmp_path / "other.pt"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("notes.txt", "a zip, but not a module")
    r = load(other_zip)
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    assert "without a pickled module and its code" in r.error, r.error
    good = tmp_path / "good.pt"
    with warnings.catch_warnings():  # (torch 2.13 marks TorchScript deprecated)
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(good))  # type: ignore[no-untyped-call]
    r = load(good)
    assert r.ok and r.to_tier == "host", r.error
