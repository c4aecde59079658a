"""`workers.bounded`: work on a thread of its own with a time limit, and single-flight builds.

Three copies of "run it on a thread of its own, wait at most N s" (a device host's load and promote,
its describe, the manager's describer) and two of the single-flight describe (one build a model at a
time, a later call refused at once while a hung build runs, the answer kept per spec) are now this
one module. The work here is real code that waits on a `threading.Event` while its gate is closed
(a factory stuck on a lock, a read from a dead server); the clock is a stand-in only where a test
needs a build to be past its limit without waiting for it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from workers.bounded import SingleFlight, TimedOut, start_on_thread

PREFIX = "residency-test-bounded-"


class Gate:
    """A build's switch: while closed, `build` waits; `calls` counts its runs, `fail` makes it raise."""

    def __init__(self, answer: object = "answer") -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.calls = 0
        self.fail: BaseException | None = None
        self.answer = answer

    def build(self) -> object:
        self.calls += 1
        self.entered.set()
        self.open.wait(30)
        if self.fail is not None:
            raise self.fail
        return self.answer


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open.set()  # a thread still waiting in the build ends
    for t in threading.enumerate():
        if t.name.startswith(PREFIX):
            t.join(30)


class Clock:
    """A monotonic clock that moves only when told (`SingleFlight(clock=...)`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- start_on_thread


def _started(work: Any, name: str) -> tuple[bool, Any]:
    """What `start_on_thread` hands its `done` for `work`, waited for."""
    got: list[tuple[bool, Any]] = []
    finished = threading.Event()

    def done(ok: bool, value: Any) -> None:
        got.append((ok, value))
        finished.set()

    start_on_thread(work, name, done)
    assert finished.wait(30)
    return got[0]


def test_start_on_thread_hands_back_the_value_from_a_thread_of_its_own() -> None:
    seen: list[str] = []

    def work() -> int:
        seen.append(threading.current_thread().name)
        return 42

    assert _started(work, f"{PREFIX}value") == (True, 42)
    assert seen == [f"{PREFIX}value"]  # not the caller's thread
    assert seen[0] != threading.current_thread().name


@pytest.mark.parametrize("error", [ValueError("bad checkpoint"), KeyboardInterrupt(), SystemExit(3)])
def test_start_on_thread_hands_back_the_works_own_exception(error: BaseException) -> None:
    def work() -> None:
        raise error

    ok, value = _started(work, f"{PREFIX}error")
    assert ok is False and value is error  # the very one (any BaseException: none is lost on the thread)


def test_start_on_thread_hands_on_the_value_or_the_exception() -> None:
    got: list[tuple[bool, object]] = []
    ended = threading.Event()

    def done(ok: bool, value: object) -> None:
        got.append((ok, value))
        if len(got) == 2:
            ended.set()

    boom = RuntimeError("boom")

    def fails() -> None:
        raise boom

    start_on_thread(lambda: "fine", f"{PREFIX}ok", done)
    start_on_thread(fails, f"{PREFIX}fails", done)
    assert ended.wait(30)
    assert sorted(got, key=lambda x: x[0]) == [(False, boom), (True, "fine")]


# ---- SingleFlight (threads)


def test_a_build_is_kept_per_key_for_its_spec(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    first = flights.begin("m", "spec-1", gate.build, f"{PREFIX}m")
    first.wait()
    assert first.answer == "answer" and first.error is None
    again = flights.begin("m", "spec-1", gate.build, f"{PREFIX}m")
    again.wait()
    assert again.answer == "answer"
    assert gate.calls == 1  # kept: not built again
    other = flights.begin("other", "spec-1", gate.build, f"{PREFIX}other")
    other.wait()
    assert gate.calls == 2  # another key is built on its own


def test_a_changed_spec_under_a_key_is_built_again(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    flights.begin("m", "spec-1", gate.build, f"{PREFIX}m").wait()
    gate.answer = "new answer"
    changed = flights.begin("m", "spec-2", gate.build, f"{PREFIX}m")
    changed.wait()
    assert changed.answer == "new answer"
    assert gate.calls == 2
    back = flights.begin("m", "spec-2", gate.build, f"{PREFIX}m")
    back.wait()
    assert back.answer == "new answer" and gate.calls == 2  # the new spec's answer is the one kept


def test_forget_drops_the_kept_answer(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    flights.begin("m", "spec", gate.build, f"{PREFIX}m").wait()
    flights.forget("m")
    flights.forget("never-built")  # (nothing to forget: no error)
    flights.begin("m", "spec", gate.build, f"{PREFIX}m").wait()
    assert gate.calls == 2


def test_a_failed_build_is_shared_by_its_callers_and_not_kept(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    gate.open.clear()
    gate.fail = RuntimeError("its weights' server is down")
    a = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    assert gate.entered.wait(10)
    b = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    assert b is a  # joined the build under way
    gate.open.set()
    a.wait()
    b.wait()
    assert a.error is gate.fail and a.answer is None
    assert gate.calls == 1
    gate.fail = None
    c = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    c.wait()
    assert c.answer == "answer" and gate.calls == 2  # a failure is not kept: the next call builds again


def test_concurrent_callers_of_one_spec_share_one_build(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    gate.open.clear()
    got: list[object] = []

    def call() -> None:
        f = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
        f.wait()
        got.append(f.answer)

    callers = [threading.Thread(target=call) for _ in range(8)]
    for t in callers:
        t.start()
    assert gate.entered.wait(10)
    gate.open.set()
    for t in callers:
        t.join(30)
    assert got == ["answer"] * 8
    assert gate.calls == 1


def test_a_hung_build_times_out_then_later_calls_are_refused_at_once(gate: Gate) -> None:
    clock = Clock()
    flights: SingleFlight[object] = SingleFlight(0.2, clock=clock)
    gate.open.clear()
    first = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    with pytest.raises(TimedOut) as e:
        first.wait()  # waits the limit (the stand-in clock stands still: the limit is waited in full)
    assert e.value.waited is True
    clock.now += 1.0  # the build is past its limit now
    for _ in range(5):
        later = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
        assert later is first
        with pytest.raises(TimedOut) as again:
            later.wait()
        assert again.value.waited is False  # refused at once: no wait
        assert str(again.value) == "still running past its limit"
    assert gate.calls == 1  # the hung build is not started again
    gate.open.set()  # it ends: its answer is kept and serves the next call
    first.done.wait(30)
    kept = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    kept.wait()
    assert kept.answer == "answer" and gate.calls == 1


def test_a_new_spec_while_the_old_build_hangs_starts_its_own_and_the_old_answer_is_not_kept() -> None:
    old, new = Gate("old answer"), Gate("new answer")
    old.open.clear()
    flights: SingleFlight[object] = SingleFlight(10)
    try:
        hung = flights.begin("m", "spec-1", old.build, f"{PREFIX}m-old")
        assert old.entered.wait(10)
        fresh = flights.begin("m", "spec-2", new.build, f"{PREFIX}m-new")
        assert fresh is not hung
        fresh.wait()
        assert fresh.answer == "new answer"
        old.open.set()
        hung.wait()
        assert hung.answer == "old answer"  # its own callers get it
        kept = flights.begin("m", "spec-2", new.build, f"{PREFIX}m-new")
        kept.wait()
        assert kept.answer == "new answer" and new.calls == 1
        stale = flights.begin("m", "spec-1", old.build, f"{PREFIX}m-old")
        stale.wait()
        assert old.calls == 2  # the replaced build's answer was not kept
    finally:
        old.open.set()


# ---- SingleFlight on an event loop


def test_waiting_on_an_event_loop_leaves_the_loop_free(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    gate.open.clear()

    async def main() -> list[object]:
        f = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
        waiting = asyncio.ensure_future(f.wait_async())
        ticks = 0
        while not gate.entered.is_set() or ticks < 3:  # the loop runs other work meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not waiting.done()
        gate.open.set()
        await waiting
        return [f.answer, ticks >= 3]

    assert asyncio.run(main()) == ["answer", True]
    assert gate.calls == 1


def test_waiting_on_an_event_loop_times_out_then_refuses_at_once(gate: Gate) -> None:
    clock = Clock()
    flights: SingleFlight[object] = SingleFlight(0.2, clock=clock)
    gate.open.clear()

    async def main() -> tuple[bool, bool]:
        f = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
        with pytest.raises(TimedOut) as first:
            await f.wait_async()
        clock.now += 1.0
        with pytest.raises(TimedOut) as later:
            await flights.begin("m", "spec", gate.build, f"{PREFIX}m").wait_async()
        return first.value.waited, later.value.waited

    assert asyncio.run(main()) == (True, False)
    assert gate.calls == 1


def test_a_build_done_past_its_limit_still_answers_on_an_event_loop(gate: Gate) -> None:
    clock = Clock()
    flights: SingleFlight[object] = SingleFlight(0.2, clock=clock)
    f = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
    f.done.wait(30)
    clock.now += 1.0

    async def main() -> object:
        await f.wait_async()
        return f.answer

    assert asyncio.run(main()) == "answer"


def test_a_cancelled_waiter_leaves_the_build_to_the_others(gate: Gate) -> None:
    flights: SingleFlight[object] = SingleFlight(10)
    gate.open.clear()

    async def main() -> object:
        f = flights.begin("m", "spec", gate.build, f"{PREFIX}m")
        first = asyncio.ensure_future(f.wait_async())
        second = asyncio.ensure_future(flights.begin("m", "spec", gate.build, f"{PREFIX}m").wait_async())
        await asyncio.sleep(0.01)
        first.cancel()
        gate.open.set()
        await second
        assert first.cancelled()
        return f.answer

    assert asyncio.run(main()) == "answer"
    assert gate.calls == 1
