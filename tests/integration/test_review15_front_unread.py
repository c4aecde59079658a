"""residency.v1.WorldSession through a gRPC front end (`server.frontends: 1`): a client that keeps its
stream open, and goes on sending actions, but stops reading its outputs is closed within the limit as
a direct one is (tests/integration/test_review15_world_unread.py). The front end relays the stream to
the manager's process over a Unix-socket channel; with gRPC's BDP probing that channel's receive window
grew to megabytes (~1000 outputs of the micro preset) before the manager's send was held, so the
manager's limit (`server.world_idle_timeout`) fired only that many outputs later, the world model held
all the while. The front end's channel now keeps a small window: flow control reaches the manager
within a few outputs, and its send limit fires as it does for a direct client."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.live import LiveManager
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

from .grpc_server import serving
from .test_world_stream import world_config

BOUND_S = 30.0
"""Only so a regression fails instead of hanging: never what the test measures."""

PACE_S = 0.1
"""How often the non-reading client sends an action: well within the idle limit (so the session is
never closed as idle: the client is there, it only does not read), slow enough that filling a window
of megabytes takes minutes."""

LIMIT_S = 1.0
"""server.world_idle_timeout: bounds each send (and the wait for each action, which PACE_S keeps)."""

HELD_WITHIN = 64
"""At most this many outputs (~1.1 MiB of the micro preset's) go out unread before the manager's send is
held. Before the fix the front end's channel took in ~230 (its BDP-grown window: 4 MiB at least) and
the client's outputs were stepped, one every PACE_S, until then."""

CLIENT = [("grpc.http2.bdp_probe", 0)]
"""The client's window stays gRPC's initial 64 KiB: it fills within a few outputs whatever the machine."""


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


def _freed(manager: LiveManager) -> bool:
    return (
        manager.sessions == {}
        and manager.live["world"].inflight == 0
        and manager.engine.models["world"].busy_until < math.inf
    )


async def _keep_sending(call: Any, first: int) -> None:
    """Actions, one every PACE_S, until the stream ends (a write then fails) or this is cancelled."""
    i = first
    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
        while True:
            await call.write(_pose(i))
            i += 1
            await asyncio.sleep(PACE_S)


def test_a_client_behind_a_front_end_that_does_not_read_is_closed_saved_and_resumable(
    tmp_path: Path,
) -> None:
    config = world_config(tmp_path, frontends=1, world_idle_timeout=LIMIT_S)

    async def main() -> None:
        async with (
            serving(config) as (target, manager),
            grpc.aio.insecure_channel(target, options=CLIENT) as ch,
        ):
            stub = pb_grpc.WorldSessionStub(ch)
            call = stub.Run()
            await call.write(_start())
            first = await call.read()
            assert isinstance(first, pb.WorldOutput) and first.segment == -1
            sid = first.session_id
            await call.write(_pose(0))
            out = await call.read()
            assert isinstance(out, pb.WorldOutput) and out.segment == 0

            # the client goes on sending actions but reads nothing more: its session is closed while
            # its stream stays open, and the world model is free again
            sender = asyncio.ensure_future(_keep_sending(call, 1))
            try:
                await _until(
                    lambda: _freed(manager),
                    "the non-reading client's session (behind a front end) still holds the model",
                )
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            assert (tmp_path / "sessions" / sid / "session.json").is_file()  # its state saved

            # the client is back: it gets every output stepped (none lost), then the status
            segments: list[int] = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                while True:
                    msg = await asyncio.wait_for(call.read(), BOUND_S)
                    assert isinstance(msg, pb.WorldOutput), msg  # (not EOF: the stream ends with an error)
                    segments.append(msg.segment)
            e = raised.value
            assert segments == list(range(1, 1 + len(segments))) and segments, segments
            # held within a few outputs (the client's and the front end's 64 KiB windows), not after
            # the megabytes a grown window takes in: the limit fired on a send, as for a direct client
            assert len(segments) < HELD_WITHIN, f"{len(segments)} outputs went out before a send was held"
            after = segments[-1] + 1
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            details = e.details() or ""
            assert f"world session {sid}: its client did not read its outputs for 1s" in details, details
            assert "was idle" not in details, details
            assert f"start.resume_session_id={sid!r}) at segment {after}" in details, details

            # resumed by its id (through the front end), at the segment after the last one it got
            outs = [o async for o in stub.Run(_inputs(_start(sid), _pose(after)))]
            assert [o.segment for o in outs] == [-1, after] and {o.session_id for o in outs} == {sid}
            assert outs[0].resumed and outs[0].next_segment == after

    asyncio.run(main())
