"""Review 17, the Ray pool's batcher (workers.ray_pool._Batcher): one slow or hung model no longer
holds every other model on its device.

The batcher kept at most two batches in flight per device, whatever their models. Two calls of one
model that took long (a slow model, or one whose code hung) held both, and every request for the
device's other models queued behind them: each timed out ("no answer from device ... within"),
though the host, which runs each model under its own lock on a data thread of its own, was free to
answer them. With in-process hosts each request has a thread of its own, so only Ray had this. Now a
batch holds one model's requests, at most two batches in flight per model (and MAX_INFLIGHT_DEVICE
for the device).

The actor handle is a fake (unit tests only; the real one is Ray's): `infer_many` waits on a gate per
model, and it has no data channel."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import types
from typing import Any

from workers import protocol as P
from workers.ray_pool import _Batcher, _Deaths


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Handle:
    """Fake actor handle: `infer_many` waits for the gate of each model in its batch (none: at once)
    and records the batches it was sent; `channel` answers None (no data channel)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.sent: list[list[str]] = []
        self.infer_many = _Remote(self._many)
        self.channel = _Remote(self._channel)

    def _channel(self) -> Any:
        f: cf.Future[None] = cf.Future()
        f.set_result(None)
        return types.SimpleNamespace(future=lambda: f)

    async def _run(self, items: list[tuple[str, Any]]) -> list[P.InferResult]:
        self.sent.append([m for m, _ in items])
        for m, _ in items:
            gate = self.gates.get(m)
            if gate is not None:
                await gate.wait()
        return [P.InferResult(m, True) for m, _ in items]

    def _many(self, items: list[tuple[str, Any]]) -> Any:
        return self._run(items)


async def _settle() -> None:
    for _ in range(20):  # the batcher's tasks take a few turns of the loop to send their batch
        await asyncio.sleep(0)


def test_a_model_whose_calls_hang_does_not_hold_the_other_models_on_its_device() -> None:
    async def main() -> None:
        handle = _Handle()
        handle.gates["slow"] = asyncio.Event()
        b = _Batcher(handle, "gpu0", _Deaths())
        slow = [asyncio.ensure_future(b.submit("slow", {})) for _ in range(2)]
        await _settle()
        slow.append(asyncio.ensure_future(b.submit("slow", {})))
        fast = asyncio.ensure_future(b.submit("fast", {}))
        done, _ = await asyncio.wait({fast}, timeout=10)
        assert fast in done, f"the fast model's request was not sent; batches sent: {handle.sent}"
        assert fast.result().ok and fast.result().model == "fast"
        assert not any(s.done() for s in slow)
        assert all("fast" not in batch or set(batch) == {"fast"} for batch in handle.sent)
        handle.gates["slow"].set()
        assert all(r.ok and r.model == "slow" for r in await asyncio.gather(*slow))
        await asyncio.gather(*list(b._tasks))
        assert b.inflight == 0

    asyncio.run(main())


def test_a_burst_of_one_model_still_goes_as_few_batches() -> None:
    """Requests of one model that queue while its batches are in flight go together in the next."""

    async def main() -> None:
        handle = _Handle()
        handle.gates["m"] = asyncio.Event()
        b = _Batcher(handle, "gpu0", _Deaths())
        first = [asyncio.ensure_future(b.submit("m", {})) for _ in range(2)]
        await _settle()
        rest = [asyncio.ensure_future(b.submit("m", {})) for _ in range(10)]
        await _settle()
        assert handle.sent == [["m"], ["m"]]  # two in flight; the rest wait for one to end
        handle.gates["m"].set()
        results = await asyncio.gather(*first, *rest)
        assert all(r.ok for r in results)
        assert sorted(len(x) for x in handle.sent) == [1, 1, 10]

    asyncio.run(main())
