"""Found in the review of the live manager's core (live.py, live_persist.py, live_sessions.py,
live_batch.py), with real models on in-process device hosts; each failed before its fix."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
from live_helpers import (
    AUDIO,
    CONFIG,
    POSES,
    TEXT,
    drain,
    kill,
    lru_config,
    run,
    started,
    until,
    world_config,
)

from manager.config import load_config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store import open_store


def _held(lm: LiveManager) -> dict[str, str]:
    return {name: s.tier for name, s in lm.pool.status("cpu0").models.items()}


def test_an_admin_evict_to_disk_pushes_no_other_model_out_of_host_ram(tmp_path: Path) -> None:
    """Host RAM holds world; an admin evicts embed (used, so worth more) to disk. The evict demoted
    embed first, which dropped world out of host RAM to make room for a copy dropped right after
    (demote embed, drop world, drop embed). Now embed is dropped at once and world stays."""
    small_host = "host: {memory: 130MiB, reserve: 0}"
    text = CONFIG.read_text().replace("host: {memory: 16GiB, reserve: 4GiB}", small_host)
    (tmp_path / "c.yaml").write_text(text)

    async def body(lm: LiveManager) -> None:
        await until(lambda: all(live.ready.is_set() for live in lm.live.values()), "all loaded at start")
        for _ in range(3):
            await lm.infer("embed", TEXT)
        lm.evict("world", "host")
        await until(lambda: lm.live["world"].tier == "host", "world demoted to host RAM")
        events = lm.subscribe()
        lm.evict("embed", "disk")
        await until(lambda: lm.live["embed"].tier == "disk" and not lm._ops, "embed dropped", 5)
        assert lm.engine.models["world"].tier == Tier.HOST
        assert _held(lm) == {"voice": "gpu", "world": "host"}
        moves = [(e["kind"], e["model"]) for e in drain(events) if e["kind"] in ("demote", "drop")]
        assert moves == [("drop", "embed")]

    run(load_config(tmp_path / "c.yaml"), body)


def test_an_admin_evict_to_host_demotes_under_a_policy_without_a_host_tier(tmp_path: Path) -> None:
    """lru-keepalive never demotes on its own: an admin's evict to host RAM (which has room) was
    silently a drop to disk."""

    async def body(lm: LiveManager) -> None:
        await lm.infer("embed", TEXT)
        lm.evict("embed", "host")
        await until(lambda: lm.live["embed"].tier == "host" and not lm._ops, "embed in host RAM", 5)
        assert lm.engine.models["embed"].tier == Tier.HOST
        assert _held(lm)["embed"] == "host"
        served = await lm.infer("embed", TEXT)  # promoted back from host RAM
        assert served.cold and lm.engine.counters.loads_by_source["host"] == 1

    run(lru_config(tmp_path), body)


def test_the_lease_gauge_is_the_books_lease_when_its_model_loads_or_leaves(tmp_path: Path) -> None:
    """The lease gauge moved only with lease actions: a load (lease at its minimum) left it at 0, and
    an evict (lease 0) left it at the last lease."""
    config = world_config(tmp_path)

    async def body(lm: LiveManager) -> None:
        world = lm.engine.models["world"]

        def gauge() -> float | None:
            return lm.metrics.registry.get_sample_value("residency_lease_bytes", {"model": "world"})

        await lm.preload("world", timeout_s=30)
        assert world.lease == world.lease_min > 0 and gauge() == world.lease
        sid, _ = await lm.open_session("world", timeout_s=30)
        await lm.step_session(sid, (0.0, 0.0, 0.0, 0.0, 0.0))
        await until(lambda: world.lease > world.lease_min, "the session's lease grown", 5)
        await lm.close_session(sid)
        assert gauge() == world.lease > world.lease_min
        lm.evict("world")  # before the tick that shrinks the lease back
        assert world.tier != Tier.GPU and world.lease == 0 and gauge() == 0

    run(config, body)


def test_an_admin_preload_keeps_its_model_until_its_load_is_confirmed(tmp_path: Path) -> None:
    """A preload waited for the confirmed load without counting as a waiter: a model with a short
    keep-alive expired on the books as soon as its estimated load time passed, the preload loaded it
    again, and so on (5 evictions and 5 thrash in 5 s) until the preload ran out of time."""
    text = CONFIG.read_text().replace(
        "    keep_alive: auto\n    max_batch: 64", "    keep_alive: 0s\n    prewarm: false\n    max_batch: 64"
    )
    assert "keep_alive: 0s" in text
    (tmp_path / "c.yaml").write_text(text)

    async def body(lm: LiveManager) -> None:
        await until(lambda: lm.live["voice"].ready.is_set(), "the pinned voice")
        events = lm.subscribe()
        await lm.preload("embed", timeout_s=5)  # was DeadlineExceeded
        assert lm.engine.counters.thrash == 0 and lm.engine.counters.evictions == 0
        loads = [e for e in drain(events) if e["model"] == "embed" and e["kind"] in ("load", "promote")]
        assert len(loads) == 1 and lm.engine.models["embed"].waiting == 0

    run(load_config(tmp_path / "c.yaml"), body)


def test_a_killed_service_takes_the_last_arrival_from_the_request_log(tmp_path: Path) -> None:
    """Requests after the last statistics save (a kill saves none) came back into the reuse
    histograms from the request log, but each model's last arrival (how long the policy thinks it has
    been idle) stayed at the saved snapshot's."""
    config = lru_config(tmp_path)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> float:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = lm._next_save = math.inf
        await lm.infer("voice", AUDIO)
        lm.save_stats()
        await lm.flush_log()
        await asyncio.sleep(0.2)
        for _ in range(2):
            await lm.infer("voice", AUDIO)  # in the journal only
        last = float(lm.engine.models["voice"].last_arrival)
        kill(lm, pool)
        store.close()
        return last

    last = asyncio.run(killed())
    store = open_store(url)

    async def restarted() -> None:
        lm, pool = await started(config, store, journal)
        voice = lm.engine.models["voice"]
        assert voice.hist.count == 3 and voice.hist.last_t == last
        assert voice.last_arrival == last  # was the snapshot's, 0.2 s earlier
        await lm.stop()
        pool.close()

    asyncio.run(restarted())
    store.close()


