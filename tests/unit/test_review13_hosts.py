"""Found in review of the device hosts and worker pools (thirteenth session); each failed before its fix.

The models are real (`safetensors-module` over real checkpoint files, factories in a module made
here); the Ray handle in the batcher test is a fake (unit tests never start Ray; the real one is
driven in tests/integration).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost
from workers.ray_pool import _Batcher, _Deaths
from workers.reconcile import plan
from workers.st_io import write_safetensors

KW = {"in_features": 4, "out_features": 2}


class _Gate:
    """A factory's switch: while closed, the factory waits (a build stuck on a lock, a download)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()

    def linear(self, in_features: int = 4, out_features: int = 2) -> nn.Module:
        self.entered.set()
        self.open.wait(30)
        return nn.Linear(in_features, out_features)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    mod = types.ModuleType("residency_review13_hosts")
    mod.linear = g.linear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield g
    g.open.set()  # a thread still waiting in the factory ends


def _checkpoint(tmp_path: Path, name: str = "lin", scale: float = 1.0) -> Path:
    p = tmp_path / f"{name}.safetensors"
    write_safetensors({"weight": torch.full((2, 4), scale), "bias": torch.zeros(2)}, p)
    return p


def _spec(name: str, path: Path, factory: str = "torch.nn:Linear") -> P.ModelSpec:
    return P.ModelSpec(name, "safetensors-module", {"factory": factory, "path": str(path), "kwargs": KW})


def _apply_in_thread(host: DeviceHost, cmd: P.Command, op_id: str, wait_s: float) -> P.CommandResult | None:
    """The command's result, or None when it has not come back within `wait_s` (it goes on)."""
    got: list[P.CommandResult] = []
    t = threading.Thread(target=lambda: got.append(host.apply(cmd, op_id)), daemon=True)
    t.start()
    t.join(wait_s)
    return got[0] if got else None


def _join_abandoned(model: str) -> None:
    for t in threading.enumerate():
        if t.name.startswith("residency-") and t.name.endswith(f"-{model}"):
            t.join(30)


class TestAHangingFactory:
    """A factory that never returns (a build waiting on a lock, a download from a dead server) held the
    host's command lock for good: the command never came back, and no later command on that device
    (another model's load, a drop to free memory) ever ran."""

    def test_a_load_that_hangs_fails_in_time_and_the_device_takes_commands_again(
        self, gate: _Gate, tmp_path: Path
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.5)
        gate.open.clear()
        stuck = _spec("stuck", _checkpoint(tmp_path), "residency_review13_hosts:linear")
        r = _apply_in_thread(host, P.Load(stuck), "1", wait_s=10)
        assert r is not None, "the load never came back"
        assert not r.ok and r.error_code == P.LOAD_TIMEOUT and r.transition == "disk->disk"
        assert "'stuck'" in (r.error or "") and "0.5 s" in (r.error or "")
        other = _apply_in_thread(host, P.Load(_spec("other", _checkpoint(tmp_path, "o"))), "2", wait_s=10)
        assert other is not None and other.ok, other
        gate.open.set()  # the abandoned build ends now: what it made is thrown away
        _join_abandoned("stuck")
        assert {n: m.tier for n, m in host.status().models.items()} == {"other": "gpu"}
        assert host.infer("stuck", {"input": np.ones((1, 4), np.float32)}).error_code == P.BAD_TRANSITION

    def test_a_promote_that_hangs_leaves_the_model_in_the_host_tier(
        self, gate: _Gate, tmp_path: Path
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.5)
        spec = _spec("m", _checkpoint(tmp_path), "residency_review13_hosts:linear")
        assert host.apply(P.Load(spec, "host"), "1").ok  # a host-tier load does not build the module
        before = host.status().models["m"]
        gate.open.clear()
        r = _apply_in_thread(host, P.Promote("m"), "2", wait_s=10)
        assert r is not None, "the promote never came back"
        assert not r.ok and r.error_code == P.LOAD_TIMEOUT and r.transition == "host->host"
        gate.open.set()
        _join_abandoned("m")  # its late end must not put the model on the gpu behind the manager's back
        after = host.status().models["m"]
        assert (after.tier, after.host_bytes) == ("host", before.host_bytes)
        assert host.models["m"].runnable is None and host.models["m"].host is not None
        assert host.apply(P.Promote("m"), "3").ok  # the host copy is still there to promote


