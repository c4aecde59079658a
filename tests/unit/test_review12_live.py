"""Found in the review of 2026-12-04 of the live manager (`manager.live`, `manager.live_persist`,
`manager.live_sessions`): one class per bug; each test failed before its fix. Real models on
in-process device hosts (no Ray, no sockets); the faults are injected around the in-process pool,
or by running a command on a device host behind the manager's back."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from live_helpers import TEXT, lru_config, run_with_pinned_voice
from live_helpers import until as _until
from test_review_resync import DIED, _books, _held, _RestartingPool
from test_review_resync_adopt import _small_config

from manager.config import load_config
from manager.live import LiveManager
from workers import protocol as P


class _RecordingPool:
    """Around the in-process pool (unit tests only): every command submitted, as (device, op, model);
    the results of the models in `hold` are kept back (the host has run the command) until they
    leave it."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.sent: list[tuple[str, str, str]] = []
        self.hold: set[str] = set()
        self._held: list[P.CommandResult] = []

    def poll(self) -> list[P.CommandResult]:
        results, self._held = self._held + self.real.poll(), []
        out = []
        for r in results:
            (self._held if r.model in self.hold else out).append(r)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        self.sent.append((device, P.command_op(cmd), P.command_model(cmd)))
        op: str = self.real.submit(device, cmd, op_id)
        return op

    def behind_the_back(self, cmd: P.Command, device: str = "cpu0") -> P.CommandResult:
        """Run `cmd` on the device host directly (the manager hears nothing of it)."""
        r: P.CommandResult = self.real.hosts[device].apply(cmd, uuid.uuid4().hex)
        assert r.ok, r
        return r


async def _quiet(lm: LiveManager) -> None:
    def quiet() -> bool:
        return not lm._ops and all(t.done() for t in lm._resyncing.values())

    await _until(quiet, "no command, no resync")


def _run(config: Any, body: Any) -> list[dict[str, Any]]:
    return run_with_pinned_voice(config, _RecordingPool, body)


