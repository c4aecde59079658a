"""Review 20, a walkthrough of the live service in process:

- A request answered DEADLINE while its model's forward still ran on its thread (a thread cannot be
  stopped) counted the model idle at once: an admin evict then acted at once instead of waiting for
  the forward ("a model in use goes when its requests end"), and its drop held the device's commands
  behind the forward (another model's request waited 7.8 s). The model now stays busy until the
  forward really ends.
- A model whose calls so far took microseconds ran its next call on the event loop, whatever it
  did: one slow call (4 s) held every other request, the admin API and world sessions, and ignored its
  own deadline. One inline call that takes longer than INLINE_SLOW_S now sends the model's calls to a
  thread for good (logged).

The manager over the in-process pool (real device hosts); the model is a fake adapter whose forward
waits on an event the test sets, registered for the test only."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import run
from test_review19_metrics_sessions import FakeZeros

from manager import live as live_mod
from manager.config import load_config
from manager.errors import DeadlineExceeded, ModelFailed
from manager.live import LiveManager
from manager.policy.types import Tier
from workers.adapters import ADAPTERS

CONFIG = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: realtime}, {name: interactive}]
models:
  - {name: slow, class: interactive, adapter: fake-r20-gated, device: cpu0, memory: 1MiB,
     load_seconds: {disk: 0.1, host: 0.05}}
  - {name: quick, class: realtime, adapter: fake-r20-gated, device: cpu0, memory: 1MiB,
     load_seconds: {disk: 0.1, host: 0.05}}
"""
GATE = threading.Event()  # a forward whose input is x > 0 waits for it (x seconds at most)
SPIN = {"s": 0.0}  # a forward whose input is x < 0 holds its thread -x seconds (awake: not sleeping)


class FakeGated(FakeZeros):
    """A fake model for the test: input x (FP32, 1); x > 0: waits for GATE (x s at most); x < 0:
    busy for -x s; else returns at once."""

    name = "fake-r20-gated"

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = float(inputs["x"][0])
        if x > 0:
            GATE.wait(x)
        elif x < 0:
            until = time.perf_counter() - x
            while time.perf_counter() < until:
                pass
        return {"y": np.zeros(1, np.float32)}


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: Callable[[LiveManager], Awaitable[Any]]
) -> Any:
    monkeypatch.setitem(ADAPTERS, "fake-r20-gated", FakeGated)
    (tmp_path / "c.yaml").write_text(CONFIG)
    GATE.clear()

    async def gated(lm: LiveManager) -> Any:
        try:
            return await body(lm)
        finally:
            GATE.set()  # (a forward still waiting ends before the stop)

    return run(load_config(tmp_path / "c.yaml"), gated)


def _x(v: float) -> dict[str, np.ndarray]:
    return {"x": np.array([v], np.float32)}


def test_a_model_whose_forward_outlives_its_deadline_stays_busy_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(lm: LiveManager) -> None:
        m = lm.engine.models["slow"]
        with pytest.raises(DeadlineExceeded):
            await lm.infer("slow", _x(30.0), timeout_s=0.3)
        assert lm.live["slow"].inflight == 1  # its forward runs on: in use
        assert m.busy_until == float("inf")
        lm.evict("slow")
        await asyncio.sleep(0.2)
        assert m.tier == Tier.GPU and lm.live["slow"].evict_to == "disk"  # deferred, not done
        GATE.set()  # the forward ends
        for _ in range(200):
            if m.tier != Tier.GPU:
                break
            await asyncio.sleep(0.02)
        assert lm.live["slow"].inflight == 0 and m.busy_until < float("inf")
        assert m.tier != Tier.GPU  # and the evict went then

    _run(tmp_path, monkeypatch, body)


def test_one_slow_inline_call_sends_the_models_calls_to_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(lm: LiveManager) -> None:
        for _ in range(30):  # microseconds each: it runs on the event loop from now on
            await lm.infer("quick", _x(0.0))
        assert lm._infer_s["quick"] < live_mod.INLINE_INFER_S
        await lm.infer("quick", _x(-0.2))  # one call that holds its thread 0.2 s
        assert "quick" in lm._slow_inline
        assert any("its calls run on a thread from now on" in r.message for r in caplog.records)

        # a slow call now runs on a thread: the loop goes on meanwhile, and its deadline holds
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        began = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await lm.infer("quick", _x(-3.0), timeout_s=0.3)
        took = time.monotonic() - began
        ticker.cancel()
        assert took < 2.0, took  # at its deadline, not after the 3 s call (slack: a loaded machine)
        assert ticks >= 5, ticks

    _run(tmp_path, monkeypatch, body)


def test_a_batched_model_whose_forward_outlives_its_deadline_stays_busy_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Read-through: the first fix covered the unbatched thread path only; a model with max_batch > 1
    runs its batches on a thread of the LocalBatcher, and was evicted under its running forward.)"""
    old = "adapter: fake-r20-gated, device: cpu0, memory: 1MiB,\n     load_seconds"
    assert old in CONFIG
    monkeypatch.setattr(
        sys.modules[__name__], "CONFIG", CONFIG.replace(old, old.replace("1MiB,", "1MiB, max_batch: 4,"), 1)
    )
    test_a_model_whose_forward_outlives_its_deadline_stays_busy_until_it_ends(tmp_path, monkeypatch)


class _HostOfItsOwn:
    """The in-process pool driven as the Ray pool is: `infer_async`, the forward awaited on a thread
    of its own (not the service's executor, which the stop's grace knows)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    async def infer_async(
        self, device: str, model: str, inputs: Any, timeout_s: float, late: Any = None
    ) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def forward() -> None:
            result = self._pool.infer(device, model, inputs, timeout_s)
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        threading.Thread(target=forward, daemon=True).start()
        return await done


def test_a_forward_on_a_host_of_its_own_is_answered_internal_at_the_stops_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Read-through: with Ray's device hosts, a forward still running at the stop's grace was cut by
    the gRPC server's stop, "Cancelling all calls" (UNAVAILABLE, which clients retry), and its request
    was never logged; in process it is answered INTERNAL and logged as a failed request.)"""
    monkeypatch.setitem(ADAPTERS, "fake-r20-gated", FakeGated)
    (tmp_path / "c.yaml").write_text(CONFIG)
    GATE.clear()

    async def body(lm: LiveManager) -> None:
        try:
            asking = asyncio.ensure_future(lm.infer("slow", _x(30.0), timeout_s=60.0))
            for _ in range(500):
                if lm.live["slow"].inflight:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            lm.abandon_waits()  # the stop's grace
            with pytest.raises(ModelFailed, match="the server is stopping, and its inference on cpu0"):
                await asyncio.wait_for(asking, 5)
            assert lm.failed == 0 and lm.served == 1  # it ran (or may have): a request, failed
            assert lm.live["slow"].inflight == 1  # its forward runs on: the model is in use
        finally:
            GATE.set()
        for _ in range(500):
            if not lm.live["slow"].inflight:
                break
            await asyncio.sleep(0.01)
        assert lm.live["slow"].inflight == 0

    run(load_config(tmp_path / "c.yaml"), body, wrap=_HostOfItsOwn)
