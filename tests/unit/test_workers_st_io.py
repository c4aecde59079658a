"""Safetensors read straight into one buffer: equal to the reference reader; bad files named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from workers.st_io import (
    CheckpointError,
    cached_fraction,
    drop_file_cache,
    parse_header,
    raw_read,
    read_safetensors,
    write_safetensors,
)


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "w.bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(5, 7, 3, generator=g),
        "ids.i64": torch.arange(11),
        "mask.bool": torch.rand(9, generator=g) > 0.5,
        "tiny.f16": torch.randn(1, generator=g).half(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    p = tmp_path / "mixed.safetensors"
    write_safetensors(tensors, p)
    return p


@pytest.mark.parametrize("method", ["mmap", "read"])
def test_equal_to_the_reference_reader(mixed: Path, method: str) -> None:
    ours, header = read_safetensors(mixed, method=method)
    ref = load_file(str(mixed))
    assert set(ours) == set(ref)
    for k, v in ref.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape and torch.equal(ours[k], v), k
    # one owned buffer: every tensor is a view into the same storage, which outlives the file
    storages = {t.untyped_storage().data_ptr() for t in ours.values() if t.numel()}
    assert len(storages) == 1
    assert header.data_bytes == sum(e.end - e.start for e in header.entries)


def test_raw_read_reads_every_byte(mixed: Path) -> None:
    assert raw_read(mixed) == mixed.stat().st_size


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda b: b[:5], "shorter than 8 bytes"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "beyond the file"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b[:8] + b"x" + b[9:], "not JSON"),
    ],
)
def test_damaged_files_are_named(mixed: Path, tmp_path: Path, damage: object, words: str) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(mixed.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CheckpointError) as e:
        read_safetensors(bad)
    assert str(bad) in str(e.value) and words in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        parse_header(tmp_path / "nope.safetensors")


def test_page_cache_can_be_measured_and_dropped(tmp_path: Path) -> None:
    p = tmp_path / "blob.bin"
    p.write_bytes(b"\x07" * (8 * 2**20))
    raw_read(p)
    assert cached_fraction(p) == pytest.approx(1.0, abs=0.05)
    drop_file_cache(p)
    frac = cached_fraction(p)
    assert frac is not None and frac < 0.5


def _with_header(tmp_path: Path, header: dict[str, object]) -> Path:
    import json
    import struct

    raw = json.dumps(header).encode()
    p = tmp_path / "fields.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    return p


@pytest.mark.parametrize(
    ("header", "words"),
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}}, "are not integers"),
        ({"w": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"w": {"dtype": "F32", "shape": [None], "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"w": {"dtype": "F32", "shape": [4.5], "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"w": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, "unsupported dtype"),
        (
            {"__metadata__": ["x"], "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            "__metadata__",
        ),
    ],
)
def test_malformed_header_fields_are_named_not_raised_raw(
    tmp_path: Path, header: dict[str, object], words: str
) -> None:
    """Each of these escaped as a TypeError or RuntimeError (an INTERNAL error on the host, the file
    unnamed); negative dims with an even count passed the size check and failed in reshape."""
    p = _with_header(tmp_path, header)
    with pytest.raises(CheckpointError) as e:
        read_safetensors(p)
    assert str(p) in str(e.value) and words in str(e.value)


def test_a_well_formed_header_still_reads(tmp_path: Path) -> None:
    p = _with_header(
        tmp_path,
        {"__metadata__": {"a": "b"}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
    )
    tensors, header = read_safetensors(p)
    assert tensors["w"].shape == (2, 2) and header.metadata == {"a": "b"}


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Permission denied (a mode-000 file; root reads it anyway, so the refusal is simulated here)."""
    import builtins

    p = tmp_path / "locked.safetensors"
    write_safetensors({"w": torch.zeros(2)}, p)
    real_open = builtins.open

    def refuse(file: object, *a: object, **k: object) -> object:
        if str(file) == str(p):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(file, *a, **k)  # type: ignore[call-overload]

    real_os_open = os.open

    def refuse_fd(file: Any, *a: Any, **k: Any) -> int:
        if str(file) == str(p):
            raise PermissionError(13, "Permission denied", str(p))
        return real_os_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: refuse(self, *a, **k))
    monkeypatch.setattr(os, "open", refuse_fd)  # (the reader opens it so: a FIFO must not wait)
    with pytest.raises(CheckpointError) as e:
        read_safetensors(p)
    assert str(p) in str(e.value) and "cannot be read (Permission denied)" in str(e.value)
    assert cached_fraction(p) is None  # unknown, not an exception: the read says why
