"""Review 15, WorldPager: `TransferHandler.resize` re-plans the prepared steps a shrink left out of the
lease before it returns. Before, it only told the page manager: the prefetched step kept its old
uploads in the retrieval buffer (and its protected segments in host) until the next `Session.step`
re-planned it, so between the resize and that step the memory held exceeded the new lease -- while
the service shrinks a lease to give that room to another model. Now the room is free when `resize`
returns; a step already started (its memory handed out) keeps its buffer until it is released, and a
step is never re-planned twice for one shrink."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, RecencyRule, SegmentInfo
from worldpager.segment_log import SegmentLog, slot_size_for
from worldpager.session import Session
from worldpager.trajectory import yaw_sweep_trajectory
from worldpager.transfer import Throttle, TransferHandler

CFG = TINY.on_the_fly()
LAYOUT = SegmentLayout.from_config(CFG, "bf16")
SEG = LAYOUT.payload_nbytes
SLOT = LAYOUT.decoded_nbytes  # one retrieval slot on the device tier
POSES = yaw_sweep_trajectory(14)
WARM = 10  # steps before the shrink: the retrieval buffers are full by then
LEASES = {"gpu": {"gpu_budget_bytes": 2 * SLOT}, "host": {"host_budget_bytes": 2 * SEG}}


def _count_prepares(h: TransferHandler) -> dict[int, int]:
    """Spy on ``h.prepare`` (the real one answers): how often each step was prepared."""
    prepared: dict[int, int] = {}
    real = h.prepare

    def prepare(step: int, *a: Any, **kw: Any) -> Any:
        prepared[step] = prepared.get(step, 0) + 1
        return real(step, *a, **kw)

    h.prepare = prepare  # type: ignore[method-assign]
    return prepared


# ---- a session: the lease holds when the handler's resize returns ----------------------------------


def _run(tmp_path: Path, shrink: Callable[[Session], None]) -> tuple[list[torch.Tensor], list[int]]:
    """WARM steps, the shrink (the next step prefetched, its buffer filled), then the rest; the
    outputs and how often each step run after the shrink was prepared."""
    with Session(
        TinyCausalWan(CFG), host_budget_bytes=16 * SEG, gpu_slots=4, retrieval_k=4, rule=RecencyRule(),
        log_dir=tmp_path / "log", keep_outputs=True,
    ) as s:  # fmt: skip
        prepared = _count_prepares(s.handler)
        for p in POSES[:WARM]:
            s.step(p)
        s.handler.wait_ready(s.step_index)
        assert s.handler.buffer_bytes == 4 * SLOT  # the prefetched step: 4 slots uploaded
        shrink(s)
        for p in POSES[WARM:]:
            s.step(p)
        s.handler.drain()
        s.pm.check()
        assert s.outputs is not None
        return list(s.outputs), [prepared[n] for n in range(WARM, len(POSES))]


@pytest.mark.parametrize("kind", sorted(LEASES))
def test_the_handlers_resize_frees_the_prefetched_steps_room_before_it_returns(
    tmp_path: Path, kind: str
) -> None:
    lease = LEASES[kind]
    want, prepared = _run(tmp_path / "ref", lambda s: s.resize_lease(**lease))
    assert prepared == [2, 1, 1, 1]

    def shrink(s: Session) -> None:
        n = s.step_index
        s.handler.resize(**lease)
        # held at once: the prefetched step was released and prepared again inside resize
        assert s.handler.buffer_bytes <= s.gpu_budget_bytes, "device tier over its new lease"
        assert s.pm.host_used_bytes <= s.pm.host_budget_bytes and s.pm.pending_bytes == 0
        assert s.handler.host_bytes <= s.pm.host_budget_bytes, "host copies over the new lease"
        assert len(s.handler.plan(n).slots) <= s.pm.slots_per_buffer
        assert not s.pm.needs_replan(n)
        s.pm.check()
        if kind == "gpu":  # one slot per buffer: the re-planned step fills at most one
            s.handler.wait_ready(n)
            assert len(s.handler.plan(n).slots) == 1 and s.handler.buffer_bytes <= SLOT

    got, prepared = _run(tmp_path / "got", shrink)
    assert prepared == [2, 1, 1, 1]  # re-planned by the resize, once; the session found nothing to do
    assert len(got) == len(want) == len(POSES)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {n}: output differs from the resize_lease run"


# ---- the handler alone ---------------------------------------------------------------------------


def _payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(LAYOUT.kv_shape, generator=g), torch.randn(LAYOUT.kv_shape, generator=g))
        for _ in range(LAYOUT.layers)
    ]
    return LAYOUT.encode(kv)


Make = Callable[..., TransferHandler]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """``make(bps=None)``: a handler with segments 0..5 in the log and in host (8 segments of host),
    3 slots per buffer; with ``bps`` reads are paced to it and the host holds 3 segments (0..2 then
    only on NVMe). Checked and closed after the test."""
    made: list[TransferHandler] = []
    with SegmentLog.create(tmp_path, slot_size_for(SEG)) as log:

        def build(bps: float | None = None) -> TransferHandler:
            pm = PageManager((3 if bps else 8) * SEG, SLOT, 3, segment_bytes=SEG)
            h = TransferHandler(pm, log, LAYOUT, throttle=Throttle(bps))
            made.append(h)
            for sid in range(6):
                info = SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0))
                assert h.add_segment(info, _payload(sid))
                h.drain()
            return h

        try:
            yield build
            for h in made:
                assert h.error is None
                h.pm.check()
        finally:
            for h in made:
                h.close()


def test_a_started_step_keeps_its_buffer_the_next_one_is_replanned(make: Make) -> None:
    h = make()
    prepared = _count_prepares(h)
    h.prepare(0, [0, 1, 2], 18)
    h.prepare(1, [5, 4, 3], 21)
    h.wait_ready(0)
    mem0, ids0 = h.memory(0)  # step 0 runs on these
    assert mem0 is not None and ids0 == (0, 1, 2)
    h.wait_ready(1)
    h.resize(gpu_budget_bytes=2 * SLOT)  # one slot per buffer
    assert prepared == {0: 1, 1: 2}  # only the step not started was re-planned
    assert len(h.plan(0).slots) == 3 and h.memory(0)[1] == ids0  # the running step's buffer kept
    assert list(h.plan(1).slots) == [5]  # the best kept
    h.wait_ready(1)
    assert h.memory(1)[1] == (5,)
    h.release(0)  # the running step ends: from here the lease holds for every buffer
    assert h.buffer_bytes <= SLOT
    h.prepare(2, [1, 2], 24)
    h.wait_ready(2)
    assert h.memory(2)[1] == (1,) and h.buffer_bytes <= 2 * SLOT
    h.release(1)
    h.release(2)
    h.resize(gpu_budget_bytes=6 * SLOT)  # a grow: nothing prepared, nothing to do
    assert prepared == {0: 1, 1: 2, 2: 1}


def test_resize_waits_for_the_steps_reads_in_flight_then_replans_it(make: Make) -> None:
    h = make(8 * SEG)  # each read holds the disk ~1/8 s
    pm = h.pm
    prepared = _count_prepares(h)
    plan = h.prepare(0, [0, 1, 2], 18)  # all three only on NVMe: three paced reads
    assert len(plan.jobs) == 3 and not pm.buffer_ready(0)
    h.resize(gpu_budget_bytes=2 * SLOT)  # waits (the lock let go) for the reads and uploads
    assert prepared == {0: 2} and list(h.plan(0).slots) == [0]
    h.wait_ready(0)
    mem, ids = h.memory(0)
    assert ids == (0,) and mem is not None and h.buffer_bytes <= SLOT
    h.release(0)


def test_memory_after_a_replan_behind_wait_ready_waits_for_the_new_buffer(make: Make) -> None:
    """A resize from another thread between a caller's `wait_ready` and its `memory` re-plans the
    step (not started yet): `memory` then waits for the new buffer rather than return it half full.
    The new plan's upload is held until `memory` asks `wait_ready`."""
    h = make()
    h.prepare(0, [0, 1, 2], 18)
    h.wait_ready(0)
    gate = threading.Event()
    gate.set()
    real_upload, real_wait = h._upload, h.wait_ready

    def upload(*a: Any) -> Any:
        assert gate.wait(30), "upload held too long"
        return real_upload(*a)

    def wait_ready(step: int, timeout: float = 120.0) -> float:
        gate.set()
        return real_wait(step, timeout)

    h._upload = upload  # type: ignore[method-assign,assignment]
    h.wait_ready = wait_ready  # type: ignore[method-assign]
    gate.clear()
    try:
        h.resize(gpu_budget_bytes=2 * SLOT)  # step 0 re-planned: its upload waits at the gate
        assert list(h.plan(0).slots) == [0]
        mem, ids = h.memory(0)
        assert ids == (0,) and mem is not None
    finally:
        gate.set()
    h.release(0)


