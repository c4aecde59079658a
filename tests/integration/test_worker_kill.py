"""A device host (a real Ray actor) killed under a load and under a request, through the live manager:
the request is served after one reload, or fails within its deadline (never a hang); a
residency event says what happened; the request log keeps every request that reached its model.

The model is `workers.demo:slow_mlp` (it takes 1.5 s to load and 1.5 s per inference), so the kill
lands while the work is in flight. `ray.kill` is asynchronous; Ray restarts the actor, empty."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from manager.config import load_config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import LiveManager
from manager.store import open_store
from workers.demo import write_tiny_mlp
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE

DEVICE = "den-cpu7"
X = {"input": np.ones((1, 16), np.float32)}
CONFIG = """
devices:
  - {{name: {device}, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - name: slow
    class: realtime
    adapter: safetensors-module
    device: {device}
    memory: 1MiB
    load_seconds: {{disk: 1.5, cached: 1.5, host: 0.1}}
    keep_alive: forever
    prewarm: false
    source:
      factory: "workers.demo:slow_mlp"
      path: "{weights}"
      kwargs: {{width: 16, load_s: 1.5, infer_s: 1.5}}
policy: {{name: lru-keepalive}}
"""


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.005)


def test_a_device_host_killed_under_a_load_and_under_a_request(
    ray_actors: list[object], tmp_path: Path
) -> None:
    weights = write_tiny_mlp(tmp_path / "slow.safetensors", 16)
    (tmp_path / "c.yaml").write_text(CONFIG.format(device=DEVICE, weights=weights))
    config = load_config(tmp_path / "c.yaml")
    url = f"sqlite:///{tmp_path / 'state.db'}"

    async def main() -> list[dict[str, Any]]:
        pool = RayWorkerPool([DeviceSpec(DEVICE, "cpu")], namespace=TEST_NAMESPACE)
        ray_actors.append(pool)
        store = open_store(url)
        lm = LiveManager(config, pool, store=store)
        events = lm.subscribe()
        await lm.start()
        live = lm.live["slow"]
        pids = [pool.status(DEVICE, timeout_s=60).pid]  # a loaded 2-core machine answers late

        async def kill_when(cond: Callable[[], bool], what: str) -> None:
            await until(cond, what)
            pool.kill(DEVICE)  # Ray restarts it, empty

        async def wait_restarted() -> None:
            def new_pid() -> bool:
                try:
                    return pool.status(DEVICE, timeout_s=5).pid not in pids
                except Exception:
                    return False

            await until(new_pid, "the killed device host restarted")
            pids.append(pool.status(DEVICE, timeout_s=60).pid)

        try:
            # 1. killed while the model loads for a request: one more load, then served
            request = asyncio.create_task(lm.infer("slow", X, timeout_s=90))
            await kill_when(lambda: live.loads_pending == 1, "the load in flight")
            served = await request
            assert served.result.ok and served.cold
            await wait_restarted()

            # 2. killed while the request runs on it: lost, reloaded, retried once, served
            request = asyncio.create_task(lm.infer("slow", X, timeout_s=90))
            await kill_when(lambda: live.inflight == 1, "the request in flight")
            served = await request
            assert served.result.ok and served.cold
            await wait_restarted()

            # 3. the same with a deadline the reload and the second run cannot meet (1.5 s each):
            # UNAVAILABLE where the reload ended too late to send it, DEADLINE_EXCEEDED where it was
            # sent and got no answer in time (which of the two depends on how soon Ray restarted
            # the host), within the deadline either way, naming the dead host
            t0 = time.monotonic()
            request = asyncio.create_task(lm.infer("slow", X, timeout_s=3.0))
            await kill_when(lambda: live.inflight == 1, "the request in flight")
            with pytest.raises((WorkerUnavailable, DeadlineExceeded), match=f"'{DEVICE}'"):
                await request
            assert time.monotonic() - t0 < 3.0 + 1.0  # its deadline, and a little: never a hang
            await wait_restarted()
            assert (await lm.infer("slow", X, timeout_s=90)).result.ok  # serving goes on
        finally:
            await lm.stop()
            pool.close()
        # every request that reached its model is in the request log; the one whose first load died
        # under it reached it on the retry
        assert [r["outcome"] for r in store.requests(0)] == ["ok", "ok", "error", "ok"]
        store.close()
        out = []
        while not events.empty():
            out.append(events.get_nowait())
        return out

    events = asyncio.run(main())
    lost = [e["detail"] for e in events if e["kind"] == "lost" and e["model"] == "slow"]
    assert len(lost) == 3, lost
    assert "died during the load" in lost[0] and all(DEVICE in d for d in lost)
    failed = [e["detail"] for e in events if e["kind"] == "failed"]
    assert failed and DEVICE in failed[0]  # the load the host died under
    loads = [e for e in events if e["kind"] == "load" and e["model"] == "slow"]
    assert len(loads) >= 4  # the first load, and one reload per kill
