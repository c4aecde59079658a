"""Review 17: what a device host says about memory after a drop of a host-tier model, and after a load
that failed half-way.

* On a CUDA device a model in the host tier holds pinned host memory, no device memory. Its drop
  waited for its bytes to come back on the device (which never held them): every such drop held the
  device's commands for the whole release wait (`release_timeout_s`, 2 s) and said its memory was not
  released. It counts no device bytes now: released at once.
* A load that failed half-way (its module built, its warmup raising) kept what it had built alive
  after its failed result was returned, until a garbage collection ran (a reference cycle through the
  failure's traceback), and on CUDA the caching allocator kept the freed blocks. What it built goes
  with its failed result now, and the device's cache is handed back (`MemoryProbe.release`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.adapters import Adapter, HostCopy
from workers.host import DeviceHost
from workers.measure import Phases


class _Probe:
    """A device whose memory in use never changes (pinned host memory is not on it)."""

    def __init__(self) -> None:
        self.releases = 0

    def used(self) -> int:
        return 1 << 30

    def free_total(self) -> tuple[int | None, int | None]:
        return 1 << 30, 2 << 30

    def release(self) -> None:
        self.releases += 1


class _Built:
    """What a materialize built (weakly referenced: the test sees when it goes)."""


BUILT: list[weakref.ref[_Built]] = []


class _Fake(Adapter):
    name = "fake"

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("x", "FP32", (-1,))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("y", "FP32", (-1,))]

    def read(self, ph: Phases) -> HostCopy:
        return HostCopy({"w": torch.zeros(1 << 20)})  # 4 MiB

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        built = _Built()
        BUILT.append(weakref.ref(built))
        return built

    def warmup(self, runnable: Any) -> None:
        if self.spec.source.get("warmup") == "fails":
            raise RuntimeError("warmup failed")

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy({"w": torch.zeros(1 << 20)})

    def runnable_bytes(self, runnable: Any) -> int:
        return 4 << 20

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"]}


@pytest.fixture
def cuda_host(monkeypatch: pytest.MonkeyPatch) -> tuple[DeviceHost, _Probe]:
    """A device host of kind cuda (CUDA said available), on a fake probe and a fake adapter."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    probe = _Probe()
    host = DeviceHost("gpu0", "cuda", node="test", probe=probe, adapter_factory=_Fake, release_timeout_s=0.05)
    return host, probe


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No garbage collection meanwhile: what survives only through a reference cycle is seen."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_dropping_a_host_tier_model_on_cuda_does_not_wait_for_device_memory(
    cuda_host: tuple[DeviceHost, _Probe],
) -> None:
    host, _ = cuda_host
    loaded = host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1")
    assert loaded.ok, loaded.error
    assert loaded.footprint.host_bytes == 4 << 20 and loaded.footprint.device_bytes == 0
    dropped = host.apply(P.Drop("m"), "2")
    assert dropped.ok and dropped.transition == "host->disk"
    assert dropped.memory_released is True  # it held no device memory: nothing to wait for


def test_dropping_a_gpu_tier_model_on_cuda_still_waits_for_its_memory(
    cuda_host: tuple[DeviceHost, _Probe],
) -> None:
    host, _ = cuda_host
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1").ok
    dropped = host.apply(P.Drop("m"), "2")
    assert dropped.ok and dropped.transition == "gpu->disk"
    assert dropped.memory_released is False  # (the fake device never gives its bytes back)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_a_load_failed_half_way_lets_go_of_what_it_built(
    cuda_host: tuple[DeviceHost, _Probe], no_gc: None, kind: str
) -> None:
    host, probe = cuda_host
    if kind == "cpu":
        probe = _Probe()
        host = DeviceHost("cpu0", "cpu", node="test", probe=probe, adapter_factory=_Fake)
    BUILT.clear()
    r = host.apply(P.Load(P.ModelSpec("m", "fake", {"warmup": "fails"})), "1")
    assert not r.ok and r.error_code == P.INTERNAL and "warmup failed" in (r.error or "")
    assert r.to_tier == "disk" and host.status().models == {}
    assert len(BUILT) == 1 and BUILT[0]() is None  # gone with the failed result, no collection needed
    assert probe.releases >= 1  # the device's cached memory handed back
