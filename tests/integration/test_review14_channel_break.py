"""Review 14, the data channel with a real Ray actor: a batch whose channel broke after it was sent
(the connection cut mid-reply, the host alive) ran again through Ray (a stateful VAD stepped twice);
it now runs once, its requests get an `internal` error saying it may have run (the host, checked with
a Ray call, is alive: not `worker_died`), and the channel is found again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray

from workers import protocol as P
from workers.pool import DeviceSpec

from .test_data_channel import burst
from .test_ray_workers import AUDIO, VOICE, make_pool, run


def _cut_after_run() -> Callable[[Any], None]:
    """What the actor runs to cut its channel's connections once its next batch has run (in its own
    process: made here, so that Ray sends it by value, as the actor cannot import this module)."""

    def install(actor: Any) -> None:
        import socket

        server = actor.server
        real = server.host

        class CutAfterRun:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def infer_many(self, items: Any) -> Any:
                out = real.infer_many(items)
                server.host = real
                for c in list(server._conns):
                    c.shutdown(socket.SHUT_RDWR)
                return out

        server.host = CutAfterRun()

    return install


def test_a_reply_cut_mid_way_runs_its_batch_once_and_says_so(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-r14b", "cpu"))
    run(pool, "den-r14b", P.Load(VOICE))
    deadline = time.monotonic() + 60
    while pool._batchers.get("den-r14b") is None or pool._batchers["den-r14b"].channel is None:
        assert burst(pool, "den-r14b", 4)[0].ok  # the channel is found meanwhile
        assert time.monotonic() < deadline, "the data channel was not found"
    batcher = pool._batchers["den-r14b"]
    address = batcher.channel.address if batcher.channel is not None else None
    ray.get(pool.actors["den-r14b"].__ray_call__.remote(_cut_after_run()), timeout=30)
    before = pool.status("den-r14b").models["voice"].inferences

    async def main() -> list[P.InferResult]:
        loop = asyncio.get_running_loop()
        batch = [(m, x, loop.create_future()) for m, x in [("voice", AUDIO)] * 3]
        batcher.inflight += 1  # as `_kick` counts the batch it starts
        await batcher._run(batch)
        return [fut.result() for _, _, fut in batch]

    results = asyncio.run(main())
    assert pool.status("den-r14b").models["voice"].inferences == before + 3  # once each, not twice
    for r in results:
        assert not r.ok and r.error_code == P.INTERNAL, r
        assert "may have run" in (r.error or "") and "'den-r14b' is alive" in (r.error or "")
    assert not batcher.deaths.reported("den-r14b", time.monotonic())
    deadline = time.monotonic() + 60
    while batcher.channel is None:  # found again: the same host, the same socket
        assert all(r.ok for r in burst(pool, "den-r14b", 4))
        assert time.monotonic() < deadline, "the data channel was not found again"
    assert batcher.channel.address == address
