"""Review 18, GPU readiness of the device host: CUDA-only paths of `workers.host`, checked on the CPU
with a fake device probe and a fake adapter (each named so; none of them is a GPU).

a. A demote waited for its model's `device_bytes` to come back. On a first CUDA load that figure (the
   device's memory in use after the load less before) also counts one-off runtime memory (cuBLAS
   workspaces, lazily loaded kernels) that no demote gives back: the demote waited the whole release
   wait and said memory_released=False. It now waits for at most its tensors' bytes.
b. A CUDA device host whose index is past the GPUs its process sees failed every command INTERNAL
   ("invalid device ordinal", a traceback in the log) and its `status()` raised. Now its commands are
   NOT_AVAILABLE naming the device, the index, how many GPUs are visible and CUDA_VISIBLE_DEVICES, and
   its status says no free/total memory (logged once, not at every status read).
c. A promote on CUDA freed the pinned host copy but never handed torch's pinned host cache back: it
   stayed page-locked in the process until a later drop or demote. It is handed back now.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.adapters import Adapter, HostCopy
from workers.host import DeviceHost
from workers.measure import Phases

MIB = 1 << 20
TENSOR_BYTES = 4 * MIB
"""The fake model's weights."""
RUNTIME_BYTES = 64 * MIB
"""What the fake CUDA runtime takes once, at the first model built on the device (never given back)."""


class FakeDeviceProbe:
    """A fake of a CUDA device's memory probe: memory in use as the fake adapter moves it; counts its
    releases (and says, at each, whether the fake adapter's last host copy was still alive)."""

    def __init__(self, *, fail_release: bool = False) -> None:
        self.in_use = 1 << 30
        self.releases = 0
        self.host_copy_alive_at_release: list[bool] = []
        self.host_copy: weakref.ref[torch.Tensor] | None = None
        self.fail_release = fail_release
        self.reads = 0
        self.runtime_loaded = False
        """The fake CUDA runtime's one-off memory taken (at the first model built on it)."""

    def used(self) -> int:
        self.reads += 1
        return self.in_use

    def free_total(self) -> tuple[int | None, int | None]:
        self.reads += 1
        return (80 << 30) - self.in_use, 80 << 30

    def release(self) -> None:
        self.releases += 1
        self.host_copy_alive_at_release.append(self.host_copy is not None and self.host_copy() is not None)
        if self.fail_release:
            raise RuntimeError("CUDA error: fake release failure")


class FakeOrdinalProbe(FakeDeviceProbe):
    """A fake of a CUDA probe on an index past the visible GPUs: every read fails as CUDA's would."""

    def used(self) -> int:
        self.reads += 1
        raise RuntimeError("CUDA error: invalid device ordinal")

    def free_total(self) -> tuple[int | None, int | None]:
        self.reads += 1
        raise RuntimeError("CUDA error: invalid device ordinal")


