"""The data channel with a real Ray actor: inference skips the actor call once the channel is found,
gives the same answers, and a killed host breaks it cleanly (WORKER_DIED via Ray, never a hang); the
restarted host's new channel is found again."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from workers import protocol as P
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .test_ray_workers import AUDIO, VOICE, make_pool, run, wait_dead, wait_status


def burst(pool: RayWorkerPool, device: str, n: int, rounds: int = 1) -> list[P.InferResult]:
    async def main() -> list[P.InferResult]:
        out: list[P.InferResult] = []
        for _ in range(rounds):
            out += await asyncio.gather(*(pool.infer_async(device, "voice", AUDIO, 30) for _ in range(n)))
            await asyncio.sleep(0.2)  # the channel is found meanwhile
        return out

    return asyncio.run(main())


def test_inference_goes_over_the_channel_and_survives_a_host_restart(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-chan0", "cpu"))
    run(pool, "den-chan0", P.Load(VOICE))
    direct = pool.infer("den-chan0", "voice", AUDIO)
    got = burst(pool, "den-chan0", 16, rounds=5)
    assert all(r.ok and r.outputs == direct.outputs for r in got)
    batcher = pool._batchers["den-chan0"]
    assert batcher.channel is not None and batcher.channel_batches > 0
    assert pool.status("den-chan0").models["voice"].inferences == 1 + 80

    pid = pool.status("den-chan0").pid
    pool.kill("den-chan0")  # asynchronous; Ray restarts the host, empty
    wait_dead(pool, "den-chan0")
    after = burst(pool, "den-chan0", 8)
    # the old channel broke: each request has an answer, never a hang (the restarted host no longer
    # holds the model, or the dead one did not answer)
    assert all(not r.ok and r.error_code in (P.WORKER_DIED, P.BAD_TRANSITION) for r in after)
    deadline = time.monotonic() + 60
    while wait_status(pool, "den-chan0").pid == pid:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    run(pool, "den-chan0", P.Load(VOICE))
    again = burst(pool, "den-chan0", 16, rounds=3)
    assert all(
        r.ok
        and np.allclose(
            P.output_array(r.outputs["speech_prob"]), P.output_array(direct.outputs["speech_prob"])
        )
        for r in again
    )
    batcher = pool._batchers["den-chan0"]
    assert batcher.channel is not None and batcher.channel.address.pid != pid
