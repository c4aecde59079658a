"""Review 16: `serve`'s stop signals (`_StopSignals`), without a process: a signal that comes with
the first (within SAME_STOP_S) is the same stop; one later, while the stop is under way, ends the
process at once. Both through the event loop's handler (`on_signal`) and through Python's own
handler that the first signal puts in place (it runs while the loop is held). `_exit_now` is
recorded instead of ending the test process; the clock is a list the test moves."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

import manager.api.server as server
from manager.api.server import SAME_STOP_S, _StopSignals


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    out: list[int] = []
    monkeypatch.setattr(server, "_exit_now", out.append)
    yield out


def _signals(now: list[float]) -> _StopSignals:
    return _StopSignals(asyncio.Event(), [], clock=lambda: now[0])


def test_a_signal_with_the_first_is_the_same_stop_and_a_later_one_exits(
    exits: list[int], capfd: pytest.CaptureFixture[str]
) -> None:
    now = [100.0]
    s = _signals(now)
    try:
        s.on_signal(signal.SIGTERM)
        assert s.stop.is_set() and s.came == [signal.SIGTERM] and exits == []
        handler = signal.getsignal(signal.SIGTERM)  # Python's own, from the first signal on
        assert callable(handler)
        now[0] += SAME_STOP_S / 2
        handler(signal.SIGTERM, None)
        s.on_signal(signal.SIGINT)  # (the loop's handler, for one it saw)
        assert exits == []
        assert "residency: SIGTERM came with the first stop signal: the same stop" in capfd.readouterr().err
        now[0] += SAME_STOP_S
        handler(signal.SIGINT, None)
        assert exits == [signal.SIGINT]
        s.on_signal(signal.SIGTERM)
        assert exits == [signal.SIGINT, signal.SIGTERM]
        assert s.came == [signal.SIGTERM]  # only the first stops the service
    finally:
        s.put_back()


def test_handlers_are_put_back(exits: list[int]) -> None:
    before = signal.getsignal(signal.SIGINT)
    s = _signals([0.0])
    s.on_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is not before
    s.put_back()
    assert signal.getsignal(signal.SIGINT) is before
