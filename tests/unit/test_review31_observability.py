"""Review 31 (an operator's side: are what the service reports and what it does the same?). Found, with
reproductions:

- A world session's KV lease below the device host's floor (three segments; on a GPU two decoded
  slots) was applied as the floor, yet the books, `ps` and `residency_lease_bytes` counted the lease
  asked for, and the engine gave the difference to other models. The host's open reply now says its
  floor, and the books take it as the model's minimum lease (`Engine.measured_lease_floor`).
- Requests that never ran (refused at admission, a load that failed or outlasted the deadline, a
  client gone while it waited) were counted in the metrics and observed by the statistics but never
  reached the request log: the weekly tuning never saw the demand it refused, and a killed manager's
  catch-up (which rebuilds from the log) lost it. They are logged now, `busy_s` 0, `outcome`
  `rejected` or `unserved` (`manager.store.base.NEVER_RAN`); the catch-up observes them without
  counting them as served requests.
- A request that reached its deadline while the service was still starting, and a second world
  session's open refused while one ran, were counted nowhere; a session with a failed step was logged
  with no outcome.
- `residency_loads_total` counted a load from the OS page cache as `disk` (the books priced it
  `cached`); a device host found restarted, and a model it no longer held, left no trace in the
  metrics (`residency_host_restarts_total`, `residency_models_lost_total` now).

Real components: the live manager over in-process device hosts (the world model is WorldPager's
"micro" stand-in), a SQLite store and journal in tmp_path."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
from live_helpers import POSES, WORLD_CONFIG, kill, run, started, world_config

from manager.api.admin import AdminServicer, model_status
from manager.config import Config, load_config
from manager.errors import DeadlineExceeded, InsufficientCapacity, ModelFailed, ResidencyError
from manager.live import LiveManager
from manager.store import open_store
from manager.store.export import export_trace
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as rpb
from workers.demo import write_tiny_mlp
from workers.host import DeviceHost

WIDTH = 256
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


def mlp_config(tmp: Path, n: int = 1, classes: str = "", load_s: float = 0.0) -> Config:
    """`n` tiny MLPs on a CPU device with room for two, `lru-keepalive` (no prewarm), a SQLite store."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = write_tiny_mlp(tmp / "mlp.safetensors", WIDTH)
    models = "\n".join(
        f"  - {{name: m{i}, class: interactive, adapter: safetensors-module, device: cpu0,\n"
        f"     memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, keep_alive: 1h,\n"
        f"     source: {{factory: 'workers.demo:slow_mlp', path: '{path}',\n"
        f"              kwargs: {{width: {WIDTH}, load_s: {load_s}, infer_s: 0.0}}}}}}"
        for i in range(n)
    )
    classes = classes or "  - {name: interactive}\n"
    text = (
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * 2.2) + 2**26}, reserve: {2**26}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n" + classes + f"store: {{url: 'sqlite:///{tmp}/state.db', journal: '{tmp}/j', "
        f"sessions: '{tmp}/sessions'}}\n"
        "models:\n" + models + "\npolicy: {name: lru-keepalive}\n"
    )
    (tmp / "c.yaml").write_text(text)
    return load_config(tmp / "c.yaml")


def sample(lm: LiveManager, name: str, **labels: str) -> float | None:
    value: float | None = lm.metrics.registry.get_sample_value(name, labels)
    return value


class TestALeaseBelowTheHostsFloor:
    def test_the_books_ps_and_the_metric_count_what_the_host_holds(self, tmp_path: Path) -> None:
        text = WORLD_CONFIG.replace("SESSIONS", str(tmp_path / "sessions")).replace(
            "elastic: {min: 16MiB, max: 64MiB}", "elastic: {min: 40KiB, max: 80KiB}"
        )
        (tmp_path / "c.yaml").write_text(text)
        config = load_config(tmp_path / "c.yaml")

        async def body(lm: LiveManager) -> None:
            sid, data = await lm.open_session("world", timeout_s=60)
            for pose in POSES[:2]:
                await lm.step_session(sid, pose)
            held = lm.pool.hosts["cpu0"].world.open_sessions[sid].lease
            m = lm.engine.models["world"]
            floor = data["lease_floor_bytes"]
            assert floor == 3 * data["segment_bytes"] > 40 * 1024  # three segments: above elastic.min
            assert held == floor  # (the host applied its floor, not the 40 KiB asked for)
            assert m.lease == held and m.lease_min == floor and m.lease_max == floor
            assert model_status(lm, "world").lease_bytes == held
            assert sample(lm, "residency_lease_bytes", model="world") == held
            dev = lm.engine.state.devices["cpu0"]
            assert dev.used == m.weights + held  # the device's books hold the host's bytes
            await lm.close_session(sid)
            # the next session opens with the floor: asked and applied agree from the start
            sid, data = await lm.open_session("world", timeout_s=60)
            assert lm.pool.hosts["cpu0"].world.open_sessions[sid].lease == m.lease == floor
            await lm.close_session(sid)

        run(config, body)

    def test_a_floor_within_elastic_min_changes_nothing(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager) -> None:
            m = lm.engine.models["world"]
            sid, data = await lm.open_session("world", timeout_s=60)
            assert data["lease_floor_bytes"] < 16 * 2**20  # (the micro stand-in's: KiBs)
            assert m.lease_min == 16 * 2**20 and m.lease >= m.lease_min
            await lm.close_session(sid)

        run(world_config(tmp_path), body)


async def _burst(lm: LiveManager) -> list[str]:
    async def one(delay: float) -> str:
        await asyncio.sleep(delay)
        try:
            await lm.infer("m0", X, timeout_s=10)
        except InsufficientCapacity:
            return "refused"
        return "ok"

    return list(await asyncio.gather(one(0), one(0.05), one(0.06), one(0.07)))


class TestRequestsThatNeverRan:
    def test_refused_requests_are_logged_and_a_kill_keeps_their_demand(self, tmp_path: Path) -> None:
        """max_queue 1 and a slow load: three of a burst of four are refused "queue full". They are
        in the request log, `busy_s` 0, outcome `rejected`; after a kill, the catch-up observes all
        four (as the live engine did) and counts one request served; the exported trace has the one
        that ran."""
        config = mlp_config(tmp_path, classes="  - {name: interactive, max_queue: 1}\n", load_s=0.8)

        async def main() -> None:
            store = open_store(f"sqlite:///{tmp_path}/state.db")
            lm, pool = await started(config, store, tmp_path / "j")
            assert sorted(await _burst(lm)) == ["ok", "refused", "refused", "refused"]
            assert lm.engine.models["m0"].hist.count == 4
            # what waits for the store, between flushes too (it was set only at a flush)
            assert sample(lm, "residency_request_log_buffered") == len(lm._log_buf) > 0
            await lm.flush_log()
            kill(lm, pool)
            records = list(store.requests(0))
            assert sorted(str(r.get("outcome")) for r in records) == [
                "ok",
                "rejected",
                "rejected",
                "rejected",
            ]
            for r in records:
                if r["outcome"] == "rejected":
                    assert r["busy_s"] == 0.0 and r["model"] == "m0"
            second, pool2 = await started(config, store, tmp_path / "j")
            try:
                assert second.engine.models["m0"].hist.count == 4  # the refused demand survived
                assert second.live["m0"].requests == 1  # served: the one that ran
            finally:
                await second.stop()
                pool2.close()
            # a trace (the weekly tuning's) holds what ran: replayed, a refusal would be a request
            # served, and each client retry another arrival
            assert export_trace(store, 3600.0, time.time() + 1, tmp_path / "t.jsonl") == 1
            store.close()

        asyncio.run(main())

    def test_a_request_at_its_deadline_while_the_service_starts_is_counted(self, tmp_path: Path) -> None:
        config = mlp_config(tmp_path)

        async def main() -> None:
            store = open_store(f"sqlite:///{tmp_path}/state.db")
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool, store=store)
            try:
                for _ in range(2):  # (its start not begun: still starting at the deadline)
                    try:
                        await lm.infer("m0", X, timeout_s=0.1)
                        raise AssertionError("served before the service started")
                    except DeadlineExceeded:
                        pass
                await lm.start()
                await lm.infer("m0", X, timeout_s=10)
                assert (lm.served, lm.rejected, lm.failed) == (1, 2, 0)
                labels = {"model": "m0", "cls": "interactive", "outcome": "rejected"}
                assert sample(lm, "residency_requests_total", **labels) == 2
                # neither observed nor logged: the statistics were not restored yet (an observation
                # then, and its record read back by the start's catch-up, counted it twice)
                assert lm.engine.models["m0"].hist.count == 1
                await lm.flush_log()
                assert [r.get("outcome", "") for r in store.requests(0)] == ["ok"]
            finally:
                await lm.stop()
                pool.close()
                store.close()

        asyncio.run(main())


