"""Review 20: a store call on a thread whose caller was cancelled (the stop cancels the minute's
statistics save) and that then ends in an error (the stop abandons it: RuntimeError) left its task's
exception unread: asyncio logged "Task exception was never retrieved" with a traceback in the
service's stop output (CI saw it once, in test_review19_stop_store_hang). A batch on a thread whose
call was abandoned raised in its done callback, and its waiters were never answered."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from manager.live_batch import LocalBatcher
from manager.live_persist import _off_loop
from workers import protocol as P


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_cancelled_callers_thread_call_that_then_fails_leaves_no_unread_exception(cuts: int) -> None:
    """`cuts` 1: the caller waits for the call (as `_off_loop` does); 2: a second cancel (the stop's
    second cut) ends that wait too."""
    seen: list[dict[str, Any]] = []
    release = threading.Event()

    def hangs_then_fails() -> None:
        release.wait(10)
        raise RuntimeError("abandoned at the service's stop: a call of _put_stats")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        caller = asyncio.ensure_future(_off_loop(hangs_then_fails))
        for _ in range(cuts):
            await asyncio.sleep(0.05)
            caller.cancel()
        if cuts == 1:
            await asyncio.sleep(0.05)
            release.set()
        await asyncio.wait({caller})
        assert caller.cancelled()
        release.set()
        await asyncio.sleep(0.2)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not seen, [c.get("message") for c in seen]


def test_a_batch_whose_thread_call_fails_answers_its_waiters() -> None:
    seen: list[dict[str, Any]] = []

    async def main() -> list[P.InferResult]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        b = LocalBatcher(None, "cpu0", "m", 4, lambda n: False)
        fut: asyncio.Future[P.InferResult] = loop.create_future()

        # (the executor's future ends in RuntimeError outside `_call`'s own handling, as
        # `StopBoundedExecutor.abandon_rest` sets it)
        async def fails() -> list[P.InferResult]:
            raise RuntimeError("abandoned at the service's stop: the inference of 'm'")

        b._schedule = lambda: None  # type: ignore[method-assign]
        task = loop.create_task(fails())
        task.add_done_callback(lambda t: b._done([({}, fut)], t))
        return [await asyncio.wait_for(fut, 5)]

    results = asyncio.run(main())
    assert not seen, [c.get("message") for c in seen]
    assert results[0].ok is False and "abandoned at the service's stop" in (results[0].error or "")
