"""Review 16: a hot reload (the config file watcher, the admin's ReloadConfig) read and checked the
config file on the service's event loop: every request waited for the parse (13 ms for
configs/home.yaml here, seconds for a large file). The file is read on a thread now, and only the
reload itself is applied on the loop. Real components: a LiveManager over in-process device hosts,
the real config file and loader; only the loader is wrapped, to see where it runs and to make it slow."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

import manager.config
from manager.api.admin import reload_from_file_on_loop
from manager.config import load_config
from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.workers_bridge import create_pool

SLOW_S = 0.5


def test_the_file_is_read_off_the_event_loop_and_the_loop_runs_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text().replace("policy: {name: residency}", "policy: {name: lru-keepalive}"))
    config = load_config(path)
    parsed_on: list[threading.Thread] = []
    real = manager.config.load_config

    def slow_load(p: Any) -> Any:
        parsed_on.append(threading.current_thread())
        time.sleep(SLOW_S)  # a large file's parse
        return real(p)

    monkeypatch.setattr(manager.config, "load_config", slow_load)

    async def main() -> tuple[list[str], int]:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(ticking())
        try:
            path.write_text(path.read_text() + "\n# edited\n")
            changes = await reload_from_file_on_loop(lm, str(path))
            return changes, ticks
        finally:
            ticker.cancel()
            await lm.stop()
            pool.close()

    changes, ticks = asyncio.run(main())
    assert changes == []
    assert parsed_on and parsed_on[0] is not threading.main_thread()
    assert ticks >= 10, ticks  # the loop went on during the parse (it was held for all of it)


def test_a_bad_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text())
    config = load_config(path)

    async def main() -> str:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            path.write_text("devices: [\n")
            with pytest.raises(InvalidRequest) as e:
                await reload_from_file_on_loop(lm, str(path))
            assert lm.config is config
            return str(e.value)
        finally:
            await lm.stop()
            pool.close()

    said = asyncio.run(main())
    assert said.startswith(f"config not reloaded: {path}:"), said
