"""Found in review (2026-12) of the live manager's resync (`manager.live`, `_resync_once`): a device
host that holds a model in a higher tier than the books say (on the GPU or in host RAM while the books
have it on disk). One class per gap; each test failed before its fix. Real models on in-process device
hosts (no Ray, no sockets); the faults are injected around the in-process pool."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from live_helpers import lru_config, run_with_pinned_voice
from live_helpers import until as _until
from test_review_resync import _books, _held

from manager import live
from manager.config import Config, load_config
from manager.live import LiveManager
from workers import protocol as P

UNREACHABLE = "device host 'cpu0' failed: ActorUnavailableError: the actor is temporarily unavailable"


class _FaultyPool:
    """Fault injector (unit tests only) around the in-process pool, whose device host stays up:
    `refuse_drops[model] = n`: the next n Drops of that model fail and the host keeps it (the result
    says so: ok=False, in the tier it holds it, as a host whose drop raised); `lie_about`: the next
    result of that (op, model) says worker_died although the host ran the command (it was unreachable
    when its result was fetched); `unreachable`: the next such command never reaches the host and its
    result says worker_died; `status_down`: a status read fails (counted in `status_refused`)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.refuse_drops: dict[str, int] = {}
        self.lie_about: set[tuple[str, str]] = set()
        self.unreachable: set[tuple[str, str]] = set()
        self.refused = 0
        self.status_down = False
        self.status_refused = 0
        self._fake: list[P.CommandResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        op = op_id or uuid.uuid4().hex
        name, kind = P.command_model(cmd), P.command_op(cmd)
        if kind == "drop" and self.refuse_drops.get(name, 0) > 0:
            self.refuse_drops[name] -= 1
            self.refused += 1
            ms = self.real.status(device).models.get(name)
            tier = "disk" if ms is None else ms.tier
            why = f"model {name!r}: drop failed: RuntimeError('a session close failed')"
            self._fake.append(
                P.CommandResult(
                    op, name, "drop", False, tier, tier, error_code=P.INTERNAL, error=why, device=device
                )
            )
            return op
        if (kind, name) in self.unreachable:
            self.unreachable.discard((kind, name))
            self._fake.append(
                P.CommandResult(
                    op, name, kind, False, error_code=P.WORKER_DIED, error=UNREACHABLE, device=device
                )
            )
            return op
        submitted: str = self.real.submit(device, cmd, op)
        return submitted

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus:
        if self.status_down:
            self.status_refused += 1
            raise ConnectionError(f"device {device!r}: no answer within {timeout_s} s")
        st: P.WorkerStatus = self.real.status(device, timeout_s)
        return st

    def poll(self) -> list[P.CommandResult]:
        out, self._fake = self._fake, []
        for r in self.real.poll():
            if (r.op, r.model) in self.lie_about:
                self.lie_about.discard((r.op, r.model))
                r = P.CommandResult(
                    r.op_id,
                    r.model,
                    r.op,
                    False,
                    error_code=P.WORKER_DIED,
                    error=UNREACHABLE,
                    device=r.device,
                )
            out.append(r)
        return out


def _run(config: Config, body: Callable[[LiveManager, _FaultyPool], Awaitable[None]]) -> list[dict[str, Any]]:
    return run_with_pinned_voice(config, _FaultyPool, body)


async def _agree(lm: LiveManager, pool: _FaultyPool, resident: dict[str, str]) -> None:
    """The books and the host both hold `resident`, with no command on its way and no resync under
    way, within every budget."""

    def settled() -> bool:
        quiet = not lm._ops and all(t.done() for t in lm._resyncing.values())
        return quiet and _books(lm) == resident and _held(pool) == resident

    await _until(settled, f"the books and the host: {resident}")
    dev, host = lm.engine.state.devices["cpu0"], lm.engine.host
    assert dev.used == sum(lm.engine.models[n].gpu_bytes for n, t in resident.items() if t == "gpu")
    assert host.used == sum(lm.engine.models[n].weights for n, t in resident.items() if t == "host")
    assert dev.used <= dev.usable and host.used <= host.usable
    assert lm.engine.counters.budget_violations == 0
    for name, tier in resident.items():
        assert lm.live[name].tier == tier
        assert lm.live[name].ready.is_set() == (tier == "gpu")


WORLD2 = """  - {name: world2, class: realtime, adapter: worldpager-mg2, device: cpu0, memory: 52366336,
     elastic: {min: 64MiB, max: 1GiB}, load_seconds: {disk: 0.13, host: 0.05}, source: {preset: tiny}}
"""


def _small_config(tmp_path: Path) -> Config:
    """lru_config with a second world model, world2 (of a higher class than world's: it may evict it
    before world served a request), on a device with room for the pinned voice and one of world and
    world2 (each 50 MiB and a 64 MiB lease), not both."""
    lru_config(tmp_path)
    text = (tmp_path / "lru.yaml").read_text()
    small = text.replace("memory: 4GiB, reserve: 512MiB", "memory: 256MiB, reserve: 64MiB")
    small = small.replace("policy: {name: lru-keepalive}", WORLD2 + "policy: {name: lru-keepalive}")
    assert small.count("world2") == 1 and "256MiB" in small
    (tmp_path / "small.yaml").write_text(small)
    return load_config(tmp_path / "small.yaml")


class TestAHostThatHoldsAModelTheBooksHaveOnDisk:
    """A device host held a model the books had on disk: its load's result said worker_died although
    the host had finished it (the host was unreachable for a moment), and the Drop that followed never
    reached it; or the host refused a Drop twice (a session's close failed, say). The resync after such
    a result only took off the books what the host no longer held, never what it held beyond them: the
    books counted room on the device (or in host RAM) that the host's model really took, so the next
    load the engine planned there could overrun the device (an out-of-memory on a GPU). Now a resync
    puts such a model on the books when it fits them (as adoption does at start), and drops it on the
    host when it does not; a Drop the host refused twice is followed by a resync."""

    def test_a_load_whose_result_said_worker_died_is_adopted(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def body(lm: LiveManager, pool: _FaultyPool) -> None:
            pool.lie_about.add(("load", "world"))
            pool.unreachable.add(("drop", "world"))
            await lm.preload("world", "host")  # the host loads it; the manager hears worker_died
            await _until(lambda: not pool.lie_about and not pool.unreachable, "both faults")
            await _agree(lm, pool, {"voice": "gpu", "world": "host"})
            await lm.preload("world")  # promoted from host RAM, as booked
            await _agree(lm, pool, {"voice": "gpu", "world": "gpu"})

        with caplog.at_level("INFO", logger="manager.live"):
            events = _run(lru_config(tmp_path), body)
        adopted = [e for e in events if e["kind"] == "adopted"]
        assert [e["model"] for e in adopted] == ["world"], events
        assert "worker_died" in adopted[0]["detail"] and "host" in adopted[0]["detail"]
        assert "device cpu0: the device host holds world" in caplog.text

    def test_a_drop_refused_twice_is_adopted_when_it_fits(self, tmp_path: Path) -> None:
        async def body(lm: LiveManager, pool: _FaultyPool) -> None:
            await lm.preload("world")
            await _agree(lm, pool, {"voice": "gpu", "world": "gpu"})
            pool.refuse_drops["world"] = 2
            lm.evict("world")  # the host refuses the drop, and its retry
            await _until(lambda: pool.refused == 2, "both drops refused")
            await _agree(lm, pool, {"voice": "gpu", "world": "gpu"})  # on the books again
            loads = pool.real.hosts["cpu0"].ops_done
            await lm.preload("world")
            assert pool.real.hosts["cpu0"].ops_done == loads  # booked there: no load

        events = _run(lru_config(tmp_path), body)
        assert "world" in [e["model"] for e in events if e["kind"] == "adopted"]

    def test_a_drop_refused_twice_is_dropped_again_when_it_does_not_fit(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """world's room went to world2: the host, still holding world, would overrun the device."""

        async def body(lm: LiveManager, pool: _FaultyPool) -> None:
            await lm.preload("world")
            await _agree(lm, pool, {"voice": "gpu", "world": "gpu"})
            pool.refuse_drops["world"] = 2
            await lm.preload("world2")  # evicts world: the host refuses its drop, and its retry
            await _until(lambda: pool.refused == 2, "both drops refused")
            await _agree(lm, pool, {"voice": "gpu", "world2": "gpu"})

        with caplog.at_level("INFO", logger="manager.live"):
            events = _run(_small_config(tmp_path), body)
        dropped = [e for e in events if e["kind"] == "held_dropped"]
        assert [e["model"] for e in dropped] == ["world"], events
        assert "does not fit the books" in caplog.text

    def test_a_drop_the_host_refuses_after_a_resync_is_not_retried_for_ever(self, tmp_path: Path) -> None:
        """The resync's own Drop refused too: said, not a loop of drops and resyncs."""

        async def body(lm: LiveManager, pool: _FaultyPool) -> None:
            await lm.preload("world")
            await _agree(lm, pool, {"voice": "gpu", "world": "gpu"})
            pool.refuse_drops["world"] = 3
            await lm.preload("world2")
            await _until(lambda: pool.refused == 3 and not lm._ops, "three drops refused")
            for _ in range(20):  # some turns of the reconciler: no fourth drop
                await asyncio.sleep(0.01)
            assert pool.refused == 3 and not lm._ops
            assert _books(lm) == {"voice": "gpu", "world2": "gpu"}

        _run(_small_config(tmp_path), body)


class TestAResyncThatCouldNotReadTheHostsStatusIsTriedAgain:
    """A resync whose device host did not report its status (unreachable for longer than its tries)
    gave up for good: a host that answered again under the same boot id, holding a model the books had
    on disk (its load's result had said worker_died, its Drop had never reached it), sent no result
    that called for another resync, so the books never learned of it. Now the reconciler resyncs such
    a device again, every RESYNC_LATER_S, until its host reports its status (a light check: no status
    read while every resync has read one)."""

    def test_the_host_answers_again_and_its_model_is_adopted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(live, "RESYNC_TRIES", 2)
        monkeypatch.setattr(live, "RESYNC_RETRY_S", 0.01)
        monkeypatch.setattr(live, "RESYNC_LATER_S", 0.2, raising=False)  # (added with the fix)

        async def body(lm: LiveManager, pool: _FaultyPool) -> None:
            pool.status_down = True
            pool.lie_about.add(("load", "world"))
            pool.unreachable.add(("drop", "world"))
            await lm.preload("world", "host")

            def gave_up() -> bool:
                faults = not pool.lie_about and not pool.unreachable
                return faults and pool.status_refused >= 4 and all(t.done() for t in lm._resyncing.values())

            await _until(gave_up, "both resyncs gave up")
            assert _books(lm) == {"voice": "gpu"} and _held(pool.real) == {"voice": "gpu", "world": "host"}
            pool.status_down = False  # it answers again: no command's result says so
            await _agree(lm, pool, {"voice": "gpu", "world": "host"})

        events = _run(lru_config(tmp_path), body)
        assert "world" in [e["model"] for e in events if e["kind"] == "adopted"]
