"""Review 17: a hot reload reads the config file on a thread, then applies what it read on the event
loop (review 16). Two reloads at once (the file watcher and the admin's ReloadConfig, or a reload and
the tuning job's write) could apply in the other order: a reload that read the file before it was
saved again applied that older text after the newer one had been applied, and the service ran a
config the file no longer held (the watcher, having seen the newer file already, never put it
right). A reload now applies only what the file still holds: when it changed during the read, it is
read again. Real components: a LiveManager over in-process device hosts, the real loader; only the
loader is wrapped, to hold the first read until the second reload has been applied."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

import manager.config
from manager.api.admin import reload_from_file_on_loop
from manager.config import load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool

BASE = CONFIG.read_text().replace(
    "policy: {name: residency}", "policy: {name: residency, thrash_window: 10m}"
)
V1 = BASE.replace("thrash_window: 10m", "thrash_window: 11m")
V2 = BASE.replace("thrash_window: 10m", "thrash_window: 12m")


def _save(path: Path, text: str) -> None:
    """As an editor that replaces the file whole (a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_reload_that_read_an_older_file_does_not_apply_it_after_a_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    config = load_config(path)
    assert BASE != V1 != V2 and config.policy.thrash_window == 600
    real = manager.config.load_config
    first_read = threading.Event()
    newer_applied = threading.Event()
    calls = 0

    def load(p: Any) -> Any:
        nonlocal calls
        calls += 1
        got = real(p)
        if calls == 1:  # the slow read: the file is saved again, and reloaded, before it returns
            first_read.set()
            newer_applied.wait(30)
        return got

    monkeypatch.setattr(manager.config, "load_config", load)

    async def main() -> float:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            _save(path, V1)
            slow = asyncio.create_task(reload_from_file_on_loop(lm, str(path)))
            await asyncio.to_thread(first_read.wait, 30)
            _save(path, V2)
            await reload_from_file_on_loop(lm, str(path))  # the watcher's, of the newer file
            assert lm.config.policy.thrash_window == 720
            newer_applied.set()
            await slow
            return lm.config.policy.thrash_window
        finally:
            newer_applied.set()
            await lm.stop()
            pool.close()

    running = asyncio.run(main())
    assert running == 720, f"the service runs thrash_window {running:g} s; the file says 12m"