class TestAResyncFollowsTheTierTheHostHoldsAModelIn:
    """A resync found a model its device host holds in another tier than the books (on the GPU while
    the books have it in host RAM, or the other way round): it took the model off the books with a
    Drop, so the host threw away a model it held where it could be used (and the next request loaded
    it again from disk). Now the books follow the host: the model is put on the books in the tier the
    host holds it (no command), and dropped there only when it does not fit the books."""

    def test_held_on_the_gpu_while_booked_in_host_ram(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            await lm.preload("world", "host")
            await _until(lambda: lm.live["world"].tier == "host", "world in host RAM")
            await _quiet(lm)
            pool.behind_the_back(P.Load(lm.specs["world"], "gpu"))
            sent = len(pool.sent)
            await lm._resync_once("cpu0", "a test's resync")
            await _quiet(lm)
            assert pool.sent[sent:] == []  # no Drop, no load
            assert _held(pool.real) == {"voice": "gpu", "world": "gpu"}
            assert _books(lm) == {"voice": "gpu", "world": "gpu"}
            m = lm.engine.models["world"]
            assert lm.engine.host.used == 0
            assert lm.engine.state.devices["cpu0"].used == sum(
                lm.engine.models[n].gpu_bytes for n in ("voice", "world")
            )
            assert m.lease == m.lease_min
            assert lm.live["world"].tier == "gpu" and lm.serving("world")
            assert lm.engine.counters.evictions == 0 and lm.engine.counters.budget_violations == 0
            gauge = lm.metrics.resident.labels("host", "host")._value.get()
            assert gauge == 0
            await lm.preload("world")  # booked on the GPU: nothing to load
            assert pool.sent[sent:] == []

        with caplog.at_level("INFO", logger="manager.live"):
            events = _run(lru_config(tmp_path), body)
        kinds = [(e["kind"], e["model"]) for e in events]
        assert ("lost", "world") not in kinds and ("drop", "world") not in kinds
        adopted = [e for e in events if e["kind"] == "adopted" and e["model"] == "world"]
        assert len(adopted) == 1, events
        assert "held in the gpu tier" in adopted[0]["detail"]
        assert "host" in adopted[0]["detail"] and "a test's resync" in adopted[0]["detail"]
        resynced = [e for e in events if e["kind"] == "resynced"]
        assert resynced and "world put on the books (gpu)" in resynced[-1]["detail"]
        assert "which the books had in the host tier" in caplog.text

    def test_held_in_host_ram_while_booked_on_the_gpu(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            await lm.preload("world")
            await _quiet(lm)
            pool.behind_the_back(P.Demote("world"))
            sent = len(pool.sent)
            await lm._resync_once("cpu0", "a test's resync")
            await _quiet(lm)
            assert pool.sent[sent:] == []
            assert _held(pool.real) == {"voice": "gpu", "world": "host"}
            assert _books(lm) == {"voice": "gpu", "world": "host"}
            m = lm.engine.models["world"]
            assert lm.engine.host.used == m.weights and m.lease == 0
            assert lm.engine.state.devices["cpu0"].used == lm.engine.models["voice"].gpu_bytes
            assert lm.live["world"].tier == "host" and not lm.live["world"].ready.is_set()
            assert lm.metrics.resident.labels("host", "host")._value.get() == m.weights
            await lm.preload("world")  # promoted from host RAM, as booked
            assert pool.sent[sent:] == [("cpu0", "load", "world")]
            assert _held(pool.real) == {"voice": "gpu", "world": "gpu"}
            assert lm.metrics.loads.labels("world", "gpu", "host")._value.get() == 1

        events = _run(lru_config(tmp_path), body)
        adopted = [e for e in events if e["kind"] == "adopted" and e["model"] == "world"]
        assert len(adopted) == 1 and "held in the host tier" in adopted[0]["detail"], events

    def test_dropped_there_when_it_does_not_fit_the_books(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """world in host RAM on the books, world2 on the GPU: the host holding world on the GPU too
        overruns the device the books count (room for one of them)."""

        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            await lm.preload("world", "host")
            await lm.preload("world2")
            await _quiet(lm)
            assert _books(lm) == {"voice": "gpu", "world": "host", "world2": "gpu"}
            pool.behind_the_back(P.Load(lm.specs["world"], "gpu"))
            sent = len(pool.sent)
            await lm._resync_once("cpu0", "a test's resync")
            await _quiet(lm)
            assert pool.sent[sent:] == [("cpu0", "drop", "world")]
            assert _held(pool.real) == {"voice": "gpu", "world2": "gpu"}
            assert _books(lm) == {"voice": "gpu", "world2": "gpu"}
            assert lm.engine.host.used == 0 and lm.live["world"].tier == "disk"
            assert lm.metrics.resident.labels("host", "host")._value.get() == 0

        with caplog.at_level("INFO", logger="manager.live"):
            events = _run(_small_config(tmp_path), body)
        dropped = [e for e in events if e["kind"] == "held_dropped"]
        assert [e["model"] for e in dropped] == ["world"], events
        assert "does not fit the books" in dropped[0]["detail"]
        assert "the books had it in the host tier" in dropped[0]["detail"]

    def test_dropped_there_when_loaded_with_another_spec(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            await lm.preload("world")
            await _quiet(lm)
            spec = lm.specs["world"]
            other = P.ModelSpec(spec.name, spec.adapter, dict(spec.source), (spec.budget_bytes or 0) + 1)
            pool.behind_the_back(P.Load(other, "host"))  # reloaded from another spec, in host RAM
            sent = len(pool.sent)
            await lm._resync_once("cpu0", "a test's resync")
            await _quiet(lm)
            assert pool.sent[sent:] == [("cpu0", "drop", "world")]
            assert _held(pool.real) == {"voice": "gpu"} and _books(lm) == {"voice": "gpu"}
            assert lm.engine.state.devices["cpu0"].used == lm.engine.models["voice"].gpu_bytes
            assert lm.engine.host.used == 0 and not lm.live["world"].ready.is_set()

        events = _run(lru_config(tmp_path), body)
        dropped = [e for e in events if e["kind"] == "held_dropped"]
        assert [e["model"] for e in dropped] == ["world"], events
        assert "another adapter" in dropped[0]["detail"]
        assert "the books had it in the gpu tier" in dropped[0]["detail"]


def _embed_estimated(tmp_path: Path, estimate: int) -> Any:
    """lru_config with embed's footprint estimated at `estimate` bytes (its measure differs)."""
    lru_config(tmp_path)
    path = tmp_path / "lru.yaml"
    text = path.read_text()
    assert text.count("memory: 90861056") == 1
    path.write_text(text.replace("memory: 90861056", f"memory: {estimate}"))
    return load_config(path)


class TestTheResidentBytesGaugeFollowsAMeasuredFootprint:
    """A device host measured a model's footprint (its load's result) other than the config's
    estimate: the books took the measure, but the residency_resident_bytes gauge kept the estimate
    (it was only set when an action followed), so the metrics said 122 MB resident where Stats (the
    books) said 93 MB, until the next move on that device."""

    def test_the_gauge_says_what_the_books_say(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            await lm.infer("embed", TEXT)
            await _quiet(lm)
            m, dev = lm.engine.models["embed"], lm.engine.state.devices["cpu0"]
            assert m.weights != 120_000_000  # measured
            assert dev.used == m.weights + lm.engine.models["voice"].weights
            assert lm.metrics.resident.labels("cpu0", "gpu")._value.get() == dev.used

        _run(_embed_estimated(tmp_path, 120_000_000), body)


class _DyingBatchPool(_RestartingPool):
    """`_RestartingPool` that records the commands submitted and whose `die_on_batch` model's next
    batch (`infer_many`: the requests that queued together) finds its device host restarting (every
    request of it: worker_died)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.die_on_batch: str | None = None
        self.sent: list[tuple[str, str]] = []

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        self.sent.append((P.command_op(cmd), P.command_model(cmd)))
        op: str = self.real.submit(device, cmd, op_id)
        return op

    def infer_many(
        self, device: str, items: list[tuple[str, Any]], timeout_s: float = 30.0
    ) -> list[P.InferResult]:
        if items and items[0][0] == self.die_on_batch:
            self.die_on_batch = None
            self.restart(device)
            return [P.InferResult(name, False, error_code=P.WORKER_DIED, error=DIED) for name, _ in items]
        out: list[P.InferResult] = self.real.infer_many(device, items)
        return out


class TestRequestsThatLoseTheirModelTogetherLoadItOnce:
    """Two requests of a model were running when its device host restarted: the first to hear it took
    the model off the books and loaded it again for its retry; the second then took it off the books
    once more, which dropped the load the first one waited for and loaded it again (a load thrown
    away: on a GPU, seconds more for both requests, and the user saw the model "lost" twice). Now a
    request that finds the books moved since it started (a load on its way, or a result taken for
    its model) waits for that load."""

    def test_one_drop_and_one_load(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _DyingBatchPool) -> None:
            await lm.infer("embed", TEXT)
            await _quiet(lm)
            pool.sent.clear()
            pool.die_on_batch = "embed"
            served = await asyncio.gather(lm.infer("embed", TEXT), lm.infer("embed", TEXT))
            assert all(s.result.ok and s.cold for s in served)
            assert pool.die_on_batch is None and pool.restarts == 1
            await _quiet(lm)
            assert [c for c in pool.sent if c[1] == "embed"] == [("drop", "embed"), ("load", "embed")]
            assert _books(lm) == {"voice": "gpu", "embed": "gpu"} == _held(pool)
            assert lm.serving("embed") and lm.engine.counters.thrash == 0

        events = run_with_pinned_voice(lru_config(tmp_path), _DyingBatchPool, body)
        assert [e["kind"] for e in events if e["model"] == "embed"].count("lost") == 1, events


class TestAnAdminEvictWaitsForTheRequestsWaitingForTheLoad:
    """An admin's evict of a model that was loading for a waiting request took it off at once; the
    request, re-admitted, loaded it again: the model ended on the GPU anyway (the evict undone), and
    the extra load counted as thrash. An evict of a model serving requests already waited for them
    to end ("a model serving requests goes when they end"); one loading for them now does too."""

    def test_the_request_is_served_from_the_one_load_and_the_model_then_goes(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            embed = lm.engine.models["embed"]
            loads_before = lm.engine.counters.loads
            pool.hold.add("embed")  # the load's result is kept back until the admin has evicted
            request = asyncio.create_task(lm.infer("embed", TEXT, timeout_s=30))
            await _until(lambda: embed.tier.name == "GPU", "embed loading for the request")
            lm.evict("embed")
            pool.hold.clear()
            served = await asyncio.wait_for(request, 30)
            assert served.result.ok
            await _until(lambda: embed.tier.name == "DISK", "embed evicted once the request ended")
            assert lm.engine.counters.loads - loads_before == 1  # was 2: loaded again for the request
            assert lm.engine.counters.thrash == 0

        events = _run(lru_config(tmp_path), body)
        deferred = [e for e in events if e["kind"] == "evict_deferred"]
        assert len(deferred) == 1 and "in flight or waiting" in deferred[0]["detail"], events

    def test_a_waiting_request_that_gives_up_lets_the_evict_go(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RecordingPool) -> None:
            embed = lm.engine.models["embed"]
            pool.hold.add("embed")  # the load's result is kept back: the request waits past its deadline
            request = asyncio.create_task(lm.infer("embed", TEXT, timeout_s=1.0))
            await _until(lambda: embed.tier.name == "GPU", "embed loading for the request")
            lm.evict("embed")
            assert lm.live["embed"].evict_to == "disk"  # deferred: a request waits for the load
            with pytest.raises(Exception, match="did not finish loading before the deadline"):
                await asyncio.wait_for(request, 30)
            # the request gave up: the evict goes once the load's result comes (until then the load
            # still fills the model's room on its device, which the books keep booked)
            assert embed.tier.name == "GPU" and lm.live["embed"].evict_to == "disk"
            pool.hold.clear()
            await _until(lambda: embed.tier.name == "DISK", "embed evicted once its load ended")
            assert lm.live["embed"].evict_to is None

        _run(lru_config(tmp_path), body)
