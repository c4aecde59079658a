"""Review 17, the live manager's admission and reconciliation (`manager/live.py`, `live_persist.py`).

(1) A device host that did not report its status at start (still starting, or slow) was never
reconciled: what it held stayed off the books for good, though the start's log said "reconciled by
its next command" (its first result only recorded its boot id), so the manager gave that room to
other models. It is now resynced by the reconciler, as a resync that could not read a status is.
(2) After the service began stopping (`abandon_waits`), a request for a model not loaded (or one
waiting for room that found some) still started its load, evicting what the load needed, only to be
answered UNAVAILABLE right after: a load nobody waits for, at a stop. Now it is answered at once and
nothing is loaded or evicted for it; a request for a loaded model is still served.
Real tiny models on in-process hosts; a pool wrapper records the commands or fails a status call."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import manager.live as live_mod
from manager.config import Config, load_config
from manager.errors import WorkerUnavailable
from manager.live import LiveManager
from manager.policy.outcomes import Admission
from manager.policy.types import Tier
from manager.store import open_store
from manager.workers_bridge import create_pool
from workers import protocol as P
from workers.demo import write_tiny_mlp

WIDTH = 64
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: {device}, reserve: 0}}
host: {{memory: 8GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
  - {{name: background, may_evict: false}}
models:
{models}
policy: {{name: lru-keepalive}}
"""
MODEL = """  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, memory: {memory},
     load_seconds: {{disk: 0.05, host: 0.01}}, keep_alive: 10m, prewarm: false,
     source: {{factory: "workers.demo:tiny_mlp", path: "{path}", kwargs: {{width: {width}}}}}}}
"""
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


def setup(tmp_path: Path, names: tuple[str, ...] = ("a", "b"), device: str = "1GiB") -> Config:
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    models = "".join(
        MODEL.format(
            name=n, cls="background" if n == "b" else "interactive", memory=MLP_BYTES, path=path, width=WIDTH
        )
        for n in names
    )
    (tmp_path / "c.yaml").write_text(CONFIG.format(models=models, device=device))
    return load_config(tmp_path / "c.yaml")


class Pool:
    """The in-process pool; records the commands submitted; its first `fail_status` status calls raise
    (a host still starting)."""

    def __init__(self, inner: Any, fail_status: int = 0) -> None:
        self.inner = inner
        self.fail_status = fail_status
        self.submitted: list[tuple[str, str]] = []
        self.inferred: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        self.submitted.append((P.command_op(cmd), P.command_model(cmd)))
        return str(self.inner.submit(device, cmd, op_id))

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> P.InferResult:
        self.inferred.append(model)
        return self.inner.infer(device, model, inputs, timeout_s)  # type: ignore[no-any-return]

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus:
        if self.fail_status > 0:
            self.fail_status -= 1
            raise TimeoutError(f"device {device!r}: no status within {timeout_s} s")
        return self.inner.status(device, timeout_s)


