"""Found in the thirtieth session's own review of what was left: a device host abandoned every load or
promote after its fixed 15 minutes (`workers.host.LOAD_TIMEOUT_S`), whatever the config said the load
takes. A model whose config says `load_seconds.disk: 1200` (a large checkpoint on a slow disk; the
config accepts up to a day) could never be loaded: each try was cut at 900 s as a hang. Now each
model's spec carries a limit of `LOAD_TIMEOUT_FACTOR` times its configured disk load time where that
is longer, and a changed estimate (a reload of the config) does not reload the model.

The factory is real code in a module made here, gated so that it takes a chosen time; the checkpoint
is a real file.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from manager.config import load_config
from manager.workers_bridge import LOAD_TIMEOUT_FACTOR, model_specs
from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

KW = {"in_features": 4, "out_features": 2}
SLOW_S = 1.0


def _slow_linear(in_features: int = 4, out_features: int = 2) -> nn.Module:
    time.sleep(SLOW_S)  # a read from a slow disk: longer than the host's own limit below
    return nn.Linear(in_features, out_features)


@pytest.fixture
def slow_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mod = types.ModuleType("residency_review30_slow")
    mod.linear = _slow_linear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield f"{mod.__name__}:linear"
    for t in threading.enumerate():  # an abandoned build ends within SLOW_S
        if t.name.startswith("residency-") and t.name.endswith("-m"):
            t.join(10)


def _spec(tmp_path: Path, factory: str, load_timeout_s: float | None) -> P.ModelSpec:
    p = tmp_path / "m.safetensors"
    write_safetensors({"weight": torch.ones((2, 4)), "bias": torch.zeros(2)}, p)
    return P.ModelSpec(
        "m",
        "safetensors-module",
        {"factory": factory, "path": str(p), "kwargs": KW},
        load_timeout_s=load_timeout_s,
    )


def test_a_load_the_spec_allows_longer_is_not_abandoned(tmp_path: Path, slow_module: str) -> None:
    host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.3)
    r = host.apply(P.Load(_spec(tmp_path, slow_module, load_timeout_s=10.0)), "1")
    assert r.ok, r
    assert host.status().models["m"].tier == "gpu"


def test_without_it_the_hosts_limit_holds(tmp_path: Path, slow_module: str) -> None:
    host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.3)
    r = host.apply(P.Load(_spec(tmp_path, slow_module, load_timeout_s=None)), "1")
    assert not r.ok and r.error_code == P.LOAD_TIMEOUT and "0.3 s" in (r.error or "")


def test_a_shorter_spec_limit_does_not_cut_the_hosts(tmp_path: Path, slow_module: str) -> None:
    host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=10.0)
    assert host.apply(P.Load(_spec(tmp_path, slow_module, load_timeout_s=0.1)), "1").ok


def test_a_promote_the_spec_allows_longer_is_not_abandoned(tmp_path: Path, slow_module: str) -> None:
    host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.3)
    assert host.apply(P.Load(_spec(tmp_path, slow_module, load_timeout_s=10.0), "host"), "1").ok
    r = host.apply(P.Promote("m"), "2")
    assert r.ok, r
    assert host.status().models["m"].tier == "gpu"


def test_a_changed_limit_is_not_a_changed_spec(tmp_path: Path) -> None:
    """A reload whose only change is the load estimate must not reload the model's weights."""
    host = DeviceHost("cpu0", "cpu", node="t")
    spec = _spec(tmp_path, "torch.nn:Linear", load_timeout_s=100.0)
    assert host.apply(P.Load(spec), "1").ok
    again = host.apply(P.Load(replace(spec, load_timeout_s=5000.0)), "2")
    assert again.ok and again.noop


HOME = """
devices: [{name: gpu0, kind: cuda, memory: 24GiB, reserve: 1GiB}]
host: {memory: 32GiB}
classes:
  - {name: interactive}
models:
  - name: slow
    adapter: safetensors-module
    source: {factory: "torch.nn:Linear", path: /nonexistent/slow.safetensors}
    device: gpu0
    class: interactive
    memory: 20GiB
    load_seconds: {disk: 1200, host: 30}
  - name: quick
    adapter: safetensors-module
    source: {factory: "torch.nn:Linear", path: /nonexistent/quick.safetensors}
    device: gpu0
    class: interactive
    memory: 1GiB
    load_seconds: {disk: 2, host: 0.5}
"""


def test_the_manager_gives_each_model_a_limit_from_its_configured_disk_load(tmp_path: Path) -> None:
    (tmp_path / "home.yaml").write_text(HOME)
    specs = model_specs(load_config(tmp_path / "home.yaml"))
    assert specs["slow"].load_timeout_s == LOAD_TIMEOUT_FACTOR * 1200 > 900
    assert specs["quick"].load_timeout_s == LOAD_TIMEOUT_FACTOR * 2  # the host's 900 s is the floor
