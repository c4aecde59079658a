"""Review 17, WorldPager failure handling: findings reproduced here before they were fixed.

1. A `Session.step` that raised part-way (a codec refusing the block's KV, a write-through that
   failed, the model itself) left the session half-stepped: the step's buffer released, the next one
   prepared, the model's window moved on. The next `step` then raised a bare ``KeyError`` (or a
   ``ProtocolError``), hiding the real cause; had it gone through, the window would have moved twice.
   Now a step that raises leaves the session failed: every later step raises a RuntimeError naming
   the step and its cause; `close` still saves it and a resume continues from the log.
2. A write to the NVMe log that failed once with an OS error (EIO: a disk or controller hiccup)
   stopped the I/O thread for good, so the whole session failed, while reads were retried. Now
   writes (write-backs and write-throughs) are retried like reads, each failure logged; one that
   persists still fails the session loudly.
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
from worldpager.model import TINY, TinyCausalWan
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import SegmentLog, slot_size_for
from worldpager.session import Session
from worldpager.transfer import TransferHandler

CFG = TINY.on_the_fly()
LAYOUT = SegmentLayout.from_config(CFG, "bf16")
SEG = LAYOUT.payload_nbytes
SLOT = LAYOUT.decoded_nbytes


def _pose(i: int) -> Pose:
    return Pose(0.0, 0.0, float(i), 0.0, 10.0 * i)


def _session(log_dir: Path, **kw: Any) -> Session:
    torch.manual_seed(0)
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG, "log_dir": log_dir, "retrieval_k": 2}
    opts.update(kw)
    return Session(TinyCausalWan(CFG), **opts)


# ---- 1. a step that fails part-way ---------------------------------------------------------------


def _fail_encode_once(s: Session) -> None:
    """Test stand-in: the session's codec refuses the next block's KV once (as it does for NaN)."""
    real = s.layout.encode
    calls = [0]

    def encode(kv: Any) -> bytes:
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("cannot encode non-finite values with bf16: 1 NaN, 0 inf (stand-in)")
        return real(kv)

    object.__setattr__(s.layout, "encode", encode)  # (a frozen dataclass)


@pytest.mark.parametrize("mode", ["prefetch", "on_demand"])
def test_a_step_that_fails_part_way_leaves_the_session_failed_naming_the_cause(
    tmp_path: Path, mode: str
) -> None:
    s = _session(tmp_path / "s", mode=mode)
    try:
        s.run([_pose(i) for i in range(3)])
        _fail_encode_once(s)
        with pytest.raises(ValueError, match="non-finite"):
            s.step(_pose(3))
        for _ in range(2):  # never a KeyError, never a second roll of the window
            with pytest.raises(RuntimeError, match=r"step 3 failed.*non-finite") as info:
                s.step(_pose(3))
            assert isinstance(info.value.__cause__, ValueError)
        assert s.step_index == 3
    finally:
        s.close()
    with Session.resume(tmp_path / "s", TinyCausalWan(CFG), host_budget_bytes=8 * SEG) as r:
        assert r.step_index == 3 and r.window_source == "log"  # (the failed step's window is not used)
        assert r.step(_pose(3)).step == 3


def test_a_bad_pose_still_leaves_the_session_usable(tmp_path: Path) -> None:
    with _session(tmp_path / "s") as s:
        s.step(_pose(0))
        with pytest.raises(ValueError, match="finite"):
            s.step(Pose(float("nan"), 0.0, 0.0, 0.0, 0.0))
        assert s.step(_pose(1)).step == 1


# ---- 2. a write that fails with an OS error ------------------------------------------------------


@pytest.fixture
def log(tmp_path: Path) -> Iterator[SegmentLog]:
    with SegmentLog.create(tmp_path / "log", slot_size_for(SEG)) as lg:
        yield lg


def _flaky_append_stand_in(log: SegmentLog, failures: list[BaseException]) -> list[int]:
    """Test stand-in for the log's append: raises the given errors on its first calls, then appends
    for real. Returns the segment ids it was called with."""
    real_append, calls = log.append, []

    def append(**kw: Any) -> int:
        calls.append(kw["segment_id"])
        if failures:
            raise failures.pop(0)
        return real_append(**kw)

    log.append = append  # type: ignore[method-assign]
    return calls


def _payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(LAYOUT.kv_shape, generator=g), torch.randn(LAYOUT.kv_shape, generator=g))
        for _ in range(LAYOUT.layers)
    ]
    return LAYOUT.encode(kv)


def _info(sid: int) -> SegmentInfo:
    return SegmentInfo(sid, 3 * sid, 3 * sid + 3, _pose(sid))


@pytest.mark.parametrize("through", [False, True])
def test_a_transient_write_error_is_retried_and_logged_and_the_segment_lands(
    log: SegmentLog, caplog: pytest.LogCaptureFixture, through: bool
) -> None:
    # through: a host tier with no room (every byte protected) makes add_segment write the segment
    # itself (a write-through, on the caller's thread); else the I/O thread writes it back
    h = TransferHandler(PageManager(2 * SEG, SLOT, 2, segment_bytes=SEG), log, LAYOUT)
    h.write_retry_delay_s = 0.001
    try:
        if through:
            for sid in (0, 1):
                assert h.add_segment(_info(sid), _payload(sid))
                h.drain()
            h.prepare(0, [0, 1], 12)
            h.wait_ready(0)
        calls = _flaky_append_stand_in(log, [OSError(errno.EIO, "stand-in EIO")])
        with caplog.at_level(logging.WARNING, logger="worldpager.transfer"):
            assert h.add_segment(_info(2), _payload(2))
            slot = h.wait_written(2, timeout=30)
        assert slot is not None and calls == [2, 2]
        assert log.read(slot)[1] == _payload(2)
        assert h.error is None
        assert any("write failed (attempt 1 of 4), retrying" in r.getMessage() for r in caplog.records)
    finally:
        h.close()


def test_a_write_error_that_persists_still_fails_loudly(log: SegmentLog) -> None:
    h = TransferHandler(PageManager(2 * SEG, SLOT, 2, segment_bytes=SEG), log, LAYOUT)
    h.write_retry_delay_s = 0.001
    try:
        calls = _flaky_append_stand_in(log, [OSError(errno.EIO, "stand-in EIO") for _ in range(10)])
        assert h.add_segment(_info(0), _payload(0))
        with pytest.raises(RuntimeError, match="stand-in EIO"):
            h.wait_written(0, timeout=30)
        assert calls == [0] * 4  # one write and three retries, no more
    finally:
        h.close()
