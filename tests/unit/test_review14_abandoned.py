"""Found in review of a load abandoned while its thread still runs (fourteenth session); each failed
before its fix.

A load past its host's `load_timeout_s` fails (LOAD_TIMEOUT) but its thread cannot be killed: what it
allocated (device memory on a GPU) stays allocated until it ends. The manager's books evicted the
model and counted its bytes free, so another model was placed into memory the hung load may still
be filling (on a real GPU: an out-of-memory for that other model).

The models are real (`safetensors-module` over real checkpoint files); the hung model's factory waits
on a `threading.Event` (a build stuck on a lock, a read from a dead server), standing beside the real
factories. The hosts, the pool and the manager are the real ones. Each host's status lists its
abandoned loads (`WorkerStatus.abandoned`, from `DeviceHost.abandoned()`): where the host does not
fill it in yet, the `abandoned_in_status` fixture wraps its real `status()` to do so.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from manager.api.admin import model_status
from manager.config import Config, load_config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.workers_bridge import create_pool
from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

MODULE = "residency_review14_abandoned"
MiB = 1 << 20
X = {"input": np.ones((1, 4), np.float32)}


class _Gate:
    """The hung model's factory: while `open` is clear it waits (`entered` says it started)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def linear(self, in_features: int = 4, out_features: int = 2) -> nn.Module:
        self.calls += 1
        self.entered.set()
        self.open.wait(60)
        return nn.Linear(in_features, out_features)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    mod = types.ModuleType(MODULE)
    mod.linear = g.linear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, mod)
    yield g
    g.open.set()  # a thread still waiting in the factory ends
    for t in threading.enumerate():
        if t.name.startswith(("residency-load-", "residency-promote-")):
            t.join(30)


@pytest.fixture
def abandoned_in_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's real status, with its abandoned loads listed (what `DeviceHost.status` says once it
    fills in `WorkerStatus.abandoned` itself: then this changes nothing)."""
    real = DeviceHost.status

    def status(self: DeviceHost) -> P.WorkerStatus:
        return replace(real(self), abandoned=self.abandoned())

    monkeypatch.setattr(DeviceHost, "status", status)


def _checkpoint(tmp_path: Path, name: str) -> Path:
    p = tmp_path / f"{name}.safetensors"
    write_safetensors({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, p)
    return p


def _config(tmp_path: Path) -> Config:
    """One CPU device with room (896 MiB usable) for `stuck` (its factory hangs while the gate is
    closed) or `other`, not both (600 MiB each, as the books estimate them)."""
    lines = [
        "devices:\n  - {name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}\n",
        "host: {memory: 4GiB, reserve: 1GiB}\nclasses:\n  - {name: interactive}\n",
        "policy: {name: lru-keepalive}\nmodels:\n",
    ]
    for name, factory in (("stuck", f"{MODULE}:linear"), ("other", "torch.nn:Linear")):
        lines.append(
            f"  - {{name: {name}, class: interactive, adapter: safetensors-module, device: cpu0,"
            " memory: 600MiB, prewarm: false, load_seconds: {disk: 0.05, host: 0.01},\n"
            f"     source: {{factory: '{factory}', path: '{_checkpoint(tmp_path, name)}',"
            " kwargs: {in_features: 4, out_features: 2}}}\n"
        )
    (tmp_path / "c.yaml").write_text("".join(lines))
    return load_config(tmp_path / "c.yaml")


async def _until(cond: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


class TestTheRoomOfAnAbandonedLoadStaysHeld:
    def test_another_model_is_not_placed_into_it_until_the_abandoned_load_ends(
        self, gate: _Gate, abandoned_in_status: None, tmp_path: Path
    ) -> None:
        config = _config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 0.5})
            host = pool.hosts["cpu0"]
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                with pytest.raises(WorkerUnavailable) as first:
                    await lm.infer("stuck", X, timeout_s=30)
                assert "did not finish within 0.5 s" in str(first.value)
                assert "still running" in str(first.value)
                assert set(host.abandoned()) == {"stuck"}

                # the hung load's room is not given to another model: it waits for room, and is
                # refused at its deadline naming what holds it
                with pytest.raises(DeadlineExceeded) as other:
                    await lm.infer("other", X, timeout_s=1.0)
                assert "stuck" in str(other.value) and "abandoned load" in str(other.value)
                assert "other" not in host.status().models
                dev = lm.engine.state.devices["cpu0"]
                assert dev.used >= 600 * MiB, "the hung load's bytes count free on the books"

                # a resync reads the host's status, which still lists it: still held
                await lm._resync_once("cpu0", "test")
                assert lm.engine.models["other"].tier == Tier.DISK
                assert dev.used >= 600 * MiB

                # the model itself reads as not resident, and its requests are refused at once,
                # naming the load still running (no second build beside the hung one)
                assert not lm.serving("stuck")
                shown = model_status(lm, "stuck")
                assert shown.tier == "loading" and "did not finish within 0.5 s" in shown.last_error
                with pytest.raises(WorkerUnavailable, match="still running"):
                    await lm.preload("stuck")
                with pytest.raises(WorkerUnavailable, match="still running"):
                    await lm.infer("stuck", X, timeout_s=30)
                assert gate.calls == 1

                gate.open.set()  # the abandoned load ends: its room comes back
                await _until(lambda: not host.abandoned(), "the abandoned load ended")
                served = await lm.infer("other", X, timeout_s=30)
                assert served.result.ok
                assert "other" in host.status().models
                assert lm.engine.models["stuck"].tier == Tier.DISK
                # and the model itself loads again (the other, idle now, makes room for it)
                assert (await lm.infer("stuck", X, timeout_s=30)).result.ok
                assert gate.calls == 2
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())

    def test_a_host_whose_status_does_not_list_it_gives_the_room_back(
        self, gate: _Gate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A status that does not list the abandoned load (it ended, the host restarted, or an older
        host that does not say) ends the hold at the next resync: the books are not held for good."""
        real = DeviceHost.status
        # an older host's status: the real one without its abandoned loads
        monkeypatch.setattr(DeviceHost, "status", lambda self: replace(real(self), abandoned={}))
        config = _config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 0.5})
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                with pytest.raises(WorkerUnavailable):
                    await lm.infer("stuck", X, timeout_s=30)
                assert lm.engine.state.devices["cpu0"].used >= 600 * MiB
                await lm._resync_once("cpu0", "test")
                assert lm.engine.models["stuck"].tier == Tier.DISK
                assert lm.engine.state.devices["cpu0"].used == 0
            finally:
                gate.open.set()
                await lm.stop()
                pool.close()

        asyncio.run(main())


