"""Review 19, requests waiting for room (`manager/live.py`); each test failed before its fix.

(1) A prewarm (a guess: the reconciler's tick, a request's chained successors) could take room that
came free ahead of a request that waited for it, within the time between two passes over the
waiting requests: the request then waited on (a background one until its deadline). A prewarm to a
device where requests wait for room is no longer made: it gives way to them.
(2) Each waiting request polled every WAIT_RETRY_S beside the task that tries them all; it now only
wakes when a pass admits (or refuses) it, at its own deadline or max_wait, or at a stop, and room
freed by the manager (an eviction, a tick's keep-alive expiry, a load's result, a request's end)
starts a pass at once instead of at the task's next WAIT_RETRY_S.

Real tiny models (safetensors checkpoints) on in-process device hosts; the policy's guess of what to
prewarm is a fake (`_fake_guess`) so that the test decides which model it names.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import run, until

import manager.live as live_mod
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.policy.types import Tier
from workers.demo import write_tiny_mlp

MiB = 1 << 20
WIDTH = 64
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


def _config(tmp_path: Path, keep_alive: str = "5m") -> Config:
    """Tiny MLPs on a CPU device with room for one of them: `x` (realtime) fills it, `lo` (background:
    may not evict) waits for room, `guess` (realtime, prewarm: true) is what a prewarm would load;
    the policy's keep-alive for all is `keep_alive`."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    src = f"source: {{factory: 'workers.demo:tiny_mlp', path: '{path}', kwargs: {{width: {WIDTH}}}}}"
    rows = (
        ("x", "realtime", "prewarm: false"),
        ("lo", "background", "prewarm: false"),
        ("guess", "realtime", "prewarm: true"),
    )
    models = "".join(
        f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, "
        f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, {extra}, {src}}}\n"
        for name, cls, extra in rows
    )
    (tmp_path / "c.yaml").write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * 1.5) + MiB}, reserve: {MiB}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        f"models:\n{models}policy: {{name: lru-keepalive, default_keep_alive: {keep_alive}}}\n"
    )
    return load_config(tmp_path / "c.yaml")


def _fake_guess(lm: LiveManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's prewarm (a fake): it names `guess` at every tick while `guess` is on disk."""
    guess = lm.engine.models["guess"]

    def prewarm(now: float) -> list[Any]:
        return [guess] if guess.tier == Tier.DISK else []

    monkeypatch.setattr(lm.engine.policy, "prewarm", prewarm)


def test_a_waiting_request_is_served_before_a_prewarm_takes_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lo` waits for room; `x` leaves and the reconciler's tick comes before any pass over the
    waiting requests: its prewarm of `guess` would take the room, `lo` (background) could never evict
    it, and would wait until its deadline. The prewarm gives way; `lo` is served."""
    config = _config(tmp_path)

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        _fake_guess(lm, monkeypatch)
        lo = asyncio.create_task(lm.infer("lo", X, timeout_s=5))
        await until(lambda: len(lm._room_waits) == 1, "lo waits for room")
        lm.evict("x")  # room comes free...
        lm.engine.tick(lm.clock())  # ...and the reconciler's tick (its prewarm) comes first
        lm._flush()
        assert lm.engine.models["guess"].tier == Tier.DISK, "the prewarm took the room lo waits for"
        served = await asyncio.wait_for(lo, 10)
        assert served.result.ok
        assert lm.engine.models["lo"].tier == Tier.GPU and lm.engine.models["guess"].tier == Tier.DISK

    run(config, body)


def test_room_a_ticks_expiry_frees_goes_to_the_waiting_request_not_to_its_prewarm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`x`'s keep-alive (the policy's, 1 s) runs out while `lo` waits: the reconciler's tick evicts
    it and, in the same tick, would prewarm `guess` into its room. No poll comes meanwhile (WAIT_RETRY_S is a
    minute): `lo` is served by the pass that the eviction starts, and `guess` stays on disk."""
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 60.0)
    config = _config(tmp_path, keep_alive="1s")

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        _fake_guess(lm, monkeypatch)
        lo = asyncio.create_task(lm.infer("lo", X, timeout_s=8))
        await until(lambda: len(lm._room_waits) == 1, "lo waits for room")
        served = await asyncio.wait_for(lo, 20)
        assert served.result.ok
        assert lm.engine.models["x"].tier != Tier.GPU
        assert lm.engine.models["guess"].tier == Tier.DISK, "the tick's prewarm took lo's room"

    run(config, body)


def test_room_an_admin_evict_frees_wakes_the_waiting_request_without_a_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No poll comes while `lo` waits (its own timer and the task's passes are a minute apart): an
    admin's evict of `x` starts a pass at once, which serves it."""
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 60.0)
    config = _config(tmp_path)

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        lo = asyncio.create_task(lm.infer("lo", X, timeout_s=30))
        await until(lambda: len(lm._room_waits) == 1, "lo waits for room")
        lm.evict("x")
        served = await asyncio.wait_for(lo, 10)
        assert served.result.ok and lm.engine.models["lo"].tier == Tier.GPU

    run(config, body)
