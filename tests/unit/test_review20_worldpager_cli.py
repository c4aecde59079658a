"""Review 20, a walkthrough of WorldPager's command line (`worldpager session`), each failing before
its fix:

- Ctrl-C printed Python's traceback (36-50 lines) and nothing about the session it saved; SIGTERM
  left the run's temporary folder (the whole segment log: 530 MB with the default preset) behind.
  Now one line (exit 130 / 143), the temporary folder removed, the session saved in --log-dir.
- With --log-dir a temporary folder was made (and left at SIGTERM) all the same.
- An empty --log-dir (an unset variable) ran the session in a temporary folder and deleted it.
- A resume with another --codec or --seed said "codec='int8' differs from the saved session's
  'bf16'", naming no flag; a --log-dir under a file, or a saved session without its log, said
  Python's "[Errno 20] Not a directory: 'afile/sub'"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worldpager.cli import main
from worldpager.segment_log import LOG_NAME
from worldpager.session import SESSION_FILE

WORLDPAGER = Path(sys.executable).parent / "worldpager"


def _session(*extra: str) -> list[str]:
    return ["session", "--preset", "micro", "--segments", "2", "--json", *extra]


def test_an_empty_log_dir_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_session("--log-dir", "")) == 2
    assert "--log-dir is empty" in capsys.readouterr().err


def test_a_log_dir_under_a_file_is_said_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    assert main(_session("--log-dir", str(tmp_path / "afile" / "sub"))) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'afile'} is a file, not a folder" in err and "Errno" not in err, err


def test_a_resume_with_another_codec_or_seed_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path / "s")
    assert main(_session("--log-dir", d)) == 0
    capsys.readouterr()
    assert main(_session("--log-dir", d, "--resume", "--codec", "int8")) == 2
    assert "--codec int8: the saved session ran --codec bf16" in capsys.readouterr().err
    assert main(_session("--log-dir", d, "--resume", "--seed", "5")) == 2
    assert "--seed 5: the saved session ran --seed 0" in capsys.readouterr().err
    assert main(_session("--log-dir", d, "--resume", "--seed", "0", "--codec", "bf16")) == 0  # the same: fine


def test_a_saved_session_without_its_log_is_said_plainly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    assert main(_session("--log-dir", str(d))) == 0
    capsys.readouterr()
    (d / LOG_NAME).unlink()
    assert main(_session("--log-dir", str(d), "--resume")) == 2
    err = capsys.readouterr().err
    assert f"holds a saved session but no {LOG_NAME} (its log is missing)" in err and "Errno" not in err, err


def _interrupted(tmp_path: Path, sig: int, log_dir: bool) -> tuple[int, str, Path]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    d = tmp_path / "kept"
    args = [str(WORLDPAGER), "session", "--preset", "micro", "--segments", "1000000", "--json"]
    args += ["--log-dir", str(d)] if log_dir else []
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (as a terminal's Ctrl-C)
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # running steps: its log has grown (in --log-dir, or in the temporary folder)
        while not any(p.name == LOG_NAME and p.stat().st_size > 0 for p in tmp_path.rglob(LOG_NAME)):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the session did not start"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, tmp


@pytest.mark.parametrize(
    ("sig", "code", "name"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_an_interrupt_is_one_line_and_leaves_no_temporary_folder(
    tmp_path: Path, sig: int, code: int, name: str
) -> None:
    rc, err, tmp = _interrupted(tmp_path, sig, log_dir=False)
    assert rc == code, err
    assert err.strip() == f"worldpager: interrupted ({name})", err
    assert list(tmp.iterdir()) == []  # the run's temporary folder (its segment log) removed


def test_an_interrupted_session_in_a_log_dir_is_saved_and_said_so(tmp_path: Path) -> None:
    rc, err, tmp = _interrupted(tmp_path, signal.SIGTERM, log_dir=True)
    d = tmp_path / "kept"
    assert rc == 143, err
    assert (
        err.strip()
        == f"worldpager: interrupted (SIGTERM); the steps it ran are kept in {d} (continue with --resume)"
    )
    assert list(tmp.iterdir()) == []  # no temporary folder made for it
    assert (d / SESSION_FILE).is_file()
    assert main(["session", "--log-dir", str(d), "--resume", "--segments", "1", "--json"]) == 0


def test_an_interrupt_before_any_step_does_not_say_steps_were_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Read-through: "the steps it ran are kept in D (continue with --resume)" was said whenever
    --log-dir was given, though a new session that ran no step leaves nothing to resume.)"""
    from worldpager.session import Session

    def interrupted(self: Session, pose: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "step", interrupted)
    d = tmp_path / "early"
    assert main(_session("--log-dir", str(d))) == 130
    assert capsys.readouterr().err.strip() == "worldpager: interrupted (SIGINT)"
    assert not (d / SESSION_FILE).exists()
