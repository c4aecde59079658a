"""A chaos run of the live manager: random concurrent requests and admin moves, then the invariants.

Five tiny MLP stand-ins (random weights; some slow to load or to run) on an in-process cpu device
that holds three of them; two classes (background may not evict); random keep-alives and
prewarm switches. 120 operations start at random times within 4 s: inferences (80 %), pins and
unpins, evicts to host or disk, preloads to gpu or host. Whatever the timing:
- every operation succeeds or fails with a domain error whose message says why (no other
  exception, and never "the device host lost the model": nothing here takes a model off its host
  under a request);
- once quiet, the manager's books match what the device host holds, tier for tier;
- no budget was ever broken on the books.
Runs of this found three bugs (see test_live_ordering.py): an evict under a request in flight, a
stale never-fits verdict after an unpin, and a ValueError from a Pin that overfilled the device.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from manager.config import Config, load_config
from manager.errors import DeadlineExceeded, InsufficientCapacity, InvalidRequest, ResidencyError
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool
from workers import protocol as P
from workers.demo import write_tiny_mlp

WIDTH = 256
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}
EXPECTED = (
    "no room",  # a background request waits for room, or an admin preload finds none
    "can never",  # pins leave no room for the model
    "is pinned; unpin it first",  # evict of a pinned model
    "cannot pin",  # pins that would not fit together
    "taken off its device while the request waited",  # an admin evict during its load
    "did not finish loading",  # a load behind others, past a short deadline
)


def chaos_config(tmp_path: Path, rng: random.Random, policy: str) -> Config:
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    models = []
    kinds = [("interactive", True), ("interactive", True), ("interactive", False)]
    kinds += [("background", False), ("background", True)]
    for i, (cls, prewarm) in enumerate(kinds):
        keep = rng.choice(["1s", "auto", "3s"])
        load_s, infer_s = rng.choice([0.0, 0.05, 0.2]), rng.choice([0.0, 0.02, 0.1])
        kwargs = f"{{width: {WIDTH}, load_s: {load_s}, infer_s: {infer_s}}}"
        models.append(
            f"  - {{name: m{i}, class: {cls}, adapter: safetensors-module, device: cpu0,\n"
            f"     memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, keep_alive: {keep},\n"
            f"     prewarm: {str(prewarm).lower()},\n"
            f"     source: {{factory: 'workers.demo:slow_mlp', path: '{path}', kwargs: {kwargs}}}}}"
        )
    text = (
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * 3.2) + 2**26}, reserve: {2**26}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        "models:\n" + "\n".join(models) + f"\npolicy: {{name: {policy}, min_residency: 0.2s}}\n"
    )
    (tmp_path / "c.yaml").write_text(text)
    return load_config(tmp_path / "c.yaml")


Outcome = tuple[Counter[str], list[str], LiveManager, P.WorkerStatus]


async def chaos(config: Config, rng: random.Random) -> Outcome:
    pool = create_pool(config, in_process=True)
    lm = LiveManager(config, pool)
    await lm.start()
    names = [m.name for m in config.models]
    outcomes: Counter[str] = Counter()
    unexpected: list[str] = []
    plan = [(rng.uniform(0, 4.0), rng.random(), rng.choice(names), rng.random()) for _ in range(120)]

    async def one(at: float, op: float, name: str, coin: float) -> None:
        await asyncio.sleep(at)
        try:
            if op < 0.8:
                served = await lm.infer(name, X, timeout_s=3.0)
                assert served.result.ok
                outcomes["served"] += 1
            elif op < 0.85:
                lm.set_pin(name, coin < 0.5)
                outcomes["pin" if coin < 0.5 else "unpin"] += 1
            elif op < 0.92:
                lm.evict(name, "disk" if coin < 0.5 else "host")
                outcomes["evict"] += 1
            else:
                await lm.preload(name, "gpu" if coin < 0.5 else "host", timeout_s=3.0)
                outcomes["preload"] += 1
        except (DeadlineExceeded, InsufficientCapacity, InvalidRequest) as e:
            outcomes[type(e).__name__] += 1
            if not any(words in str(e) for words in EXPECTED):
                unexpected.append(f"{name}: {type(e).__name__}: {e}")
        except ResidencyError as e:  # WorkerUnavailable: a model lost under a request
            unexpected.append(f"{name}: {type(e).__name__}: {e}")

    try:
        await asyncio.wait_for(asyncio.gather(*(one(*p) for p in plan)), 60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # quiet: nothing on its way to or from the host
            busy = pool.pending() or any(live.loads_pending for live in lm.live.values())
            if not busy and all(m.ready_at <= lm.clock() for m in lm.engine.models.values()):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        return outcomes, unexpected, lm, pool.status("cpu0")
    finally:
        await lm.stop()
        pool.close()


@pytest.mark.parametrize("policy", ["residency", "lru-keepalive"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_requests_and_admin_moves_keep_the_books_true(tmp_path: Path, policy: str, seed: int) -> None:
    rng = random.Random(seed)
    config = chaos_config(tmp_path, rng, policy)
    outcomes, unexpected, lm, status = asyncio.run(chaos(config, rng))
    assert unexpected == []
    assert outcomes["served"] > 0 and sum(outcomes.values()) == 120
    tiers = {Tier.GPU: "gpu", Tier.HOST: "host", Tier.DISK: "disk"}
    books = {m.name: tiers[m.tier] for m in lm.engine.models.values()}
    held = {name: status.models[name].tier if name in status.models else "disk" for name in books}
    assert books == held
    assert lm.engine.counters.budget_violations == 0
