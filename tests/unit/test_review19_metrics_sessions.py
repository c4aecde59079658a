"""Review 19: the metrics left world sessions out. `residency stats` counts a world session as a request
once it ends (`requests`), and its open as a cold start when it found its model off the GPU; the
metrics counted inferences only, so after 10 inferences and 8 sessions `stats` said 18 requests while
`residency_requests_total` summed to 10, and `residency_request_wait_seconds` had no series for the
world model's class. A session is now counted in `residency_requests_total` (its model, class, and
outcome: `error` when a step of it failed) when it ends, and its wait for its model (admission, a
cold start) in `residency_request_wait_seconds` and in Stats' waits when it opens.

The manager over the in-process pool (real device hosts): the world model is WorldPager's "micro"
stand-in; the inference model is a fake adapter (it returns zeros), registered for the test only."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from manager.api.admin import AdminServicer
from manager.config import load_config
from manager.errors import InsufficientCapacity, InvalidRequest, ModelFailed
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as rpb
from workers import protocol as P
from workers.adapters import ADAPTERS, Adapter, HostCopy

CONFIG = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: realtime}, {name: interactive}]
store: {sessions: SESSIONS}
models:
  - {name: tiny, class: realtime, adapter: fake-r19-zeros, device: cpu0, memory: 1MiB,
     load_seconds: {disk: 0.1, host: 0.05}}
  - {name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {min: 16MiB, max: 64MiB}, load_seconds: {disk: 0.2, host: 0.05}, source: {preset: micro}}
"""
POSE = (0.0, 0.0, 0.0, 0.0, 0.0)


class FakeZeros(Adapter):
    """A fake model for the test: one FP32 input, one output of zeros."""

    name = "fake-r19-zeros"

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("x", "FP32", (1,))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("y", "FP32", (1,))]

    def read(self, ph: Any) -> HostCopy:
        return HostCopy(tensors={"w": torch.zeros(4)})

    def materialize(self, host: HostCopy, ph: Any) -> Any:
        return host.tensors

    def to_host(self, runnable: Any, ph: Any) -> HostCopy:
        return HostCopy(tensors=runnable)

    def runnable_bytes(self, runnable: Any) -> int:
        return 16

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": np.zeros(1, np.float32)}


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: Callable[[LiveManager], Awaitable[Any]]
) -> Any:
    monkeypatch.setitem(ADAPTERS, "fake-r19-zeros", FakeZeros)
    (tmp_path / "c.yaml").write_text(CONFIG.replace("SESSIONS", str(tmp_path / "sessions")))
    config = load_config(tmp_path / "c.yaml")

    async def main() -> Any:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            return await body(lm)
        finally:
            await lm.stop()
            pool.close()

    return asyncio.run(main())


def samples(lm: LiveManager, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for metric in lm.metrics.registry.collect()
        for s in metric.samples
        if s.name == name
    }


def test_sessions_are_counted_in_the_metrics_as_stats_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(lm: LiveManager) -> None:
        for _ in range(3):
            await lm.infer("tiny", {"x": np.zeros(1, np.float32)})
        for _ in range(2):
            sid, _ = await lm.open_session("world")
            await lm.step_session(sid, POSE)
            await lm.close_session(sid)
        sid, _ = await lm.open_session("world")  # a session one of whose steps failed (on its host;
        # a pose out of range is the client's mistake, refused before: review 31)
        world = lm.pool.hosts["cpu0"].world

        def fails(session_id: str, pose: Any) -> Any:
            raise RuntimeError("the step failed on the device host")

        world.step = fails  # (this instance's, for one step)
        try:
            with pytest.raises(ModelFailed, match="the step failed on the device host"):
                await lm.step_session(sid, POSE)
        finally:
            del world.step
        with pytest.raises(InvalidRequest, match="pose"):  # (the client's: not a second failure)
            await lm.step_session(sid, (math.nan, 0.0, 0.0, 0.0, 0.0))
        await lm.end_session(sid)
        stats = await AdminServicer(lm).Stats(rpb.StatsRequest(), None)

        requests = samples(lm, "residency_requests_total")
        assert requests == {
            (("cls", "realtime"), ("model", "tiny"), ("outcome", "ok")): 3.0,
            (("cls", "interactive"), ("model", "world"), ("outcome", "ok")): 2.0,
            (("cls", "interactive"), ("model", "world"), ("outcome", "error")): 1.0,
        }
        assert stats.requests == 6 and stats.rejected == 0 and stats.errors == 0
        assert sum(requests.values()) == stats.requests + stats.rejected + stats.errors

        waits = samples(lm, "residency_request_wait_seconds_count")
        assert waits == {(("cls", "realtime"),): 3.0, (("cls", "interactive"),): 3.0}
        assert sum(waits.values()) == stats.requests  # each served request's wait, once
        wait_sum = sum(samples(lm, "residency_request_wait_seconds_sum").values())
        assert wait_sum == pytest.approx(stats.load_wait_s)
        assert set(stats.wait_p99_s) == {"realtime", "interactive"}
        assert len(lm.waits["interactive"]) == 3

    _run(tmp_path, monkeypatch, body)


def test_a_session_is_counted_when_it_ends_and_its_wait_when_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session open is counted when it ends, not before (as `stats` has it), its wait when it opens;
    a second session on the world model is refused (one at a time) before admission: counted rejected
    (review 31: it was counted nowhere)."""

    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        before = samples(lm, "residency_requests_total")
        assert before == {}  # open, not ended: not a request yet (as `stats` has it)
        assert samples(lm, "residency_request_wait_seconds_count") == {(("cls", "interactive"),): 1.0}
        assert lm.served == 0
        with pytest.raises(InsufficientCapacity, match="runs one at a time"):
            await lm.open_session("world")
        refused = {(("cls", "interactive"), ("model", "world"), ("outcome", "rejected")): 1.0}
        assert samples(lm, "residency_requests_total") == refused and lm.rejected == 1
        await lm.close_session(sid)
        after = samples(lm, "residency_requests_total")
        assert after == {**refused, (("cls", "interactive"), ("model", "world"), ("outcome", "ok")): 1.0}
        assert lm.served == 1

    _run(tmp_path, monkeypatch, body)
