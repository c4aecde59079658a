"""Review 15, WorldPager: three concerns raised about the handler's run-time lease (`TransferHandler.resize`
re-plans prepared steps) and its failure paths, each reproduced here before it was fixed.

1. `memory(step)` after a copy thread failed: the failure handler marks every buffer ready, so
   `memory` handed out whatever had been uploaded (a partial buffer) without raising; now it raises
   the handler's error, as `wait_ready` does.
2. `close()` racing a `resize`: a re-plan between close's drain and its stopping the threads queued
   the Read of the re-planned step, whose Upload then went behind the upload thread's stop marker and
   never ran (the step's buffer never became ready). Now a resize (or a prepare) once close has begun
   is refused with a clear error, and a resize waiting on transfers when close begins abandons its
   re-plan; nothing is left half planned, and neither waits on the other.
3. `Session.resize_lease` re-planned the session's next step itself when the page manager said it
   was out of the lease: after the handler's resize that is only ever a started step (its memory
   handed out, the model computing on it), which the handler keeps until it ends -- the session
   released it under the model. Now the session leaves it to the handler.
"""

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
from worldpager.transfer import TransferHandler

CFG = TINY.on_the_fly()
LAYOUT = SegmentLayout.from_config(CFG, "bf16")
SEG = LAYOUT.payload_nbytes
SLOT = LAYOUT.decoded_nbytes  # one retrieval slot on the device tier


def _payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(LAYOUT.kv_shape, generator=g), torch.randn(LAYOUT.kv_shape, generator=g))
        for _ in range(LAYOUT.layers)
    ]
    return LAYOUT.encode(kv)


@pytest.fixture
def log(tmp_path: Path) -> Iterator[SegmentLog]:
    with SegmentLog.create(tmp_path, slot_size_for(SEG)) as lg:
        yield lg


@pytest.fixture
def handler(log: SegmentLog) -> Iterator[TransferHandler]:
    """Segments 0..5 in the log; the host holds 3 segments (3, 4, 5: 0..2 only on NVMe), 3 slots per
    buffer. Closed after the test."""
    h = TransferHandler(PageManager(3 * SEG, SLOT, 3, segment_bytes=SEG), log, LAYOUT)
    try:
        for sid in range(6):
            assert h.add_segment(SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0)), _payload(sid))
            h.drain()
        yield h
    finally:
        h.close()


# ---- 1. memory() after a copy thread failed ------------------------------------------------------