class TestWorldSessionsInTheMetricsAndTheLog:
    def test_a_refused_second_open_and_a_failed_step(self, tmp_path: Path) -> None:
        store = open_store(f"sqlite:///{tmp_path}/state.db")

        async def body(lm: LiveManager) -> None:
            sid, _ = await lm.open_session("world", timeout_s=60)
            await lm.step_session(sid, POSES[0])
            try:
                await lm.open_session("world", timeout_s=5)
                raise AssertionError("a second session opened beside the first")
            except InsufficientCapacity as e:
                assert "runs a session" in str(e)
            world = lm.pool.hosts["cpu0"].world

            def fails(session_id: str, pose: Any) -> Any:
                raise RuntimeError("the step failed on the device host")

            world.step = fails  # (this instance's, for one step: a step that fails on its host)
            try:
                await lm.step_session(sid, POSES[1])
                raise AssertionError("a failing step stepped")
            except ModelFailed as e:
                assert "the step failed on the device host" in str(e)
            finally:
                del world.step
            await lm.close_session(sid)
            assert (lm.served, lm.rejected) == (1, 1)
            labels = {"model": "world", "cls": "interactive"}
            assert sample(lm, "residency_requests_total", **labels, outcome="rejected") == 1
            assert sample(lm, "residency_requests_total", **labels, outcome="error") == 1
            assert lm.engine.models["world"].hist.count == 2
            await lm.flush_log()

        try:
            run(world_config(tmp_path), body, store=store)
            records: list[dict[str, Any]] = list(store.requests(0))
            assert [(r["kind"], r["outcome"]) for r in records] == [
                ("session", "error"),
                ("session", "rejected"),
            ]
            assert records[1]["busy_s"] == 0.0
        finally:
            store.close()


