"""Review 14 of what an untrusted or careless client or file can do to the service's files and process
through world sessions (manager/live_sessions.py, manager/api/world.py, workers/world.py): one class
per bug found; each docstring says what happened before. Real components: the service's gRPC server on
a free port over in-process device hosts, the real world model (the micro stand-in) and its saved
sessions on disk."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_helpers import WORLD_CONFIG
from test_review13_api import _open, _step, on_port_0, rpc_error, serving

import manager.live_sessions as sessions_mod
from manager.config import Config, load_config
from residency_proto.v1 import residency_pb2 as rpb
from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

WORLD2 = """  - {name: world2, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {min: 16MiB, max: 64MiB}, load_seconds: {disk: 0.2, host: 0.05}, source: {preset: micro}}
"""
"""A second world model on the same device (a world model runs one session at a time)."""


def config(tmp_path: Path, *, extra: str = "", sessions_keep: int | None = None) -> Config:
    """WORLD_CONFIG (plus `extra` model lines) on port 0, its sessions under tmp_path/sessions."""
    (tmp_path / "c.yaml").write_text(WORLD_CONFIG.replace("SESSIONS", str(tmp_path / "sessions")) + extra)
    cfg = on_port_0(load_config(tmp_path / "c.yaml"), tmp_path)
    if sessions_keep is not None:
        cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"sessions_keep": sessions_keep})})
    return cfg


async def start(channel: grpc.aio.Channel, model: str) -> tuple[Any, rpb.WorldOutput]:
    """A new session of `model`: its stream, and its first output."""
    call = rpb_grpc.WorldSessionStub(channel).Run()
    await call.write(rpb.WorldInput(start=rpb.WorldStart(model=model)))
    return call, await call.read()


async def saved_session(channel: grpc.aio.Channel, manager: Any) -> str:
    """A session of the world model run for 3 segments and ended by its client: its state saved, its
    close on the host over."""
    call, opened = await _open(channel)
    sid = opened.session_id
    assert [(await _step(call, i)).segment for i in range(3)] == [0, 1, 2]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    closing = manager._closing()
    if closing:
        await asyncio.wait(closing.values(), timeout=30)
    assert (manager.session_dir / sid / "session.json").is_file()
    return sid


async def resume_error(channel: grpc.aio.Channel, sid: str, timeout_s: float = 20.0) -> grpc.aio.AioRpcError:
    """The error a resume of `sid` ends with (fails when it opens, or takes longer than `timeout_s`)."""

    async def attempt() -> None:
        call, opened = await _open(channel, resume=sid)
        await call.done_writing()
        pytest.fail(f"the resume of {sid} opened (at segment {opened.next_segment})")

    return await rpc_error(asyncio.wait_for(attempt(), timeout_s))


def tree(d: Path) -> dict[str, bytes]:
    """Every file under `d` and its bytes."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


class TestASymlinkInTheSessionsFolder:
    """`store.sessions_keep`'s prune took a symbolic link named like a session (`<12 hex digits> ->
    /somewhere/else`) for a saved session: it walked and counted the bytes of the folder it points
    to, then "deleted" it (shutil.rmtree refuses a link, silently) and counted those bytes as freed.
    A link to a big folder made every real saved session be deleted, and the link was logged as
    deleted though it was not."""

    def test_it_is_neither_counted_nor_deleted_and_the_real_sessions_fit(self, tmp_path: Path) -> None:
        cfg = config(tmp_path, sessions_keep=1500)
        sessions, outside = tmp_path / "sessions", tmp_path / "outside"
        outside.mkdir()
        (outside / "big").write_bytes(b"y" * 10_000)
        old, newer, link = "a00000000001", "a00000000002", "c00000000001"
        for age, sid in enumerate((newer, old)):
            (sessions / sid).mkdir(parents=True)
            (sessions / sid / "segments.wplog").write_bytes(b"x" * 1000)
            os.utime(sessions / sid / "segments.wplog", (1e9 - age * 100, 1e9 - age * 100))
        (sessions / link).symlink_to(outside, target_is_directory=True)  # written last: the newest

        async def main() -> None:
            async with serving(cfg) as (channel, _, _):
                call, opened = await _open(channel)  # an open prunes the saved sessions
                assert opened.segment == -1
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF

        asyncio.run(main())
        assert not (sessions / old).exists()  # 2,000 bytes saved, 1,500 kept: the oldest goes
        assert (sessions / newer / "segments.wplog").exists()  # was deleted: the link's bytes counted
        assert (sessions / link).is_symlink() and (outside / "big").read_bytes() == b"y" * 10_000


