"""Saved world sessions are their user's alone: WorldPager creates a log's folders 0700 and files 0600,
and a session saved before that is made so on resume, never through a link."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from manager.live_sessions import _private_sessions_dir
from workers.world import make_private
from worldpager.segment_log import SegmentLog, make_private_dirs


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_a_new_log_is_private_and_its_existing_parents_are_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    d = tmp_path / "a" / "b" / "0123456789ab"
    SegmentLog.create(d, 4096).close()
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", d)] == [0o700] * 3
    assert {f.name: _mode(f) for f in d.iterdir()} == {f.name: 0o600 for f in d.iterdir()}
    assert _mode(tmp_path) == 0o755


def test_make_private_dirs_refuses_what_is_no_folder(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        make_private_dirs(tmp_path / "f")
    tmp_path.chmod(0o755)
    assert make_private_dirs(tmp_path) == tmp_path and _mode(tmp_path) == 0o755  # one that exists: as it is


def test_the_sessions_folder_is_made_private_but_not_its_parent(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    _private_sessions_dir(tmp_path / "sessions")
    assert _mode(tmp_path / "sessions") == 0o700 and _mode(tmp_path) == 0o755
    (tmp_path / "sessions").chmod(0o755)  # made by an earlier version
    _private_sessions_dir(tmp_path / "sessions")
    assert _mode(tmp_path / "sessions") == 0o700


def test_an_older_saved_session_is_tightened_never_through_a_link(tmp_path: Path) -> None:
    d = tmp_path / "0123456789ab"
    d.mkdir(mode=0o755)
    (d / "session.json").write_text("{}")
    (d / "session.json").chmod(0o644)
    outside = tmp_path / "outside"
    outside.write_text("not the session's")
    outside.chmod(0o644)
    (d / "window.bin").symlink_to(outside)
    make_private("0123456789ab", d)
    assert _mode(d) == 0o700 and _mode(d / "session.json") == 0o600
    assert _mode(outside) == 0o644


def test_a_reload_applies_a_new_world_idle_timeout_at_once() -> None:
    """A world stream reads `server.world_idle_timeout` at each wait for its client's next action, so
    a reload must not say "at the next restart" for it (an operator would restart for nothing), while
    the other server settings, read at start, still say so."""
    from live_helpers import CONFIG

    from manager.config import load_config
    from manager.reload import plan_reload

    base = load_config(CONFIG)
    server = base.server.model_copy(update={"world_idle_timeout": 30.0, "keepalive": 10.0})
    assert plan_reload(base, base.model_copy(update={"server": server})) == [
        "server.keepalive (at the next restart)",
        "server.world_idle_timeout",
    ]
