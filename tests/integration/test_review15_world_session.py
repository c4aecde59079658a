"""residency.v1.WorldSession over a real socket (in-process server and hosts): an idle client's session is
closed at `server.world_idle_timeout` (state saved, DEADLINE_EXCEEDED naming the id to resume, the world
model freed), the limit follows a reload, and saved sessions are private to the service's user."""

from __future__ import annotations

import asyncio
import math
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

from .grpc_server import serving
from .test_world_stream import world_config

BOUND_S = 60.0
"""Only so a regression fails instead of hanging: never what the tests measure."""

IDLE_S = 1.5
"""The idle limit: long enough that a loaded 2-core machine never stalls the client's own next step
past it (the client, the server and the in-process host share one event loop)."""


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, which leaves group and others read access to what is created by default."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


async def _inputs(*msgs: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
    for m in msgs:
        yield m


def _start(resume: str = "") -> pb.WorldInput:
    return pb.WorldInput(start=pb.WorldStart(model="world", resume_session_id=resume))


def _pose(i: int) -> pb.WorldInput:
    return pb.WorldInput(action=pb.WorldAction(x=float(i), yaw=20.0 * i))


def _idle_end(details: str, sid: str, segment: int) -> None:
    assert f"world session {sid} was idle for {IDLE_S}s" in details, details
    assert f"start.resume_session_id={sid!r}) at segment {segment}" in details, details


def test_an_idle_world_client_is_closed_saved_and_resumable(tmp_path: Path) -> None:
    config = world_config(tmp_path, world_idle_timeout=IDLE_S)

    async def main() -> None:
        async with serving(config) as (target, manager), grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.WorldSessionStub(ch)
            call = stub.Run()
            await call.write(_start())
            first = await call.read()
            assert isinstance(first, pb.WorldOutput) and first.segment == -1
            sid = first.session_id
            await call.write(_pose(0))
            out = await call.read()
            assert isinstance(out, pb.WorldOutput) and out.segment == 0
            # then nothing more, the stream kept open: the server ends it
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), BOUND_S)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _idle_end(e.value.details() or "", sid, 1)

            # closed before its status went out: the books free the world model
            assert manager.sessions == {}
            assert manager.live["world"].inflight == 0
            assert manager.engine.models["world"].busy_until < math.inf
            assert (tmp_path / "sessions" / sid / "session.json").is_file()  # its state saved

            # resumed by its id, at the segment its client had not been sent yet
            outs = [o async for o in stub.Run(_inputs(_start(sid), _pose(1)))]
            assert [o.segment for o in outs] == [-1, 1] and {o.session_id for o in outs} == {sid}
            assert outs[0].resumed and outs[0].next_segment == 1

    asyncio.run(main())


def test_the_idle_limit_follows_a_reload(tmp_path: Path) -> None:
    # no limit at first (null); a reload sets one: the waits after it keep to it
    config = world_config(tmp_path, world_idle_timeout=None)

    async def main() -> None:
        async with serving(config) as (target, manager), grpc.aio.insecure_channel(target) as ch:
            call = pb_grpc.WorldSessionStub(ch).Run()
            await call.write(_start())
            first = await call.read()
            assert isinstance(first, pb.WorldOutput)
            sid = first.session_id
            server = manager.config.server.model_copy(update={"world_idle_timeout": IDLE_S})
            manager.reload(manager.config.model_copy(update={"server": server}))
            await call.write(_pose(0))
            out = await call.read()
            assert isinstance(out, pb.WorldOutput) and out.segment == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), BOUND_S)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _idle_end(e.value.details() or "", sid, 1)
            assert manager.sessions == {}

    asyncio.run(main())


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_saved_sessions_are_private_and_older_ones_are_tightened(tmp_path: Path, umask_022: None) -> None:
    config = world_config(tmp_path)
    sessions = tmp_path / "sessions"
    tmp_path.chmod(0o755)  # the user's folder above store.sessions

    async def main() -> None:
        async with serving(config) as (target, _), grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.WorldSessionStub(ch)
            outs = [o async for o in stub.Run(_inputs(_start(), _pose(0), _pose(1)))]
            sid = outs[0].session_id
            folder = sessions / sid
            files = sorted(p.name for p in folder.iterdir())
            assert {"session.json", "window.bin", "segments.wplog", "index.json", "meta.json"} <= set(files)
            assert _mode(sessions) == 0o700 and _mode(folder) == 0o700
            assert {f: _mode(folder / f) for f in files} == {f: 0o600 for f in files}
            assert _mode(tmp_path) == 0o755  # a parent it did not create is left as it is

            # a session saved before, with the default modes: it still resumes, and is made private
            sessions.chmod(0o755)
            folder.chmod(0o755)
            for f in files:
                (folder / f).chmod(0o644)
            again = [o async for o in stub.Run(_inputs(_start(sid), _pose(2)))]
            assert [o.segment for o in again] == [-1, 2] and again[0].resumed
            assert _mode(sessions) == 0o700 and _mode(folder) == 0o700
            now = sorted(p.name for p in folder.iterdir())
            assert {f: _mode(folder / f) for f in now} == {f: 0o600 for f in now}

    asyncio.run(main())