async def until(cond: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def preload_on_host(pool: Any, config: Config, name: str) -> None:
    """`name` loaded on its device host before the manager starts (an earlier run's, on a cluster)."""
    from manager.workers_bridge import model_specs

    pool.submit("cpu0", P.Load(model_specs(config)[name], "gpu"), f"earlier-{name}")
    deadline = time.monotonic() + 30
    while True:
        results = pool.poll()
        if results:
            assert results[0].ok, results[0].error
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_host_whose_status_was_unread_at_start_is_reconciled_later(tmp_path: Path) -> None:
    config = setup(tmp_path)

    async def main() -> None:
        inner = create_pool(config, in_process=True)
        preload_on_host(inner, config, "a")
        pool = Pool(inner, fail_status=1)  # the start's status call gets no answer
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            assert lm.engine.models["a"].tier == Tier.DISK  # unknown at start
            # the host holds `a`: the books take it in (its room is not given to another model)
            await until(lambda: lm.engine.models["a"].tier == Tier.GPU, "the books hold a")
            assert lm.serving("a")
            served = await lm.infer("a", X, timeout_s=10)
            assert served.result.ok and not served.cold
            assert ("load", "a") not in pool.submitted  # held already: not loaded again
        finally:
            await lm.stop()
            inner.close()

    asyncio.run(main())


def one_fits(tmp_path: Path) -> Config:
    """Models `a` and `b` (of a class that may evict nothing) on a device with room for one at a time."""
    return setup(tmp_path, device=str(MLP_BYTES * 3 // 2))


def test_at_a_stop_a_request_for_a_model_not_loaded_starts_no_load(tmp_path: Path) -> None:
    config = setup(tmp_path)

    async def main() -> None:
        inner = create_pool(config, in_process=True)
        pool = Pool(inner)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            assert (await lm.infer("a", X, timeout_s=10)).result.ok
            lm.abandon_waits()  # the service is stopping (its gRPC server's grace)
            with pytest.raises(WorkerUnavailable, match="the service is stopping"):
                await lm.infer("b", X, timeout_s=10)
            with pytest.raises(WorkerUnavailable, match="the service is stopping"):
                await lm.preload("b")
            assert ("load", "b") not in pool.submitted and ("drop", "a") not in pool.submitted
            assert lm.engine.models["a"].tier == Tier.GPU and lm.engine.models["b"].tier == Tier.DISK
            assert (await lm.infer("a", X, timeout_s=10)).result.ok  # a loaded model is still served
        finally:
            await lm.stop()
            inner.close()

    asyncio.run(main())


def test_at_a_stop_a_request_waiting_for_room_does_not_load_when_room_frees(tmp_path: Path) -> None:
    config = one_fits(tmp_path)

    async def main() -> None:
        inner = create_pool(config, in_process=True)
        pool = Pool(inner)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            assert (await lm.infer("a", X, timeout_s=10)).result.ok
            waiting = asyncio.ensure_future(lm.infer("b", X, timeout_s=20))
            await until(lambda: lm.engine.models["b"].waiting == 1, "b waits for room")
            await asyncio.sleep(0.1)
            lm.abandon_waits()
            lm.evict("a")  # room for `b` is free now
            with pytest.raises(WorkerUnavailable, match="the service is stopping"):
                await waiting
            assert ("load", "b") not in pool.submitted
        finally:
            await lm.stop()
            inner.close()

    asyncio.run(main())


class PinsDownAtStart:
    """A real SQLite store whose "pins" document cannot be read at start (the store was down then);
    records on which thread each later read of it is made."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = True
        self.read_on_loop: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_doc(self, name: str) -> Any:
        if name == "pins":
            if self.down:
                self.down = False
                raise ConnectionError("the store does not answer")
            self.read_on_loop.append(threading.current_thread() is threading.main_thread())
        return self.inner.get_doc(name)


def test_the_admin_pins_unread_at_start_are_read_off_the_event_loop(tmp_path: Path) -> None:
    """A store that hangs would hold every request for its timeout, at each try (once a minute)."""
    config = setup(tmp_path)
    inner = open_store(f"sqlite:///{tmp_path}/state.db")
    inner.put_doc("pins", {"b": True})  # an admin's pin of an earlier run
    store = PinsDownAtStart(inner)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store)
        await lm.start()
        try:
            assert not lm.engine.models["b"].pinned  # unread at start
            await until(lambda: store.read_on_loop, "the pins read again")
            await until(lambda: lm.serving("b"), "the pinned b loaded")
            assert lm.engine.models["b"].pinned
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())
    inner.close()
    assert store.read_on_loop == [False]


def test_a_host_that_stays_silent_is_resynced_again_without_its_reason_growing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each later resync of a device whose status stayed unread added " (its status was unread)" to
    its reason once more (a line longer by that, in the log and the events, every few seconds, for as
    long as the host was away), and warned each time."""
    monkeypatch.setattr(live_mod, "RESYNC_TRIES", 1)
    monkeypatch.setattr(live_mod, "RESYNC_LATER_S", 0.0)
    config = setup(tmp_path)

    async def main() -> str:
        inner = create_pool(config, in_process=True)
        pool = Pool(inner)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            pool.fail_status = 10**9  # the host goes away
            calls: list[str] = []
            real = lm._resync_once

            async def counted(device: str, why: str) -> list[str]:
                calls.append(why)
                return await real(device, why)

            lm._resync_once = counted  # type: ignore[method-assign]
            lm._resync_soon("cpu0", "a test")
            await until(lambda: len(calls) >= 4, "resynced again and again")
            return calls[-1]
        finally:
            await lm.stop()
            inner.close()

    with caplog.at_level(logging.INFO, logger="manager.live"):
        why = asyncio.run(main())
    assert why == "a test (its status was unread)"
    warned = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "did not report" in r.getMessage()
    ]
    assert len(warned) == 1, [r.getMessage() for r in warned]


class DiesUnderTheFirstLoad(Pool):
    """The device host dies under the first load of `model` (as the Ray pool answers it: WORKER_DIED,
    nothing loaded); its later loads run."""

    def __init__(self, inner: Any, model: str) -> None:
        super().__init__(inner)
        self.model = model
        self.died: list[P.CommandResult] = []

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        if isinstance(cmd, P.Load) and cmd.model.name == self.model and not self.died:
            assert op_id is not None
            self.died.append(
                P.CommandResult(
                    op_id,
                    self.model,
                    "load",
                    False,
                    error_code=P.WORKER_DIED,
                    device=device,
                    error=f"device {device!r}: its host died (test)",
                )
            )
            return op_id
        return super().submit(device, cmd, op_id)

    def poll(self) -> list[P.CommandResult]:
        out = list(self.died[:1]) if self.died and self.died[0] is not None else []
        if out:
            self.died[0] = None  # type: ignore[call-overload]
        return out + list(self.inner.poll())


def test_a_request_whose_load_died_waits_for_room_to_load_again(tmp_path: Path) -> None:
    """Its host died under the load, and right then there was no room to load it again: the request
    went on as if its model were loaded (the failed load had set its "ready" event to wake its
    waiters) and was sent to a host that does not hold it; or, a moment later, it failed with the
    first load's error. It waits for room (within its deadline) and is served once it loads."""
    config = setup(tmp_path)

    async def main() -> None:
        inner = create_pool(config, in_process=True)
        pool = DiesUnderTheFirstLoad(inner, "a")
        lm = LiveManager(config, pool)
        await lm.start()
        real = lm.engine.admit
        no_room = 3  # the re-admissions after the death find no room (a stand-in for a busy device)

        def admit(m: Any, rank: int, now: float) -> Any:
            nonlocal no_room
            if pool.died and m.name == "a" and m.tier != Tier.GPU and no_room > 0:
                no_room -= 1
                return Admission("wait", float("inf"), "no room yet")
            return real(m, rank, now)

        lm.engine.admit = admit  # type: ignore[method-assign]
        try:
            served = await lm.infer("a", X, timeout_s=20)
            assert served.result.ok and served.cold
            assert no_room == 0 and pool.submitted.count(("load", "a")) == 1  # loaded once, on room
            assert pool.inferred == ["a"]  # sent to its host once: loaded
        finally:
            await lm.stop()
            inner.close()

    asyncio.run(main())
