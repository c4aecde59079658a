"""Review 18, the live manager (`manager/live.py`); each test failed before its fix.

(1) A LOAD_TIMEOUT answer (the device host abandoned a load that still runs there) that came after
an admin evicted the loading model found the model on disk on the books and held nothing: the room
the hung load still fills was free on the books, and another model was loaded into it. The room is
now booked and held again when that answer comes (as without the evict), until the host's status no
longer lists the abandoned load.
(2) A request put back to wait for room after its admission (its model taken off its device under
its load) waited until its deadline; like a first admission, it is now refused at its class's
`max_wait`, counted from its arrival.
(3) `set_pin` wrote the "pins" document to the store on the event loop (a store that hangs held
every request); the write is now made on a thread, in the order of the calls, and a failed write is
logged and made again once the store answers.
(4) Requests waiting for room were served in whatever order their polls came: a request of a higher
class could wait while a lower-class one that came earlier took the room. Room that comes free now
goes to the waiting requests in class order (highest first), within a class in arrival order.
(5) An admin's evict of a model whose load (or promote) was still on its way took it off the books
at once, while its device host's load still filled the room (until the host answered: up to its
load timeout), so another model could be booked into it. The evict now waits for that load's
result (the call answers at once; an `evict_deferred` event says so), then goes as usual.
(6) `set_pin`, with the pins saved in the store still unread (the store was down at start), read
them on the event loop; it now reads them on a thread before its write, merging as before: the
admin's new pin wins for its model, the saved pins hold for the others.

Real tiny models (safetensors checkpoints) on in-process device hosts, a real SQLite store.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import Gate, gated_module, run, until
from test_review14_abandoned import MODULE
from test_review14_abandoned import _config as _stuck_config

import manager.live as live_mod
from manager.config import Config, load_config
from manager.errors import DeadlineExceeded, InsufficientCapacity, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store import open_store
from manager.workers_bridge import create_pool
from workers.demo import write_tiny_mlp

MiB = 1 << 20
WIDTH = 64
MLP_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
X = {"input": np.ones((1, WIDTH), dtype=np.float32)}


def _tier(lm: LiveManager, name: str) -> Tier:
    """Where the books have `name` now."""
    tier: Tier = lm.engine.models[name].tier
    return tier


# ---- (1) a LOAD_TIMEOUT after an admin's evict ----------------------------------------------------
X4 = {"input": np.ones((1, 4), np.float32)}


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    yield from gated_module(monkeypatch, MODULE)


def test_a_load_timeout_after_an_admin_evict_keeps_the_room_held(gate: Gate, tmp_path: Path) -> None:
    config = _stuck_config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 1.5})
        host = pool.hosts["cpu0"]
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            dev = lm.engine.state.devices["cpu0"]
            # the client gives up before the host abandons the load: nobody waits for it now
            with pytest.raises(DeadlineExceeded, match="did not finish loading"):
                await lm.infer("stuck", X4, timeout_s=0.2)
            assert lm.live["stuck"].loads_pending == 1 and _tier(lm, "stuck") == Tier.GPU
            lm.evict("stuck")  # the admin's evict, while the load is on its way
            await until(lambda: lm.live["stuck"].loads_pending == 0, "the load's result came")
            assert set(host.abandoned()) == {"stuck"}, "the load should still run on its host"
            # its room stays held: the other model is not loaded into it
            assert dev.used >= 600 * MiB, "the hung load's bytes count free on the books"
            with pytest.raises(DeadlineExceeded, match="abandoned load"):
                await lm.infer("other", X4, timeout_s=1.0)
            assert "other" not in host.status().models
            with pytest.raises(WorkerUnavailable, match="still running"):
                await lm.infer("stuck", X4, timeout_s=5)

            gate.open.set()  # the abandoned load ends: the room comes back, the evict holds
            await until(lambda: not host.abandoned(), "the abandoned load ended")
            assert (await lm.infer("other", X4, timeout_s=30)).result.ok
            assert _tier(lm, "stuck") == Tier.DISK and "stuck" not in host.status().models
            assert gate.calls == 1
        finally:
            gate.open.set()
            await lm.stop()
            pool.close()

    asyncio.run(main())


# ---- (2) and (4): requests waiting for room --------------------------------------------------------
def _two_models(tmp_path: Path, *, load_s: float = 0.0, max_wait: str = "") -> Config:
    """Two tiny MLPs on a CPU device that holds one of them: `a` (background, its build takes
    `load_s`) and `c` (interactive). The background class may not evict, waiting `max_wait` at most."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    models = ""
    for name, cls in (("a", "background"), ("c", "interactive")):
        models += (
            f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, "
            f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false, "
            f"source: {{factory: 'workers.demo:slow_mlp', path: '{path}', "
            f"kwargs: {{width: {WIDTH}, load_s: {load_s if name == 'a' else 0.0}, infer_s: 0.0}}}}}}\n"
        )
    wait = f", max_wait: {max_wait}" if max_wait else ""
    (tmp_path / "c.yaml").write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * 1.5) + MiB}, reserve: {MiB}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        f"classes:\n  - {{name: interactive}}\n  - {{name: background, may_evict: false{wait}}}\n"
        f"models:\n{models}policy: {{name: lru-keepalive}}\n"
    )
    return load_config(tmp_path / "c.yaml")