class TestLoadsAndLostModelsInTheMetrics:
    def test_a_load_from_the_page_cache_is_counted_as_the_books_price_it(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager) -> None:
            await lm.infer("m0", X, timeout_s=10)
            m = lm.engine.models["m0"]
            sources = {
                s: sample(lm, "residency_loads_total", model="m0", tier="gpu", source=s)
                for s in ("disk", "cached")
            }
            counted = [s for s, v in sources.items() if v == 1]
            assert len(counted) == 1 and sum(v or 0 for v in sources.values()) == 1
            # the metric's source is the one whose load time the books measured (the seed moved)
            assert m.cost.capture()[counted[0]]

        run(mlp_config(tmp_path), body)

    def test_a_host_restarted_empty_is_counted_and_so_is_each_model_it_lost(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager) -> None:
            await lm.infer("m0", X, timeout_s=10)
            await lm.infer("m1", X, timeout_s=10)
            old = lm.pool.hosts["cpu0"]
            lm.pool.hosts["cpu0"] = DeviceHost(old.name, old.kind, index=old.index, node=old.node)
            served = await lm.infer("m0", X, timeout_s=10)
            assert served.result.ok and served.cold

            for _ in range(200):
                lost = [sample(lm, "residency_models_lost_total", model=n) or 0 for n in ("m0", "m1")]
                if sample(lm, "residency_host_restarts_total", device="cpu0") and sum(lost) == 2:
                    break
                await asyncio.sleep(0.05)
            assert sample(lm, "residency_host_restarts_total", device="cpu0") == 1
            lost = [sample(lm, "residency_models_lost_total", model=n) or 0 for n in ("m0", "m1")]
            assert sum(lost) == 2  # both were on the books there, neither on the new host

        run(mlp_config(tmp_path, n=2), body)


class TestStatsSaysWhatRanAndFailed:
    def test_failed_runs_are_the_requests_metrics_errors_that_ran(self, tmp_path: Path) -> None:
        """`stats`' `errors` counts the requests that failed before they ran; those that ran and
        failed were only in `requests`, so `stats` showed no failure while the metric counted them.
        `failed_runs` (StatsResponse field 12) counts them."""

        async def body(lm: LiveManager) -> None:
            await lm.infer("m0", X, timeout_s=10)
            for _ in range(3):  # three features short: the module's own code raises
                try:
                    await lm.infer("m0", {"input": np.ones((1, WIDTH - 3), dtype=np.float32)}, timeout_s=10)
                    raise AssertionError("a malformed input ran")
                except ResidencyError:
                    pass
            stats = await AdminServicer(lm).Stats(rpb.StatsRequest(), None)
            assert (stats.requests, stats.failed_runs, stats.errors) == (4, 3, 0)
            error = sample(lm, "residency_requests_total", model="m0", cls="interactive", outcome="error")
            assert error == stats.failed_runs + stats.errors

        run(mlp_config(tmp_path), body)
