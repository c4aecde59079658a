"""Review 18e of the live manager (`manager/live.py`, `manager/metrics.py`); each test failed before
its fix.

(1) A model whose load failed (its checkpoint missing) was not logged at all: the failure showed only
in `ps`, the events and the failures metric. Each failed load or promote is now logged at WARNING
(model, device, error code, reason), once per cause: the same model failing again for the same reason
is not logged again until the reason changes, a load of it succeeded in between, or FAIL_LOG_EVERY_S
passed (then with how many times it failed since).
(2) `residency_loads_total` counted a load when it was sent, so a model that never loaded showed as
many loads as failures. A load is now counted when its device host confirms it.
(3) A request whose model's load failed was counted `rejected` (Stats and the requests metric), the
word for what admission refuses (no room, queue full); it is now an `error`. Such a request never
reached its device host: the request log (served requests only, the replay's input) has no row for it.

Real tiny models (safetensors checkpoints) on in-process device hosts, a real SQLite store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from live_helpers import Gate, gated_module, until

import manager.live as live_mod
from manager.config import Config, load_config
from manager.errors import InsufficientCapacity, WorkerUnavailable
from manager.live import LiveManager
from manager.store import open_store
from manager.workers_bridge import create_pool
from workers.st_io import write_safetensors

X4 = {"input": np.ones((1, 4), np.float32)}
GATED = "residency_review18e_live"


def _config(tmp_path: Path, device_mib: int = 1024, ok_factory: str = "torch.nn:Linear") -> Config:
    """One CPU device; `gone` (interactive) whose checkpoint is not written, and `ok` (interactive),
    tiny Linear modules of 300 MiB each as the books estimate them."""
    lines = [
        f"devices:\n  - {{name: cpu0, kind: cpu, memory: {device_mib}MiB, reserve: 64MiB}}\n",
        "host: {memory: 4GiB, reserve: 1GiB}\n",
        "classes:\n  - {name: realtime}\n  - {name: interactive, max_wait: 0.2s}\n",
        "policy: {name: lru-keepalive}\nmodels:\n",
    ]
    for name in ("gone", "ok"):
        path = tmp_path / f"{name}.safetensors"
        factory = ok_factory if name == "ok" else "torch.nn:Linear"
        if name == "ok":
            _write(path)
        lines.append(
            f"  - {{name: {name}, class: interactive, adapter: safetensors-module, device: cpu0,"
            " memory: 300MiB, prewarm: false, load_seconds: {disk: 0.05, host: 0.01},\n"
            f"     source: {{factory: '{factory}', path: '{path}',"
            " kwargs: {in_features: 4, out_features: 2}}}\n"
        )
    (tmp_path / "c.yaml").write_text("".join(lines))
    return load_config(tmp_path / "c.yaml")


def _write(path: Path) -> None:
    write_safetensors({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, path)


class _Clock:
    """Wall time plus an offset a test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def _run(
    config: Config,
    body: Callable[[LiveManager, _Clock], Awaitable[None]],
    store: object = None,
) -> None:
    async def main() -> None:
        clock = _Clock()
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=clock)
        await lm.start()
        try:
            await body(lm, clock)
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def _failure_lines(caplog: pytest.LogCaptureFixture, model: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "manager.live" and r.levelno == logging.WARNING
        and r.getMessage().startswith(f"model '{model}': its ") and " failed" in r.getMessage()
    ]  # fmt: skip


async def _fails(lm: LiveManager, model: str = "gone") -> None:
    with pytest.raises(WorkerUnavailable, match="could not be loaded"):
        await lm.infer(model, X4, timeout_s=10)


