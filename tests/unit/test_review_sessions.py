"""Found in the review of world sessions in the live service (manager/live_sessions.py, the
WorldSession servicer, workers/world.py) and of the fast path (2026-12); each failed before its fix."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import POSES, world_config

from manager.live import LiveManager
from manager.workers_bridge import create_pool


class _HeldSteps:
    """The in-process pool, with a switch that holds the next session step in its worker thread
    (after it ran on the host: its segment is generated and in the log) until `go` is set."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.hold = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        reply = self.pool.session(device, method, *args, **kw)
        if method == "step" and self.hold:
            self.hold = False
            self.entered.set()
            self.go.wait(10)
        return reply


def run_world(tmp_path: Path, body: Callable[[LiveManager, Any], Awaitable[Any]]) -> Any:
    config = world_config(tmp_path)

    async def main() -> Any:
        pool = _HeldSteps(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            return await body(lm, pool)
        finally:
            await lm.stop()
            pool.close()

    return asyncio.run(main())


class TestResumeAfterAHangUpMidStep:
    """A client hung up while a step ran: its segment was generated and logged on the host, but
    never sent. The stream's end closed the session; resumed with `start.resume_session_id`, it
    went on after that segment (next_segment 3 where the client had 2): the segment was lost to the
    client, which could never get it. (The reopen after a host death already rolled back to the
    client's next segment; a resume did not.)"""

    def test_a_resumed_session_goes_on_at_the_segment_its_client_did_not_get(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _HeldSteps) -> None:
            sid, _ = await lm.open_session("world")
            got = [await lm.step_session(sid, p) for p in POSES[:2]]
            assert [d["step"] for d in got] == [0, 1]
            pool.hold = True
            step = asyncio.ensure_future(lm.step_session(sid, POSES[2]))
            await asyncio.to_thread(pool.entered.wait, 10)
            step.cancel()  # the client hung up: its stream's end closes the session
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(lm.close_session(sid))
            pool.go.set()
            await closing
            assert step.cancelled()
            _, opened = await lm.open_session("world", resume_id=sid, codec="")
            assert opened["resumed"] and opened["next_segment"] == 2
            d = await lm.step_session(sid, POSES[2])
            assert d["step"] == 2
            await lm.close_session(sid)

        run_world(tmp_path, body)

    def test_a_client_that_reconnects_at_once_gets_that_segment_too(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _HeldSteps) -> None:
            sid, _ = await lm.open_session("world")
            assert (await lm.step_session(sid, POSES[0]))["step"] == 0
            pool.hold = True
            step = asyncio.ensure_future(lm.step_session(sid, POSES[1]))
            await asyncio.to_thread(pool.entered.wait, 10)
            step.cancel()
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(lm.close_session(sid))
            await asyncio.sleep(0)  # the close is on its way to the host; the client is back at once
            pool.go.set()
            _, opened = await lm.open_session("world", resume_id=sid, codec="")
            await closing
            assert opened["next_segment"] == 1
            assert (await lm.step_session(sid, POSES[1]))["step"] == 1
            await lm.close_session(sid)

        run_world(tmp_path, body)


class _Watched:
    """A lock that says when a thread named `who` tries to take it."""

    def __init__(self, lock: Any, who: str, tried: threading.Event) -> None:
        self.lock, self.who, self.tried = lock, who, tried

    def __enter__(self) -> _Watched:
        if threading.current_thread().name == self.who:
            self.tried.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


class TestAResumeWaitsForTheCloseOfItsSession:
    """The host's close took a session out of `open_sessions` first, then closed it (its I/O
    drained, its rolling window and state saved: a while). A resume that came meanwhile (a client
    reconnecting at once) saw no session open and reopened it from the state of the close not yet
    written: its rolling window rebuilt from the log at codec precision (not the exact one the close
    was saving), and then the old close overwrote the resumed session's `session.json` and read the
    model's KV window that the new session had already replaced. Now an open waits for a close."""

    def test_a_resume_during_the_close_continues_from_the_closed_state(self, tmp_path: Path) -> None:
        import torch

        from workers.world import WorldSessions
        from worldpager.layout import SegmentLayout
        from worldpager.model import TinyCausalWan
        from worldpager.session import SESSION_PRESETS

        cfg = SESSION_PRESETS["micro"].on_the_fly()
        kv = 3 * SegmentLayout.from_config(cfg, "bf16", torch.float32).payload_nbytes
        ref_ws = WorldSessions(torch.device("cpu"))
        ref_ws.open("world", TinyCausalWan(cfg), "ref", kv, tmp_path / "ref")
        ref = [ref_ws.step("ref", p) for p in POSES[:3]]
        ref_ws.close("ref")

        ws, model = WorldSessions(torch.device("cpu")), TinyCausalWan(cfg)
        ws.open("world", model, "a", kv, tmp_path / "a")
        assert [ws.step("a", p)["step"] for p in POSES[:2]] == [0, 1]
        saving, gate, tried = threading.Event(), threading.Event(), threading.Event()
        session = ws.get("a").session
        save_window = session._save_window

        def held_save() -> Any:
            saving.set()
            gate.wait(10)
            return save_window()

        session._save_window = held_save
        ws._opening = _Watched(ws._opening, "resume", tried)  # type: ignore[assignment]
        results: dict[str, Any] = {}

        def close() -> None:
            results["close"] = ws.close("a")

        def resume() -> None:
            try:
                results["resume"] = ws.open("world", model, "a", kv, tmp_path / "a", None, resume=True)
            except Exception as e:  # recorded for the assertion below
                results["resume"] = e
            tried.set()

        closer = threading.Thread(target=close, name="close")
        closer.start()
        assert saving.wait(10)
        resumer = threading.Thread(target=resume, name="resume")
        resumer.start()
        assert tried.wait(10)  # the resume has come to the host's lock (or, before, opened already)
        gate.set()
        closer.join(10)
        resumer.join(10)
        assert results["close"]["closed"] and results["close"]["segments"] == 2
        opened = results["resume"]
        assert isinstance(opened, dict) and opened["next_segment"] == 2
        assert ws.get("a").session.window_source == "checkpoint"  # the exact window the close saved
        d = ws.step("a", POSES[2])
        ws.close("a")
        assert d["step"] == 2 and d["latents"] == ref[2]["latents"]


class TestASessionLeftOpenByAKilledManager:
    """Device hosts outlive a killed manager on a cluster (`ray.address`): the world model is adopted
    by the next run, with the session the killed one had open still open on its host (and holding
    its KV). The new manager knew nothing of it, so every new session on the world model was refused
    INVALID_ARGUMENT ("model 'world' runs world session ...") and the orphaned client's resume too
    ("session ... is already open"), until the model happened to leave the GPU. Now the orphan is
    closed on the host (its state saved) and the open goes on."""

    @pytest.mark.parametrize("first", ["new", "resume"])
    def test_the_next_manager_opens_and_resumes_past_an_orphaned_session(
        self, tmp_path: Path, first: str
    ) -> None:
        config = world_config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            old = LiveManager(config, pool)
            await old.start()
            orphan, _ = await old.open_session("world")
            assert [(await old.step_session(orphan, p))["step"] for p in POSES[:2]] == [0, 1]
            assert old._task is not None
            old._task.cancel()  # killed: its streams are gone, its device host is not
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                assert lm.live["world"].ready.is_set()  # adopted as the host holds it
                if first == "new":
                    sid, opened = await lm.open_session("world")
                    assert sid != orphan and opened["next_segment"] == 0
                    await lm.close_session(sid)
                again, resumed = await lm.open_session("world", resume_id=orphan, codec="")
                assert again == orphan and resumed["resumed"] and resumed["next_segment"] == 2
                assert (await lm.step_session(orphan, POSES[2]))["step"] == 2
                await lm.close_session(orphan)
                assert lm.live["world"].inflight == 0 and lm.sessions == {}
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())


