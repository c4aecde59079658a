"""Unit tests never start Ray (STYLE practice 5): `ray.init` raises here, and Ray reads as not
started. In the whole suite the integration tests' session Ray runs in this process too: seen as
started, `ensure_ray` went on without its start and `serve` served on that Ray (a test that was to
stop at the start hung), so a unit test meets Ray as a run of the unit tests alone does."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def disallow_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit tests must not start Ray; put the test under tests/integration/")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB file system of its own (tmpfs), to fill; skipped where this user may not mount one."""
    with tempfile.TemporaryDirectory(prefix="residency-full-") as d:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small file system here: {done.stderr.decode().strip()}")
        try:
            yield Path(d)
        finally:
            subprocess.run(["umount", d], check=True)
