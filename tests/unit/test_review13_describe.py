"""Found in review of `DeviceHost.describe` (thirteenth session); each failed before its fix.

A model's metadata (its declared inputs and outputs) is read by building its module on the meta
device, which runs its factory. The factories here are real (a module made here, over a real
checkpoint file) and wait on a `threading.Event` while their gate is closed (a build stuck on a lock,
a download from a dead server).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

from workers import protocol as P
from workers.adapters import AdapterError
from workers.host import DeviceHost
from workers.st_io import write_safetensors

MODULE = "residency_review13_describe"


class _Declared(nn.Module):
    residency_inputs = (("tokens", "INT64", (-1, 4)),)
    residency_outputs = (("logits", "FP32", (-1, 2)),)

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)


class _Gate:
    """A factory's switch: while closed, the factory waits; `calls` counts the factory's runs."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.calls = 0
        self.fail = False

    def build(self) -> nn.Module:
        self.calls += 1
        if self.fail:
            raise RuntimeError("its weights' server is down")
        self.entered.set()
        self.open.wait(30)
        return _Declared()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    mod = types.ModuleType(MODULE)
    mod.build = g.build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield g
    g.open.set()  # a thread still waiting in the factory ends
    for t in threading.enumerate():
        if t.name.startswith("residency-describe-"):
            t.join(30)


def _spec(tmp_path: Path, name: str = "m") -> P.ModelSpec:
    ck = tmp_path / f"{name}.safetensors"
    write_safetensors(_Declared().state_dict(), ck)
    return P.ModelSpec(name, "safetensors-module", {"factory": f"{MODULE}:build", "path": str(ck)})


def _describe_in_thread(host: DeviceHost, spec: P.ModelSpec, wait_s: float) -> list[object]:
    """[answer or exception], or [] when describe has not come back within `wait_s` (it goes on)."""
    got: list[object] = []

    def run() -> None:
        try:
            got.append(host.describe(spec))
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)
    return got


def _names(answer: object) -> tuple[list[str], list[str]]:
    assert isinstance(answer, tuple), answer
    ins, outs = answer
    return [t.name for t in ins], [t.name for t in outs]


class TestAHangingFactoryAndDescribe:
    """`describe` built the module with the caller's thread: a factory that never returns held that
    thread (one of a Ray host's 16 data threads) for good, and every later ModelMetadata-style call
    started another build that hung as well, until the host had no data thread left for inference."""

    def test_a_describe_that_hangs_fails_in_time_naming_the_model_and_the_limit(
        self, gate: _Gate, tmp_path: Path
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", describe_timeout_s=0.3)
        gate.open.clear()
        got = _describe_in_thread(host, _spec(tmp_path, "stuck"), wait_s=10)
        assert got, "describe never came back"
        e = got[0]
        assert isinstance(e, AdapterError) and e.code == P.LOAD_TIMEOUT, e
        assert "'stuck'" in e.message and "0.3 s" in e.message and "cpu0" in e.message

    def test_repeated_describes_of_a_hanging_model_start_one_build(self, gate: _Gate, tmp_path: Path) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", describe_timeout_s=0.3)
        gate.open.clear()
        spec = _spec(tmp_path, "stuck")
        answers = [_describe_in_thread(host, spec, wait_s=10) for _ in range(5)]
        assert all(a and isinstance(a[0], AdapterError) for a in answers), answers
        assert gate.calls == 1, f"{gate.calls} builds hang in the factory, one per call"
        assert "still running" in str(answers[-1][0])
        gate.open.set()  # the one build ends: its answer serves the next call
        for t in threading.enumerate():
            if t.name.startswith("residency-describe-"):
                t.join(30)
        assert _names(host.describe(spec)) == (["tokens"], ["logits"])
        assert gate.calls == 1

    def test_a_describe_while_one_of_the_same_spec_runs_waits_for_it(
        self, gate: _Gate, tmp_path: Path
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", describe_timeout_s=20)
        gate.open.clear()
        spec = _spec(tmp_path)
        first: list[object] = []
        t = threading.Thread(target=lambda: first.append(host.describe(spec)), daemon=True)
        t.start()
        assert gate.entered.wait(10)
        second: list[object] = []
        t2 = threading.Thread(target=lambda: second.append(host.describe(spec)), daemon=True)
        t2.start()
        gate.open.set()
        t.join(10)
        t2.join(10)
        assert first and second, (first, second)
        assert _names(first[0]) == _names(second[0]) == (["tokens"], ["logits"])
        assert gate.calls == 1


def test_a_successful_describe_is_kept_per_spec(gate: _Gate, tmp_path: Path) -> None:
    """Every call built the module again (the factory ran once per ModelMetadata call)."""
    host = DeviceHost("cpu0", "cpu", node="t")
    spec = _spec(tmp_path)
    assert _names(host.describe(spec)) == (["tokens"], ["logits"])
    assert _names(host.describe(spec)) == (["tokens"], ["logits"])
    assert gate.calls == 1
    other = P.ModelSpec(spec.name, "safetensors-module", {**spec.source, "kwargs": {}})
    assert _names(host.describe(other)) == (["tokens"], ["logits"])
    assert gate.calls == 2  # another spec under the same name is described on its own


def test_a_load_replaces_a_kept_answer(gate: _Gate, tmp_path: Path) -> None:
    """A factory that failed on the meta device is FACTORY_FAILED, naming why (review 19: it answered a
    guessed `input` and `output`, kept for good); the failure is not kept: once the model loads (its
    factory works now), its declared ones are the answer."""
    host = DeviceHost("cpu0", "cpu", node="t")
    spec = _spec(tmp_path)
    gate.fail = True
    with pytest.raises(AdapterError) as e:
        host.describe(spec)
    assert e.value.code == P.FACTORY_FAILED and "its weights' server is down" in e.value.message
    gate.fail = False
    assert host.apply(P.Load(spec), "1").ok
    assert _names(host.describe(spec)) == (["tokens"], ["logits"])


def test_an_unknown_adapter_is_still_a_clear_error(tmp_path: Path) -> None:
    host = DeviceHost("cpu0", "cpu", node="t")
    with pytest.raises(AdapterError) as e:
        host.describe(P.ModelSpec("x", "no-such-adapter", {}))
    assert e.value.code == P.UNKNOWN_ADAPTER and "'x'" in e.value.message


def test_the_ray_pools_describe_waits_past_the_hosts_own_limit() -> None:
    """It gave up at 30 s, before the host's limit (60 s): the caller got Ray's GetTimeoutError
    instead of the host's error saying the factory may hang."""
    import inspect

    from workers.host import DESCRIBE_TIMEOUT_S
    from workers.ray_pool import RayWorkerPool

    default = inspect.signature(RayWorkerPool.describe).parameters["timeout_s"].default
    assert default > DESCRIBE_TIMEOUT_S
