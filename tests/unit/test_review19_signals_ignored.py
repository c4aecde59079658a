"""Review 19: `workers.signals.stop_signals_raise` (around Ray's start) made a SIGINT the process was
started with ignored (`residency serve &`) stop the start, though the rest of `serve` keeps such a
signal ignored (POSIX: a background job ignores the terminal's interrupt). Now a signal ignored when it
is entered stays ignored within it; the others raise as before."""

from __future__ import annotations

import os
import signal

import pytest

from workers.signals import StopSignal, stop_signals_raise


def test_an_ignored_signal_stays_ignored_and_the_others_raise() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_signals_raise():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing happens
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # (a point where a handler would have run)
        with pytest.raises(StopSignal) as e, stop_signals_raise():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert e.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back as it was
    finally:
        signal.signal(signal.SIGINT, before)