class TestAPruneRunningWhileAnotherSessionResumes:
    """The prune at an open kept the sessions open or opening when it started. It runs on a thread,
    while the other world models go on: a saved session that another world model began to resume
    after it started (the prune walking the folder meanwhile) was deleted under that resume, though
    it was opening, and then open."""

    def test_the_session_being_resumed_is_kept(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        cfg = config(tmp_path, extra=WORLD2, sessions_keep=0)  # every saved session not open is pruned
        real_du = sessions_mod._du
        walking = threading.Event()
        state: dict[str, Any] = {}

        def du_held(d: Path) -> tuple[int, float]:
            """The real walk; the first one held until the saved session's resume has begun."""
            if not walking.is_set():
                walking.set()
                deadline = time.monotonic() + 30
                lm, sid = state["manager"], state["sid"]
                while sid not in lm._opening_ids and sid not in lm.sessions and time.monotonic() < deadline:
                    time.sleep(0.01)
            return real_du(d)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                sid = await saved_session(channel, manager)
                state.update(manager=manager, sid=sid)
                monkeypatch.setattr(sessions_mod, "_du", du_held)
                other = asyncio.ensure_future(start(channel, "world2"))  # its open prunes
                while not walking.is_set():
                    await asyncio.sleep(0.01)
                again, reopened = await _open(channel, resume=sid)  # world, meanwhile
                assert reopened.session_id == sid and reopened.next_segment == 3
                call, opened = await other
                assert opened.segment == -1 and opened.session_id != sid
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
                assert (manager.session_dir / sid / "segments.wplog").exists()  # was deleted
                assert (await _step(again, 3)).segment == 3
                await again.done_writing()
                assert await again.read() == grpc.aio.EOF
                closing = manager._closing()
                if closing:
                    await asyncio.wait(closing.values(), timeout=30)
                assert json.loads((manager.session_dir / sid / "session.json").read_text())["next_step"] == 4

        asyncio.run(main())


class TestASavedSessionThatIsNotPlainFiles:
    """A resume followed whatever it found under `store.sessions/<id>`: a session folder that is a
    symbolic link (a session moved elsewhere and linked back, a link planted there), or a log file
    that is one (`cp -s` from a backup), had the service write through it into the other folder
    (the resume's roll-back record, the steps' segments, the retired slots' holes punched in a backup);
    a `window.bin` that is a named pipe (or a link to /dev/zero) held the device host's open for good
    (or read until memory ran out), and with it every later open of a world session on that host."""

    @pytest.mark.parametrize("what", ["the folder", "segments.wplog"])
    def test_a_symlink_is_refused_and_what_it_points_to_left_alone(self, tmp_path: Path, what: str) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                sid = await saved_session(channel, manager)
                d, outside = manager.session_dir / sid, tmp_path / "outside"
                if what == "the folder":
                    shutil.move(d, outside)
                    d.symlink_to(outside, target_is_directory=True)
                    name = "its folder"
                else:
                    outside.mkdir()
                    shutil.move(d / "segments.wplog", outside / "segments.wplog")
                    (d / "segments.wplog").symlink_to(outside / "segments.wplog")
                    name = "segments.wplog"
                before = tree(outside)
                e = await resume_error(channel, sid)
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, details
                assert f"world session {sid!r}" in details and f"{name} is a symbolic link" in details
                assert str(tmp_path) not in details  # the server's paths are its own
                assert tree(outside) == before

        asyncio.run(main())

    @pytest.mark.parametrize("name", ["window.bin", "sent.json"])  # read by the host, by the manager
    def test_a_named_pipe_is_refused_at_once_and_sessions_open_after(self, tmp_path: Path, name: str) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                sid = await saved_session(channel, manager)
                pipe = manager.session_dir / sid / name
                pipe.unlink()
                os.mkfifo(pipe)
                try:
                    e = await resume_error(channel, sid, timeout_s=15)
                finally:  # (before the fix: the host's open waits on the pipe; let it go)
                    with contextlib.suppress(OSError):
                        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, details  # was DEADLINE_EXCEEDED: held
                assert f"{name} is not a regular file" in details
                call, opened = await _open(channel)  # the host is not held
                assert opened.segment == -1 and (await _step(call, 0)).segment == 0
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF

        asyncio.run(main())


class TestTheRecordOfWhatAClientWasSent:
    """A stream's end records in the session's folder the next segment its client was not sent
    (`sent.json`, through `sent.json.tmp`): a `sent.json.tmp` that was a symbolic link (to a file
    elsewhere) was written through, the file it points to overwritten with `{"next_segment": n}`."""

    def test_it_is_never_written_through_a_symlink(self, tmp_path: Path) -> None:
        cfg = config(tmp_path)
        precious = tmp_path / "precious.txt"
        precious.write_text("keep me")

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                call, opened = await _open(channel)
                sid = opened.session_id
                assert (await _step(call, 0)).segment == 0
                (manager.session_dir / sid / "sent.json.tmp").symlink_to(precious)
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
                sent = json.loads((manager.session_dir / sid / "sent.json").read_text())
                assert sent == {"next_segment": 1}
                again, reopened = await _open(channel, resume=sid)
                assert reopened.next_segment == 1
                await again.done_writing()
                assert await again.read() == grpc.aio.EOF

        asyncio.run(main())
        assert precious.read_text() == "keep me"


class TestADamagedSavedSession:
    """A resume of a session whose saved state is damaged ended UNAVAILABLE (which clients retry:
    it would never work) with the log's exception's repr and the server's paths, and a traceback in
    the server's log ("world session: SegmentLogError('/home/.../sessions/<id>/meta.json: ...')",
    "world session: FileNotFoundError(2, 'No such file or directory')"); a `session.json` that is
    not JSON any more answered NOT_FOUND "no saved world session", though its log was there."""

    @pytest.mark.parametrize(
        ("damage", "words"),
        [
            ("meta", "meta.json: max_bytes -5 is not a number of bytes >= 0 (or null)"),
            ("no log", "segments.wplog is missing"),
            ("session.json", "session.json is unreadable"),
            ("field", "session.json: next_step is '3', expected a whole number >= 0"),
        ],
    )
    def test_it_is_refused_saying_what_is_damaged_without_the_servers_paths(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, words: str
    ) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                sid = await saved_session(channel, manager)
                d = manager.session_dir / sid
                if damage == "meta":
                    meta = json.loads((d / "meta.json").read_text())
                    (d / "meta.json").write_text(json.dumps({**meta, "max_bytes": -5}))
                elif damage == "no log":
                    (d / "segments.wplog").unlink()
                elif damage == "session.json":
                    (d / "session.json").write_text("[" * 100_000)
                else:
                    state = json.loads((d / "session.json").read_text())
                    (d / "session.json").write_text(json.dumps({**state, "next_step": "3"}))
                e = await resume_error(channel, sid)
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, details
                assert f"world session {sid!r}: its saved state is damaged: {words}" in details
                assert str(tmp_path) not in details
                # the operator's log names the folder, without a traceback
                logged = [r for r in caplog.records if sid in r.getMessage() and "damaged" in r.getMessage()]
                assert logged and str(d) in logged[0].getMessage()
                assert not [r for r in caplog.records if r.exc_info]

        asyncio.run(main())

    def test_a_session_never_saved_is_still_not_found(self, tmp_path: Path) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, _):
                (manager.session_dir / "0123456789ab").mkdir(parents=True)  # a folder, nothing in it
                for sid in ("0123456789ab", "0123456789ac"):
                    e = await resume_error(channel, sid)
                    assert e.code() == grpc.StatusCode.NOT_FOUND
                    assert "no saved world session" in (e.details() or "")

        asyncio.run(main())