# ---- (1) failed loads are logged, once per cause ------------------------------------------------
def test_a_failed_load_is_logged_once_per_cause(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = _config(tmp_path)
    caplog.set_level(logging.INFO, logger="manager.live")

    async def body(lm: LiveManager, clock: _Clock) -> None:
        await _fails(lm)
        lines = _failure_lines(caplog, "gone")
        assert len(lines) == 1, lines
        line = lines[0]
        assert "cpu0" in line and "missing_checkpoint" in line and "no such file" in line, line
        assert str(tmp_path / "gone.safetensors") in line

        for _ in range(3):  # a client retrying: the same cause, not logged again
            await _fails(lm)
        assert len(_failure_lines(caplog, "gone")) == 1

        (tmp_path / "gone.safetensors").write_bytes(b"not a safetensors file")  # another cause
        await _fails(lm)
        lines = _failure_lines(caplog, "gone")
        assert len(lines) == 2 and "bad_checkpoint" in lines[1], lines

        _write(tmp_path / "gone.safetensors")  # fixed: it loads
        assert (await lm.infer("gone", X4, timeout_s=10)).result.ok
        lm.evict("gone")
        await asyncio.sleep(0.2)
        (tmp_path / "gone.safetensors").write_bytes(b"not a safetensors file")  # broken again
        await _fails(lm)
        lines = _failure_lines(caplog, "gone")
        assert len(lines) == 3 and lines[2] == lines[1], lines  # the same cause, after a success: said again

    _run(config, body)


def test_a_load_that_keeps_failing_is_logged_again_with_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    caplog.set_level(logging.INFO, logger="manager.live")

    async def body(lm: LiveManager, clock: _Clock) -> None:
        await _fails(lm)
        for _ in range(4):
            await _fails(lm)
        assert len(_failure_lines(caplog, "gone")) == 1
        clock.offset += live_mod.FAIL_LOG_EVERY_S + 1
        await _fails(lm)
        lines = _failure_lines(caplog, "gone")
        assert len(lines) == 2, lines
        assert "missing_checkpoint" in lines[1] and "5 more times" in lines[1], lines[1]

    _run(config, body)


# ---- (2) loads_total counts confirmed loads -----------------------------------------------------
def test_loads_total_counts_only_loads_their_host_confirmed(tmp_path: Path) -> None:
    config = _config(tmp_path)

    async def body(lm: LiveManager, clock: _Clock) -> None:
        reg = lm.metrics.registry
        for _ in range(3):
            await _fails(lm)
        gone = {"model": "gone", "tier": "gpu", "source": "disk"}
        assert reg.get_sample_value("residency_loads_total", gone) is None
        failures = {"model": "gone", "code": "missing_checkpoint"}
        assert reg.get_sample_value("residency_load_failures_total", failures) == 3
        assert (await lm.infer("ok", X4, timeout_s=10)).result.ok
        # (from disk, or from the OS page cache as the books price it: review 31)
        ok = [
            reg.get_sample_value("residency_loads_total", {"model": "ok", "tier": "gpu", "source": s})
            for s in ("disk", "cached")
        ]
        assert sorted(ok, key=str) == [1, None]

    _run(config, body)


def test_loads_total_help_says_confirmed(tmp_path: Path) -> None:
    config = _config(tmp_path)
    lm = LiveManager(config, create_pool(config, in_process=True))
    try:
        (metric,) = [m for m in lm.metrics.registry.collect() if m.name == "residency_loads"]
        assert "confirmed" in metric.documentation
    finally:
        lm.pool.close()


# ---- (3) a load failure's request is an error, not rejected -------------------------------------
def test_a_request_whose_load_failed_is_an_error_not_rejected(tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

    async def body(lm: LiveManager, clock: _Clock) -> None:
        reg = lm.metrics.registry
        t0 = lm.clock()
        await _fails(lm)
        await _fails(lm)
        labels = {"model": "gone", "cls": "interactive"}
        assert reg.get_sample_value("residency_requests_total", {**labels, "outcome": "error"}) == 2
        assert reg.get_sample_value("residency_requests_total", {**labels, "outcome": "rejected"}) is None
        assert lm.rejected == 0 and lm.failed == 2 and lm.served == 0
        assert (await lm.infer("ok", X4, timeout_s=10)).result.ok
        await lm.flush_log()
        rows = list(store.requests(t0 - 1))
        # the two that never ran are demand in the log, `unserved` (review 31); the one that ran, ok
        assert [(r["model"], r.get("outcome")) for r in rows] == [("gone", "unserved")] * 2 + [("ok", "ok")]

    try:
        _run(config, body, store=store)
    finally:
        store.close()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    yield from gated_module(monkeypatch, GATED)


def test_a_request_admission_refuses_is_still_rejected(gate: Gate, tmp_path: Path) -> None:
    """Room for one of the two models, held by `ok`'s load still on its way (not evictable): a
    request for `gone` finds no room within its class's max_wait, refused by admission before any
    load of it: `rejected`, as before."""
    config = _config(tmp_path, device_mib=560, ok_factory=f"{GATED}:linear")

    async def body(lm: LiveManager, clock: _Clock) -> None:
        first = asyncio.create_task(lm.infer("ok", X4, timeout_s=30))
        await until(lambda: lm.live["ok"].loads_pending == 1, "ok's load on its way")
        with pytest.raises(InsufficientCapacity, match="no room within its class's max_wait"):
            await lm.infer("gone", X4, timeout_s=5)
        gate.open.set()
        assert (await first).result.ok
        labels = {"model": "gone", "cls": "interactive", "outcome": "rejected"}
        assert lm.metrics.registry.get_sample_value("residency_requests_total", labels) == 1
        assert lm.rejected == 1 and lm.failed == 0

    _run(config, body)
