"""Found in review (2026-12) of how the live manager keeps its books in step with its device hosts,
one class per gap; each test failed before its fix. Real models on in-process device hosts (no Ray,
no sockets); a restarted device host is a fresh, empty `DeviceHost` put in the dead one's place, as
Ray restarts a dead actor."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from live_helpers import AUDIO, POSES, TEXT, lru_config, run_with_pinned_voice, world_config
from live_helpers import drain as _drain
from live_helpers import until as _until

from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool
from workers import protocol as P
from workers.host import DeviceHost

DIED = "device host 'cpu0' died: ActorDiedError: the actor died unexpectedly"


class _RestartingPool:
    """Fault injector (unit tests only) around the in-process pool: `restart()` puts a fresh, empty
    device host in the place of the running one (Ray restarting a dead actor); `die_under` makes that
    happen under the next command of that kind (its result then says worker_died, as the Ray pool
    reports a command whose host died under it), `die_on_infer` under the next inference of that
    model (worker_died too)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.die_under: str | None = None
        self.die_on_infer: str | None = None
        self.restarts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def restart(self, device: str = "cpu0") -> None:
        old = self.real.hosts[device]
        self.real.hosts[device] = DeviceHost(old.name, old.kind, index=old.index, node=old.node)
        self.restarts += 1

    def poll(self) -> list[P.CommandResult]:
        out = []
        for r in self.real.poll():
            if self.die_under is not None and r.op == self.die_under:
                self.die_under = None
                self.restart(r.device)
                r = P.CommandResult(
                    r.op_id, r.model, r.op, False, error_code=P.WORKER_DIED, error=DIED, device=r.device
                )
            out.append(r)
        return out

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> P.InferResult:
        if model == self.die_on_infer:
            self.die_on_infer = None
            self.restart(device)
            return P.InferResult(model, False, error_code=P.WORKER_DIED, error=DIED)
        result: P.InferResult = self.real.infer(device, model, inputs, timeout_s)
        return result


def _held(pool: Any) -> dict[str, str]:
    return {n: s.tier for n, s in pool.status("cpu0").models.items()}


def _books(lm: LiveManager) -> dict[str, str]:
    tiers = {Tier.GPU: "gpu", Tier.HOST: "host"}
    return {n: tiers[m.tier] for n, m in lm.engine.models.items() if m.tier in tiers}


