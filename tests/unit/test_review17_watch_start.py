"""Review 17: the config file watcher began only once the service had started (Ray's start, the
pinned models' loads: tens of seconds, minutes for an LLM), and took the file as it was then for the
one the service runs. An edit saved during the start-up was never applied, nor said to be refused:
the file said one thing, the service did another, until the next edit or restart. The watcher now
starts from the file as `serve` found it. Real components: `serve` over in-process device hosts, the
real config file and loader; the pool's creation (Ray's start) is where the edit is saved."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

import manager.api.server as server_mod
import manager.workers_bridge as bridge
from manager.config import load_config
from manager.live import LiveManager


def test_an_edit_saved_during_start_up_is_applied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = CONFIG.read_text().replace("policy: {name: residency}", "policy: {name: lru-keepalive}") + (
        f"server: {{listen: '127.0.0.1:0'}}\n"
        f"store: {{url: 'sqlite:///{tmp_path}/state.db', journal: '{tmp_path}/requests.journal'}}\n"
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    config = load_config(path)
    assert config.policy.thrash_window == 600
    real_create = bridge.create_pool

    def create(*args: Any, **kwargs: Any) -> Any:  # Ray's start: the user saves an edit meanwhile
        path.write_text(text.replace("{name: lru-keepalive}", "{name: lru-keepalive, thrash_window: 12m}"))
        return real_create(*args, **kwargs)

    monkeypatch.setattr(bridge, "create_pool", create)
    monkeypatch.setattr(server_mod, "watch_config", functools.partial(server_mod.watch_config, every_s=0.05))
    made: list[LiveManager] = []

    class Recorded(LiveManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(server_mod, "LiveManager", Recorded)
    seen: dict[str, Any] = {}

    async def watch(lm: LiveManager) -> None:
        events = lm.subscribe()
        try:
            while True:
                ev = await asyncio.wait_for(events.get(), 10.0)
                if ev["kind"] in ("config_reloaded", "config_rejected"):
                    seen["event"] = ev
                    return
        except TimeoutError:
            seen["event"] = None
        finally:
            seen["thrash_window"] = lm.config.policy.thrash_window
            os.kill(os.getpid(), signal.SIGTERM)  # caught by serve's handler: a clean stop

    tasks: list[asyncio.Task[None]] = []

    def ready(port: int) -> None:
        tasks.append(asyncio.get_running_loop().create_task(watch(made[0])))

    asyncio.run(server_mod.serve(config, config_path=str(path), in_process=True, ready=ready))
    assert seen["event"] is not None, "the edit saved during start-up was neither applied nor refused"
    assert seen["event"]["kind"] == "config_reloaded", seen["event"]
    assert seen["thrash_window"] == 720
