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
import contextlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

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
    "no answer from device",  # a forward started near its deadline, answered at it (DEADLINE_EXCEEDED)
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


async def quiet(lm: LiveManager, pool: Any, settle_s: float) -> None:
    """Wait until nothing is on its way to or from the host (20 s at most), then `settle_s` more."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = pool.pending() or any(live.loads_pending for live in lm.live.values())
        if not busy and all(m.ready_at <= lm.clock() for m in lm.engine.models.values()):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)


async def admin_move(lm: LiveManager, move: str, name: str, coin: float) -> None:
    """An admin's pin or unpin, evict (to disk or host RAM) or preload (to gpu or host RAM) of `name`,
    the alternative chosen by `coin`."""
    if move == "pin":
        lm.set_pin(name, coin < 0.5)
    elif move == "evict":
        lm.evict(name, "disk" if coin < 0.5 else "host")
    else:
        await lm.preload(name, "gpu" if coin < 0.5 else "host", timeout_s=3.0)


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
            else:
                await admin_move(lm, "pin" if op < 0.85 else "evict" if op < 0.92 else "preload", name, coin)
                outcomes["admin"] += 1
        except (DeadlineExceeded, InsufficientCapacity, InvalidRequest) as e:
            outcomes[type(e).__name__] += 1
            if not any(words in str(e) for words in EXPECTED):
                unexpected.append(f"{name}: {type(e).__name__}: {e}")
        except ResidencyError as e:  # WorkerUnavailable: a model lost under a request
            unexpected.append(f"{name}: {type(e).__name__}: {e}")

    try:
        await asyncio.wait_for(asyncio.gather(*(one(*p) for p in plan)), 60)
        await quiet(lm, pool, settle_s=0.3)
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


def world_config(tmp_path: Path, rng: random.Random) -> Config:
    """The world model (WorldPager's "micro" stand-in, elastic KV lease) and three MLP stand-ins on a
    cpu device that holds the world model at its minimum lease and two of the MLPs."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    models = [
        "  - {name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,\n"
        "     elastic: {min: 16MiB, max: 64MiB}, load_seconds: {disk: 0.2, host: 0.05}, keep_alive: 3s,\n"
        "     source: {preset: micro}}"
    ]
    for i, cls in enumerate(["interactive", "interactive", "background"]):
        load_s, infer_s = rng.choice([0.0, 0.05, 0.2]), rng.choice([0.0, 0.02, 0.1])
        keep = rng.choice(["1s", "auto", "3s"])
        models.append(
            f"  - {{name: m{i}, class: {cls}, adapter: safetensors-module, device: cpu0,\n"
            f"     memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, keep_alive: {keep},\n"
            f"     source: {{factory: 'workers.demo:slow_mlp', path: '{path}',\n"
            f"              kwargs: {{width: {WIDTH}, load_s: {load_s}, infer_s: {infer_s}}}}}}}"
        )
    room = 20 * 2**20 + int(MLP_BYTES * 2.2) + 40 * 2**20
    text = (
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {room + 2**26}, reserve: {2**26}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        f"store: {{sessions: '{tmp_path / 'sessions'}'}}\n"
        "models:\n" + "\n".join(models) + "\npolicy: {name: residency, min_residency: 0.2s}\n"
    )
    (tmp_path / "c.yaml").write_text(text)
    return load_config(tmp_path / "c.yaml")


async def cancel_after(task: asyncio.Task[Any], seconds: float | None) -> bool:
    """Await `task`, or cancel it after `seconds` (a client hanging up); True if it was cancelled."""
    if seconds is not None:
        done, _ = await asyncio.wait({task}, timeout=seconds)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return True
    await task
    return False


