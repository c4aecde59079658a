"""Review 18d of the live manager (`manager/live.py`); each test failed before its fix.

(1) A load the device host had not confirmed yet counted as loaded once its estimated time had
passed: a higher-class request's room-making evicted it. Its Drop follows the load on the host, but
when that load is then abandoned (LOAD_TIMEOUT, still running there) the room had been booked for
the other model already, which was loaded beside the hung load: the device held more than the
books. A load or promote now counts as loading (not evictable) until its host answers for it.
(2) A pin whose store write failed was written again only at the reconciler's next save (a minute
later): a stop before that lost it across the restart. The stop now writes it (bounded).
(3) The requests waiting for room were answered at a stop only at their next poll; they are now
woken at once (UNAVAILABLE), and the task that polls for them is cancelled.
(4) A pass over the requests waiting for room admitted one whose deadline had passed (its own timer
not yet run): its model was loaded, evicting others for it, for a request that failed at once. A
request past its deadline (or its class's max_wait) is now woken to fail, never admitted.

Real tiny models (safetensors checkpoints) on in-process device hosts, a real SQLite store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from live_helpers import Gate, gated_module, run, until
from test_review18_live import MLP_BYTES, WIDTH, X4, MiB, X, _tier

import manager.live as live_mod
from manager.config import Config, load_config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store import open_store
from manager.workers_bridge import create_pool
from workers.demo import write_tiny_mlp
from workers.st_io import write_safetensors

MODULE = "residency_review18d_live"


# ---- (1) an unconfirmed load is not evicted ----------------------------------------------------
@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    yield from gated_module(monkeypatch, MODULE)


def _classed_config(tmp_path: Path, keep_alive: str = "30m") -> Config:
    """One CPU device with room (896 MiB usable) for one of `stuck` (interactive; its factory hangs
    while the gate is closed) and `other` (realtime: it may evict
    `stuck`), 600 MiB each as the books estimate them; the policy's keep-alive `keep_alive`."""
    lines = [
        "devices:\n  - {name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}\n",
        "host: {memory: 4GiB, reserve: 1GiB}\n",
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n",
        "policy: {name: lru-keepalive, default_keep_alive: KEEP}\nmodels:\n",
    ]
    for name, cls, factory in (
        ("stuck", "interactive", f"{MODULE}:linear"),
        ("other", "realtime", "torch.nn:Linear"),
    ):
        path = tmp_path / f"{name}.safetensors"
        write_safetensors({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, path)
        lines.append(
            f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0,"
            " memory: 600MiB, prewarm: false, load_seconds: {disk: 0.05, host: 0.01},\n"
            f"     source: {{factory: '{factory}', path: '{path}',"
            " kwargs: {in_features: 4, out_features: 2}}}\n"
        )
    (tmp_path / "c.yaml").write_text("".join(lines).replace("KEEP", keep_alive))
    return load_config(tmp_path / "c.yaml")


def test_an_unconfirmed_load_past_its_estimate_is_not_evicted(gate: Gate, tmp_path: Path) -> None:
    config = _classed_config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 1.5})
        host = pool.hosts["cpu0"]
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            dev = lm.engine.state.devices["cpu0"]
            # its client gives up, past the load's estimate (0.05 s): the load is still on its way
            with pytest.raises(DeadlineExceeded, match="did not finish loading"):
                await lm.infer("stuck", X4, timeout_s=0.3)
            assert lm.live["stuck"].loads_pending == 1 and _tier(lm, "stuck") == Tier.GPU
            # a realtime request may evict an idle interactive model, not one still loading: its
            # room is the hung load's (abandoned at 1.5 s, still running on its host after that)
            with pytest.raises(DeadlineExceeded, match="no room became free"):
                await lm.infer("other", X4, timeout_s=3.0)
            assert "other" not in host.status().models, "other was loaded beside the hung load"
            assert set(host.abandoned()) == {"stuck"}
            assert _tier(lm, "stuck") == Tier.GPU and dev.used >= 600 * MiB  # held: its room booked

            gate.open.set()  # the abandoned load ends: its room comes free
            await until(lambda: not host.abandoned(), "the abandoned load ended")
            assert (await lm.infer("other", X4, timeout_s=30)).result.ok
            assert dev.used <= dev.usable
        finally:
            gate.open.set()
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_confirmed_load_is_evictable_again(gate: Gate, tmp_path: Path) -> None:
    """Once its host confirms the load, the model is an ordinary resident (not left 'loading' for
    good): it is unloaded when its keep-alive runs out."""
    config = _classed_config(tmp_path, keep_alive="1s")
    gate.open.set()

    async def body(lm: LiveManager) -> None:
        assert (await lm.infer("stuck", X4, timeout_s=30)).result.ok
        assert lm.engine.models["stuck"].ready_at <= lm.clock()
        await until(lambda: _tier(lm, "stuck") == Tier.DISK, "stuck unloaded at its keep-alive's end")

    run(config, body)


