"""Review 14, the data channel with a real Ray actor: a batch whose reply is over the channel's frame
limit ran over the channel and then again through Ray (a stateful VAD stepped twice); its results
now come from the first run, fetched with the actor's `channel_reply` call."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from workers import channel
from workers import protocol as P
from workers.pool import DeviceSpec

from .test_data_channel import burst
from .test_ray_workers import AUDIO, VOICE, make_pool, run

LIMIT = 8192
ITEMS = [("voice", AUDIO)] + [("nope", {})] * 100  # a ~4.5 KiB request, a ~12 KiB reply


# Sets the host's frame limit, in its own process (a lambda: Ray sends it by value, as the actor
# cannot import this test module).
_SET_FRAME_LIMIT = lambda actor, limit: setattr(sys.modules["workers.channel"], "MAX_FRAME", limit)  # noqa: E731


def test_an_over_limit_reply_runs_its_batch_once(
    ray_actors: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-r14", "cpu"))
    run(pool, "den-r14", P.Load(VOICE))
    deadline = time.monotonic() + 60
    while pool._batchers.get("den-r14") is None or pool._batchers["den-r14"].channel is None:
        assert burst(pool, "den-r14", 4)[0].ok  # the channel is found meanwhile
        assert time.monotonic() < deadline, "the data channel was not found"
    batcher = pool._batchers["den-r14"]
    ray.get(pool.actors["den-r14"].__ray_call__.remote(_SET_FRAME_LIMIT, LIMIT), timeout=30)
    monkeypatch.setattr(channel, "MAX_FRAME", LIMIT)  # the limit is one constant, on both sides
    before = pool.status("den-r14").models["voice"].inferences

    async def main() -> list[P.InferResult]:
        loop = asyncio.get_running_loop()
        batch = [(m, x, loop.create_future()) for m, x in ITEMS]
        batcher.inflight += 1  # as `_kick` counts the batch it starts
        await batcher._run(batch)
        return [fut.result() for _, _, fut in batch]

    sent = batcher.channel_batches
    results = asyncio.run(main())
    assert pool.status("den-r14").models["voice"].inferences == before + 1
    assert [r.model for r in results] == [m for m, _ in ITEMS]
    assert results[0].ok and "speech_prob" in results[0].outputs
    assert all(not r.ok and r.error_code == P.BAD_TRANSITION for r in results[1:])
    assert batcher.channel is not None and batcher.channel_batches == sent  # held, then fetched
    assert ray.get(pool.actors["den-r14"].channel_reply.remote("no-such-token"), timeout=30) is None
