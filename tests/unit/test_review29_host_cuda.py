"""Found in the 29th review (the worker layer), CUDA-only paths of `workers.host` checked on the CPU
with review 18's fake device probe and fake adapter (fakes, named so; none of them is a GPU):

a. A CUDA load from disk read its checkpoint into pinned host memory and let it go, but never handed
   torch's pinned host cache back (a promote does): about the checkpoint's size stayed page-locked in
   the device host's process, off the host-RAM books, until a later drop or demote. Only that cache
   is handed back (`release_host`): a whole release would wait for the device's other streams.
b. A CUDA model's `device_bytes` was only what the device's memory in use grew by during its load:
   memory freed meanwhile (another process on a home GPU, a world session's cache emptied on another
   thread) booked it smaller than its own tensors, and the manager then over-committed the GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_review18_host_cuda import MIB, TENSOR_BYTES, FakeAdapter, FakeDeviceProbe, _host

from workers import protocol as P
from workers.measure import Phases


class HostReleasingProbe(FakeDeviceProbe):
    """Review 18's fake CUDA probe with `release_host` (CudaProbe's pinned-host-cache release alone),
    counted, with whether the fake adapter's last host copy was still alive at each."""

    def __init__(self) -> None:
        super().__init__()
        self.host_releases: list[bool] = []

    def release_host(self) -> None:
        self.host_releases.append(self.host_copy is not None and self.host_copy() is not None)


def test_a_cuda_load_from_disk_hands_its_pinned_read_buffer_back(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = HostReleasingProbe()
    host = _host(monkeypatch, probe)
    loaded = host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1")
    assert loaded.ok and loaded.transition == "disk->gpu", loaded.error
    assert probe.host_releases == [False]  # once, after the buffer it was read into went
    assert probe.releases == 0  # not a whole release: no wait for the device's other streams


def test_a_cuda_load_to_host_ram_keeps_its_copy_and_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = HostReleasingProbe()
    host = _host(monkeypatch, probe)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1").ok
    assert probe.releases == 0 and probe.host_releases == []  # its pinned copy is the host tier itself


def test_a_cpu_load_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = HostReleasingProbe()
    host = _host(monkeypatch, probe, kind="cpu")
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1").ok
    assert probe.releases == 0 and probe.host_releases == []


class _FreesMeanwhile(FakeAdapter):
    """The fake adapter, while something else on the (fake) GPU frees 3 MiB during its build."""

    def materialize(self, host: Any, ph: Phases) -> Any:
        runnable = super().materialize(host, ph)
        self.probe.in_use -= 3 * MIB
        return runnable


def test_device_bytes_are_never_below_the_models_own_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeDeviceProbe()
    probe.runtime_loaded = True  # (no one-off runtime memory: the growth is the tensors' alone)
    host = _host(monkeypatch, probe)
    host.adapter_factory = lambda spec, device: _adapter(_FreesMeanwhile(spec, device), probe)
    loaded = host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1")
    assert loaded.ok, loaded.error
    assert loaded.footprint.tensor_bytes == TENSOR_BYTES
    assert loaded.footprint.device_bytes == TENSOR_BYTES  # the growth was 1 MiB of its 4
    assert host.status().models["m"].device_bytes == TENSOR_BYTES  # (what a resync books)


def _adapter(adapter: FakeAdapter, probe: FakeDeviceProbe) -> FakeAdapter:
    adapter.probe = probe
    return adapter
