"""A rolling window that can only be restored at step 0 (the log lost a segment of every window) said
"the log still holds the session up to step 0: resume it there with resume_at=0": true, but it reads as
if something was kept. It now says plainly that the session must restart from the beginning (step 0),
and how (``resume_at=0``; the CLI: ``--resume --resume-at 0``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_review18_worldpager import _damage, _pose, _resume, _saved

from worldpager.cli import main
from worldpager.session_store import WindowLostError


def test_a_window_lost_back_to_step_0_says_the_session_restarts_from_the_beginning(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _saved(d, 2)  # the window at step 2 holds segments 0 and 1
    _damage(d, 0, "corrupt")
    with pytest.raises(WindowLostError) as info:
        _resume(d)
    assert info.value.resume_at == 0
    msg = str(info.value)
    assert msg.startswith(f"{d}: cannot rebuild the rolling window: segment 0")
    assert "must restart from the beginning (step 0)" in msg and "resume_at=0" in msg
    assert "holds the session up to step 0" not in msg and "\n" not in msg
    with _resume(d, resume_at=0) as r:  # the hint works: the session starts again at step 0
        assert r.step_index == 0 and r.step(_pose(0)).step == 0


def test_a_window_lost_at_a_later_step_keeps_its_hint(tmp_path: Path) -> None:
    e = WindowLostError("x: cannot rebuild the rolling window: segment 8", 8)
    assert str(e) == (
        "x: cannot rebuild the rolling window: segment 8; the log still holds the session up to step "
        "8: resume it there with resume_at=8 (the segments from 8 on are generated again)"
    )


def test_cli_says_the_session_restarts_from_the_beginning_and_the_flag_does_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    assert main(["session", "--preset", "micro", "--segments", "2", "--log-dir", str(d), "--json"]) == 0
    capsys.readouterr()
    _damage(d, 0, "corrupt")
    assert main(["session", "--resume", "--segments", "1", "--log-dir", str(d), "--json"]) == 2
    out, err = capsys.readouterr()
    # the corrupt slot it found (and retired) first, one warning line, then the error's one line
    warned, said = err.strip().splitlines()
    assert out == "" and "Traceback" not in err and warned.startswith("worldpager: warning: ")
    assert said.startswith(f"worldpager: {d}: cannot rebuild the rolling window: segment 0")
    assert "must restart from the beginning (step 0)" in said
    assert "--resume --resume-at 0" in said and "resume_at=" not in said
    argv = ["session", "--resume", "--resume-at", "0", "--segments", "1", "--log-dir", str(d), "--json"]
    assert main(argv) == 0
    assert '"first_segment": 0' in capsys.readouterr().out
