"""Stop signals during steps that block (Ray's start, a store's opening), when the caller's own
handlers would act only once the step ended: an event loop's, which the blocking step keeps from
running. Plain Python: the manager uses it as the Ray pool does."""

from __future__ import annotations

import contextlib
import signal
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


@contextlib.contextmanager
def stop_signals_raise(error: type[StopSignal] = StopSignal) -> Iterator[None]:
    """Within it, the first SIGINT, SIGTERM or SIGHUP raises `error(signum)` at once; a second does
    not break off what the first one undoes. The handlers from before are put back after it (one
    that comes while they go back reaches the handler from before all the same: Python's wakeup fd).
    A signal ignored when it is entered (`residency serve &` ignores SIGINT, `nohup` SIGHUP) stays
    ignored. Only on the main thread (the one Python runs signal handlers on); elsewhere it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise error(signum)

    try:
        for s in STOP_SIGNALS:
            if held[s] is not signal.SIG_IGN:  # (one the process was started with ignored stays so)
                signal.signal(s, interrupt)
        yield
    finally:
        fired = True  # none raised while the handlers go back: it would pass the caller's `except`
        for s, h in held.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