class _ManyUnusable:
    """The in-process device host's world sessions, a resume reporting `n` segments missing from its
    log (as a long session whose log lost its tail does, at every resume)."""

    def __init__(self, world: Any, n: int) -> None:
        self.world, self.n = world, n

    def __getattr__(self, k: str) -> Any:
        return getattr(self.world, k)

    def open(self, *args: Any, **kw: Any) -> dict[str, Any]:
        reply = dict(self.world.open(*args, **kw))
        if kw.get("resume"):
            reply["missing_segments"] = list(range(1000, 1000 + self.n))
        return reply


class TestAResumeWithManyUnusableSegments:
    """The first output of a resume listed every slot and segment found unusable, one line each,
    however many: 200,000 missing segments made a 5 MB message, over a client's default 4 MiB
    limit, so the stream failed RESOURCE_EXHAUSTED at every resume: the session could never be
    resumed."""

    def test_the_list_is_cut_saying_how_many_more(self, tmp_path: Path) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, pool):
                sid = await saved_session(channel, manager)
                host = pool.hosts["cpu0"]
                host.world = _ManyUnusable(host.world, 200_000)
                call, opened = await _open(channel, resume=sid)
                assert opened.resumed and opened.next_segment == 3
                lines = list(opened.unusable)
                assert lines[:2] == ["segment 1000: missing", "segment 1001: missing"]
                assert len(lines) <= 101 and lines[-1] == f"… and {200_000 - len(lines) + 1:,} more"
                assert (await _step(call, 3)).segment == 3
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF

        asyncio.run(main())


class TestARefusalNamesNoOtherClientsSession:
    """A session's id is all a resume needs. A second client's start on a world model that runs a
    session was refused RESOURCE_EXHAUSTED "world model 'world' runs a session (<its id>)": any
    client was told the running session's id, and could resume it, its world and history, once its
    own client's stream ended."""

    def test_the_running_sessions_id_is_not_told(self, tmp_path: Path) -> None:
        cfg = config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, _, _):
                first, opened = await _open(channel)
                sid = opened.session_id
                e = await rpc_error(_open(channel))
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "world model 'world' runs a session" in details and sid not in details
                await first.done_writing()
                assert await first.read() == grpc.aio.EOF

        asyncio.run(main())
