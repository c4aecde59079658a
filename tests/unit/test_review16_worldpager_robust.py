"""Review 16, WorldPager robustness: three findings, each reproduced here before it was fixed.

1. `TransferHandler` read a segment back from the NVMe log once: any OS error (a transient EIO,
   EINTR, EAGAIN) made the segment corrupt, lost for good. Now an OS error is retried a bounded
   number of times, each failure logged; only one that persists (or a failed integrity check) loses
   the segment, and such a slot is not retired.
2. A session's `EventLog` kept every `LeaseResized` event: a long session whose lease the manager
   resizes often grew without bound. Now only the last ``max_events`` are kept; `event_counts` still
   counts them all.
3. `load_mg2_checkpoint` cast an integer tensor to float and loaded NaN/inf weights silently. Now
   both are refused, naming the file and the tensor.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager.layout import SegmentLayout
from worldpager.model import TINY, CheckpointMismatch, TinyCausalWan, load_mg2_checkpoint
from worldpager.page_types import Corrupt, Evicted, LeaseResized
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_header import CorruptSlotError
from worldpager.segment_log import SegmentLog, slot_size_for
from worldpager.session import Session
from worldpager.session_records import EventLog
from worldpager.transfer import TransferHandler

CFG = TINY.on_the_fly()
LAYOUT = SegmentLayout.from_config(CFG, "bf16")
SEG = LAYOUT.payload_nbytes
SLOT = LAYOUT.decoded_nbytes


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
    """Segments 0..3 in the log; the host holds 2 (2, 3: 0 and 1 only on NVMe). Short retry pauses."""
    h = TransferHandler(PageManager(2 * SEG, SLOT, 2, segment_bytes=SEG), log, LAYOUT)
    h.read_retry_delay_s = 0.001
    try:
        for sid in range(4):
            assert h.add_segment(SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0)), _payload(sid))
            h.drain()
        yield h
    finally:
        h.close()


def _flaky_read_stand_in(log: SegmentLog, failures: list[BaseException]) -> list[int]:
    """Test stand-in for the log's read: raises the given errors on its first calls, then reads for
    real. Returns the list of slots it was called with."""
    real_read, calls = log.read, []

    def read(slot: int) -> Any:
        calls.append(slot)
        if failures:
            raise failures.pop(0)
        return real_read(slot)

    log.read = read  # type: ignore[method-assign]
    return calls


# ---- 1. transient read errors ------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.EIO, errno.EINTR, errno.EAGAIN])
def test_a_transient_read_error_is_retried_and_logged_and_the_segment_arrives(
    handler: TransferHandler, log: SegmentLog, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    h = handler
    slot = h.log_slot(0)
    calls = _flaky_read_stand_in(log, [OSError(err, "transient stand-in error")])
    with caplog.at_level(logging.WARNING, logger="worldpager.transfer"):
        plan = h.prepare(0, [0], 12)
        h.wait_ready(0)
    assert list(plan.slots) == [0]
    mem, ids = h.memory(0)
    assert ids == (0,) and mem is not None  # read back on the retry: not lost
    assert calls == [slot, slot]
    assert not [e for e in h.take_events() if isinstance(e, Corrupt)]
    assert any("read failed (attempt 1 of 4), retrying" in r.getMessage() for r in caplog.records)
    h.release(0)
    assert h.prepare(1, [0], 15).unavailable == ()  # still a candidate afterwards


def test_a_read_error_that_persists_loses_the_segment_but_does_not_retire_its_slot(
    handler: TransferHandler, log: SegmentLog, caplog: pytest.LogCaptureFixture
) -> None:
    h = handler
    slot = h.log_slot(0)
    assert slot is not None
    calls = _flaky_read_stand_in(log, [OSError(errno.EIO, "stand-in EIO") for _ in range(10)])
    with caplog.at_level(logging.WARNING, logger="worldpager.transfer"):
        h.prepare(0, [0], 12)
        h.wait_ready(0)
    assert calls == [slot] * 4  # one read and three retries, no more
    assert h.memory(0) == (None, ())
    (corrupt,) = [e for e in h.take_events() if isinstance(e, Corrupt)]
    assert corrupt.seg_id == 0 and corrupt.slot == slot
    assert corrupt.reason is not None and "unreadable after 4 attempts" in corrupt.reason
    assert "stand-in EIO" in corrupt.reason
    assert any("giving the segment up" in r.getMessage() for r in caplog.records)
    assert SegmentLog.read(log, slot)[0].segment_id == 0  # not retired: the data is still there


def test_a_failed_integrity_check_is_not_retried(handler: TransferHandler, log: SegmentLog) -> None:
    h = handler
    slot = h.log_slot(0)
    assert slot is not None
    calls = _flaky_read_stand_in(log, [CorruptSlotError(slot, "payload checksum mismatch", log.path)])
    h.prepare(0, [0], 12)
    h.wait_ready(0)
    assert calls == [slot]
    (corrupt,) = [e for e in h.take_events() if isinstance(e, Corrupt)]
    assert corrupt.reason == "payload checksum mismatch"


# ---- 2. LeaseResized events are bounded --------------------------------------------------------


def test_the_event_log_keeps_the_last_max_events_lease_resizes_and_counts_them_all() -> None:
    log = EventLog(max_events=3)
    corrupt = Corrupt(7, 0, slot=2, reason="payload checksum mismatch")
    log.record(LeaseResized(1, 1, 0))
    log.record(corrupt)
    for n in range(2, 1001):
        log.record(LeaseResized(n, 1, 0))
        log.record(Evicted(n, 1))
    kept = log.events()
    assert kept[0] == corrupt  # every other notable event is kept, in order with the resizes
    assert kept[1:4] == [LeaseResized(n, 1, 0) for n in (998, 999, 1000)]
    assert kept[4:] == [Evicted(n, 1) for n in (998, 999, 1000)]
    assert log.counts() == {"LeaseResized": 1000, "Corrupt": 1, "Evicted": 999}


def test_a_session_resized_often_keeps_its_events_bounded_and_its_counts_right(tmp_path: Path) -> None:
    with Session(
        TinyCausalWan(CFG), host_budget_bytes=4 * SEG, gpu_slots=2, retrieval_k=2,
        log_dir=tmp_path / "log", max_events=5,
    ) as s:  # fmt: skip
        for n in range(200):
            s.resize_lease(host_budget_bytes=(4 + n % 2) * SEG)
        resized = [e for e in s.events if isinstance(e, LeaseResized)]
        assert len(resized) == 5
        assert s.event_counts()["LeaseResized"] == 200


# ---- 3. checkpoints with the wrong kind of number, or NaN/inf weights --------------------------


def _save(path: Path, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_checkpoint_with_a_non_finite_weight_is_refused_naming_file_and_tensor(
    tmp_path: Path, bad: float
) -> None:
    model = TinyCausalWan(TINY)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = "blocks.0.self_attn.q.weight"
    state[name].view(-1)[3] = bad
    path = tmp_path / "mg2.safetensors"
    _save(path, state)
    before = model.state_dict()[name].clone()
    with pytest.raises(
        ValueError, match=rf"mg2\.safetensors: 1 tensors hold NaN or infinite .*{name} \(1 of"
    ):
        load_mg2_checkpoint(model, path)
    assert torch.equal(model.state_dict()[name], before)  # nothing loaded


def test_a_checkpoint_with_an_integer_tensor_where_a_float_is_expected_is_refused(tmp_path: Path) -> None:
    model = TinyCausalWan(TINY)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = "time_embedding.0.bias"
    state[name] = torch.ones_like(state[name], dtype=torch.int64)
    path = tmp_path / "mg2.safetensors"
    _save(path, state)
    with pytest.raises(
        CheckpointMismatch,
        match=rf"mg2\.safetensors: 1 tensors of the wrong kind: {name} is integer \(int64\) where "
        r"the model has floating \(float32\)",
    ):
        load_mg2_checkpoint(model, path)


def test_a_good_checkpoint_in_another_float_precision_still_loads(tmp_path: Path) -> None:
    src, dst = TinyCausalWan(TINY), TinyCausalWan(TINY)
    path = tmp_path / "mg2.safetensors"
    _save(path, {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()})
    load_mg2_checkpoint(dst, path)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v.to(torch.bfloat16).float())


def test_a_float8_checkpoint_with_a_nan_is_refused_too(tmp_path: Path) -> None:
    model = TinyCausalWan(TINY)
    state = {k: v.to(torch.float8_e4m3fn) for k, v in model.state_dict().items()}
    name = "time_embedding.0.weight"
    state[name].view(-1)[0] = float("nan")
    path = tmp_path / "mg2.safetensors"
    _save(path, state)
    match = rf"mg2\.safetensors: 1 tensors hold NaN or infinite weights: {name} \(1 of"
    with pytest.raises(ValueError, match=match):
        load_mg2_checkpoint(model, path)
