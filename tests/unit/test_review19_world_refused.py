"""A world session refused at its first pose (or whose open failed on its host) left a saved session on
disk: a folder with an empty log and a ``session.json`` at step 0, nothing worth resuming, which a
resume then "continued" from the beginning and `store.sessions_keep` had to prune. A session that ran
no step now leaves nothing behind; one that ran a step is saved as before. Real WorldPager sessions on
the "micro" stand-in; the manager's through the in-process pool (real device hosts)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from live_helpers import POSES, world_config

from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from workers.world import WorldSessions
from worldpager.model import TinyCausalWan
from worldpager.retrieval import Pose
from worldpager.session import SESSION_FILE, SESSION_PRESETS, Session, read_saved_state

CFG = SESSION_PRESETS["micro"].on_the_fly()
BAD = Pose(math.nan, 0.0, 0.0, 0.0, 0.0)
GOOD = Pose(0.0, 0.0, 0.0, 0.0, 0.0)


def _session(d: Path, **kw: Any) -> Session:
    return Session(TinyCausalWan(CFG), host_budget_bytes=1 << 20, log_dir=d, **kw)


# ---- worldpager ---------------------------------------------------------------------------------------


def test_a_new_session_refused_at_its_first_pose_leaves_nothing_on_disk(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = _session(d)
    with pytest.raises(ValueError, match="pose"):
        s.step(BAD)
    s.close()
    assert not d.exists()


def test_a_new_session_that_ran_a_step_is_saved_as_before(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = _session(d)
    s.step(GOOD)
    with pytest.raises(ValueError, match="pose"):
        s.step(BAD)
    s.close()
    saved = read_saved_state(d)
    assert saved is not None and saved["next_step"] == 1
    r = Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=1 << 20)
    try:
        assert r.step_index == 1
    finally:
        r.close()


def test_a_folder_given_with_other_files_keeps_them(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    _session(d).close()
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_an_empty_folder_given_stays(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    _session(d).close()
    assert d.is_dir() and not any(d.iterdir())


def test_a_resumed_session_closed_without_a_step_keeps_its_saved_state(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = _session(d)
    s.step(GOOD)
    s.close()
    r = Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="pose"):
        r.step(BAD)
    r.close()
    saved = read_saved_state(d)
    assert saved is not None and saved["next_step"] == 1


def test_a_host_open_closed_before_any_step_leaves_nothing(tmp_path: Path) -> None:
    ws = WorldSessions(torch.device("cpu"))
    ws.open("world", TinyCausalWan(CFG), "a", 1 << 20, tmp_path / "a")
    with pytest.raises(ValueError, match="pose"):
        ws.step("a", (math.nan, 0.0, 0.0, 0.0, 0.0))
    closed = ws.close("a")
    assert closed["segments"] == 0 and closed["discarded"] is True
    assert not (tmp_path / "a").exists()


def test_a_host_reopen_at_step_0_of_a_saved_session_is_not_discarded(tmp_path: Path) -> None:
    """Read-through: the manager judged a close by its segment count alone, so a session the host
    reopened at step 0 from a saved log (after a host restart, or a resume at 0) would have its folder
    removed. The host now says whether it discarded the session (`Session.discarded`)."""
    ws = WorldSessions(torch.device("cpu"))
    ws.open("world", TinyCausalWan(CFG), "a", 1 << 20, tmp_path / "a")
    ws.step("a", (0.0, 0.0, 0.0, 0.0, 0.0))
    assert ws.close("a")["discarded"] is False
    ws.open("world", TinyCausalWan(CFG), "a", 1 << 20, tmp_path / "a", resume=True, resume_at=0)
    closed = ws.close("a")
    assert closed["segments"] == 0 and closed["discarded"] is False
    assert (tmp_path / "a").exists()


# ---- the manager --------------------------------------------------------------------------------------


def _run_world(tmp_path: Path, body: Callable[[LiveManager], Awaitable[Any]]) -> Any:
    config = world_config(tmp_path)

    async def main() -> Any:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            return await body(lm)
        finally:
            await lm.stop()
            pool.close()

    return asyncio.run(main())


def test_a_stream_refused_at_its_first_pose_leaves_no_saved_session(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        with pytest.raises(InvalidRequest, match="pose"):
            await lm.step_session(sid, (math.nan, 0.0, 0.0, 0.0, 0.0))
        saved, note = await lm.end_session(sid)
        assert not saved
        assert note == (
            f"world session {sid} was not saved (it ran no segment: there is nothing to resume): "
            "it cannot be resumed; start a new session"
        )
        assert not (lm.session_dir / sid).exists()  # no sent.json left behind either

    _run_world(tmp_path, body)


def test_a_stream_that_ran_a_segment_is_still_saved(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        assert (await lm.step_session(sid, POSES[0]))["step"] == 0
        with pytest.raises(InvalidRequest, match="pose"):
            await lm.step_session(sid, (math.nan, 0.0, 0.0, 0.0, 0.0))
        saved, note = await lm.end_session(sid)
        assert saved and "at segment 1" in note
        assert (lm.session_dir / sid / SESSION_FILE).is_file()
        _, opened = await lm.open_session("world", resume_id=sid, codec="")
        assert opened["resumed"] and opened["next_segment"] == 1

    _run_world(tmp_path, body)


def test_a_resumed_session_closed_without_a_step_is_kept(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        await lm.step_session(sid, POSES[0])
        await lm.close_session(sid)
        await lm.open_session("world", resume_id=sid, codec="")
        await lm.close_session(sid)  # (its host reports segments=1: the step it continues at)
        _, opened = await lm.open_session("world", resume_id=sid, codec="")
        assert opened["resumed"] and opened["next_segment"] == 1

    _run_world(tmp_path, body)


def test_a_close_whose_save_fails_after_a_step_still_gives_the_memory_back(tmp_path: Path) -> None:
    """test_review17_world_release_fail's case, with the step a save now needs (a session that ran
    none saves nothing)."""
    import errno

    calls: list[str] = []
    ws = WorldSessions(torch.device("cpu"), release=lambda: calls.append("release"))
    ws.open("world", TinyCausalWan(CFG), "a", 1 << 20, tmp_path / "a")
    ws.step("a", (0.0, 0.0, 0.0, 0.0, 0.0))
    session = ws.open_sessions["a"].session

    def full_disk(*_: Any, **__: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    session._save_state = full_disk
    with pytest.raises(OSError, match="No space left"):
        ws.close("a")
    assert calls == ["release"] and "a" not in ws.open_sessions
