"""worldpager fixes from review 28: a session folder's files and who may write them. A new session
wrote over (and, running no step, deleted) a user's own files named as its own; a write error other
than a full disk (EFBIG over a file-size limit, EIO) ended the CLI in a traceback and lost
session.json; a creation that failed part-way left a folder neither a new run nor --resume took; two
processes on one log overwrote each other's slots; an index entry with a non-finite pose crashed a
resume; host-only mode kept one `Dropped` event per step without bound. Real files in tmp_path, real
sessions on the "micro" stand-in, the CLI in a subprocess where a user would see it; each test failed
before its fix."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import worldpager.segment_log as segment_log
import worldpager.session_store as session_store
from worldpager.cli import main
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.page_types import DiskFull
from worldpager.segment_log import (
    INDEX_NAME,
    LOG_NAME,
    META_NAME,
    LogInUse,
    SegmentLog,
    SegmentLogError,
    slot_size_for,
)
from worldpager.session import SESSION_FILE, SESSION_PRESETS, WINDOW_FILE, Session, read_saved_state
from worldpager.session_records import EventLog
from worldpager.trajectory import yaw_sweep_trajectory
from worldpager.transfer import Dropped, TransferError

WP = [sys.executable, "-m", "worldpager.cli"]
CFG = SESSION_PRESETS["micro"].on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16", torch.float32).payload_nbytes
POSES = yaw_sweep_trajectory(8)
PAGE = 6000
SLOT = slot_size_for(2 * PAGE)


def _wp(*argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WP, *argv], capture_output=True, text=True, timeout=300, **kw)


def _said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What the CLI said on stderr, less its warnings about the host tier's size."""
    return [ln for ln in done.stderr.strip().splitlines() if "warning: the host tier" not in ln]


def _segment(rng: random.Random, sid: int) -> dict[str, Any]:
    return {
        "segment_id": sid, "frame_start": 3 * sid, "frame_end": 3 * sid + 3,
        "pose": (0.0, 1.0, 2.0, float(sid), 4.0), "codec": "bf16", "position_state": "post-rope",
        "position": 3 * sid, "payload": rng.randbytes(2 * PAGE), "page_offsets": (0, PAGE),
    }  # fmt: skip


def _filled(d: Path, n: int) -> None:
    rng = random.Random(28)
    with SegmentLog.create(d, SLOT) as log:
        for i in range(n):
            assert log.append(**_segment(rng, i)) == i


# ---- 1: a new session never writes over, nor deletes, files it did not make ---------------------------


@pytest.mark.parametrize(
    "name", [INDEX_NAME, META_NAME, SESSION_FILE, WINDOW_FILE, SESSION_FILE + ".tmp", INDEX_NAME + ".tmp"]
)
def test_a_new_session_refuses_a_folder_holding_a_file_of_its_names(tmp_path: Path, name: str) -> None:
    mine = tmp_path / name
    mine.write_text('{"my": "three weeks of work"}\n')
    done = _wp("session", "--preset", "micro", "--segments", "1", "--log-dir", str(tmp_path), "--json")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    said = _said(done)
    assert len(said) == 1 and str(tmp_path) in said[0] and str(mine) in said[0], said
    assert "new session would write over" in said[0], said
    assert mine.read_text() == '{"my": "three weeks of work"}\n'
    assert sorted(os.listdir(tmp_path)) == [name]  # nothing of the session made


def test_a_session_that_runs_no_step_deletes_no_file_of_the_users(tmp_path: Path) -> None:
    for name in (WINDOW_FILE, SESSION_FILE, "notes.txt"):
        (tmp_path / name).write_text("user data\n")
    with pytest.raises(FileExistsError) as caught:  # (its close deleted window.bin and session.json)
        Session(TinyCausalWan(CFG), host_budget_bytes=1 << 20, log_dir=tmp_path).close()
    assert caught.value.filename in {str(tmp_path / WINDOW_FILE), str(tmp_path / SESSION_FILE)}
    assert sorted(os.listdir(tmp_path)) == sorted([WINDOW_FILE, SESSION_FILE, "notes.txt"])
    assert all((tmp_path / n).read_text() == "user data\n" for n in os.listdir(tmp_path))


def test_a_session_that_runs_no_step_removes_only_its_own_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("user data\n")
    (tmp_path / (LOG_NAME + ".tmp")).write_text("user data\n")  # (no name of the session's)
    s = Session(TinyCausalWan(CFG), host_budget_bytes=1 << 20, log_dir=tmp_path)
    assert (tmp_path / LOG_NAME).exists() and (tmp_path / SESSION_FILE).exists()
    s.close()
    assert s.discarded
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", LOG_NAME + ".tmp"])


# ---- 2: a write error other than a full disk is one line, and the session is saved --------------------