def test_a_promote_over_the_budget_keeps_the_host_copy_it_had(tmp_path: Path, monkeypatch: Any) -> None:
    """A module whose build adds a large computed buffer (not in the checkpoint) is too large for its
    budget on the device: it went back to the host tier as a copy of the built module, buffer and all,
    so host RAM held 100 times what the model held there before the promote."""
    mod = types.ModuleType("residency_review13_buffer")

    class WithTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.register_buffer("table", torch.zeros(1_000_000))  # 4 MB, computed at build

    mod.WithTable = WithTable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ck = tmp_path / "t.safetensors"
    write_safetensors({f"lin.{k}": v for k, v in nn.Linear(4, 2).state_dict().items()}, ck)
    spec = P.ModelSpec(
        "t",
        "safetensors-module",
        {"factory": f"{mod.__name__}:WithTable", "path": str(ck)},
        budget_bytes=100_000,
    )
    host = DeviceHost("cpu0", "cpu", node="t")
    assert host.apply(P.Load(spec, "host"), "1").ok
    before = host.status().models["t"]
    r = host.apply(P.Promote("t"), "2")
    assert not r.ok and r.error_code == P.TOO_LARGE and r.transition == "host->host"
    after = host.status().models["t"]
    assert (after.tier, after.tensor_bytes, after.host_bytes) == (
        "host",
        before.tensor_bytes,
        before.host_bytes,
    )
    assert host.models["t"].host is not None and host.models["t"].host.nbytes == before.host_bytes


def test_the_batcher_does_not_send_requests_their_callers_gave_up_on() -> None:
    """Requests queued behind a slow host that timed out (the caller got its answer and went) were
    still sent and run later, ahead of every newer request: a burst of timeouts became minutes of
    work for no one."""
    ran: list[str] = []

    class _Remote:
        def __init__(self, fn: Any) -> None:
            self.remote = fn

    class _Handle:
        """Fake actor handle (unit tests only; the real one is Ray's): no data channel, and an
        `infer_many` that waits for `gate`."""

        def __init__(self) -> None:
            self.gate = asyncio.Event()
            self.infer_many = _Remote(self._many)
            self.channel = _Remote(self._channel)

        def _channel(self) -> Any:
            f: cf.Future[None] = cf.Future()
            f.set_result(None)
            return types.SimpleNamespace(future=lambda: f)

        async def _run(self, items: list[tuple[str, Any]]) -> list[P.InferResult]:
            await self.gate.wait()
            ran.extend(m for m, _ in items)
            return [P.InferResult(m, True) for m, _ in items]

        def _many(self, items: list[tuple[str, Any]]) -> Any:
            return self._run(items)

    async def main() -> None:
        handle = _Handle()
        b = _Batcher(handle, "gpu0", _Deaths())

        async def request(model: str, timeout: float) -> P.InferResult | None:
            try:
                return await asyncio.wait_for(b.submit(model, {}), timeout)
            except TimeoutError:
                return None

        gave_up = await asyncio.gather(*(request("old", 0.2) for _ in range(6)))
        assert gave_up == [None] * 6
        handle.gate.set()
        fresh = await request("fresh", 10)
        await asyncio.gather(*list(b._tasks))
        assert fresh is not None and fresh.ok
        # two of the six were already in flight (two batches of a model at most) when their callers went
        assert ran == ["old", "old", "fresh"]

    asyncio.run(main())


def test_reconcile_replaces_a_model_held_with_another_spec(tmp_path: Path) -> None:
    """The README: a model a host holds with another source than the config's is dropped there, not
    adopted. `plan` compared tiers only, so it planned nothing and the old weights kept serving."""
    host = DeviceHost("cpu0", "cpu", node="t")
    old = _spec("m", _checkpoint(tmp_path, "one", 1.0))
    new = replace(old, source={**old.source, "path": str(_checkpoint(tmp_path, "two", 5.0))})
    assert host.apply(P.Load(old), "1").ok
    cmds = plan({"m": "gpu"}, {"m": new}, host.status())
    assert cmds == [P.Load(new, "gpu")]
    for i, cmd in enumerate(cmds):
        assert host.apply(cmd, f"r{i}").ok
    assert host.status().models["m"].spec == new
    assert plan({"m": "gpu"}, {"m": new}, host.status()) == []  # converged: nothing more to do
    out = host.infer("m", {"input": np.ones((1, 4), np.float32)})
    assert P.output_array(out.outputs["output"]).tolist() == [[20.0, 20.0]]