class TestWorkerStatusAbandoned:
    def test_a_status_pickled_by_an_older_host_reads_with_none_abandoned(self) -> None:
        """Over Ray a status is pickled: one from a host without the field lacks it in its state, and
        a `default_factory` field has no class attribute to fall back on (AttributeError)."""
        new = P.WorkerStatus("cpu0", "cpu", "n", 1, 0.0, {}, 0, abandoned={"m": ("load", 3.0)})
        assert pickle.loads(pickle.dumps(new)).abandoned == {"m": ("load", 3.0)}
        old = object.__new__(P.WorkerStatus)
        state = {k: v for k, v in new.__dict__.items() if k != "abandoned"}
        object.__setattr__(old, "__dict__", state)
        back = pickle.loads(pickle.dumps(old))
        assert back.abandoned == {} and back.device == "cpu0"
        assert P.WorkerStatus("cpu0", "cpu", "n", 1, 0.0, {}, 0).abandoned == {}


def test_a_restarted_manager_holds_the_room_of_a_load_an_earlier_run_abandoned(
    gate: _Gate, tmp_path: Path
) -> None:
    """A manager that starts on device hosts still running an abandoned load of an earlier run (the
    manager restarted, the Ray actors lived on) learnt of it only at that device's next resync, or at
    the host's refusal of a load: meanwhile another model could be placed into its room. Its start
    (`adopt`) now holds that room at once, from the hosts' statuses."""
    config = _config(tmp_path)

    async def main() -> None:
        pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 0.5})
        host = pool.hosts["cpu0"]
        first = LiveManager(config, pool)
        await first.start()
        try:
            with pytest.raises(WorkerUnavailable):
                await first.infer("stuck", X, timeout_s=30)
        finally:
            await first.stop()
        assert set(host.abandoned()) == {"stuck"}  # still running on the host
        again = LiveManager(config, pool)
        await again.start()
        try:
            assert again.engine.state.devices["cpu0"].used >= 600 * MiB
            assert not again.serving("stuck")
            with pytest.raises(WorkerUnavailable, match="still running"):
                await again.infer("stuck", X, timeout_s=30)
        finally:
            gate.open.set()
            await again.stop()
            pool.close()

    asyncio.run(main())
