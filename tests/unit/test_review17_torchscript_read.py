"""Review 17: the torchscript adapter took an archive's size from a stat of its path, then opened the
path and read that many bytes: a file renamed over the path in between (a new version of the model
deployed with `mv`) was read at the other file's size, cut short (a load failing "not a TorchScript
archive") or short of it ("short read"); one rewritten in place while read loaded without a word. The
size is now the open file's (fstat) and the read is from that file, so what was checked is what is
read, and a file written to meanwhile fails the load BAD_CHECKPOINT saying it changed while being
read. The swap is done at the moment between the two: when the read's buffer is allocated."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost

X = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)


def _save(module: nn.Module, path: Path) -> None:
    with warnings.catch_warnings():  # torch marks TorchScript deprecated; it still scripts and saves
        warnings.simplefilter("ignore")
        torch.jit.script(module.eval()).save(str(path))  # type: ignore[no-untyped-call]


def _answer(module: nn.Module) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = module(torch.from_numpy(X)).numpy()
    return out


def _at_the_read(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> list[int]:
    """Run `act` once, when the load allocates the buffer for the archive's bytes (after its size is
    known, before its bytes are read); the sizes it was allocated with."""
    real = torch.empty
    sizes: list[int] = []

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not sizes and kwargs.get("dtype") is torch.uint8 and len(args) == 1 and isinstance(args[0], int):
            sizes.append(args[0])
            act()
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return sizes


def _load(path: Path) -> tuple[DeviceHost, P.CommandResult]:
    host = DeviceHost("cpu0", "cpu", node="review17")
    r = host.apply(P.Load(P.ModelSpec("ts", "torchscript", {"path": str(path)})), "load")
    return host, r


@pytest.mark.parametrize("other_width", [512, 1], ids=["larger", "smaller"])
def test_a_file_renamed_over_the_path_meanwhile_does_not_cut_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_width: int
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    path = tmp_path / "model.pt"
    _save(model, path)
    other = tmp_path / "other.pt"
    _save(nn.Sequential(nn.Linear(4, other_width), nn.Linear(other_width, 2)), other)
    assert (other.stat().st_size > path.stat().st_size) == (other_width > 8)
    sizes = _at_the_read(monkeypatch, lambda: os.replace(other, path))
    host, r = _load(path)
    assert sizes, "the swap did not happen"
    # failed BAD_CHECKPOINT before: a prefix of the larger file, or a short read of the smaller one
    assert r.ok, r.error
    got = host.infer("ts", {"input": X})
    assert got.ok, got.error
    _, shape, raw = got.outputs["output"]
    # the file that was opened and measured is the one served, whole
    assert np.frombuffer(raw, np.float32).reshape(shape).tobytes() == _answer(model).tobytes()


@pytest.mark.parametrize("change", ["append", "truncate"])
def test_a_file_written_to_while_read_fails_the_load_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    path = tmp_path / "model.pt"
    _save(nn.Linear(4, 2), path)
    size = path.stat().st_size

    def write() -> None:
        if change == "append":
            with path.open("ab") as f:
                f.write(b"\0" * 4096)
        else:
            os.truncate(path, size // 2)

    sizes = _at_the_read(monkeypatch, write)
    _, r = _load(path)
    assert sizes == [size]
    # an append loaded without a word before; a truncation said "short read"
    assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
    assert "changed while being read" in (r.error or "") and str(path) in (r.error or ""), r.error


def test_an_unchanged_archive_still_loads_whole(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    path = tmp_path / "model.pt"
    _save(model, path)
    host, r = _load(path)
    assert r.ok, r.error
    got = host.infer("ts", {"input": X})
    assert got.ok, got.error
    _, shape, raw = got.outputs["output"]
    assert np.frombuffer(raw, np.float32).reshape(shape).tobytes() == _answer(model).tobytes()
