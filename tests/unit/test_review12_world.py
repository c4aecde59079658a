"""Found in the review of the world-session path (manager/api/world.py, manager/live_sessions.py,
workers/world.py) in 2026-12; each test failed before its fix."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from live_helpers import POSES, world_config

from manager.live import LiveManager
from manager.workers_bridge import create_pool
from workers.world import WorldSessions
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.session import SESSION_PRESETS

MIB = 2**20


class _ResizeOnRelease:
    """A session's lock that, when the stepping thread lets it go, waits until a resize that queued
    behind the step has run: the moment between a step's end and its reply, made to last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stepping: threading.Thread | None = None
        self.step_in = threading.Event()
        self.resized = threading.Event()

    def __enter__(self) -> _ResizeOnRelease:
        self.lock.acquire()
        if self.stepping is None:
            self.stepping = threading.current_thread()
            self.step_in.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if threading.current_thread() is self.stepping:
            self.resized.wait(10)


class TestAStepReportsTheLeaseItRanWith:
    """A step read the session's lease for its reply after it had let the session's lock go, so a
    resize that waited behind the step (the manager shrinking the lease for another model) was
    reported as the lease of a segment that ran with the old one: `lease_bytes` 3 segments with
    `host_bytes` of 6 in the same output (the proto: "the KV lease the runtime held for this
    segment")."""

    def test_a_resize_queued_behind_a_step_is_not_that_steps_lease(self, tmp_path: Path) -> None:
        cfg = SESSION_PRESETS["micro"].on_the_fly()
        seg = SegmentLayout.from_config(cfg, "bf16", torch.float32).payload_nbytes
        ws = WorldSessions(torch.device("cpu"))
        opened = ws.open("world", TinyCausalWan(cfg), "a", 40 * seg, tmp_path / "a")
        assert opened["lease_bytes"] == 40 * seg
        lock = _ResizeOnRelease()
        ws.open_sessions["a"].lock = lock  # type: ignore[assignment]
        applied: list[int] = []

        def shrink() -> None:
            lock.step_in.wait(10)
            applied.append(ws.resize("a", 3 * seg))  # waits for the step's lock
            lock.resized.set()

        t = threading.Thread(target=shrink)
        t.start()
        d = ws.step("a", POSES[0])
        t.join(10)
        assert applied == [3 * seg]
        assert d["lease_bytes"] == 40 * seg  # the lease the segment ran with
        assert ws.step("a", POSES[1])["lease_bytes"] == 3 * seg  # the next one runs with the new one
        ws.close("a")


class _HeldOpen:
    """The in-process pool, holding a session open's reply in its worker thread (the session is
    open on the host already) until `go` is set."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        reply = self.pool.session(device, method, *args, **kw)
        if method == "open":
            self.entered.set()
            self.go.wait(10)
        return reply


class TestTheOpeningLeaseIsTheOneInForce:
    """A lease the engine shrank while a session opened is applied to it before the open's reply
    (README), but the reply (the stream's first output, `lease_bytes`) still named the lease the
    open was sent with: the client was told 40 MiB while the session held 16 MiB."""

    def test_a_shrink_during_the_open_is_the_opened_lease(self, tmp_path: Path) -> None:
        config = world_config(tmp_path)

        async def main() -> None:
            pool = _HeldOpen(create_pool(config, in_process=True))
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                m = lm.engine.models["world"]
                # the engine's own lease changes held off: this test makes them
                lm.engine._refresh_lease = lambda m, now: None  # type: ignore[method-assign]
                await lm.preload("world")
                lm.engine._set_lease(m, 40 * MIB, lm.clock(), "test: lent free room")
                lm._flush()
                opening = asyncio.ensure_future(lm.open_session("world"))
                assert await asyncio.to_thread(pool.entered.wait, 10)
                lm.engine._set_lease(m, 16 * MIB, lm.clock(), "test: another model needs the room")
                lm._flush()
                pool.go.set()
                sid, opened = await opening
                assert m.lease == 16 * MIB
                assert opened["lease_bytes"] == 16 * MIB
                d = await lm.step_session(sid, POSES[0])
                assert d["lease_bytes"] == opened["lease_bytes"]
                await lm.close_session(sid)
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())


class _SlowClose:
    """The in-process pool, its session closes held until `go` is set (a host still saving a
    session's state), each close's reply recorded."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.go = threading.Event()
        self.closes: list[Any] = []

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        if method == "close":
            self.go.wait(10)
        reply = self.pool.session(device, method, *args, **kw)
        if method == "close":
            self.closes.append(reply)
        return reply


class TestAnOpenWaitsForTheCloseOfTheStreamBefore:
    """A stream's end takes its session off the manager's books at once and closes it on the host in
    the background. A new session opened on the world model meanwhile reached the host while the
    old one was still open there: the host refused it, and the manager took the old session for an
    orphan "left open on the device host by an earlier run of the manager" (a false warning and
    event, a second close); and the open's prune (`store.sessions_keep`) deleted the old session's
    directory while its host close was saving its state there (FileNotFoundError on the host, the
    close failed)."""

    def test_the_old_session_closes_cleanly_and_is_no_orphan(self, tmp_path: Path) -> None:
        config = world_config(tmp_path)
        config = config.model_copy(update={"store": config.store.model_copy(update={"sessions_keep": 0})})

        async def main() -> None:
            pool = _SlowClose(create_pool(config, in_process=True))
            lm = LiveManager(config, pool)
            events = lm.subscribe()
            await lm.start()
            try:
                a, _ = await lm.open_session("world")
                assert [(await lm.step_session(a, p))["step"] for p in POSES[:3]] == [0, 1, 2]
                closing = asyncio.ensure_future(lm.close_session(a))
                await asyncio.sleep(0.05)
                assert a not in lm.sessions  # off the books; its host close is held
                opening = asyncio.ensure_future(lm.open_session("world"))
                await asyncio.sleep(0.5)
                assert (lm.session_dir / a / "session.json").exists()  # not pruned while it closes
                pool.go.set()
                assert (await closing)["closed"] is True
                b, _ = await opening
                assert b != a
                assert all(r.ok for r in pool.closes), [r.error for r in pool.closes]
                assert len(pool.closes) == 1  # closed once, by its own stream's end
                await lm.close_session(b)
            finally:
                await lm.stop()
                pool.close()
            seen = []
            while not events.empty():
                seen.append(events.get_nowait())
            assert not [e for e in seen if "earlier run" in str(e.get("detail", ""))]

        asyncio.run(main())
