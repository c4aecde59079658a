"""residency.v1.WorldSession over a real socket (in-process server and hosts): a client that keeps its
stream open, and goes on sending actions, but stops reading its outputs (a frozen app, a stuck UI
thread) fills its HTTP/2 receive window within a few outputs; the server's next send then waited on
flow control for ever, holding the world model (busy, its KV lease held), and the idle timer never ran
(the server was not waiting for input). Now a send that does not go through within
`server.world_idle_timeout` closes the session (state saved, model freed) and the stream ends
DEADLINE_EXCEEDED naming the id to resume; a server stop ends such a stream at once too."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.api.server import build_server
from manager.config import Config
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

from .test_world_stream import world_config

BOUND_S = 30.0
"""Only so a regression fails instead of hanging: never what the tests measure."""

NOT_READ = 64
"""Actions the client sends without reading: 64 outputs of ~18 KiB (the micro preset's latents), far
beyond a 64 KiB receive window."""

IDLE_S = 1.5
"""The idle limit: long enough that a loaded 2-core machine never stalls the client's own writes past it
(the client, the server and the in-process host share one event loop)."""

CLIENT = [("grpc.http2.bdp_probe", 0)]
"""The client's window stays gRPC's initial 64 KiB (BDP probing would grow it on a fast loopback): it
fills within a few outputs whatever the machine."""


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[str, LiveManager, grpc.aio.Server]]:
    """The service's gRPC server in this process on a free port, with in-process device hosts."""
    pool = create_pool(config, in_process=True)
    manager = LiveManager(config, pool)
    server, port, _ = await build_server(config, manager)
    await server.start()
    await manager.start()
    try:
        yield f"127.0.0.1:{port}", manager, server
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


def _start(resume: str = "") -> pb.WorldInput:
    return pb.WorldInput(start=pb.WorldStart(model="world", resume_session_id=resume))


def _pose(i: int) -> pb.WorldInput:
    return pb.WorldInput(action=pb.WorldAction(x=float(i), yaw=20.0 * i))


async def _inputs(*msgs: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
    for m in msgs:
        yield m


async def _until(done: Callable[[], bool], what: str) -> None:
    for _ in range(int(BOUND_S / 0.05)):
        if done():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


async def _open_and_stop_reading(stub: Any) -> tuple[Any, str]:
    """A stream that read its first two outputs and then sent NOT_READ more actions, reading none."""
    call = stub.Run()
    await call.write(_start())
    first = await call.read()
    assert isinstance(first, pb.WorldOutput) and first.segment == -1
    await call.write(_pose(0))
    out = await call.read()
    assert isinstance(out, pb.WorldOutput) and out.segment == 0
    for i in range(1, 1 + NOT_READ):
        await call.write(_pose(i))
    return call, first.session_id


async def _read_to_the_end(call: Any) -> tuple[list[int], grpc.aio.AioRpcError]:
    """The client reads again: the outputs queued for it, in order, then the stream's status."""
    segments: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while True:
            out = await asyncio.wait_for(call.read(), BOUND_S)
            assert isinstance(out, pb.WorldOutput), out  # (not EOF: the stream ends with an error)
            segments.append(out.segment)
    return segments, e.value


def _freed(manager: LiveManager) -> bool:
    return (
        manager.sessions == {}
        and manager.live["world"].inflight == 0
        and manager.engine.models["world"].busy_until < math.inf
    )


def test_a_client_that_does_not_read_is_closed_saved_and_resumable(tmp_path: Path) -> None:
    config = world_config(tmp_path, world_idle_timeout=IDLE_S)

    async def main() -> None:
        async with (
            serving(config) as (target, manager, _),
            grpc.aio.insecure_channel(target, options=CLIENT) as ch,
        ):
            stub = pb_grpc.WorldSessionStub(ch)
            call, sid = await _open_and_stop_reading(stub)
            # the client reads nothing more: its session is closed while its stream stays open (the
            # send it held given up), and the world model is free again
            await _until(lambda: _freed(manager), "the non-reading client's session still holds the model")
            assert (tmp_path / "sessions" / sid / "session.json").is_file()  # its state saved

            # the client is back: it gets every output stepped (none lost), then the status
            segments, e = await _read_to_the_end(call)
            assert segments == list(range(1, 1 + len(segments))) and 0 < len(segments) < NOT_READ
            after = segments[-1] + 1
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            details = e.details() or ""
            unread = f"world session {sid}: its client did not read its outputs for {IDLE_S}s"
            assert unread in details, details
            assert "server.world_idle_timeout" in details and "was idle" not in details, details
            assert f"start.resume_session_id={sid!r}) at segment {after}" in details, details

            # resumed by its id, at the segment after the last one its client got
            outs = [o async for o in stub.Run(_inputs(_start(sid), _pose(after)))]
            assert [o.segment for o in outs] == [-1, after] and {o.session_id for o in outs} == {sid}
            assert outs[0].resumed and outs[0].next_segment == after

    asyncio.run(main())


def test_a_client_that_reads_slowly_but_within_the_limit_keeps_its_session(tmp_path: Path) -> None:
    # the limit is on one send, not on the session: a client that reads its outputs in a burst after a
    # pause shorter than the limit loses nothing
    config = world_config(tmp_path, world_idle_timeout=60.0)

    async def main() -> None:
        async with (
            serving(config) as (target, manager, _),
            grpc.aio.insecure_channel(target, options=CLIENT) as ch,
        ):
            call, sid = await _open_and_stop_reading(pb_grpc.WorldSessionStub(ch))
            await asyncio.sleep(0.5)  # a pause (the sends wait on flow control): not a measure
            segments = []
            for _ in range(NOT_READ):
                out = await asyncio.wait_for(call.read(), BOUND_S)
                assert isinstance(out, pb.WorldOutput)
                segments.append(out.segment)
            assert segments == list(range(1, 1 + NOT_READ)) and sid in manager.sessions
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF and await call.code() == grpc.StatusCode.OK

    asyncio.run(main())


async def _steps_settled(manager: LiveManager, counter: Callable[[], int]) -> None:
    """Until the session takes no more steps (its send is held by the full window): only so that the
    stop below comes while the send is held (the case under test); the assertions hold either way."""
    last = -1
    for _ in range(int(BOUND_S / 0.5)):
        if counter() == last:
            return
        last = counter()
        await asyncio.sleep(0.5)


def _counting(manager: LiveManager) -> Callable[[], int]:
    steps = [0]
    step: Callable[..., Awaitable[Any]] = manager.step_session

    async def counted(*a: Any, **k: Any) -> Any:
        steps[0] += 1
        return await step(*a, **k)

    manager.step_session = counted  # type: ignore[method-assign]
    return lambda: steps[0]


def test_a_stop_ends_the_stream_of_a_client_that_does_not_read(tmp_path: Path) -> None:
    # no limit (null): the send waits on the client for ever, but a server stop still ends the stream
    # at once, its session saved and named (it held the stop for its whole grace, then got gRPC's cancel)
    config = world_config(tmp_path, world_idle_timeout=None)

    async def main() -> None:
        async with (
            serving(config) as (target, manager, server),
            grpc.aio.insecure_channel(target, options=CLIENT) as ch,
        ):
            steps = _counting(manager)
            call, sid = await _open_and_stop_reading(pb_grpc.WorldSessionStub(ch))
            await _steps_settled(manager, steps)
            assert sid in manager.sessions and steps() < NOT_READ  # held by the send, not done
            server.world_stopping.set()  # as `serve` does when it stops
            await _until(lambda: _freed(manager), "a stop left the non-reading client's session open")
            segments, e = await _read_to_the_end(call)
            assert segments == list(range(1, 1 + len(segments)))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            details = e.details() or ""
            assert "the server is stopping" in details, details
            assert f"start.resume_session_id={sid!r}) at segment {segments[-1] + 1}" in details, details

    asyncio.run(main())