class TestAHostRestartLearnedFromAResultResyncsTheBooks:
    """A device host restarted (it died and came back empty), and the manager learned it from a
    command's or a request's result: a worker_died, or a result from the new host. Only the model of
    that result was taken off the books: the host's other models stayed counted on the GPU and in host
    RAM (room nobody could use) until a request of theirs failed, and a pinned model stayed unloaded
    until then. Now the manager reads the host's status again, as adoption does at start: what the
    host no longer holds leaves the books (said, with the reason, and not counted as an eviction), and
    pinned models load again."""

    def _run(
        self, tmp_path: Path, body: Callable[[LiveManager, _RestartingPool], Awaitable[None]]
    ) -> list[dict[str, Any]]:
        config = lru_config(tmp_path)  # voice pinned; nothing else loads until asked for
        return run_with_pinned_voice(config, _RestartingPool, body)

    @staticmethod
    async def _resynced(lm: LiveManager, pool: _RestartingPool, resident: dict[str, str]) -> None:
        """The books hold what the restarted host holds (`resident`), the pinned voice loaded again."""
        await _until(lambda: _books(lm) == resident, f"the books: {resident}")
        await _until(lambda: _held(pool) == resident and lm.live["voice"].ready.is_set(), f"held: {resident}")
        dev = lm.engine.state.devices["cpu0"]
        assert dev.used == sum(lm.engine.models[n].gpu_bytes for n, t in resident.items() if t == "gpu")
        assert lm.engine.host.used == sum(
            lm.engine.models[n].weights for n, t in resident.items() if t == "host"
        )

    @staticmethod
    async def _two_resident(lm: LiveManager, pool: _RestartingPool) -> None:
        """embed on the GPU beside the pinned voice, and world in host RAM, confirmed by the host."""
        await lm.infer("embed", TEXT)
        await lm.preload("world", "host")
        await _until(
            lambda: _held(pool) == {"voice": "gpu", "embed": "gpu", "world": "host"}, "all three held"
        )
        await _until(lambda: lm.live["world"].tier == "host", "world confirmed in host RAM")

    def test_a_worker_died_result_of_a_command(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def body(lm: LiveManager, pool: _RestartingPool) -> None:
            await lm.infer("embed", TEXT)
            evictions, thrash = lm.engine.counters.evictions, lm.engine.counters.thrash
            pool.die_under = "load"
            await lm.preload("world", "host")  # the host dies under this load, and comes back empty
            await self._resynced(lm, pool, {"voice": "gpu"})
            assert pool.restarts == 1
            assert lm.engine.counters.evictions == evictions  # lost, not evicted
            reg = lm.metrics.registry
            assert reg.get_sample_value("residency_evictions_total", {"model": "embed", "to": "disk"}) is None
            assert (await lm.infer("embed", TEXT)).cold  # loaded again at its next request
            assert lm.engine.counters.thrash == thrash  # a reload after a loss is no thrash

        with caplog.at_level("INFO", logger="manager.live"):
            events = self._run(tmp_path, body)
        lost = {e["model"]: e["detail"] for e in events if e["kind"] == "lost"}
        assert set(lost) == {"voice", "embed"}, lost
        assert "no longer holds it" in lost["embed"] and "worker_died" in lost["embed"]
        assert "device cpu0: the device host no longer holds embed" in caplog.text

    def test_a_result_from_a_restarted_host(self, tmp_path: Path) -> None:
        """No command was in flight when the host died: the next one simply runs on the new host."""

        async def body(lm: LiveManager, pool: _RestartingPool) -> None:
            await lm.infer("embed", TEXT)
            pool.restart()  # quietly: nothing in flight
            await lm.preload("world", "host")  # succeeds, on the new host
            await self._resynced(lm, pool, {"voice": "gpu", "world": "host"})

        events = self._run(tmp_path, body)
        lost = {e["model"]: e["detail"] for e in events if e["kind"] == "lost"}
        assert set(lost) == {"voice", "embed"} and "restarted" in lost["embed"], lost

    def test_a_worker_died_request_frees_the_other_models_host_ram_too(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _RestartingPool) -> None:
            await self._two_resident(lm, pool)
            pool.die_on_infer = "voice"
            served = await lm.infer("voice", AUDIO)  # the host dies under it: retried once, served
            assert served.result.ok and served.cold
            await self._resynced(lm, pool, {"voice": "gpu"})

        events = self._run(tmp_path, body)
        lost = [e["model"] for e in events if e["kind"] == "lost"]
        assert {"voice", "embed", "world"} <= set(lost), lost

    def test_a_failed_demote_of_a_model_the_host_no_longer_holds(self, tmp_path: Path) -> None:
        """bad_transition: the host does not hold the model the command names (it restarted)."""

        async def body(lm: LiveManager, pool: _RestartingPool) -> None:
            await self._two_resident(lm, pool)
            pool.restart()
            lm.evict("embed", "host")  # a demote: the new host does not hold embed
            await self._resynced(lm, pool, {"voice": "gpu"})

        self._run(tmp_path, body)

    def test_a_world_session_step_that_finds_the_host_restarted(self, tmp_path: Path) -> None:
        """The session is reopened on the new host (as before), and the host's other models are
        resynced too: the pinned voice, lost with it, loads again."""
        voice = """  - {name: voice, class: interactive, adapter: silero-vad, device: cpu0, memory: 3MiB,
     pin: true, load_seconds: {disk: 0.1, host: 0.05}}
"""
        config = world_config(tmp_path, voice)

        async def body(lm: LiveManager, pool: _RestartingPool) -> None:
            sid, _ = await lm.open_session("world")
            assert (await lm.step_session(sid, POSES[0]))["step"] == 0
            pool.restart()
            again = await lm.step_session(sid, POSES[1])
            assert again["resumed"] and again["step"] == 1
            await _until(lambda: _held(pool) == {"voice": "gpu", "world": "gpu"}, "both held again")
            await _until(lambda: lm.live["voice"].ready.is_set(), "voice confirmed again")
            assert _books(lm) == {"voice": "gpu", "world": "gpu"}
            await lm.close_session(sid)

        events = run_with_pinned_voice(config, _RestartingPool, body)
        assert "voice" in [e["model"] for e in events if e["kind"] == "lost"]


class TestASessionLeftOpenByAKilledManagerIsClosedAtAdoption:
    """A manager killed with a world session open left it open on its device host (hosts outlive it
    on a cluster), holding its KV memory. The next manager closed it only once a new open on the world
    model was refused in words it recognised, so until then the host held the orphan's KV memory (and
    a world model the books counted idle). Now the host's status lists its open sessions and adoption
    closes each one this manager has no record of (its state saved, so its client can resume it)."""

    def test_the_next_manager_closes_it_at_start(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        config = world_config(tmp_path)

        async def main() -> list[dict[str, Any]]:
            pool = create_pool(config, in_process=True)  # the device host outlives both managers
            old = LiveManager(config, pool)
            await old.start()
            orphan, _ = await old.open_session("world")
            assert [(await old.step_session(orphan, p))["step"] for p in POSES[:2]] == [0, 1]
            host = pool.hosts["cpu0"]
            held = host.world.open_sessions[orphan].session
            assert old._task is not None
            old._task.cancel()  # killed: its streams are gone, its device host is not

            lm = LiveManager(config, pool)
            events = lm.subscribe()
            await lm.start()
            try:
                # right after the start, before any open: no session on the host, its KV let go
                assert host.world.open_sessions == {}
                assert held._closed
                assert getattr(pool.status("cpu0"), "sessions", None) == ()
                assert lm.live["world"].ready.is_set()  # the world model itself is adopted
                again, resumed = await lm.open_session("world", resume_id=orphan, codec="")
                assert again == orphan and resumed["resumed"] and resumed["next_segment"] == 2
                assert (await lm.step_session(orphan, POSES[2]))["step"] == 2
                await lm.close_session(orphan)
            finally:
                await lm.stop()
                pool.close()
            return _drain(events)

        with caplog.at_level("INFO", logger="manager.live"):
            events = asyncio.run(main())
        closed = [e for e in events if e["kind"] == "session_closed"]
        assert "left open on the device host by an earlier run" in closed[0]["detail"], closed
        assert "closed at adoption" in caplog.text

    def test_one_left_open_after_adoption_is_still_closed_at_the_next_open(self, tmp_path: Path) -> None:
        """The fallback: a session opened on the host after adoption, by nobody this manager knows
        (a manager killed mid-open, say), is closed when an open on its world model is refused."""
        config = world_config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                await lm.preload("world")
                m = lm.engine.models["world"]
                stray = "0123456789ab"
                reply = pool.session("cpu0", "open", "world", stray, int(m.lease_min), "bf16",
                                     str(lm.session_dir / stray))  # fmt: skip
                assert reply.ok
                sid, opened = await lm.open_session("world")
                assert sid != stray and opened["next_segment"] == 0
                assert set(pool.hosts["cpu0"].world.open_sessions) == {sid}
                await lm.close_session(sid)
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())

    def test_a_status_from_an_older_host_says_no_sessions(self) -> None:
        """A reattached host of an older release: its status lacks the fields added since (defaults)."""
        st = P.WorkerStatus("cpu0", "cpu", "n", 1, 0.0, {}, 0)
        assert getattr(st, "sessions", None) == () and getattr(st, "boot_id", None) == ""