def test_a_file_size_limit_is_one_line_and_the_session_is_saved(tmp_path: Path) -> None:
    d = tmp_path / "log"

    def limit() -> None:  # (Python ignores SIGXFSZ: the write fails with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600 << 10, resource.RLIM_INFINITY))

    argv = ["session", "--preset", "micro", "--segments", "40", "--host-memory", "150KiB"]
    done = _wp(*argv, "--log-dir", str(d), "--json", preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = _said(done)[-1]
    assert last.startswith("worldpager: session: step "), last
    assert f"{d / LOG_NAME}: File too large" in last and str(d) in last, last
    saved = read_saved_state(d)  # (close raised before it saved: no session.json)
    assert saved is not None and saved["next_step"] >= 1


def test_close_after_a_transfer_thread_failed_saves_the_session_then_raises(tmp_path: Path) -> None:
    s = Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path)

    def eio(**_: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    s.log.append = eio  # type: ignore[method-assign]  # the disk fails (not full): the I/O thread dies
    s.step(POSES[0])  # prefetch: step 1 prepared, segment 0 written behind
    with pytest.raises(TransferError) as e:
        s.close()
    assert str(e.value) == f"transfer thread failed: {tmp_path / LOG_NAME}: Input/output error"
    assert isinstance(e.value, SegmentLogError) and isinstance(e.value, RuntimeError)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EIO
    saved = read_saved_state(tmp_path)
    assert saved is not None and saved["next_step"] == 1
    assert not any(t.is_alive() for t in s.handler._threads)


# ---- 3: a creation that fails part-way leaves the folder as it was ------------------------------------


def _refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses the writes of meta.json's temporary file (full)."""
    real = segment_log.open_fresh

    class Full:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_log, "open_fresh", lambda path: Full(real(path)))


def test_a_creation_that_fails_leaves_a_folder_a_new_run_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notes.txt").write_text("user data\n")
    with monkeypatch.context() as m:
        _refuse_writes(m)
        with pytest.raises(OSError) as caught:
            Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path)
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # (an empty segments.wplog was left)
    with Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path) as s:
        s.step(POSES[0])
    assert read_saved_state(tmp_path) is not None


def test_a_creation_that_fails_in_a_new_folder_removes_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "log"
    _refuse_writes(monkeypatch)
    with pytest.raises(OSError):
        Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=d)
    assert not d.exists()


# ---- 4: one writer of a log at a time ----------------------------------------------------------------


_OPEN = """
import sys
from worldpager.segment_log import SegmentLog, SegmentLogError
try:
    with SegmentLog.open(sys.argv[1]) as log:
        print("opened", log.n_slots)
except SegmentLogError as e:
    print("refused", e)
"""


def _open_elsewhere(d: Path) -> str:
    """What another process opening the log in ``d`` gets."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN, str(d)], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_a_second_process_opening_a_log_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = SegmentLog.create(tmp_path, SLOT)
    said = _open_elsewhere(tmp_path)  # (both handed out slot 0: the second overwrote the first's segment)
    assert said == f"refused {tmp_path / LOG_NAME}: in use by another process: one writer at a time"
    first.close()
    assert _open_elsewhere(tmp_path) == "opened 0"
    with SegmentLog.open(tmp_path):
        assert _open_elsewhere(tmp_path).startswith("refused ")
    assert _open_elsewhere(tmp_path) == "opened 0"


def test_a_resume_of_a_folder_in_use_is_one_line(tmp_path: Path) -> None:
    meta = {"preset": "micro"}  # (as the CLI saves it: its resume reads the preset)
    with Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path, metadata=meta) as s:
        s.run(POSES[:2])
    with SegmentLog.open(tmp_path):  # another process's session holds it
        done = _wp("session", "--segments", "1", "--log-dir", str(tmp_path), "--resume", "--json")
    assert done.returncode == 2, done.stderr
    said = _said(done)
    assert said == [f"worldpager: {tmp_path / LOG_NAME}: in use by another process: one writer at a time"]


def test_close_saves_the_session_before_it_lets_the_log_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the review of these fixes: close gave up the log's lock, then saved session.json and
    window.bin; a process let in meanwhile read the state from before this run's steps (and this one
    then wrote over the state of a session the other had open). The save now comes first."""
    seen: list[str] = []
    save = Session._save_state

    def spy(self: Session, window: Any) -> None:
        seen.append(_open_elsewhere(tmp_path))  # (each save: at the start, then at close)
        save(self, window)

    monkeypatch.setattr(Session, "_save_state", spy)
    with Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path) as s:
        s.run(POSES[:3])
    assert len(seen) == 2 and all(x.startswith("refused ") for x in seen), seen
    assert json.loads((tmp_path / "session.json").read_text())["next_step"] == 3


