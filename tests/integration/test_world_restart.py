"""A world session survives its device host (a real Ray actor) being killed: the live manager loads the
model again on the restarted host, reopens the session from its saved index in the session directory
and goes on with the same pose — no segment lost or repeated, old segments still retrieved from disk,
the output close to an uninterrupted run's. Killed once between two steps and once under a step
(`ray.kill` is asynchronous; Ray restarts the actor, empty). The "micro" stand-in (random weights,
seeded: the restarted host builds the same ones), with a lease of a few segments so that retrieval
reads old segments back from the NVMe log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from manager.config import load_config
from manager.live import LiveManager
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool
from workers.world import WorldSessions
from worldpager.model import TinyCausalWan
from worldpager.segment_log import SegmentLog
from worldpager.session import SESSION_PRESETS
from worldpager.trajectory import yaw_sweep_trajectory

from .conftest import TEST_NAMESPACE

DEVICE = "den-cpu8"
CONFIG = """
devices: [{{name: {device}, kind: cpu, memory: 1GiB, reserve: 128MiB}}]
host: {{memory: 8GiB, reserve: 1GiB}}
classes: [{{name: interactive}}]
store: {{sessions: "{sessions}"}}
models:
  - {{name: world, class: interactive, adapter: worldpager-mg2, device: {device}, memory: 4MiB,
     elastic: {{min: 100KiB, max: 120KiB}}, load_seconds: {{disk: 0.2, host: 0.05}}, keep_alive: forever,
     source: {{preset: micro}}}}
"""
POSES = [(p.x, p.y, p.z, p.pitch, p.yaw) for p in yaw_sweep_trajectory(16)]
FIRST_KILL, SECOND_KILL = 6, 10  # before step 6 (the host restarted before it); under step 10


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def _reference(tmp_path: Path, kv_bytes: int) -> list[dict[str, Any]]:
    """The same session, uninterrupted, in this process."""
    ws = WorldSessions(torch.device("cpu"))
    ws.open("world", TinyCausalWan(SESSION_PRESETS["micro"].on_the_fly()), "ref", kv_bytes, tmp_path / "ref")
    try:
        return [ws.step("ref", p) for p in POSES]
    finally:
        ws.close("ref")


def test_a_world_session_continues_from_its_saved_index_after_its_host_is_killed(
    ray_actors: list[object], tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    (tmp_path / "c.yaml").write_text(CONFIG.format(device=DEVICE, sessions=sessions))
    config = load_config(tmp_path / "c.yaml")

    async def main() -> tuple[str, int, list[dict[str, Any]], list[dict[str, Any]]]:
        pool = RayWorkerPool([DeviceSpec(DEVICE, "cpu")], namespace=TEST_NAMESPACE)
        ray_actors.append(pool)
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        await lm.start()
        pids = [pool.status(DEVICE, timeout_s=60).pid]  # a loaded 2-core machine answers late

        def restarted() -> bool:
            try:
                return pool.status(DEVICE, timeout_s=5).pid not in pids
            except Exception:
                return False

        try:
            sid, opened = await lm.open_session("world", timeout_s=90)
            out = [await lm.step_session(sid, p) for p in POSES[:FIRST_KILL]]

            pool.kill(DEVICE)  # between two steps: the next step finds the host restarted empty
            # (waited for: `ray.kill` returns before the old process is gone, and a step sent at once
            # could still run on it; the second kill, under a step, is the one that finds it dead)
            await until(restarted, "the killed device host restarted")
            pids.append(pool.status(DEVICE, timeout_s=60).pid)
            out += [await lm.step_session(sid, p) for p in POSES[FIRST_KILL:SECOND_KILL]]

            step = asyncio.create_task(lm.step_session(sid, POSES[SECOND_KILL]))
            pool.kill(DEVICE)  # under a step (or just after it: either way nothing is lost)
            out.append(await step)
            await until(restarted, "the killed device host restarted again")
            out += [await lm.step_session(sid, p) for p in POSES[SECOND_KILL + 1 :]]
            closed = await lm.close_session(sid)
            assert closed.get("closed") and closed["segments"] == len(POSES)
        finally:
            await lm.stop()
            pool.close()
        seen = []
        while not events.empty():
            seen.append(events.get_nowait())
        return sid, int(opened["lease_bytes"]), out, seen

    sid, lease, out, events = asyncio.run(main())
    assert [d["step"] for d in out] == list(range(len(POSES)))  # no segment lost, none repeated
    assert all(d["durable"] for d in out)
    resumed = [d["step"] for d in out if d["resumed"]]
    assert FIRST_KILL in resumed and len(resumed) >= 1  # the second kill may land after its step
    assert all(d["corrupt_slots"] == {} and d["missing_segments"] == [] for d in out if d["resumed"])
    kinds = [e["kind"] for e in events if e["model"] == "world"]
    assert kinds.count("session_lost") == len(resumed) and kinds.count("session_resumed") == len(resumed)

    after = out[FIRST_KILL:]  # old segments, written before the kill, come back from the log
    assert any(i < FIRST_KILL for d in after if d["misses"] for i in d["retrieved"])
    ref = _reference(tmp_path, lease)
    assert [d["retrieved"] for d in out] == [r["retrieved"] for r in ref]
    for got, want in zip(out, ref, strict=True):  # a reopened window is at codec precision: close
        a = torch.frombuffer(bytearray(got["latents"]), dtype=torch.float32)
        b = torch.frombuffer(bytearray(want["latents"]), dtype=torch.float32)
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-2, got["step"]
    with SegmentLog.open(sessions / sid) as log:  # the session's log holds every segment
        assert {log.header(slot).segment_id for slot in log.slots()} == set(range(len(POSES)))
        assert log.corrupt_slots() == {}