def test_a_request_admitted_again_is_refused_at_its_classs_max_wait(tmp_path: Path) -> None:
    config = _two_models(tmp_path, load_s=0.5, max_wait="1s")

    async def body(lm: LiveManager) -> None:
        a = lm.engine.models["a"]
        request = asyncio.create_task(lm.infer("a", X, timeout_s=8))
        await until(lambda: a.tier == Tier.GPU, "a admitted, its load begun")
        lm._off_books(a, "test: the device host no longer holds it")
        await lm.preload("c")  # c takes the room; a background request may not evict it
        with pytest.raises(InsufficientCapacity, match=r"no room within its class's max_wait \(1.0 s\)"):
            await asyncio.wait_for(request, 15)
        assert lm.engine.models["c"].tier == Tier.GPU
        assert lm.rejected == 1

    run(config, body)


def _three_models(tmp_path: Path, holds: float = 1.5) -> Config:
    """Tiny MLPs on a CPU device with room for `holds` of them (1.5: one): `x` (realtime) fills it,
    `lo`, `lo2` (background: may not evict) and `hi` (interactive: may not evict `x`) wait for room."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    src = f"source: {{factory: 'workers.demo:tiny_mlp', path: '{path}', kwargs: {{width: {WIDTH}}}}}"
    models = "".join(
        f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, "
        f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false, {src}}}\n"
        for name, cls in (
            ("x", "realtime"),
            ("lo", "background"),
            ("lo2", "background"),
            ("hi", "interactive"),
        )
    )
    (tmp_path / "c.yaml").write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * holds) + MiB}, reserve: {MiB}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        f"models:\n{models}policy: {{name: lru-keepalive}}\n"
    )
    return load_config(tmp_path / "c.yaml")


async def _room_after_the_poll_of(lm: LiveManager, name: str) -> None:
    """Evict `x` (the room) right after the next admission attempt for `name` (out of the pass that
    made it: the event loop runs this once that pass is over)."""
    polled = asyncio.Event()
    real = lm.engine.admit

    def admit(m: Any, rank: int, now: float) -> Any:
        out = real(m, rank, now)
        if m.name == name:
            polled.set()
        return out

    lm.engine.admit = admit  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(polled.wait(), 10)
    finally:
        lm.engine.admit = real  # type: ignore[method-assign]
    lm.evict("x")


def test_room_goes_to_the_higher_class_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background request for `lo` waits first, an interactive one for `hi` later (neither may evict
    `x`, of a higher class). Once `x` is evicted, `hi` is served; `lo`, which came earlier, waits."""
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 0.5)  # polls far apart: who polls next is known
    config = _three_models(tmp_path)

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        lo = asyncio.create_task(lm.infer("lo", X, timeout_s=4))
        await until(lambda: lm.queued.get("background") == 1, "lo waits for room")
        await asyncio.sleep(0.25)  # (half a poll apart)
        hi = asyncio.create_task(lm.infer("hi", X, timeout_s=10))
        await until(lambda: lm.queued.get("interactive") == 1, "hi waits for room")
        await _room_after_the_poll_of(lm, "hi")  # hi just asked: lo would ask next
        served = await asyncio.wait_for(hi, 10)
        assert served.result.ok
        assert not lo.done(), "the background request was served before the interactive one"
        assert lm.engine.models["hi"].tier == Tier.GPU and lm.engine.models["lo"].tier == Tier.DISK
        with pytest.raises(DeadlineExceeded, match="no room became free before the deadline"):
            await lo  # (hi stays; the background class may not evict)

    run(config, body)


