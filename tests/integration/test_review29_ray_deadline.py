"""Found in the 29th review (the worker layer): on Ray's device hosts, a request answered DEADLINE
while its forward still ran left its model idle on the books (in process it stays busy until the
forward ends). An evict (an admin's, a keep-alive that ran out) then sent a Drop, which the host
holds until the forward ends, and every later command of that device (another model's load) queued
behind it. Real components: a local Ray with a device-host actor, the live manager, a real
safetensors checkpoint and the `workers.demo` stand-in models (one sleeps in its forward)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import numpy as np
import pytest

from manager.config import load_config
from manager.errors import DeadlineExceeded
from manager.live import LiveManager
from workers.demo import write_tiny_mlp
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE

DEV = "r29-cpu0"
X = {"input": np.ones((1, 16), np.float32)}


def test_a_forward_past_its_deadline_keeps_its_model_busy_and_the_device_free(
    ray_actors: list[object], tmp_path: Path
) -> None:
    w = write_tiny_mlp(tmp_path / "w.safetensors", width=16)
    (tmp_path / "c.yaml").write_text(f"""
devices: [{{name: {DEV}, kind: cpu, memory: 4GiB, reserve: 512MiB}}]
host: {{memory: 16GiB, reserve: 4GiB}}
classes: [{{name: interactive}}]
store: {{url: "sqlite:///{tmp_path}/state.db", journal: {tmp_path}/requests.journal}}
models:
  - {{name: hang, class: interactive, adapter: safetensors-module, device: {DEV}, memory: 1MiB,
     prewarm: false, source: {{factory: "workers.demo:slow_mlp", path: "{w}",
     kwargs: {{width: 16, load_s: 0.0, infer_s: 8.0}}}}}}
  - {{name: other, class: interactive, adapter: safetensors-module, device: {DEV}, memory: 1MiB,
     prewarm: false, source: {{factory: "workers.demo:tiny_mlp", path: "{w}", kwargs: {{width: 16}}}}}}
policy: {{name: lru-keepalive}}
""")
    config = load_config(tmp_path / "c.yaml")
    pool = RayWorkerPool([DeviceSpec(DEV, "cpu")], namespace=TEST_NAMESPACE)
    ray_actors.append(pool)

    async def body() -> None:
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            with pytest.raises(DeadlineExceeded):
                await lm.infer("hang", X, timeout_s=2.0)  # its forward takes 8 s
            assert lm.live["hang"].inflight == 1  # still running on its host: busy, as in process
            assert lm.engine.models["hang"].busy_until == math.inf
            lm.evict("hang")  # deferred until the forward ends: no Drop holds the device meanwhile
            began = time.monotonic()
            served = await lm.infer("other", X, timeout_s=5.0)
            assert served.result.ok
            assert time.monotonic() - began < 5.0
            for _ in range(200):  # the forward ends: idle, and the deferred evict goes
                if lm.live["hang"].inflight == 0 and lm.live["hang"].tier == "disk":
                    break
                await asyncio.sleep(0.1)
            assert lm.live["hang"].inflight == 0
            assert lm.live["hang"].tier == "disk"
        finally:
            await lm.stop()

    asyncio.run(body())
