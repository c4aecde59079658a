"""Review 18, WorldPager resume: findings reproduced here before they were fixed.

1. A saved session could not be resumed while its disk was full: the resume rewrote ``session.json``
   (and, after a crash, the log's index) and failed with a bare ``OSError`` (no folder named), though
   reading the session and restoring it needs no new disk space. Now the resume succeeds; the writes
   that do need space (a roll-back's record, the index, the save at close) fail as `LogFullError`
   naming the folder, and leave nothing half-written behind.
2. A segment lost from the log's rolling-window part (its bytes corrupt, its header gone) with no
   usable ``window.bin`` made the resume fail without saying at which ``resume_at`` step the log still
   holds a consistent session. The error now names that step (`WindowLostError.resume_at`), and
   `worldpager session --resume` prints it as ``--resume-at N`` (a new flag) on its one error line.
"""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager.cli import main
from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.retrieval import Pose
from worldpager.segment_log import (
    HEADER_SIZE,
    INDEX_NAME,
    LOG_NAME,
    LogFullError,
    SegmentLog,
    SegmentLogError,
    slot_size_for,
)
from worldpager.session import SESSION_FILE, WINDOW_FILE, Session
from worldpager.session_records import MissingSegment
from worldpager.session_store import WindowLostError

CFG = TINY.on_the_fly()  # = the CLI's --preset micro
SEG = SegmentLayout.from_config(CFG, "bf16").payload_nbytes


def _pose(i: int) -> Pose:
    return Pose(0.0, 0.0, float(i), 0.0, 10.0 * i)


def _saved(log_dir: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = TinyCausalWan(CFG)
    with Session(model, host_budget_bytes=8 * SEG, log_dir=log_dir, retrieval_k=2) as s:
        s.run([_pose(i) for i in range(steps)])


def _resume(log_dir: Path, **kw: Any) -> Session:
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG, "retrieval_k": 2, **kw}
    return Session.resume(log_dir, TinyCausalWan(CFG), **opts)


# ---- 1. a full disk --------------------------------------------------------------------------------


def _no_space(*_: object, **__: object) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile(io.RawIOBase):
    """Test stand-in: a file opened for writing on a full disk (it opens; every write fails)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


class _Disk:
    """Test stand-in for a full disk: every write to a file (os.write/pwrite/pwritev, and files from
    os.fdopen for writing) fails with ENOSPC, as on a full filesystem; opening, reading, fsync and
    unlinking still work. `free()` gives the space back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch
        self.real_fdopen = os.fdopen

    def fill(self) -> None:
        real_fdopen = self.real_fdopen

        def fdopen(fd: int, mode: str = "r", *a: Any, **kw: Any) -> Any:
            return _FullFile(fd) if any(c in mode for c in "wa+") else real_fdopen(fd, mode, *a, **kw)

        for name in ("write", "pwrite", "pwritev"):
            self.mp.setattr(os, name, _no_space)
        self.mp.setattr(os, "fdopen", fdopen)

    def free(self) -> None:
        self.mp.undo()


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> _Disk:
    return _Disk(monkeypatch)


def _leftovers(log_dir: Path) -> list[str]:
    return sorted(p.name for p in log_dir.iterdir() if p.name.endswith(".tmp"))


def test_a_saved_session_resumes_on_a_full_disk_and_its_close_says_disk_full_naming_the_folder(
    tmp_path: Path, disk: _Disk
) -> None:
    d = tmp_path / "s"
    _saved(d, 5)
    before = (d / SESSION_FILE).read_bytes()
    disk.fill()
    r = _resume(d)  # raised OSError(ENOSPC): the resume rewrote session.json
    assert (r.step_index, r.window_source) == (5, "checkpoint")
    assert r.step(_pose(5)).step == 5  # runs; its segment stays in host (the log is full)
    assert not r.wait_written(5, timeout=10.0)
    with pytest.raises(LogFullError, match="No space left on device") as info:
        r.close()
    assert str(info.value).startswith(f"{d}: disk full")
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC  # (still caught so)
    assert (d / SESSION_FILE).read_bytes() == before  # the saved session is as it was
    assert _leftovers(d) == []  # no half-written .tmp files hold space
    disk.free()
    with _resume(d) as again:  # the step that could not be saved is generated again
        assert (again.step_index, again.window_source) == (5, "checkpoint")
        assert again.step(_pose(5)).step == 5


def test_a_session_whose_index_was_not_saved_resumes_on_a_full_disk(tmp_path: Path, disk: _Disk) -> None:
    d = tmp_path / "s"
    _saved(d, 5)
    (d / INDEX_NAME).unlink()  # (a crash before the index was written: the reopen scans the log)
    disk.fill()
    r = _resume(d)  # raised OSError(ENOSPC): the reopen's index write
    assert r.step_index == 5 and r.log.index_state == "rebuilt"
    with pytest.raises(LogFullError, match=f"^{d}: disk full"):
        r.close()
    disk.free()
    with _resume(d) as again:
        assert again.step_index == 5


def test_a_roll_back_on_a_full_disk_is_refused_as_disk_full_and_changes_nothing(
    tmp_path: Path, disk: _Disk
) -> None:
    d = tmp_path / "s"
    _saved(d, 5)
    before = (d / SESSION_FILE).read_bytes()
    disk.fill()
    with pytest.raises(LogFullError, match=f"^{d}: disk full") as info:  # was a bare OSError
        _resume(d, resume_at=3)
    assert "roll-back to step 3" in str(info.value)
    assert (d / SESSION_FILE).read_bytes() == before and _leftovers(d) == []
    disk.free()
    with _resume(d, resume_at=3) as again:
        assert again.step_index == 3