class _FakeEvent:
    """A CUDA event stand-in (this machine has no CUDA): an id to see which ones were waited on."""

    made = 0

    def __init__(self) -> None:
        _FakeEvent.made += 1
        self.id = _FakeEvent.made


class _FakeStream:
    """The compute stream stand-in: records the events it was made to wait on."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_event(self, ev: _FakeEvent) -> None:
        self.waited.append(ev.id)


def test_memory_makes_the_compute_stream_wait_on_a_replanned_buffers_uploads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resize from another thread re-planned the step between the caller's `wait_ready` and
    `memory`, and the new buffer was ready already (its segments were in host RAM): `memory` handed it
    out with the compute stream waiting only on the old plan's upload events, so on CUDA the model
    could read buffers the side stream was still writing (found in review; CUDA stood in by fakes)."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)  # (CPU tensors, fake stream)
    with SegmentLog.create(tmp_path, slot_size_for(SEG)) as log:
        h = TransferHandler(PageManager(8 * SEG, SLOT, 3, segment_bytes=SEG), log, LAYOUT)
        try:
            for sid in range(6):
                info = SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0))
                assert h.add_segment(info, _payload(sid))
            h.drain()
            made: list[int] = []

            def upload(payload: bytes, f: int, t: int, buf: Any, slot: int) -> Any:
                ev = _FakeEvent()
                made.append(ev.id)
                kvs = h.layout.rerotate(h.layout.decode(payload), f, t)
                return [h._place(buf, slot, i, kv) for i, kv in enumerate(kvs)], ev

            monkeypatch.setattr(h, "_upload", upload)
            monkeypatch.setattr(h, "_cuda", True)
            h.prepare(0, [0, 1, 2], 18)
            h.wait_ready(0)
            old = set(made)
            assert old and old <= set(stream.waited)
            h.resize(gpu_budget_bytes=2 * SLOT)  # step 0 re-planned within the smaller lease
            assert h._steps[0].ready.wait(10)
            new = set(made) - old
            assert new  # the re-plan uploaded
            _, ids = h.memory(0)
            assert ids == (0,)
            assert new <= set(stream.waited)
            h.release(0)
        finally:
            monkeypatch.setattr(h, "_cuda", False)
            h.close()
