"""Found in the 17th review of the world-session stream (manager/api/world.py, manager/live_sessions.py);
each test failed before its fix."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc._cython import cygrpc
from live_helpers import POSES, drain, until, world_config

from manager.api.world import WorldSessionServicer
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as pb


class Aborted(Exception):
    """`context.abort`'s own exception (grpc.aio raises one to end the handler)."""


class HeldAfter:
    """A servicer context whose first `ok` writes go out and whose next one is held for good (the
    client stopped reading, or hung up while it was on its way), or fails with `error`."""

    def __init__(self, ok: int, error: Exception | None = None) -> None:
        self.ok, self.error = ok, error
        self.written: list[pb.WorldOutput] = []
        self.held = asyncio.Event()
        self.aborted: list[tuple[Any, str]] = []

    def time_remaining(self) -> None:
        return None  # (a stream without a deadline)

    async def write(self, out: pb.WorldOutput) -> None:
        if len(self.written) >= self.ok:
            self.held.set()
            if self.error is not None:
                raise self.error
            await asyncio.Event().wait()
        self.written.append(out)

    async def abort(self, code: Any, details: str) -> None:
        self.aborted.append((code, details))
        raise Aborted(details)


def _pose(i: int) -> pb.WorldInput:
    x, y, z, pitch, yaw = POSES[i]
    return pb.WorldInput(action=pb.WorldAction(x=x, y=y, z=z, pitch=pitch, yaw=yaw))


async def _inputs(*msgs: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
    for m in msgs:
        yield m
    await asyncio.Event().wait()  # the client keeps its stream open


def _run_world(tmp_path: Path, body: Any, **server: Any) -> None:
    config = world_config(tmp_path)
    if server:
        config = config.model_copy(update={"server": config.server.model_copy(update=server)})

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            await body(lm)
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


class TestASegmentWhoseSendFailedIsNotCountedSent:
    """A step's output counted as sent to its client as soon as the step returned, before it was
    written: a client that hung up while segment 1 was on its way (its call cancelled, or the write
    failing as the stream went) was told, and a resume continued, at segment 2. Segment 1 was lost
    to it for good (generated on the host, never received). Now the session continues at it."""

    def test_a_client_that_hangs_up_mid_send_resumes_at_that_segment(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager) -> None:
            servicer = WorldSessionServicer(lm)
            context = HeldAfter(ok=2)  # the open's output and segment 0 go out; segment 1's is held
            start = pb.WorldInput(start=pb.WorldStart(model="world"))
            run = asyncio.ensure_future(servicer._run(_inputs(start, _pose(0), _pose(1)), context))
            await asyncio.wait_for(context.held.wait(), 30)
            sid = context.written[0].session_id
            assert [o.segment for o in context.written] == [-1, 0]
            run.cancel()  # the client hung up: gRPC cancels the handler
            with pytest.raises(asyncio.CancelledError):
                await run
            await until(lambda: not lm._closing(), "the session's close")
            _, opened = await lm.open_session("world", resume_id=sid, codec="")
            assert opened["next_segment"] == 1
            assert (await lm.step_session(sid, POSES[1]))["step"] == 1
            await lm.close_session(sid)

        _run_world(tmp_path, body)

    def test_a_send_that_fails_as_the_stream_goes_is_not_counted_sent(self, tmp_path: Path) -> None:
        # gRPC's own error from the write: the stream is gone, nothing of it reaches the client
        async def body(lm: LiveManager) -> None:
            servicer = WorldSessionServicer(lm)
            context = HeldAfter(ok=2, error=cygrpc.ExecuteBatchError("Failed grpc_call_start_batch"))
            start = pb.WorldInput(start=pb.WorldStart(model="world"))
            with pytest.raises(grpc.aio.BaseError):
                await servicer._run(_inputs(start, _pose(0), _pose(1)), context)
            sid = context.written[0].session_id
            assert sid not in lm.sessions and context.aborted == []
            await until(lambda: not lm._closing(), "the session's close")
            _, opened = await lm.open_session("world", resume_id=sid, codec="")
            assert opened["next_segment"] == 1
            await lm.close_session(sid)

        _run_world(tmp_path, body)

    def test_a_client_that_stops_reading_still_gets_the_output_it_held(self, tmp_path: Path) -> None:
        # (unchanged: the send given up stays queued in gRPC, so a client that reads again gets that
        # segment, then the status, which names the segment after it)
        async def body(lm: LiveManager) -> None:
            servicer = WorldSessionServicer(lm)
            context = HeldAfter(ok=2)
            start = pb.WorldInput(start=pb.WorldStart(model="world"))
            with pytest.raises(Aborted) as e:
                await servicer._run(_inputs(start, _pose(0), _pose(1)), context)
            sid = context.written[0].session_id
            assert "did not read its outputs" in str(e.value)
            assert f"start.resume_session_id={sid!r}) at segment 2" in str(e.value), e.value

        _run_world(tmp_path, body, world_idle_timeout=0.2)


class NoSession:
    """The manager as `_run` sees it before any session opened."""

    def __init__(self) -> None:
        self.sessions: dict[str, Any] = {}


class TestAStopEndsAStreamThatSentNoStartYet:
    """The first message was read with no regard to the server's stop: a stream opened without its
    `start` yet held the stop for its whole grace and then ended with gRPC's own cancel ("Cancelling
    all calls"), not UNAVAILABLE "the server is stopping" as every other open world stream does."""

    def test_the_stop_ends_the_wait_for_start(self) -> None:
        async def main() -> None:
            servicer = WorldSessionServicer(NoSession())  # type: ignore[arg-type]
            context = HeldAfter(ok=0)

            async def silent() -> AsyncIterator[pb.WorldInput]:
                await asyncio.Event().wait()
                yield pb.WorldInput()  # (never reached)

            run = asyncio.ensure_future(servicer._run(silent(), context))
            await asyncio.sleep(0.05)
            servicer.stopping.set()
            with pytest.raises(Aborted):
                await asyncio.wait_for(run, 10)
            [(code, details)] = context.aborted
            assert code.name == "UNAVAILABLE"
            assert details.startswith("the server is stopping") and "None" not in details, details

        asyncio.run(main())


class _Held:
    """The in-process pool, whose next session call of `method` waits (in its worker thread, before it
    reaches the host) until `go` is set."""

    def __init__(self, pool: Any, method: str) -> None:
        self.pool = pool
        self.method = method
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        if method == self.method and not self.go.is_set():
            self.entered.set()
            self.go.wait(10)
        return self.pool.session(device, method, *args, **kw)


class TestALeaseChangeThatMeetsAClosedSession:
    """A lease change the manager decided for an open session reached its host after the session's
    stream had ended (the host answered "no open world session"): it was published as a
    `lease_failed` event naming no model (`model` ""), the session's model read after the reply,
    once the close had taken the session off the books. A session closed meanwhile has no lease to
    change: nothing failed, and nothing is published as failed."""

    def test_no_failure_is_published_for_a_session_closed_meanwhile(self, tmp_path: Path) -> None:
        config = world_config(tmp_path)

        async def main() -> None:
            pool = _Held(create_pool(config, in_process=True), "resize")
            lm = LiveManager(config, pool)
            await lm.start()
            events = lm.subscribe()
            try:
                sid, _ = await lm.open_session("world")
                device = lm.engine.models["world"].device
                resize = asyncio.ensure_future(lm._resize_session(device, sid, 32 * 2**20))
                await asyncio.to_thread(pool.entered.wait, 10)
                await lm.close_session(sid)  # the client's stream ended meanwhile
                pool.go.set()
                assert await resize is None
                seen = [e for e in drain(events) if e["kind"].startswith("lease_")]
                assert seen == [], seen
            finally:
                pool.go.set()
                await lm.stop()
                pool.close()

        asyncio.run(main())

    def test_a_failure_of_an_open_sessions_resize_names_its_model(self, tmp_path: Path) -> None:
        config = world_config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool)
            await lm.start()
            events = lm.subscribe()
            try:
                sid, _ = await lm.open_session("world")
                device = lm.engine.models["world"].device
                await asyncio.to_thread(pool.session, device, "close", sid)  # its host lost it
                assert await lm._resize_session(device, sid, 32 * 2**20) is None
                [failed] = [e for e in drain(events) if e["kind"] == "lease_failed"]
                assert failed["model"] == "world" and sid in failed["detail"], failed
                await lm.close_session(sid)
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())