def test_room_goes_to_the_earlier_request_of_a_class_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 0.5)
    config = _three_models(tmp_path)

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        first = asyncio.create_task(lm.infer("lo", X, timeout_s=10))
        await until(lambda: lm.queued.get("background") == 1, "lo waits for room")
        await asyncio.sleep(0.25)
        second = asyncio.create_task(lm.infer("lo2", X, timeout_s=3))
        await until(lambda: lm.queued.get("background") == 2, "lo2 waits for room")
        await _room_after_the_poll_of(lm, "lo")  # lo just asked: lo2 would ask next
        assert (await asyncio.wait_for(first, 10)).result.ok
        assert not second.done()
        with pytest.raises(DeadlineExceeded):
            await second
        assert lm.engine.models["lo2"].tier == Tier.DISK

    run(config, body)


# ---- (3) set_pin's store write -----------------------------------------------------------------
class _Store:
    """The real SQLite store; its "pins" writes are recorded (the thread each ran on, the document),
    the first one slow; while `down`, they fail."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes: list[tuple[int, dict[str, Any]]] = []
        self.down = False
        self.slow_first = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_doc(self, key: str, doc: Any) -> None:
        if key == "pins":
            if self.down:
                raise ConnectionError("store unreachable (test)")
            if not self.writes and self.slow_first:
                threading.Event().wait(self.slow_first)
            self.writes.append((threading.get_ident(), dict(doc)))
        self.inner.put_doc(key, doc)


def test_set_pin_writes_the_store_off_the_event_loop_in_order(tmp_path: Path) -> None:
    config = _three_models(tmp_path, holds=4.5)  # room for every pin
    store = _Store(open_store(f"sqlite:///{tmp_path / 'state.db'}"))
    store.slow_first = 0.3  # a slow first write must not land after the later ones

    async def body(lm: LiveManager) -> None:
        loop_thread = threading.get_ident()
        lm.set_pin("hi", True)
        assert lm.engine.models["hi"].pinned  # at once
        lm.set_pin("hi", False)
        lm.set_pin("lo", True)
        lm.set_pin("hi", True)
        assert lm.pin_overrides == {"hi": True, "lo": True}
        await until(lambda: len(store.writes) == 4, "the four pin writes")
        assert all(t != loop_thread for t, _ in store.writes), "a store write ran on the event loop"
        assert [d for _, d in store.writes] == [
            {"hi": True},
            {},
            {"lo": True},
            {"hi": True, "lo": True},
        ]
        assert store.inner.get_doc("pins") == {"hi": True, "lo": True}

    try:
        run(config, body, store=store)
    finally:
        store.inner.close()


def test_a_failed_pin_write_is_logged_and_made_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _three_models(tmp_path, holds=4.5)  # room for every pin
    store = _Store(open_store(f"sqlite:///{tmp_path / 'state.db'}"))

    async def body(lm: LiveManager) -> None:
        # (the reconciler's first save step, at start, over: one still under way would set the next
        # save a minute on after the test brings it forward below)
        await until(lambda: lm._next_save > 0, "the reconciler's first save step")
        store.down = True
        with caplog.at_level(logging.WARNING, logger="manager.live"):
            lm.set_pin("hi", True)
            assert lm.engine.models["hi"].pinned
            await until(lambda: "store unreachable (test)" in caplog.text, "the failure logged")
        said = [r.getMessage() for r in caplog.records if "store unreachable (test)" in r.getMessage()]
        assert len(said) == 1 and "'hi'" in said[0] and "not saved" in said[0]
        store.down = False
        lm._next_save = 0.0  # the reconciler's next save step (once a minute) comes now
        await until(
            lambda: store.inner.get_doc("pins") == {"hi": True}, "the pin saved once the store answers"
        )

    try:
        run(config, body, store=store)
    finally:
        store.inner.close()


# ---- (5) an admin's evict of a model whose load is still on its way ------------------------------
def test_an_admin_evict_during_a_load_keeps_the_room_until_the_load_ends(gate: Gate, tmp_path: Path) -> None:
    """The evict took the loading model off the books at once, while its device host's load still
    filled the room (until the host answered: up to its load timeout): another model was booked into
    it. The evict now waits for the load's result, then goes as usual."""
    config = _stuck_config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        host = pool.hosts["cpu0"]
        lm = LiveManager(config, pool)
        events = lm.subscribe()
        await lm.start()
        try:
            dev = lm.engine.state.devices["cpu0"]
            with pytest.raises(DeadlineExceeded, match="did not finish loading"):
                await lm.infer("stuck", X4, timeout_s=0.2)  # nobody waits for the load now
            assert lm.live["stuck"].loads_pending == 1
            lm.evict("stuck")
            # between the evict and the load's result, the room is not free on the books
            assert _tier(lm, "stuck") == Tier.GPU, "the evict freed the room the load still fills"
            assert dev.used >= 600 * MiB
            with pytest.raises(DeadlineExceeded, match="no room became free"):
                await lm.infer("other", X4, timeout_s=1.0)
            assert _tier(lm, "other") == Tier.DISK and "other" not in host.status().models

            gate.open.set()  # the load ends (it worked): the evict goes now
            await until(lambda: _tier(lm, "stuck") == Tier.DISK, "stuck evicted once its load ended")
            await until(lambda: "stuck" not in host.status().models, "stuck dropped on its host")
            assert lm.live["stuck"].evict_to is None
            assert (await lm.infer("other", X4, timeout_s=30)).result.ok
            assert _tier(lm, "stuck") == Tier.DISK
        finally:
            gate.open.set()
            await lm.stop()
            pool.close()
        said = []
        while not events.empty():
            e = events.get_nowait()
            if e["kind"] == "evict_deferred" and e["model"] == "stuck":
                said.append(e["detail"])
        assert len(said) == 1 and "load" in said[0], said

    asyncio.run(main())