def test_a_full_disk_append_names_the_log_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with SegmentLog.create(tmp_path / "log", slot_size_for(100)) as log:
        monkeypatch.setattr(os, "pwritev", _no_space)
        with pytest.raises(LogFullError, match=f"^{tmp_path / 'log' / LOG_NAME}: disk full writing slot 0"):
            log.append(
                segment_id=0, frame_start=0, frame_end=3, pose=(0.0,) * 5, codec="bf16",
                position_state="post-rope", position=0, payload=bytes(100),
            )  # fmt: skip
        monkeypatch.undo()


def test_cli_resume_on_a_full_disk_runs_and_reports_the_full_disk_naming_the_folder(
    tmp_path: Path, disk: _Disk, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    assert main(["session", "--preset", "micro", "--segments", "2", "--log-dir", str(d), "--json"]) == 0
    capsys.readouterr()
    disk.fill()
    assert main(["session", "--resume", "--segments", "1", "--log-dir", str(d), "--json"]) == 1
    out, err = capsys.readouterr()
    disk.free()
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"worldpager: session: saving the session when it closed failed: {d}: disk full")


# ---- 2. a lost segment in the rolling window --------------------------------------------------------


def _damage(log_dir: Path, segment: int, how: str) -> None:
    """Lose ``segment`` from a saved session's log (``corrupt``: payload bytes; ``unwritten``: its
    header zeroed, as a slot never written) and drop window.bin, so the window must come from the log."""
    with SegmentLog.open(log_dir) as log:
        slot, ss = log.find(segment), log.slot_size
    assert slot is not None
    with open(log_dir / LOG_NAME, "r+b") as f:
        if how == "corrupt":
            f.seek(slot * ss + HEADER_SIZE + 100)
            f.write(b"\xff" * 64)
        else:
            f.seek(slot * ss)
            f.write(bytes(HEADER_SIZE))
    (log_dir / WINDOW_FILE).unlink()


@pytest.mark.parametrize(
    ("how", "host_segments"),
    [("corrupt", 8), ("corrupt", 1), ("unwritten", 8)],  # (1: found by the window's own read)
)
def test_a_lost_window_segment_error_names_the_step_to_resume_at(
    tmp_path: Path, how: str, host_segments: int
) -> None:
    d = tmp_path / "s"
    _saved(d, 10)  # the window at step 10 holds segments 8 and 9
    _damage(d, 8, how)
    with pytest.raises(WindowLostError) as info:
        _resume(d, host_budget_bytes=host_segments * SEG)
    assert info.value.resume_at == 8
    msg = str(info.value)
    assert msg.startswith(f"{d}: cannot rebuild the rolling window: segment 8")
    assert "resume_at=8" in msg and "\n" not in msg
    assert isinstance(info.value, SegmentLogError)  # (as before: callers catch it so)
    with _resume(d, resume_at=8) as r:  # the hint works: a consistent session at step 8
        assert (r.step_index, r.window_source) == (8, "log")
        assert not [e for e in r.events if isinstance(e, MissingSegment)]
        assert r.step(_pose(8)).step == 8


def test_the_hint_skips_steps_whose_window_lost_a_segment_too(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _saved(d, 10)
    _damage(d, 7, "corrupt")
    (d / WINDOW_FILE).touch()  # (re-dropped by the next _damage)
    _damage(d, 8, "corrupt")
    with pytest.raises(WindowLostError) as info:
        _resume(d)
    assert info.value.resume_at == 7  # step 8's window holds 7, lost as well
    with _resume(d, resume_at=7) as r:
        assert r.step_index == 7 and r.step(_pose(7)).step == 7


def test_cli_resume_error_names_the_resume_at_step_and_the_flag_resumes_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    assert main(["session", "--preset", "micro", "--segments", "10", "--log-dir", str(d), "--json"]) == 0
    capsys.readouterr()
    _damage(d, 8, "corrupt")
    assert main(["session", "--resume", "--segments", "1", "--log-dir", str(d), "--json"]) == 2
    out, err = capsys.readouterr()
    # the corrupt slot it found (and retired) first, one warning line, then the error's one line
    warned, said = err.strip().splitlines()
    assert out == "" and "Traceback" not in err
    assert warned.startswith(f"worldpager: warning: {d / LOG_NAME}: slot ") and "(never used)" in warned
    assert said.startswith(f"worldpager: {d}: cannot rebuild the rolling window: segment 8")
    assert "--resume-at 8" in said and "resume_at=" not in said
    argv = ["session", "--resume", "--resume-at", "8", "--segments", "1", "--log-dir", str(d), "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["first_segment"], res["segments"], res["total_segments"]) == (8, 1, 9)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--resume-at", "3"], "--resume-at needs --resume"),
        (["--resume", "--resume-at", "-1"], "--resume-at '-1': expected a whole number in [0, "),
        (["--resume", "--resume-at", "x"], "--resume-at 'x': expected a whole number in [0, "),
    ],
)
def test_cli_resume_at_refuses_what_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    d = tmp_path / "s"
    assert main(["session", "--preset", "micro", "--segments", "1", "--log-dir", str(d)]) == 0
    capsys.readouterr()
    assert main(["session", "--segments", "1", "--log-dir", str(d), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"worldpager: {expected}") and "Traceback" not in err