def test_memory_after_a_copy_thread_failed_raises_rather_than_hand_out_a_partial_buffer(
    handler: TransferHandler, log: SegmentLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = handler

    def broken(slot: int) -> Any:  # not an OSError: the I/O thread itself fails
        raise RuntimeError("controller reset")

    monkeypatch.setattr(log, "read", broken)
    plan = h.prepare(0, [3, 4, 0], 18)  # 3 and 4 from host (uploads), 0 read from NVMe: it fails
    assert len(plan.jobs) == 3 and not h.pm.buffer_ready(0)
    assert h._steps[0].ready.wait(30)  # set by the failure handler, not by the uploads
    assert h.error is not None and not h.pm.buffer_ready(0)  # segment 0 never arrived
    with pytest.raises(RuntimeError, match="transfer thread failed: RuntimeError\\('controller reset'\\)"):
        h.memory(0)
    with pytest.raises(RuntimeError, match="controller reset"):
        h.wait_ready(0)  # (as before)


# ---- 2. close() and resize() -------------------------------------------------------------------


def _a_step_a_shrink_replans_with_a_read(h: TransferHandler) -> None:
    """Step 0 prepared while step 1 held every host segment: its best segment (0, on NVMe only) found
    no room and is left out. Step 1 then ends: a GPU shrink now re-plans step 0 into one slot, and
    the room is there for segment 0: the re-plan is a Read, its Upload follows when it lands."""
    h.prepare(1, [3, 4, 5], 21)
    plan = h.prepare(0, [0, 1, 3, 4], 18)
    assert plan.unavailable == (0, 1) and list(plan.slots) == [3, 4]
    h.wait_ready(1)
    h.wait_ready(0)
    h.release(1)
    assert not h.pm.needs_replan(0)


def test_a_resize_between_closes_drain_and_its_stop_is_refused_nothing_is_left_half_planned(
    handler: TransferHandler, log: SegmentLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving the reviewer described: a resize after close's drain, before the threads stop.
    The re-plan's Read is held until the upload thread's stop marker is queued (as a slow disk
    would), so its Upload would come after it."""
    h = handler
    _a_step_a_shrink_replans_with_a_read(h)
    stopped = threading.Event()
    real_put, real_read, real_drain = h._uploads.put, log.read, h.drain

    def put(item: Any, *a: Any, **kw: Any) -> None:
        real_put(item, *a, **kw)
        if item is None:
            stopped.set()

    def read(slot: int) -> Any:
        stopped.wait(30)
        return real_read(slot)

    outcome: list[BaseException | None] = []

    def drain(timeout: float = 60.0) -> None:
        real_drain(timeout)
        try:  # the resize comes in here (another thread's, run in this one at this point)
            h.resize(gpu_budget_bytes=2 * SLOT)
            outcome.append(None)
        except RuntimeError as e:
            outcome.append(e)

    monkeypatch.setattr(h._uploads, "put", put)
    monkeypatch.setattr(log, "read", read)
    monkeypatch.setattr(h, "drain", drain)
    h.close()
    assert len(outcome) == 1
    if outcome[0] is None:  # re-planned in time: its transfers all ran before the threads stopped
        assert list(h.plan(0).slots) == [0]
    else:
        assert "closed" in str(outcome[0]) and "resize" in str(outcome[0]), outcome[0]
        assert list(h.plan(0).slots) == [3, 4]  # abandoned: the step's plan as it was
    assert h.error is None
    assert h.pm.buffer_ready(0) and h._steps[0].ready.is_set(), "step 0's transfers never ran"
    assert not h.pm.io_queue() and not h._outstanding
    h.pm.check()


def test_resize_and_prepare_after_close_are_refused_clearly(handler: TransferHandler) -> None:
    h = handler
    h.prepare(0, [3, 4], 18)
    h.wait_ready(0)
    h.close()
    with pytest.raises(RuntimeError, match="transfer handler is closed: cannot resize"):
        h.resize(gpu_budget_bytes=2 * SLOT)
    with pytest.raises(RuntimeError, match="transfer handler is closed: cannot prepare step 1"):
        h.prepare(1, [5], 21)
    with pytest.raises(RuntimeError, match="transfer handler is closed: cannot add segment 99"):
        h.add_segment(SegmentInfo(99, 297, 300, Pose(0, 0, 0, 0, 0)), _payload(99))
    assert 99 not in h._host  # (a write-back queued after close would never have run)
    assert 1 not in h._steps and list(h.plan(0).slots) == [3, 4]
    h.close()  # (twice: a no-op)


def test_a_close_during_a_resize_waiting_on_transfers_abandons_its_replan_no_deadlock(
    handler: TransferHandler, log: SegmentLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resize waits (the lock let go) for step 0's reads before re-planning it; close comes in
    meanwhile. The reads are held until close drains: the resize gives up its re-plan, close finishes
    the reads and stops the threads, each call returns."""
    h = handler
    gate, asked = threading.Event(), threading.Event()
    real_read, real_drain, real_needs = log.read, h.drain, h.pm.needs_replan

    def read(slot: int) -> Any:
        gate.wait(30)
        return real_read(slot)

    def drain(timeout: float = 60.0) -> None:
        gate.set()
        real_drain(timeout)

    def needs_replan(step: int) -> bool:
        asked.set()
        return real_needs(step)

    monkeypatch.setattr(log, "read", read)
    monkeypatch.setattr(h, "drain", drain)
    monkeypatch.setattr(h.pm, "needs_replan", needs_replan)
    plan = h.prepare(0, [0, 1, 2], 18)  # three reads, held at the gate
    assert len(plan.jobs) == 3
    errors: list[BaseException] = []

    def run(fn: Callable[[], None]) -> threading.Thread:
        def body() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    resizer = run(lambda: h.resize(gpu_budget_bytes=2 * SLOT))
    assert asked.wait(30)  # the resize has the lock: close gets it once the resize waits
    closer = run(h.close)
    closer.join(60)
    resizer.join(60)
    gate.set()
    assert not closer.is_alive() and not resizer.is_alive(), "close and resize deadlocked"
    assert not errors, errors
    assert list(h.plan(0).slots) == [0, 1, 2]  # the re-plan was abandoned: the step as it was
    assert h.pm.buffer_ready(0) and h._steps[0].ready.is_set()
    h.pm.check()


# ---- 3. Session.resize_lease and a started step --------------------------------------------------


def test_resize_lease_while_a_step_computes_leaves_the_started_step_to_the_handler(tmp_path: Path) -> None:
    """A resize from another thread while step n computes on its memory: the handler re-plans step
    n+1 (prefetched, not started) and keeps step n's buffer; the session must not re-plan step n."""
    poses = yaw_sweep_trajectory(12)
    with Session(
        TinyCausalWan(CFG), host_budget_bytes=16 * SEG, gpu_slots=4, retrieval_k=4, rule=RecencyRule(),
        log_dir=tmp_path / "log",
    ) as s:  # fmt: skip
        for p in poses[:10]:
            s.step(p)
        n = s.step_index
        prepared: list[int] = []
        real_prepare, real_generate = s.handler.prepare, s.model.generate_block
        inside, go = threading.Event(), threading.Event()

        def prepare(step: int, *a: Any, **kw: Any) -> Any:
            prepared.append(step)
            return real_prepare(step, *a, **kw)

        def generate_block(*a: Any, **kw: Any) -> Any:
            if not inside.is_set():
                inside.set()
                assert go.wait(30)
            return real_generate(*a, **kw)

        s.handler.prepare = prepare  # type: ignore[method-assign]
        s.model.generate_block = generate_block  # type: ignore[method-assign]
        records: list[Any] = []
        stepper = threading.Thread(target=lambda: records.append(s.step(poses[10])), daemon=True)
        stepper.start()
        try:
            assert inside.wait(30)  # step n runs on its memory (4 segments)
            assert s.handler._steps[n].started and len(s.handler.plan(n).slots) == 4
            s.resize_lease(gpu_budget_bytes=2 * SLOT)
            assert prepared == [n + 1, n + 1]  # n+1 prefetched, then re-planned; n left alone
            assert len(s.handler.plan(n).slots) == 4 and s.handler._steps[n].started
        finally:
            go.set()
            stepper.join(60)
        assert not stepper.is_alive() and len(records) == 1
        (rec,) = records
        assert rec.step == n and rec.hits + rec.misses == 4 and len(rec.retrieved) == 4
        rec = s.step(poses[11])  # the next step runs within the new lease
        assert rec.step == n + 1 and len(rec.retrieved) == 1
        s.pm.check()
