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


def test_serve_takes_the_files_identity_from_before_the_command_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`residency serve` reads the config, then checks for CUDA (importing torch: seconds) before
    `serve` starts: an edit saved then was taken for the file the service runs. The command now gives
    `serve` the file's identity from before its read, so the watcher sees the edit."""
    from manager import cli
    from manager.api.admin import file_identity

    text = CONFIG.read_text() + f"store: {{url: 'sqlite:///{tmp_path}/state.db'}}\n"
    path = tmp_path / "c.yaml"
    path.write_text(text)
    before = file_identity(str(path))
    real_missing = bridge.cuda_missing_here

    def missing(*args: Any, **kwargs: Any) -> Any:  # (after the read) the user saves an edit
        path.write_text(text.replace("policy: {name: residency}", "policy: {name: lru-keepalive}"))
        return real_missing(*args, **kwargs)

    got: dict[str, Any] = {}

    async def fake_serve(config: Any, **kwargs: Any) -> None:
        got.update(kwargs, policy=config.policy.name)

    monkeypatch.setattr(bridge, "cuda_missing_here", missing)
    monkeypatch.setattr(server_mod, "serve", fake_serve)
    assert cli.main(["serve", "--config", str(path), "--in-process"]) == 0
    assert got["policy"] == "residency"  # the file as it was read
    assert got["config_seen"] == before != file_identity(str(path))  # so the watcher reloads the edit
