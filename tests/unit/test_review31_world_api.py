"""Review 31 (the WorldSession API from a client app's side). Found, with reproductions:

- A resume skipped the segments the server had sent but the app never read: the server counts a
  segment sent once gRPC has taken its output, and outputs queued on a connection that then went
  (an app killed while it pipelined its poses) were counted. The app could not say what it had.
  `WorldStart.resume_at` (its first segment not received) now brings the session back there.
- A resume of the app's own session while its earlier stream was still held (a dropped link the
  server had not found dead yet) was INVALID_ARGUMENT "end its stream first": clients do not retry
  that, and the app could not follow the advice. It is UNAVAILABLE now, to retry.
- A client's keepalive pings under 5 minutes apart, while a paused session sent no data, were
  taken for abuse by gRPC's default ping policy: GOAWAY "too_many_pings" closed the connection and
  the session. Pings every 5 s or more are taken now (`manager.api.runtime.keepalive_options`).
- A pose out of range (the client's mistake, INVALID_ARGUMENT) counted the session a failure
  (`error`) in the metrics and the request log.

Real components: the service's gRPC server on a free port over in-process device hosts (the world
model is WorldPager's "micro" stand-in), a client from the generated stubs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from live_helpers import grpc_service, served_world_config, until

from manager.api.runtime import CLIENT_PING_MIN_S
from manager.api.world import IDLE_RECHECK_S
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc


def start(**kw: Any) -> pb.WorldInput:
    return pb.WorldInput(start=pb.WorldStart(model="world", **kw))


def pose(i: int, **kw: float) -> pb.WorldInput:
    d: dict[str, float] = {"x": float(i), "yaw": 20.0 * i, **kw}
    return pb.WorldInput(action=pb.WorldAction(**d))


async def _messages(*msgs: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
    for m in msgs:
        yield m


async def collect(
    stub: Any, *msgs: pb.WorldInput
) -> tuple[list[pb.WorldOutput], grpc.aio.AioRpcError | None]:
    outs: list[pb.WorldOutput] = []
    try:
        async for o in stub.Run(_messages(*msgs), timeout=60):
            outs.append(o)
    except grpc.aio.AioRpcError as e:
        return outs, e
    return outs, None


@contextlib.asynccontextmanager
async def world_stub(tmp_path: Path, options: Any = None) -> AsyncIterator[tuple[Any, Any]]:
    """A WorldSession stub on the service's gRPC server (free port, in-process hosts), and its manager."""
    async with (
        grpc_service(served_world_config(tmp_path)) as (port, manager, _, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel,
    ):
        yield pb_grpc.WorldSessionStub(channel), manager  # type: ignore[no-untyped-call]


class TestAResumeAfterAHangUp:
    def _hang_up_after_reading_one(
        self, tmp_path: Path, resume: dict[str, Any]
    ) -> tuple[int, int, list[int]]:
        """An app pipelines 6 poses, reads the first output, and is killed; it resumes with `resume`.
        Returns the server's count of segments sent, where the resume continues, and the segments
        the resume's stream brought."""
        result: list[Any] = []

        async def main() -> None:
            async with world_stub(tmp_path) as (stub, manager):
                call = stub.Run()
                await call.write(start())
                sid = (await call.read()).session_id
                for i in range(6):
                    await call.write(pose(i))
                assert (await call.read()).segment == 0  # the app reads one output
                w = manager._world[sid]
                await until(lambda: w.next_segment >= 6, "the six steps sent, as the server counts")
                call.cancel()  # ... and is killed
                await until(lambda: not manager.sessions, "the session closed")
                outs, e = await collect(stub, start(resume_session_id=sid, **resume), pose(100))
                assert e is None, e
                result.extend([w.next_segment, outs[0].next_segment, [o.segment for o in outs]])

        asyncio.run(main())
        return result[0], result[1], result[2]

    def test_resume_at_brings_back_the_segments_the_app_never_read(self, tmp_path: Path) -> None:
        counted, at, segments = self._hang_up_after_reading_one(tmp_path, {"resume_at": 1})
        # the server took five or six for sent (the sixth's write may fail under the hang-up: `unsent`)
        assert counted in (5, 6)
        assert at == 1 and segments == [-1, 1]  # continued at the app's first segment not received

    def test_without_it_the_servers_count_holds(self, tmp_path: Path) -> None:
        counted, at, segments = self._hang_up_after_reading_one(tmp_path, {})
        assert counted in (5, 6) and at == counted and segments == [-1, counted]

    def test_resume_at_past_the_servers_count_is_the_servers_count(self, tmp_path: Path) -> None:
        counted, at, segments = self._hang_up_after_reading_one(tmp_path, {"resume_at": 50})
        assert counted in (5, 6) and at == counted and segments == [-1, counted]


def test_resume_at_is_checked(tmp_path: Path) -> None:
    async def main() -> None:
        async with world_stub(tmp_path) as (stub, _):
            _, e = await collect(stub, start(resume_at=3))
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.details() == "start.resume_at goes with start.resume_session_id (the session to resume)"
            _, e = await collect(stub, start(resume_session_id="0123456789ab", resume_at=-1))
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "start.resume_at must be a segment number >= 0, got -1" in (e.details() or "")

    asyncio.run(main())


def test_a_resume_while_the_old_stream_is_held_is_to_be_retried(tmp_path: Path) -> None:
    async def main() -> None:
        async with world_stub(tmp_path) as (stub, manager):
            held = stub.Run()  # the app's first stream, not yet found gone by the server
            await held.write(start())
            sid = (await held.read()).session_id
            await held.write(pose(0))
            assert (await held.read()).segment == 0
            _, e = await collect(stub, start(resume_session_id=sid))
            assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE
            assert f"world session {sid!r} is open on another stream: retry once it ends" in (
                e.details() or ""
            )
            await held.done_writing()  # it ends: the retry resumes it
            assert await held.code() == grpc.StatusCode.OK
            await until(lambda: not manager.sessions, "the first stream's session closed")
            outs, e = await collect(stub, start(resume_session_id=sid), pose(1))
            assert e is None and [o.segment for o in outs] == [-1, 1]

    asyncio.run(main())


def test_a_clients_keepalive_pings_keep_a_paused_session(tmp_path: Path) -> None:
    """Pings every CLIENT_PING_MIN_S while the session is paused (no data): it survives the pause."""
    ms = int(CLIENT_PING_MIN_S * 1000)
    options = [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]

    async def main() -> None:
        async with world_stub(tmp_path, options) as (stub, manager):
            call = stub.Run()
            await call.write(start())
            sid = (await call.read()).session_id
            await call.write(pose(0))
            assert (await call.read()).segment == 0
            await asyncio.sleep(4 * CLIENT_PING_MIN_S)  # paused: four pings, no data
            assert sid in manager.sessions
            await call.write(pose(1))
            assert (await call.read()).segment == 1
            await call.done_writing()

    asyncio.run(main())


def test_a_pose_out_of_range_is_the_clients_mistake_not_a_failed_session(tmp_path: Path) -> None:
    async def main() -> None:
        async with world_stub(tmp_path) as (stub, manager):
            outs, e = await collect(stub, start(), pose(0), pose(1, x=float("nan")))
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [o.segment for o in outs] == [-1, 0]
            await until(lambda: not manager.sessions, "the session closed")
            reg = manager.metrics.registry
            labels = {"model": "world", "cls": "interactive"}
            assert reg.get_sample_value("residency_requests_total", {**labels, "outcome": "ok"}) == 1
            assert reg.get_sample_value("residency_requests_total", {**labels, "outcome": "error"}) is None

    asyncio.run(main())


def test_a_reloaded_idle_timeout_reaches_a_session_already_waiting(tmp_path: Path) -> None:
    """Review 31 (live reload): a session waiting for its client's next action under no limit (or the
    old one) waited on under it after a reload lowered `server.world_idle_timeout`; the limit is
    looked at again every IDLE_RECHECK_S now."""

    async def main() -> None:
        async with world_stub(tmp_path) as (stub, manager):
            unlimited = manager.config.server.model_copy(update={"world_idle_timeout": None})
            manager.reload(manager.config.model_copy(update={"server": unlimited}))
            call = stub.Run()
            await call.write(start())
            sid = (await call.read()).session_id
            await call.write(pose(0))
            assert (await call.read()).segment == 0  # now waiting for its next action, under no limit
            await asyncio.sleep(0.5)
            one_second = manager.config.server.model_copy(update={"world_idle_timeout": 1.0})
            manager.reload(manager.config.model_copy(update={"server": one_second}))
            began = asyncio.get_running_loop().time()
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert asyncio.get_running_loop().time() - began < 1.0 + IDLE_RECHECK_S + 2.0
            assert f"world session {sid} was idle for 1s" in (await call.details() or "")
            await until(lambda: not manager.sessions, "the session closed, its state saved")

    asyncio.run(main())