class TestASessionsEndIsTheWorldModelsLastUse:
    """A closed session counted as a request of the world model (`requests`, the request log) but
    left its last use where its last step was, or at "never" for a session with no steps: `ps` said
    the model had not been used though a session had held it until a moment ago, and a restart that
    rebuilt the figures from the request log put it at the session's end (drift)."""

    def test_close_sets_last_used(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _HeldSteps) -> None:
            live = lm.live["world"]
            sid, _ = await lm.open_session("world")
            before = lm.clock()
            await lm.close_session(sid)
            assert live.requests == 1 and live.last_used >= before

        run_world(tmp_path, body)


VOICE = """  - {name: voice, class: interactive, adapter: silero-vad, device: cpu0, memory: 3MiB,
     load_seconds: {disk: 0.1, host: 0.05}}
"""


class TestAWorldSessionsSuccessorsArePrewarmed:
    """The policy learns which models follow a request (voice came within a minute of each world
    session's start) and prewarms them right after it; the replay does so for a world session as
    for any request (at its start). The live manager never asked the policy after a session, so a
    model that always followed one was never prewarmed (a cold start the replay did not have)."""

    def test_a_model_that_follows_world_sessions_is_loaded_when_one_opens(self, tmp_path: Path) -> None:
        from manager.policy.types import Tier

        config = world_config(tmp_path, VOICE)
        audio = {"audio": np.zeros(512, dtype=np.float32)}

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                voice = lm.engine.models["voice"]
                for _ in range(2):
                    sid, _ = await lm.open_session("world")
                    await lm.infer("voice", audio, timeout_s=30)
                    await lm.close_session(sid)
                    lm.evict("voice", "disk")
                    assert voice.tier == Tier.DISK
                sid, _ = await lm.open_session("world")
                assert voice.tier == Tier.GPU, "voice follows world sessions: prewarmed at the start"
                await lm.close_session(sid)
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())
