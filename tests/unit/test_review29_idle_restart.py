"""Found in the 29th review (the worker layer): a device host that died while idle and came back
empty (Ray restarts a dead actor) went unnoticed until a command or request of it said so. The books
kept counting its models, the pinned voice on the GPU and `ready`, so `ps`, the metrics and the budget
showed it resident, and the next request for it paid a whole load. The reconciler now reads each
host's status every HOST_CHECK_S and resyncs a device whose host has a new boot id. Real models on
in-process device hosts; the restarted host is a fresh, empty `DeviceHost` put in the dead one's
place (review_resync's fault injector), as Ray restarts a dead actor."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_helpers import lru_config, run_with_pinned_voice
from live_helpers import until as _until
from test_review_resync import _RestartingPool

import manager.live as live_mod
from manager.live import LiveManager


def test_a_host_restarted_while_idle_is_resynced_and_its_pinned_model_loaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_mod, "HOST_CHECK_S", 0.2)
    config = lru_config(tmp_path)  # voice pinned; nothing else loads until asked for

    async def body(lm: LiveManager, pool: _RestartingPool) -> None:
        await _until(lambda: bool(lm._boots.get("cpu0")), "the host's boot id known")
        old = lm._boots["cpu0"]
        loads = pool.real.hosts["cpu0"].status().models["voice"].inferences  # (a fresh host: none)
        assert loads == 0
        pool.restart()  # it died idle and came back empty: no command, no request says so
        assert "voice" not in pool.status("cpu0").models
        # the periodic check finds the new host process: the books follow, the pinned voice loads again
        await _until(lambda: lm._boots["cpu0"] != old, "the new boot id seen")
        await _until(lambda: "voice" in pool.status("cpu0").models, "the pinned voice loaded again")
        await _until(lambda: lm.live["voice"].ready.is_set(), "the pinned voice confirmed")
        assert pool.status("cpu0").models["voice"].tier == "gpu"

    events = run_with_pinned_voice(config, _RestartingPool, body)
    lost = [e for e in events if e["kind"] == "lost" and e["model"] == "voice"]
    assert len(lost) == 1 and "restarted" in lost[0]["detail"], lost