def test_stats_rejected_counts_what_the_rejected_metric_counts(tmp_path: Path) -> None:
    """A request that waited for room past its deadline was counted rejected by the requests metric
    but not by Stats' `rejected` (which a retried request, counted served, could also count)."""
    lru_config(tmp_path)
    small = "memory: 200MiB, reserve: 0"
    text = (tmp_path / "lru.yaml").read_text().replace("memory: 4GiB, reserve: 512MiB", small)
    (tmp_path / "lru.yaml").write_text(text)

    async def body(lm: LiveManager) -> None:
        await lm.preload("world", timeout_s=30)  # embed (background: may not evict) fits only without it
        with pytest.raises(DeadlineExceeded, match="no room became free before the deadline"):
            await lm.infer("embed", TEXT, cls="background", timeout_s=0.3)
        labels = {"model": "embed", "cls": "background", "outcome": "rejected"}
        assert lm.metrics.registry.get_sample_value("residency_requests_total", labels) == 1
        assert lm.rejected == 1 and lm.served == 0

    run(load_config(tmp_path / "lru.yaml"), body)


def test_an_admin_pin_without_room_loads_its_model_once_room_is_free(tmp_path: Path) -> None:
    """ "A Pin loads the model as soon as there is free room for it": one pinned while the room was
    taken (embed, within its keep-alive) stayed on disk for good once embed left."""
    lru_config(tmp_path)
    small = "memory: 200MiB, reserve: 0"  # voice and world, or voice and embed
    text = (tmp_path / "lru.yaml").read_text().replace("memory: 4GiB, reserve: 512MiB", small)
    (tmp_path / "lru.yaml").write_text(text)

    async def body(lm: LiveManager) -> None:
        await lm.infer("embed", TEXT)
        lm.set_pin("world", True)
        assert lm.engine.models["world"].tier == Tier.DISK  # no room yet: nothing evicted for it
        lm.evict("embed")
        await until(lambda: lm.live["world"].ready.is_set(), "the pinned world loaded", 5)
        assert lm.engine.models["world"].tier == Tier.GPU and _held(lm)["world"] == "gpu"

    run(load_config(tmp_path / "lru.yaml"), body)


class _SlowWorldOpen:
    """The in-process pool, its host's reply to an open of a `world` session 0.5 s late (the session
    is open on the host while the manager waits for the reply)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        reply = self.pool.session(device, method, *args, **kw)
        if method == "open" and args[0] == "world":
            time.sleep(0.5)
        return reply


def test_a_resume_of_a_session_another_world_model_is_opening_is_refused(tmp_path: Path) -> None:
    """Resumed on a second world model while the first was reopening it, the host's refusal ("already
    open") made the manager take the first's session for one an earlier run left open: it closed it
    on the host, then recorded it open (the books: open; the host: closed)."""
    extra = (
        "  - {name: world2, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,\n"
        "     elastic: {min: 16MiB, max: 64MiB}, load_seconds: {disk: 0.2, host: 0.05},\n"
        "     source: {preset: micro}}\n"
    )

    async def body(lm: LiveManager) -> None:
        await lm.preload("world", timeout_s=30)
        await lm.preload("world2", timeout_s=30)
        sid, _ = await lm.open_session("world")
        await lm.step_session(sid, POSES[0])
        await lm.close_session(sid)
        events = lm.subscribe()
        first = asyncio.create_task(lm.open_session("world", resume_id=sid))
        await until(lambda: sid in lm._opening_ids, "the resume on world under way", 5)
        with pytest.raises(WorkerUnavailable, match="is open on another stream: retry once it ends"):
            await lm.open_session("world2", resume_id=sid)
        assert (await first)[0] == sid
        assert list(lm.sessions) == [sid] and list(lm.pool.hosts["cpu0"].world.open_sessions) == [sid]
        assert not [e for e in drain(events) if e["kind"] == "session_closed"]
        await lm.step_session(sid, POSES[1])
        await lm.close_session(sid)

    run(world_config(tmp_path, extra), body, wrap=_SlowWorldOpen)