class TestAResumeRetriedWhileItsAbandonedOpenEnds:
    """A client whose resume was cancelled mid-open (it hung up while the model loaded) and that tried
    again at once was told INVALID_ARGUMENT "world session X is open: end its stream first" (not to
    be retried), though it had ended its stream: the abandoned open was still under way, to be closed
    once open. Now it is told UNAVAILABLE, to retry in a moment, until that close is done."""

    def test_the_retry_is_told_to_retry_and_a_later_one_resumes(self, tmp_path: Path) -> None:
        from manager.errors import WorkerUnavailable

        config = world_config(tmp_path)

        async def main() -> None:
            pool = _Held(create_pool(config, in_process=True), "open")
            pool.go.set()
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                sid, _ = await lm.open_session("world")
                await lm.step_session(sid, POSES[0])
                await lm.close_session(sid)
                pool.go.clear()
                first = asyncio.ensure_future(lm.open_session("world", resume_id=sid, codec=""))
                await asyncio.to_thread(pool.entered.wait, 10)
                first.cancel()  # the client hung up mid-open
                with pytest.raises(asyncio.CancelledError):
                    await first
                with pytest.raises(WorkerUnavailable, match=r"is still being closed .* retry in a moment"):
                    await lm.open_session("world", resume_id=sid, codec="")
                pool.go.set()
                await until(lambda: not lm._left_ids and sid not in lm.sessions, "the abandoned open closed")
                await until(lambda: not lm._closing(), "the session's close")
                got, opened = await lm.open_session("world", resume_id=sid, codec="")
                assert got == sid and opened["next_segment"] == 1
                await lm.close_session(sid)
            finally:
                pool.go.set()
                await lm.stop()
                pool.close()

        asyncio.run(main())