class FakeAdapter(Adapter):
    """A fake adapter moving the fake probe's memory: its weights on the device while in the gpu tier,
    the fake runtime's one-off memory at the first build; a demote gives its weights back
    (`source["keeps"] == "yes"`: it gives nothing back)."""

    name = "fake"
    probe: FakeDeviceProbe

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("x", "FP32", (-1,))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("y", "FP32", (-1,))]

    def read(self, ph: Phases) -> HostCopy:
        return self._host_copy()

    def _host_copy(self) -> HostCopy:
        t = torch.zeros(TENSOR_BYTES // 4)
        self.probe.host_copy = weakref.ref(t)
        return HostCopy({"w": t})

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        if not self.probe.runtime_loaded:
            self.probe.runtime_loaded = True
            self.probe.in_use += RUNTIME_BYTES
        self.probe.in_use += TENSOR_BYTES
        return object()

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        if self.spec.source.get("keeps") != "yes":
            self.probe.in_use -= TENSOR_BYTES
        return self._host_copy()

    def runnable_bytes(self, runnable: Any) -> int:
        return TENSOR_BYTES

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"]}


def _host(
    monkeypatch: pytest.MonkeyPatch,
    probe: FakeDeviceProbe,
    *,
    kind: str = "cuda",
    index: int = 0,
    visible: int = 1,
    release_timeout_s: float = 0.3,
) -> DeviceHost:
    """A device host of `kind` on the fake probe and the fake adapter; for cuda, CUDA said available
    with `visible` GPUs (fakes of torch.cuda.is_available and device_count)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)

    def fake_factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
        adapter = FakeAdapter(spec, device)
        adapter.probe = probe
        return adapter

    name = "gpu0" if kind == "cuda" else "cpu0"
    return DeviceHost(
        name, kind, index=index, node="test", probe=probe, adapter_factory=fake_factory,
        release_timeout_s=release_timeout_s,
    )  # fmt: skip


# ---- a. a demote waits for its tensors' bytes, not the runtime's one-off memory


def test_a_first_load_counts_the_runtime_in_device_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _host(monkeypatch, FakeDeviceProbe())
    loaded = host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1")
    assert loaded.ok, loaded.error
    assert loaded.footprint.device_bytes == TENSOR_BYTES + RUNTIME_BYTES  # (the setting of the bug)
    assert loaded.footprint.tensor_bytes == TENSOR_BYTES


@pytest.mark.parametrize("how", ["demote", "load-host"])
def test_a_demote_after_a_first_cuda_load_says_its_memory_released(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    host = _host(monkeypatch, FakeDeviceProbe(), release_timeout_s=0.3)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1").ok
    cmd: P.Command = P.Demote("m") if how == "demote" else P.Load(P.ModelSpec("m", "fake"), "host")
    demoted = host.apply(cmd, "2")
    assert demoted.ok and demoted.transition == "gpu->host", demoted.error
    assert demoted.memory_released is True  # its 4 MiB came back; the runtime's 64 MiB never do
    assert demoted.timing.release_s < 0.3  # (not the whole wait: released as soon as it was seen)


def test_a_demote_whose_tensors_stay_on_the_device_still_says_unreleased(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = _host(monkeypatch, FakeDeviceProbe(), release_timeout_s=0.05)
    spec = P.ModelSpec("m", "fake", {"keeps": "yes"})
    assert host.apply(P.Load(spec, "gpu"), "1").ok
    demoted = host.apply(P.Demote("m"), "2")
    assert demoted.ok and demoted.memory_released is False


def test_a_second_promote_and_demote_still_say_released(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _host(monkeypatch, FakeDeviceProbe())
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1").ok
    assert host.apply(P.Demote("m"), "2").memory_released is True
    promoted = host.apply(P.Promote("m"), "3")
    assert promoted.ok and promoted.footprint.device_bytes == TENSOR_BYTES  # no runtime this time
    assert host.apply(P.Demote("m"), "4").memory_released is True


# ---- b. an index past the visible GPUs


@pytest.mark.parametrize("cvd", [None, "3"])
def test_an_index_past_the_visible_gpus_is_not_available_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cvd: str | None
) -> None:
    if cvd is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    probe = FakeOrdinalProbe()
    host = _host(monkeypatch, probe, index=1, visible=1)
    cmds: list[P.Command] = [
        P.Load(P.ModelSpec("m", "fake"), "gpu"), P.Load(P.ModelSpec("m", "fake"), "host"),
        P.Promote("m"), P.Demote("m"), P.Drop("m"),
    ]  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="workers.host"):
        for i, cmd in enumerate(cmds):
            r = host.apply(cmd, str(i))
            assert not r.ok and r.error_code == P.NOT_AVAILABLE, r.error
            err = r.error or ""
            assert "'gpu0'" in err and "index 1" in err and "1 GPU" in err and "'m'" in err, err
            assert ("CUDA_VISIBLE_DEVICES is not set" if cvd is None else "CUDA_VISIBLE_DEVICES='3'") in err
            assert "Traceback" not in err and r.to_tier == "disk"
    assert not any(rec.exc_info for rec in caplog.records)  # no traceback logged
    assert probe.reads == 0  # nothing asked of the device that is not there


def test_the_status_of_an_index_past_the_visible_gpus_has_no_memory_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probe = FakeOrdinalProbe()
    host = _host(monkeypatch, probe, index=2, visible=2)
    with caplog.at_level(logging.DEBUG, logger="workers.host"):
        for _ in range(3):
            st = host.status()
            assert st.device_free_bytes is None and st.device_total_bytes is None
            assert st.kind == "cuda" and st.models == {}
    said = [rec for rec in caplog.records if "index 2" in rec.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "2 GPU" in said[0].getMessage() and "'gpu0'" in said[0].getMessage()
    assert probe.reads == 0


def test_an_index_within_the_visible_gpus_works(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeDeviceProbe()
    host = _host(monkeypatch, probe, index=1, visible=2)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "1").ok
    st = host.status()
    assert st.device_total_bytes == 80 << 30 and st.device_free_bytes is not None


# ---- c. a CUDA promote hands the pinned host cache back


def test_a_cuda_promote_hands_its_pinned_host_copy_back(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeDeviceProbe()
    host = _host(monkeypatch, probe)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1").ok
    before = probe.releases
    promoted = host.apply(P.Promote("m"), "2")
    assert promoted.ok and promoted.transition == "host->gpu", promoted.error
    assert probe.releases == before + 1
    assert probe.host_copy_alive_at_release[-1] is False  # released after the host copy went


def test_a_cuda_promote_by_load_hands_its_pinned_host_copy_back(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeDeviceProbe()
    host = _host(monkeypatch, probe)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1").ok
    before = probe.releases
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "gpu"), "2").ok
    assert probe.releases == before + 1 and probe.host_copy_alive_at_release[-1] is False


def test_a_failing_release_after_a_promote_is_logged_and_the_promote_holds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probe = FakeDeviceProbe(fail_release=True)
    host = _host(monkeypatch, probe)
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1").ok
    with caplog.at_level(logging.DEBUG, logger="workers.host"):
        promoted = host.apply(P.Promote("m"), "2")
    assert promoted.ok and promoted.to_tier == "gpu", promoted.error
    assert host.status().models["m"].tier == "gpu"
    said = [rec for rec in caplog.records if "fake release failure" in rec.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG and "promote of m" in said[0].getMessage()


def test_a_cpu_promote_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeDeviceProbe()
    host = _host(monkeypatch, probe, kind="cpu")
    assert host.apply(P.Load(P.ModelSpec("m", "fake"), "host"), "1").ok
    promoted = host.apply(P.Promote("m"), "2")
    assert promoted.ok and probe.releases == 0  # the CPU path is unchanged