def test_an_admin_evict_during_a_promote_waits_for_it(gate: Gate, tmp_path: Path) -> None:
    """The same for a promote from host RAM (its build hangs as a load's does): to host RAM once
    the promote ends, its room on the device held until then."""
    config = _stuck_config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        host = pool.hosts["cpu0"]
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            dev = lm.engine.state.devices["cpu0"]
            gate.open.set()  # (a read into host RAM builds the module on meta to check the file)
            await lm.preload("stuck", "host")
            await until(lambda: lm.live["stuck"].tier == "host", "stuck in host RAM")
            gate.open.clear()
            with pytest.raises(DeadlineExceeded, match="did not finish loading"):
                await lm.infer("stuck", X4, timeout_s=0.2)  # its promote hangs
            assert lm.live["stuck"].loads_pending == 1
            lm.evict("stuck", "host")
            assert _tier(lm, "stuck") == Tier.GPU and dev.used >= 600 * MiB
            gate.open.set()
            await until(lambda: _tier(lm, "stuck") == Tier.HOST, "stuck demoted once its promote ended")
            await until(lambda: lm.live["stuck"].tier == "host", "the demote confirmed")
            assert host.status().models["stuck"].tier == "host"
            assert (await lm.infer("other", X4, timeout_s=30)).result.ok
        finally:
            gate.open.set()
            await lm.stop()
            pool.close()

    asyncio.run(main())


# ---- (6) set_pin reads the saved pins off the event loop ------------------------------------------
class _DownStore:
    """The real SQLite store; every call fails while `down` (an outage at start); the threads its
    reads of the "pins" document ran on are recorded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = True
        self.pin_reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            if self.down:
                raise ConnectionError("store down (test)")
            return attr(*a, **k)

        return call

    def get_doc(self, key: str) -> Any:
        if self.down:
            raise ConnectionError("store down (test)")
        if key == "pins":
            self.pin_reads.append(threading.get_ident())
        return self.inner.get_doc(key)


def test_set_pin_reads_the_saved_pins_off_the_event_loop(tmp_path: Path) -> None:
    """The store was down at start: the saved pins are unread. The next admin pins read them on a
    thread, then merge: the admin's new word for its model wins, the saved pins hold for the others."""
    config = _three_models(tmp_path, holds=4.5)  # room for every pin
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    inner.put_doc("pins", {"hi": True, "lo": True})  # saved by the run before
    store = _DownStore(inner)

    async def body(lm: LiveManager) -> None:
        loop_thread = threading.get_ident()
        await until(lambda: lm._next_save > 0, "the reconciler's first save step (the store down)")
        assert lm._pins_unread and not lm.engine.models["lo"].pinned
        store.down = False
        lm.set_pin("hi", False)  # the admin's word for hi: over the saved pin
        lm.set_pin("lo2", True)
        assert not lm.engine.models["hi"].pinned and lm.engine.models["lo2"].pinned  # at once
        await until(lambda: lm.engine.models["lo"].pinned, "the saved pin of lo read and applied")
        await until(lambda: inner.get_doc("pins") == {"lo": True, "lo2": True}, "the merged pins saved")
        assert store.pin_reads, "the saved pins were not read"
        assert all(t != loop_thread for t in store.pin_reads), "the pins were read on the event loop"
        assert not lm.engine.models["hi"].pinned and lm.engine.models["lo2"].pinned
        assert lm.pin_overrides == {"lo": True, "lo2": True} and not lm._pins_unread

    try:
        run(config, body, store=store)
        assert inner.get_doc("pins") == {"lo": True, "lo2": True}
    finally:
        inner.close()
