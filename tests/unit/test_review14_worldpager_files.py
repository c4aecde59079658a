"""worldpager fixes from review 14: the files a resume reads (``window.bin``, ``segments.wplog`` and its
slot headers) and the temporary files the atomic writers create in the session folder. Real files in
tmp_path (sparse ones made with truncate: no disk blocks), real sessions on the "micro" stand-in;
each test failed before its fix."""

from __future__ import annotations

import json
import logging
import os
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager import session_store as store
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.segment_log import INDEX_NAME, LOG_NAME, META_NAME, SegmentLog, slot_size_for
from worldpager.session import SESSION_PRESETS, CorruptSlot, MissingSegment, Session
from worldpager.trajectory import yaw_sweep_trajectory

PAGE = 6000
SLOT = slot_size_for(2 * PAGE)
CFG = SESSION_PRESETS["micro"].on_the_fly()
POSES = yaw_sweep_trajectory(8)
SEG = SegmentLayout.from_config(CFG, "bf16", torch.float32).payload_nbytes
BIG = 256 << 20  # a sparse file's length: no disk blocks, but reading it would allocate all of it


def _segment(rng: random.Random, sid: int) -> dict[str, Any]:
    return {
        "segment_id": sid, "frame_start": 3 * sid, "frame_end": 3 * sid + 3, "pose": (0.0,) * 5,
        "codec": "bf16", "position_state": "post-rope", "position": 3 * sid,
        "payload": rng.randbytes(2 * PAGE), "page_offsets": (0, PAGE),
    }  # fmt: skip


def _filled(d: Path, n: int, **create: Any) -> list[dict[str, Any]]:
    rng = random.Random(14)
    segs = [_segment(rng, i) for i in range(n)]
    with SegmentLog.create(d, SLOT, **create) as log:
        for i, seg in enumerate(segs):
            assert log.append(**seg) == i
    return segs


def _saved(d: Path, n: int) -> None:
    """A closed session of ``n`` segments in ``d`` (segment i in slot i)."""
    with Session(TinyCausalWan(CFG), log_dir=d, host_budget_bytes=16 * SEG) as s:
        s.run(POSES[:n])
        assert [s.handler.wait_written(i) for i in range(n)] == list(range(n))


# ---- 1: window.bin's size is checked before it is read -------------------------------------------------


