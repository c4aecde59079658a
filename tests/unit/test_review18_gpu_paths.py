"""Review 18, GPU readiness: CUDA-only code paths that never ran on a GPU, checked on the CPU with
fakes of the torch.cuda calls they make (each fake is named so; none of them is a GPU).

1. `TransferHandler`: the uploaded KV tensors are made on the handler's side stream and read by the
   caller's compute stream (`memory` concatenates them there). The caching allocator is told of the
   upload thread's current stream (always the device's default stream), not of the stream that
   waited on the uploads and reads them: a caller computing on a stream of its own could see the
   memory handed to the next uploads while it still read it. Fixed: `memory` calls `record_stream`
   with the stream it makes wait.
2. `TransferHandler(device="cuda")` (no index) kept the index-less device: every thread resolves it
   to its own current device, and a new thread's (the upload thread's) is cuda:0, whatever device
   the caller had selected. Now the handler names the current device at its creation.
3. `nvml_power_w(index)` took the CUDA index as NVML's: NVML numbers every GPU of the machine and
   ignores CUDA_VISIBLE_DEVICES (which a CUDA device host keeps), so it read another GPU's power.
   Now the device is found by its UUID (as CUDA reports it).
4. `CudaProbe.release` emptied the device cache only: pinned host memory freed (a host-tier model
   dropped) stayed in torch's pinned host cache, page-locked in the process for good. Now it is
   handed back too.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_review16_worldpager_robust import LAYOUT, SEG, SLOT, _payload

from workers.measure import CudaProbe, nvml_power_w
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import SegmentLog, slot_size_for
from worldpager.transfer import TransferHandler

# ---- fakes of the torch.cuda calls (no GPU here) ---------------------------------------------------


class FakeStream:
    """Stands in for a `torch.cuda.Stream`: records the events it was made to wait on."""

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self.name, self.device = name, device
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """Stands in for a `torch.cuda.Event`: records the stream it was recorded on."""

    def __init__(self) -> None:
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream


class FakeCuda:
    """The stream calls `TransferHandler` makes, as CUDA behaves: the current stream is per thread,
    the default stream (one per device) is every thread's until it selects another."""

    def __init__(self) -> None:
        self.default = FakeStream("default")
        self._local = threading.local()
        self.record_stream: dict[int, list[FakeStream]] = {}  # data_ptr -> streams the allocator was told of

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        prev = self.current_stream()
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = prev

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "current_stream", self.current_stream)
        mp.setattr(torch.cuda, "stream", self.stream)
        mp.setattr(torch.cuda, "Event", FakeEvent)
        mp.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: t.clone())  # (no pinned memory here)

        def record_stream(t: torch.Tensor, s: FakeStream) -> None:
            self.record_stream.setdefault(t.data_ptr(), []).append(s)

        mp.setattr(torch.Tensor, "record_stream", record_stream)


@pytest.fixture
def log(tmp_path: Path) -> Iterator[SegmentLog]:
    with SegmentLog.create(tmp_path, slot_size_for(SEG)) as lg:
        yield lg


# ---- 1. the allocator is told of the stream that reads the uploads ----------------------------------


def test_memory_tells_the_allocator_of_the_compute_stream_that_reads_the_uploads(
    log: SegmentLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeCuda()
    fake.install(monkeypatch)
    h = TransferHandler(PageManager(4 * SEG, SLOT, 3, segment_bytes=SEG), log, LAYOUT)
    side = FakeStream("side")
    h._cuda, h._stream = True, side  # type: ignore[assignment]  # the CUDA branch, with the fakes
    try:
        for sid in range(3):
            assert h.add_segment(SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0)), _payload(sid))
        h.drain()
        compute = FakeStream("compute")  # the caller computes on a stream of its own
        with torch.cuda.stream(compute):  # type: ignore[arg-type]
            h.prepare(0, [0, 1, 2], 12)
            h.wait_ready(0)
            mem, ids = h.memory(0)
        assert ids == (0, 1, 2) and mem is not None
        buf = h._steps[0]
        events: list[Any] = list(buf.cuda_events)  # (the fakes)
        assert len(events) == 3 and all(ev.stream is side for ev in events)  # recorded on the side stream
        assert all(ev in compute.waited for ev in events)  # the compute stream waits on every upload
        assert buf.store is not None  # (review 19: one buffer per layer, every slot in it)
        made = [t for pair in buf.store for t in pair]
        assert len(made) == 2 * LAYOUT.layers
        told = [fake.record_stream.get(t.data_ptr(), []) for t in made]
        # every tensor made on the side stream is known to be read by the stream that reads it
        assert all(compute in streams for streams in told), told[:2]
        h.release(0)
    finally:
        h.close()


# ---- 2. "cuda" without an index names the current device once -----------------------------------


def test_a_cuda_handler_without_an_index_names_the_device_current_at_its_creation(
    log: SegmentLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[FakeStream] = []

    def fake_stream_ctor(device: Any = None, priority: int = 0, **_: Any) -> FakeStream:
        s = FakeStream("side", torch.device(device) if device is not None else None)
        made.append(s)
        return s

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the caller selected cuda:1
    monkeypatch.setattr(torch.cuda, "Stream", fake_stream_ctor)
    h = TransferHandler(PageManager(4 * SEG, SLOT, 3, segment_bytes=SEG), log, LAYOUT, device="cuda")
    try:
        # the upload thread's current device is its own (cuda:0 in a new thread): it must be told
        assert h.device == torch.device("cuda", 1)
        assert [s.device for s in made] == [torch.device("cuda", 1)]
    finally:
        h.close()


# ---- 3. NVML finds the CUDA device by its UUID ----------------------------------------------------


class FakeNvml(types.ModuleType):
    """Stands in for `pynvml` on a machine of two GPUs, in NVML's (PCI) order."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.order = ["GPU-0b1c2d3e-0000-0000-0000-00000000000a", "GPU-0b1c2d3e-0000-0000-0000-00000000000b"]
        self.milliwatts = {self.order[0]: 61_000, self.order[1]: 250_000}

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return self.order[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> str:
        u = uuid.decode() if isinstance(uuid, bytes) else uuid
        if u not in self.milliwatts:
            raise RuntimeError(f"NVML: no device {u}")  # (pynvml raises its NVMLError_NotFound)
        return u

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return self.milliwatts[handle]


def test_nvml_power_is_the_cuda_devices_found_by_uuid_not_nvmls_device_of_that_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's device 0 is the machine's second GPU
    # (torch reports a device's UUID as NVML does, less the "GPU-" prefix)
    uuid = nvml.order[1].removeprefix("GPU-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuid))
    assert nvml_power_w(0) == 250.0


def test_nvml_power_is_none_when_the_device_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="ffffffff-0000")
    )
    assert nvml_power_w(0) is None  # no figure rather than another GPU's


# ---- 4. CudaProbe.release hands the pinned host cache back ------------------------------------------


def test_cuda_probe_release_hands_back_the_pinned_host_cache_too(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"synchronize({device})"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    # a CUDA build's binding (absent from this CPU build)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host_empty_cache"), raising=False)
    CudaProbe(1).release()
    assert calls[0] == "synchronize(1)"  # the copies still running end first
    assert "empty_cache" in calls and "host_empty_cache" in calls
