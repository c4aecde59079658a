"""Stop signals during steps that block (Ray's start, a store's opening), when the caller's own
handlers would act only once the step ended: an event loop's, which the blocking step keeps from
running. Plain Python: the manager uses it as the Ray pool does."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop the service (SIGHUP: its terminal closed). SIGTERM first: where a handler
of a library's (Ray's) is to go, it goes soonest."""


class StopSignal(KeyboardInterrupt):
    """A stop signal came (`signum`). A KeyboardInterrupt, so that no `except Exception` on its way
    (in a library's own code either) holds it up, and a caller stops as it does for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def honoured_stop_signals() -> tuple[int, ...]:
    """The stop signals the service acts on: STOP_SIGNALS less those this process was started with
    ignored (SIGINT in a shell's background job, SIGHUP under `nohup`): the one who started it chose
    so, and they stay ignored. SIGTERM, what supervisors send, is always among them."""
    return tuple(s for s in STOP_SIGNALS if s == signal.SIGTERM or signal.getsignal(s) != signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_raise(
    error: type[StopSignal] = StopSignal, signals: tuple[int, ...] | None = None
) -> Iterator[None]:
    """Within it, the first stop signal (of `signals`, default `honoured_stop_signals()`) raises
    `error(signum)` at once; a second, or one while a KeyboardInterrupt is being handled (what the
    first one undoes: Ray's start), does not break that off. The handlers from before are put back
    after it (one that comes while they go back reaches the handler from before all the same:
    Python's wakeup fd). Only on the main thread (the one Python runs signal handlers on); elsewhere
    it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {s: signal.getsignal(s) for s in (honoured_stop_signals() if signals is None else signals)}
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired or isinstance(sys.exc_info()[1], KeyboardInterrupt):
            return
        fired = True
        raise error(signum)

    try:
        for s in held:
            signal.signal(s, interrupt)
        yield
    finally:
        fired = True  # none raised while the handlers go back: it would pass the caller's `except`
        for s, h in held.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