def test_a_resume_whose_session_was_saved_as_it_opened_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume reads session.json before it takes the log's lock: one saved meanwhile (by the
    process that held it, closing) is not the one it read, and the resume says to try again."""
    with Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path) as s:
        s.run(POSES[:2])
    real_open = session_store.open_log

    def open_after_a_save(*args: Any, **kwargs: Any) -> Any:
        state = json.loads((tmp_path / "session.json").read_text())
        state["next_step"] = 1  # (another process's close, saving as this one opens)
        (tmp_path / "session.json").write_text(json.dumps(state))
        return real_open(*args, **kwargs)

    monkeypatch.setattr(session_store, "open_log", open_after_a_save)
    with pytest.raises(LogInUse, match="saved by another process while this one opened it: resume it again"):
        Session.resume(tmp_path, TinyCausalWan(CFG), host_budget_bytes=8 * SEG)
    monkeypatch.undo()
    with Session.resume(tmp_path, TinyCausalWan(CFG), host_budget_bytes=8 * SEG) as s:  # (let go: opens)
        assert s._next in (1, 2)  # (as the saved state and the log agree)


# ---- 5: index entries are checked as the headers on disk are ------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"), [("pose", [0.0, 1.0, 2.0, 1.0, float("inf")]), ("frame_end", -1)]
)
def test_an_index_entry_no_header_could_hold_rebuilds_the_index(
    tmp_path: Path, field: str, value: object
) -> None:
    _filled(tmp_path, 4)
    with SegmentLog.open(tmp_path) as log:
        good = [log.header(s) for s in range(4)]
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    idx["entries"][1][field] = value  # (json writes Infinity, and reads it back)
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))
    with SegmentLog.open(tmp_path) as log:
        assert log.index_state == "rebuilt"  # (loaded: the entry trusted)
        assert [log.header(s) for s in range(4)] == good
        assert log.corrupt_slots() == {}


def test_a_resume_over_an_index_with_an_infinite_pose_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["session", "--preset", "micro", "--host-memory", "150KiB", "--log-dir", str(tmp_path)]
    assert main([*argv, "--segments", "8"]) == 0
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    idx["entries"][1]["pose"][4] = float("inf")
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))
    capsys.readouterr()
    assert main([*argv, "--segments", "3", "--resume", "--json"]) == 0  # (a math domain error)
    said = json.loads(capsys.readouterr().out)
    assert said["first_segment"] == 8 and said["corrupt_slots"] == []


# ---- 6: host-only mode keeps a bounded number of Dropped events ---------------------------------------


def test_dropped_events_are_counted_all_but_kept_bounded() -> None:
    log = EventLog(10)
    log.record(DiskFull(0, ()))
    drops = [Dropped(i, SEG) for i in range(1, 1001)]
    log.extend(drops)
    kept = log.events()
    assert kept == [DiskFull(0, ()), drops[0], *drops[-10:]]  # (all 1,000 were kept)
    assert log.counts() == {"DiskFull": 1, "Dropped": 1000}


def test_a_session_in_host_only_mode_keeps_its_events_bounded(tmp_path: Path) -> None:
    s = Session(
        TinyCausalWan(CFG), host_budget_bytes=4 * SEG, log_dir=tmp_path / "log", retrieval_k=1,
        log_max_bytes=3 * slot_size_for(SEG), max_events=5, trim_memory=False,
    )  # fmt: skip
    with s:
        s.run(yaw_sweep_trajectory(40))
        counts = s.event_counts()
        dropped = [e for e in s.events if isinstance(e, Dropped)]
    assert counts["Dropped"] >= 30
    assert len(dropped) == 6 and dropped[-1].seg_id == 39


def test_the_world_worker_says_a_log_in_use_is_busy_not_damaged(tmp_path: Path) -> None:
    """The service's world worker: a resume refused because another process has the session's log open
    is UNAVAILABLE ("open in another process", without the server's paths), not "its saved state is
    damaged" (BAD_INPUT): the log is whole, and opens once that process has closed it."""
    import types

    from workers import protocol as P
    from workers.host import DeviceHost
    from workers.world import WorldSessions
    from worldpager.segment_log import LogInUse

    def resume() -> None:
        raise LogInUse(f"{tmp_path / LOG_NAME}: in use by another process: one writer at a time")

    with pytest.raises(LogInUse) as e:
        WorldSessions._resumed("s1", tmp_path, resume)
    said = str(e.value)
    assert said == (
        "world session 's1' is open in another process (its log is locked): "
        "resume it once that one has closed it"
    )
    assert str(tmp_path) not in said

    def call() -> dict[str, object]:
        WorldSessions._resumed("s1", tmp_path, resume)
        return {}

    reply = DeviceHost._session_call(types.SimpleNamespace(name="cpu0"), call)  # type: ignore[arg-type]
    assert (reply.ok, reply.error_code) == (False, P.NOT_AVAILABLE)
    assert "open in another process" in (reply.error or "")


def test_a_world_sessions_disk_failure_is_told_without_the_servers_path() -> None:
    """Found by the review of these fixes: a TransferError names the log file, and the world worker
    passed it to the client (the status details), where the server keeps its sessions."""
    import logging
    import types

    from workers import protocol as P
    from workers.host import DeviceHost

    path = "/var/lib/residency/worlds/3f2a/segments.wplog"

    def step() -> dict[str, object]:
        raise TransferError(f"transfer thread failed: {path}: Input/output error") from OSError(
            errno.EIO, "Input/output error"
        )

    logging.disable(logging.CRITICAL)
    try:
        reply = DeviceHost._session_call(types.SimpleNamespace(name="cuda:0"), step)  # type: ignore[arg-type]
    finally:
        logging.disable(logging.NOTSET)
    assert (reply.ok, reply.error_code) == (False, P.INTERNAL)
    assert reply.error == "world session: its log could not be written or read (Input/output error)"
