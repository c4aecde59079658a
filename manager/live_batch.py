"""Dynamic batching on the in-process data path (device hosts in the server's process).

On Ray, `workers.ray_pool`'s batcher already sends what queued meanwhile as one batch. In process,
a request used to call its device host by itself; for a model with `max_batch` > 1 it now goes
through a `LocalBatcher`: the requests for that model that arrive in the same turn of the event
loop, or while its previous batch runs on a thread, go to the host in one `infer_many` call, where
`DeviceHost.infer_many` stacks those that fit together into one call of the model. A request waits
one turn of the loop at most before its batch starts (as the unbatched path already yields one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from workers import protocol as P

Inputs = dict[str, np.ndarray]


class LocalBatcher:
    """One model's queue. `run_inline(n)` says whether a batch of `n` requests is quick enough to
    run on the event loop itself (else it runs on a thread, one batch at a time)."""

    def __init__(
        self, pool: Any, device: str, model: str, max_batch: int, run_inline: Callable[[int], bool]
    ) -> None:
        self.pool = pool
        self.device = device
        self.model = model
        self.max_batch = max_batch
        self.run_inline = run_inline
        self.queue: list[tuple[Inputs, asyncio.Future[P.InferResult]]] = []
        self.scheduled = False
        self.running = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0
        self.requests = 0
        self._carrying: dict[asyncio.Future[P.InferResult], asyncio.Task[Any]] = {}
        """A request's future -> the batch on a thread that carries it, until that batch ends."""

    async def submit(self, inputs: Inputs, late: list[asyncio.Future[Any]] | None = None) -> P.InferResult:
        """The request's result. Cancelled (its deadline passed) while its batch runs on a thread,
        that batch's task goes in `late`: its forward runs on (a thread cannot be stopped)."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # a new event loop (tests run several): the old one's futures are gone
            self.loop, self.queue, self.scheduled, self.running = loop, [], False, False
            self._carrying = {}
        fut: asyncio.Future[P.InferResult] = loop.create_future()
        self.queue.append((inputs, fut))
        self._schedule()
        try:
            return await fut
        except asyncio.CancelledError:
            carrier = self._carrying.get(fut)
            if carrier is not None and not carrier.done() and late is not None:
                late.append(carrier)
            raise

    def _schedule(self) -> None:
        if not self.scheduled and not self.running and self.queue and self.loop is not None:
            self.scheduled = True
            self.loop.call_soon(self._go)

    def _go(self) -> None:
        self.scheduled = False
        if self.running or not self.queue:
            return
        batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
        batch = [(x, f) for x, f in batch if not f.done()]  # a caller that gave up (cancelled)
        if not batch:
            self._schedule()
            return
        self.batches += 1
        self.requests += len(batch)
        items = [(self.model, x) for x, _ in batch]
        if self.run_inline(len(batch)):
            self._answer(batch, self._call(items))
            self._schedule()
            return
        self.running = True
        assert self.loop is not None
        task = self.loop.create_task(asyncio.to_thread(self._call, items))
        for _, f in batch:
            self._carrying[f] = task
        task.add_done_callback(lambda t: self._done(batch, t))

    def _done(
        self, batch: list[tuple[Inputs, asyncio.Future[P.InferResult]]], task: asyncio.Task[Any]
    ) -> None:
        self.running = False
        for _, f in batch:
            self._carrying.pop(f, None)
        if task.cancelled():
            results = [self._failed("the batch was cancelled") for _ in batch]
        elif (e := task.exception()) is not None:  # (its thread's call abandoned at the stop)
            results = [self._failed(f"{type(e).__name__}: {e}") for _ in batch]
        else:
            results = task.result()
        self._answer(batch, results)
        self._schedule()

    def _call(self, items: list[tuple[str, Inputs]]) -> list[P.InferResult]:
        try:
            if len(items) == 1:  # nothing to stack: the plain call
                return [self.pool.infer(self.device, self.model, items[0][1])]
            results: list[P.InferResult] = self.pool.infer_many(self.device, items)
        except Exception as e:  # the host never raises; a pool that does answers every waiter
            return [self._failed(f"{type(e).__name__}: {e}") for _ in items]
        return results

    def _failed(self, why: str) -> P.InferResult:
        return P.InferResult(self.model, False, error_code=P.INTERNAL, error=f"model {self.model!r}: {why}")

    @staticmethod
    def _answer(
        batch: list[tuple[Inputs, asyncio.Future[P.InferResult]]], results: list[P.InferResult]
    ) -> None:
        for (_, fut), r in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(r)


__all__ = ["LocalBatcher"]