def leftovers(lm: LiveManager, pool: Any) -> list[str]:
    """What a quiet manager should not have: books that differ from what the host holds, a model
    still busy, a session open on the books or on the host, a budget broken."""
    out = []
    status = pool.status("cpu0")
    tiers = {Tier.GPU: "gpu", Tier.HOST: "host", Tier.DISK: "disk"}
    books = {m.name: tiers[m.tier] for m in lm.engine.models.values()}
    held = {name: status.models[name].tier if name in status.models else "disk" for name in books}
    if books != held:
        out.append(f"the books {books} are not what the host holds {held}")
    for name, live in lm.live.items():
        if live.inflight or lm.engine.models[name].busy_until == float("inf"):
            out.append(f"{name} still busy: {live.inflight} in flight")
    if lm.sessions or pool.hosts["cpu0"].world.open_sessions:
        out.append(f"sessions left open: {lm.sessions} {list(pool.hosts['cpu0'].world.open_sessions)}")
    if lm.engine.counters.budget_violations:
        out.append(f"{lm.engine.counters.budget_violations} budget violations")
    return out


async def world_chaos(config: Config, rng: random.Random) -> tuple[Counter[str], list[str]]:
    pool = create_pool(config, in_process=True)
    lm = LiveManager(config, pool)
    await lm.start()
    outcomes: Counter[str] = Counter()
    unexpected: list[str] = []
    names = ["m0", "m1", "m2"]

    def check(e: ResidencyError, what: str) -> None:
        outcomes[type(e).__name__] += 1
        if not any(words in str(e) for words in (*EXPECTED, "runs a session")):
            unexpected.append(f"{what}: {type(e).__name__}: {e}")

    async def session(at: float, steps: int, hang_up: float | None) -> None:
        await asyncio.sleep(at)
        sid: str | None = None

        async def stream() -> None:  # what the WorldSession RPC does, its client's stream ending
            nonlocal sid
            try:
                sid, _ = await lm.open_session("world", timeout_s=5.0)
                for i in range(steps):
                    await lm.step_session(sid, (float(i), 0.0, 0.0, 0.0, 10.0 * i))
            finally:
                if sid is not None and sid in lm.sessions:
                    await lm.close_session(sid)

        try:
            gone = await cancel_after(asyncio.ensure_future(stream()), hang_up)
            outcomes["session hung up" if gone else "session"] += 1
        except ResidencyError as e:
            check(e, "session")

    async def one(at: float, op: float, name: str, coin: float, hang_up: float | None) -> None:
        await asyncio.sleep(at)
        target = name if coin < 0.75 else "world"
        try:
            if op < 0.7:
                gone = await cancel_after(asyncio.ensure_future(lm.infer(name, X, timeout_s=3.0)), hang_up)
                outcomes["hung up" if gone else "served"] += 1
            else:
                await admin_move(
                    lm, "pin" if op < 0.78 else "evict" if op < 0.88 else "preload", target, coin
                )
                outcomes["admin"] += 1
        except ResidencyError as e:
            check(e, name)

    hang_ups = [None, None, 0.01, 0.05, 0.2]
    plan = [one(rng.uniform(0, 5), rng.random(), rng.choice(names), rng.random(), rng.choice(hang_ups))
            for _ in range(100)]  # fmt: skip
    plan += [
        session(rng.uniform(0, 5), rng.randint(0, 6), rng.choice([*hang_ups, 0.5, 1.0])) for _ in range(10)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*plan), 90)
        await quiet(lm, pool, settle_s=0.5)
        unexpected += leftovers(lm, pool)
        return outcomes, unexpected
    finally:
        await lm.stop()
        pool.close()


@pytest.mark.parametrize("seed", [3, 13])
def test_world_sessions_and_clients_that_hang_up_leave_nothing_behind(tmp_path: Path, seed: int) -> None:
    """World sessions (0-6 segments) among the requests and admin moves, and clients that hang up at
    random points (opening, stepping, closing, waiting for a request). Runs of this found four bugs
    (see test_live_ordering.py): a second session on the world model reset the first's KV window;
    a session whose client hung up while it opened, or while it closed, left the model busy for good;
    and a close cancelled while it waited for a worker thread never reached the host."""
    rng = random.Random(seed)
    outcomes, unexpected = asyncio.run(world_chaos(world_config(tmp_path, rng), rng))
    assert unexpected == []
    assert outcomes["served"] > 0 and outcomes["session"] > 0 and sum(outcomes.values()) == 110
