"""Filling a file system to its last byte (tests of full disks, on the `small_disk` fixture of
tests/unit/conftest.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def fill(folder: Path) -> Path:
    """Fill the file system of `folder` to its last byte; the file that holds the filling."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * size)
    return filler