def test_a_window_file_of_the_wrong_size_is_refused_before_it_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: the resume read the whole of ``window.bin`` before comparing its length with
    what session.json and the model imply: a 2 GB sparse file allocated 2 GB. Now its size is checked
    first (on the open file): a wrong one is not used (the window is rebuilt from the log, as for any
    other mismatch), logged naming the file and both sizes, nothing read."""
    d = tmp_path / "s"
    _saved(d, 4)
    saved = store.read_saved_state(d)
    assert saved is not None and saved["window"] is not None
    want = saved["window"]["nbytes"]
    window = d / store.WINDOW_FILE
    os.truncate(window, BIG)  # sparse: no disk blocks
    model = TinyCausalWan(CFG)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            assert store.checkpoint_window(saved, 4, model, d, {}) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = caplog.text
    assert str(window) in msg and f"{BIG} bytes" in msg and f"expected {want}" in msg
    assert "rebuilt from the log" in msg
    assert peak < 16 << 20  # was the whole file


def test_a_window_file_of_the_right_size_is_still_used(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _saved(d, 4)
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as s:
        assert s.window_source == "checkpoint" and s.step_index == 4


# ---- 2: a reopen without an index does not scan a sparse log's holes slot by slot ----------------------


def test_a_sparse_tail_is_the_end_of_the_log_not_corrupt_slots(tmp_path: Path) -> None:
    """Found in review: a reopen without a usable index read every slot of a 40 GB sparse log (45 s)
    and reported about a million corrupt slots. Never-written slots (a hole, all-zero headers) after
    the last written one are the end of the log: none reported, the next append goes after the last
    written slot."""
    segs = _filled(tmp_path, 3)
    os.truncate(tmp_path / LOG_NAME, 3 * SLOT + BIG)  # a hole of BIG bytes after slot 2
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as log:
        assert log.index_state == "rebuilt"
        assert log.corrupt_slots() == {} and log.slots() == [0, 1, 2] and log.n_slots == 3
        assert log.bytes_read < 3 * SLOT + (1 << 20)  # the hole was not read
        assert log.append(**segs[0]) == 3
    with SegmentLog.open(tmp_path) as log:  # the index written then is trusted
        assert log.index_state == "loaded" and log.slots() == [0, 1, 2, 3]


def test_a_corrupt_slot_and_a_hole_between_written_slots_are_still_reported(tmp_path: Path) -> None:
    """A slot whose bytes fail their checks, and never-written slots, between written slots are
    reported corrupt (not taken for the end of the log)."""
    segs = _filled(tmp_path, 3)
    path = tmp_path / LOG_NAME
    with open(path, "r+b") as f:  # slot 1: a header that fails its checksum
        f.seek(SLOT + 100)
        f.write(b"\xff")
    with SegmentLog.open(tmp_path) as log:  # slots 3, 4, 5; then 3 and 4 zeroed: never written
        for seg in segs:
            log.append(**seg)
    with open(path, "r+b") as f:
        f.seek(3 * SLOT)
        f.write(bytes(2 * SLOT))
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as log:
        assert sorted(log.corrupt_slots()) == [1, 3, 4] and log.slots() == [0, 2, 5]
        assert log.n_slots == 6
        assert log.corrupt_slots()[1] == "header checksum mismatch"


def test_the_scan_stops_at_what_the_budget_lets_the_log_hold(tmp_path: Path) -> None:
    """A log with a ``max_bytes`` budget cannot have appended a slot whose header alone would be past
    it: a scan does not look for slots past that (a planted slot far into a hole included)."""
    segs = _filled(tmp_path, 2, max_bytes=8 * SLOT)
    far = (BIG // SLOT) * SLOT
    os.truncate(tmp_path / LOG_NAME, far)  # a slot's bytes planted 256 MiB in, after a hole
    with open(tmp_path / LOG_NAME, "r+b") as f:
        f.seek(0)
        head = f.read(SLOT)
        f.seek(far)
        f.write(head)
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as log:
        assert log.slots() == [0, 1] and len(log.corrupt_slots()) <= 8 * SLOT // 4096
        assert log.read(1)[1] == segs[1]["payload"]


# ---- 3: a slot whose segment id cannot belong to the log ------------------------------------------------


def _planted_far_segment(d: Path) -> int:
    """A closed session of 3 segments, then a slot with a valid header and payload for segment 10**12
    (written by the log itself, so every checksum holds); its slot."""
    _saved(d, 3)
    sid = 10**12
    with SegmentLog.open(d) as log:
        h, payload = log.read(2)
        fpb = CFG.frames_per_block
        return log.append(
            segment_id=sid, frame_start=sid * fpb, frame_end=(sid + 1) * fpb, pose=h.pose,
            codec=h.codec, position_state=h.position_state, position=sid * fpb, payload=payload,
            page_offsets=h.page_offsets,
        )  # fmt: skip


def test_a_segment_id_past_the_log_is_a_misfit_slot(tmp_path: Path) -> None:
    """Found in review: a slot header with a valid checksum and segment id 10**12 made the resume's
    restore loop run 10**12 times. A segment id no slot count of the log can reach is a slot that
    does not fit: skipped, reported as unusable."""
    d = tmp_path / "s"
    slot = _planted_far_segment(d)
    layout = SegmentLayout.from_config(CFG, "bf16", torch.float32)
    with SegmentLog.open(d) as log:
        assert slot in log.slots()
        stored = store.stored_segments(log, layout, CFG, d)
        assert sorted(stored) == [0, 1, 2]
        assert store.misfit(log.header(slot), layout, log.n_slots) is not None


def test_a_resume_skips_and_reports_a_segment_id_past_the_log(tmp_path: Path) -> None:
    d = tmp_path / "s"
    slot = _planted_far_segment(d)
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as s:
        assert s.step_index == 3
        reasons = {e.slot: e.reason for e in s.events if isinstance(e, CorruptSlot)}
        assert list(reasons) == [slot] and "segment id 1000000000000" in reasons[slot]
        assert not [e for e in s.events if isinstance(e, MissingSegment)]


# ---- 4: the atomic writers never write through a planted link -----------------------------------------


@pytest.mark.parametrize("name", [store.SESSION_FILE, store.WINDOW_FILE, INDEX_NAME])
def test_a_planted_tmp_symlink_is_not_written_through(tmp_path: Path, name: str) -> None:
    """Found in review: the atomic writers opened ``<name>.tmp`` with a plain open(): a symbolic link
    planted under that name in the session folder had the write go into the file it points to. Now
    the temporary file is created afresh (O_EXCL, O_NOFOLLOW): the link is replaced, its target left
    as it was, and the file itself written."""
    d = tmp_path / "s"
    _saved(d, 2)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    (d / f"{name}.tmp").symlink_to(outside)
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as s:
        s.run(POSES[2:3])  # close() writes session.json, window.bin and index.json
    assert outside.read_bytes() == b"keep me"
    assert not (d / f"{name}.tmp").exists() and not (d / f"{name}.tmp").is_symlink()
    if name != store.WINDOW_FILE:
        assert json.loads((d / name).read_text(encoding="utf-8"))
    saved = store.read_saved_state(d)
    assert saved is not None and saved["next_step"] == 3
    assert json.loads((d / META_NAME).read_text(encoding="utf-8"))["log_id"]
