"""Work run on a thread of its own, waited for at most a time limit.

A model's own code (its factory, its reads) may hang for good: a device host's load or promote, or a
describe (building the module on the meta device), must not hold its caller (the host's command
thread, a Ray data thread, the manager's event loop) for good with it.

* `start_on_thread(fn, name, done)`: `fn()` on a daemon thread of its own, then `done(ok, value)`.
* `SingleFlight`: one build a key at a time, each on a thread of its own and waited for at most the
  limit counted from its start; a later call for the same spec joins the build under way (one past
  its limit is refused at once, not started again while it runs); a successful answer is kept per
  key, for the spec it was built for (another spec under that key is built on its own).
* `running_builds()`: the builds of this process's single flights (the manager's describes) that
  still run, one phrase each: `workers.pool.left_running` names them to `residency serve`'s exit
  (a thread inside a model's native code can abort the interpreter's finalization). A device host's
  own (`listed=False`) it names itself, once its pool is closed (`DeviceHost.describing`).

Daemon threads, not an executor's: a call that never returns would hold the executor's shutdown,
and so the process's exit. Plain Python (no torch, no Ray): the manager uses it as the hosts do.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class TimedOut(Exception):
    """Work not done within its limit; it goes on, on its own thread."""

    def __init__(self, waited: bool) -> None:
        self.waited = waited
        """True: this call waited (the rest of) the limit for it; False: the limit was past already
        when the call came (a build still running past it), so it was refused at once."""
        super().__init__("waited past its limit" if waited else "still running past its limit")


def start_on_thread(fn: Callable[[], T], name: str, done: Callable[[bool, Any], None]) -> None:
    """`fn()` on a daemon thread named `name`; then, on that thread, `done(True, its value)` or
    `done(False, the exception it raised)` (any BaseException: it is handed on, never lost)."""

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, fn())
        except BaseException as e:  # handed to whoever waits for it
            result = (False, e)
        done(*result)

    threading.Thread(target=run, name=name, daemon=True).start()


class Flight(Generic[V]):
    """One build of `spec` (`SingleFlight.begin`): on a thread of its own, or an answer kept."""

    def __init__(self, spec: Any, timeout_s: float, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.clock = clock
        self.started = clock()
        self.done = threading.Event()
        self.answer: V | None = None
        self.error: BaseException | None = None
        """What the build raised (shared by every caller: raise a fresh error of one's own from it)."""
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def left(self) -> float:
        """Seconds left of its limit (counted from its start; <= 0: past it)."""
        return self.started + self.timeout_s - self.clock()

    def wait(self) -> None:
        """Until it is done, within its limit; TimedOut past it (`waited` False: the limit was past
        already, so this call did not wait at all)."""
        left = self.left()
        if not self.done.wait(max(0.0, left)):
            raise TimedOut(waited=left > 0)

    async def wait_async(self) -> None:
        """`wait` for an event loop: the loop's thread is not held meanwhile. A caller cancelled
        leaves the build running (others may wait for it)."""
        if self.done.is_set():
            return
        left = self.left()
        if left <= 0:
            raise TimedOut(waited=False)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake() -> None:  # (on the build's thread)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                loop.call_soon_threadsafe(settle)

        self._on_done(wake)
        try:
            await asyncio.wait_for(fut, left)
        except TimeoutError:
            raise TimedOut(waited=True) from None

    def _on_done(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self, ok: bool, value: Any) -> None:
        if ok:
            self.answer = value
        else:
            self.error = value
        with self._lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class SingleFlight(Generic[V]):
    """Builds by key (a model's name), one a key at a time, each on a thread of its own and waited for
    at most `timeout_s` from its start; a successful answer kept per key for its spec.

    Thread-safe: callers on any thread (and event loops, `Flight.wait_async`) share it.

    `what` and `where` name its builds in `running_builds` ("the describe of 'x' in the manager");
    `listed=False` leaves them out of it (an owner that says them itself: `running()`)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        what: str = "build",
        where: str = "in this process",
        listed: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.what = what
        self.where = where
        self._lock = threading.Lock()
        self._kept: dict[Hashable, tuple[Any, V]] = {}
        """A successful build's answer by key, with the spec it was for."""
        self._running: dict[Hashable, Flight[V]] = {}
        """The build under way by key (at most one a key: a later call for its spec joins it)."""
        self._live: dict[Flight[V], Hashable] = {}
        """Every build whose thread still runs, with its key: those in `_running`, and those a build
        of another spec under their key replaced there (left to end by themselves)."""
        if listed:
            _listed.add(self)

    def begin(self, key: Hashable, spec: Any, build: Callable[[], V], name: str) -> Flight[V]:
        """The flight that answers `spec` under `key`: the answer kept for that spec (done already),
        or the build of that spec under way, or `build()` started now on a thread named `name` (a
        build of another spec under the key is left to end by itself; its answer is not kept)."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept[0] == spec:
                flight: Flight[V] = Flight(spec, self.timeout_s, self.clock)
                flight._finish(True, kept[1])
                return flight
            running = self._running.get(key)
            if running is not None and running.spec == spec:
                return running
            flight = self._running[key] = Flight(spec, self.timeout_s, self.clock)
            self._live[flight] = key
        start_on_thread(build, name, lambda ok, value: self._ended(key, flight, ok, value))
        return flight

    def running(self) -> list[tuple[Hashable, float]]:
        """The builds whose threads still run (a factory that hangs, past its limit or not): their key
        and the seconds each has run, oldest first. A thread cannot be killed: it is left to end by
        itself, or with the process."""
        now = self.clock()
        with self._lock:
            live = sorted(self._live.items(), key=lambda fk: fk[0].started)
        return [(key, now - flight.started) for flight, key in live]

    def forget(self, key: Hashable) -> None:
        """The answer kept under `key` goes (what was built it may no longer say)."""
        with self._lock:
            self._kept.pop(key, None)

    def _ended(self, key: Hashable, flight: Flight[V], ok: bool, value: Any) -> None:
        with self._lock:
            self._live.pop(flight, None)
            if self._running.get(key) is flight:  # not one replaced by another spec's since
                del self._running[key]
                if ok:
                    self._kept[key] = (flight.spec, value)
        flight._finish(ok, value)


_listed: weakref.WeakSet[SingleFlight[Any]] = weakref.WeakSet()
"""The single flights made `listed` in this process (`running_builds`). Weak: a build still running
holds its own (its thread's end calls it), one with none running may go."""


def running_builds() -> list[str]:
    """The builds still running on the threads of this process's listed single flights, one phrase
    each ("the describe of 'x' in the manager (running 12 s)"); empty when none."""
    return sorted(
        f"the {flights.what} of {key!r} {flights.where} (running {secs:.0f} s)"
        for flights in list(_listed)
        for key, secs in flights.running()
    )
