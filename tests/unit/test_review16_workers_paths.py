"""Review 16: a checkpoint path that cannot name a file is a clear load error, not INTERNAL.

A `source.path` with a NUL byte in it (YAML's "\\0") or a file name longer than the file system takes
(ENAMETOOLONG) failed the load INTERNAL ("load failed: ValueError('embedded null byte')",
"OSError(36, 'File name too long')") with a traceback in the log: `Path.is_file`, `Path.exists`
(the page-cache probe, the budget's size check, the missing-or-bad decision) and `open` raise there
rather than answer. Each is BAD_CHECKPOINT naming the model and the path now. A file that is not a
TorchScript archive is said naming the file too (the message named the model only).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import CheckpointError, parse_header, read_safetensors

NUL = "/tmp/review16\0weights.safetensors"
LONG = "/tmp/" + "w" * 300 + ".safetensors"
SOURCES = {
    "safetensors-module": {"factory": "torch.nn:Identity"},
    "torchscript": {},
    "silero-vad": {},
    "worldpager-mg2": {},
}


@pytest.mark.parametrize("budget", [None, 1 << 30])
@pytest.mark.parametrize("adapter", sorted(SOURCES))
@pytest.mark.parametrize("path", [NUL, LONG], ids=["nul-byte", "name-too-long"])
def test_a_path_that_cannot_name_a_file_is_bad_checkpoint(
    adapter: str, path: str, budget: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    host = DeviceHost("cpu0", "cpu", node="test")
    spec = P.ModelSpec("m", adapter, {**SOURCES[adapter], "path": path}, budget_bytes=budget)
    with caplog.at_level(logging.ERROR):
        r = host.apply(P.Load(spec), "1")
    assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT), r.error
    error = r.error or ""
    assert error.startswith("model 'm': ") and "load failed" not in error
    assert (repr(path) if "\0" in path else path) in error
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert host.status().models == {}


@pytest.mark.parametrize("path", [NUL, LONG], ids=["nul-byte", "name-too-long"])
def test_the_reader_says_a_path_that_cannot_name_a_file(path: str) -> None:
    for read in (parse_header, read_safetensors):
        with pytest.raises(CheckpointError) as exc:
            read(path)  # type: ignore[operator]
        assert (repr(path) if "\0" in path else path) in str(exc.value)


def test_a_file_that_is_not_a_torchscript_archive_is_named(tmp_path: Path) -> None:
    host = DeviceHost("cpu0", "cpu", node="test")
    for name, data in (("empty.pt", b""), ("text.pt", b"not an archive\n" * 10)):
        path = tmp_path / name
        path.write_bytes(data)
        r = host.apply(P.Load(P.ModelSpec("ts", "torchscript", {"path": str(path)})), name)
        assert (r.ok, r.error_code) == (False, P.BAD_CHECKPOINT)
        assert (r.error or "").startswith(f"model 'ts': {path}: not a TorchScript archive"), r.error
