"""`worldpager session --resume` on a folder with no usable session.json says which of the four it is
(2026-12-06): it said "(session.json missing or unreadable)" for a file that was there and merely
damaged, so the user looked for a missing file."""

from __future__ import annotations

from pathlib import Path

import pytest

from worldpager.cli import main
from worldpager.session import SESSION_FILE


def _resume(d: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["session", "--resume", "--log-dir", str(d), "--segments", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_no_session_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"no saved session in {tmp_path} (no {SESSION_FILE})" in _resume(tmp_path, capsys)


def test_a_damaged_session_file_is_called_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / SESSION_FILE).write_text('{"format": "worldpager-session", "next_st')
    err = _resume(tmp_path, capsys)
    assert f"{tmp_path / SESSION_FILE} is damaged: not JSON (" in err


def test_a_session_file_of_another_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / SESSION_FILE).write_text('{"format": "something-else", "version": 9}')
    err = _resume(tmp_path, capsys)
    assert "is not a session this version saved (its format or version differs)" in err


def test_a_session_file_that_cannot_be_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / SESSION_FILE).mkdir()  # (a folder of that name: unreadable even as root)
    err = _resume(tmp_path, capsys)
    assert f"{tmp_path / SESSION_FILE} cannot be read: " in err
