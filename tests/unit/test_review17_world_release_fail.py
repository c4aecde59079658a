"""Found in the 17th review of workers/world.py: a world session whose close, or whose open, failed
midway had let its buffers go (the session's own close frees them before it saves its state) but never
gave that memory back to the driver (`WorldSessions.release`: on CUDA, empty_cache), so other
processes and the device host's free-memory probe went on seeing it used. Each failed before its fix."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from test_review17_world_release import _seg

from workers.world import WorldSessions
from worldpager.model import TinyCausalWan


def test_a_close_whose_save_fails_still_gives_the_memory_back(tmp_path: Path) -> None:
    cfg, seg = _seg()
    calls: list[str] = []
    ws = WorldSessions(torch.device("cpu"), release=lambda: calls.append("release"))
    ws.open("world", TinyCausalWan(cfg), "a", 10 * seg, tmp_path / "a")
    ws.step("a", (0.0, 0.0, 0.0, 0.0, 0.0))  # (a session that ran no step saves nothing: review 19)
    session = ws.open_sessions["a"].session

    def full_disk(*_: Any, **__: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    session._save_state = full_disk  # its buffers and threads go first, then the save fails
    with pytest.raises(OSError, match="No space left"):
        ws.close("a")
    assert calls == ["release"]
    assert "a" not in ws.open_sessions


class _FailsOnTheDevice:
    """WorldPager's Session as far as `WorldSessions.open` uses it, whose device buffers cannot be
    allocated (CUDA out of memory): when it is built (`at` "build") or at its lease's resize."""

    at = "resize"
    closed = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        if self.at == "build":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    def resize_lease(self, **_: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    def close(self) -> None:
        type(self).closed += 1


@pytest.mark.parametrize("at", ["build", "resize"])
def test_an_open_that_fails_on_the_device_gives_the_memory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    import worldpager.session

    cfg, seg = _seg()
    monkeypatch.setattr(_FailsOnTheDevice, "at", at)
    monkeypatch.setattr(_FailsOnTheDevice, "closed", 0)
    monkeypatch.setattr(worldpager.session, "Session", _FailsOnTheDevice)
    calls: list[str] = []
    # (a CUDA host's sessions, built without CUDA: the fake session touches no device)
    ws = WorldSessions(torch.device("cuda"), release=lambda: calls.append("release"))
    with pytest.raises(torch.OutOfMemoryError):
        ws.open("world", TinyCausalWan(cfg), "a", 10 * seg, tmp_path / "a")
    assert _FailsOnTheDevice.closed == (1 if at == "resize" else 0) and ws.open_sessions == {}
    assert calls == ["release"]


def test_a_step_whose_index_save_fails_still_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 18: every 8th step saves the log's index after the step has run. A full disk there
    turned the step's answer into an error (internal), though the step had happened and its
    segment was in the log; the save is housekeeping (a resume rebuilds a stale index), so it is
    logged and the step answers."""
    from workers.world import INDEX_EVERY

    cfg, seg = _seg()
    ws = WorldSessions(torch.device("cpu"))
    ws.open("world", TinyCausalWan(cfg), "a", 10 * seg, tmp_path / "a")
    session = ws.open_sessions["a"].session

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    session.flush_index = full_disk  # type: ignore[method-assign]
    steps = [ws.step("a", (0.0, 0.0, 0.0, 0.0, 0.0))["step"] for _ in range(INDEX_EVERY + 1)]
    assert steps == list(range(INDEX_EVERY + 1))
    assert "its log's index was not saved" in caplog.text and "No space left" in caplog.text
    ws.close("a")