# ---- (2) a pin whose write failed is written at the stop -------------------------------------------
def _three_models(tmp_path: Path, holds: float = 1.5) -> Config:
    """Tiny MLPs on a CPU device with room for `holds` of them (1.5: one): `x` (realtime), `lo`
    (background: may not evict) and `hi` (interactive)."""
    path = write_tiny_mlp(tmp_path / "mlp.safetensors", WIDTH)
    src = f"source: {{factory: 'workers.demo:tiny_mlp', path: '{path}', kwargs: {{width: {WIDTH}}}}}"
    models = "".join(
        f"  - {{name: {name}, class: {cls}, adapter: safetensors-module, device: cpu0, "
        f"memory: {MLP_BYTES}, load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false, {src}}}\n"
        for name, cls in (("x", "realtime"), ("lo", "background"), ("hi", "interactive"))
    )
    (tmp_path / "c.yaml").write_text(
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {int(MLP_BYTES * holds) + MiB}, reserve: {MiB}}}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n  - {name: background, may_evict: false}\n"
        f"models:\n{models}policy: {{name: lru-keepalive}}\n"
    )
    return load_config(tmp_path / "c.yaml")


class _FlakyStore:
    """The real SQLite store; its "pins" writes fail while `down`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_doc(self, key: str, doc: Any) -> None:
        if key == "pins" and self.down:
            raise ConnectionError("store unreachable (test)")
        self.inner.put_doc(key, doc)


def test_a_pin_whose_write_failed_is_saved_at_the_stop(tmp_path: Path) -> None:
    config = _three_models(tmp_path, holds=3.5)
    inner = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store = _FlakyStore(inner)

    async def body(lm: LiveManager) -> None:
        await until(lambda: lm._next_save > 0, "the reconciler's first save step")
        store.down = True
        lm.set_pin("hi", True)
        await until(
            lambda: lm._pins_dirty and lm._pins_write is not None and lm._pins_write.done(),
            "the write failed",
        )
        store.down = False  # the store answers again, before the reconciler's next save (a minute)

    try:
        run(config, body, store=store)
        assert inner.get_doc("pins") == {"hi": True}, "the admin's pin was lost at the stop"
    finally:
        inner.close()


# ---- (3) and (4): requests waiting for room ------------------------------------------------------
def test_a_request_waiting_for_room_is_answered_at_once_at_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 60.0)  # no poll comes before the test's end
    config = _three_models(tmp_path)

    async def body(lm: LiveManager) -> None:
        await lm.preload("x")
        request = asyncio.create_task(lm.infer("lo", X, timeout_s=50))
        await until(lambda: len(lm._room_waits) == 1, "lo waits for room")
        lm.abandon_waits()
        with pytest.raises(WorkerUnavailable, match="stopping"):
            await asyncio.wait_for(request, 10)
        task = lm._room_task
        await lm.stop()
        assert task is None or task.done(), "the task that polls the waiting requests outlived the stop"

    run(config, body)


def test_a_pass_does_not_admit_a_request_past_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_mod, "WAIT_RETRY_S", 60.0)  # its own timer has not run yet
    config = _three_models(tmp_path)
    ahead = [0.0]

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, clock=lambda: time.time() + ahead[0])
        await lm.start()
        try:
            await lm.preload("x")
            request = asyncio.create_task(lm.infer("lo", X, timeout_s=20))
            await until(lambda: len(lm._room_waits) == 1, "lo waits for room")
            ahead[0] = 25.0  # its deadline has passed (its timer, on the loop's own clock, not yet)
            lm.evict("x")  # room comes free...
            lm._room_pass()  # ...and a pass comes before the request's timer
            assert _tier(lm, "lo") == Tier.DISK, "lo was loaded for a request past its deadline"
            with pytest.raises(DeadlineExceeded, match="no room became free before the deadline"):
                await asyncio.wait_for(request, 10)
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())
