"""Review 15, the segment log: a run of never-written slots between written ones (a hole) is retired at
once -- one marker naming the run over its first slot's header and one hole punched over the rest --
where it was retired slot by slot before (a marker write and a hole punch per slot). The index keeps
naming every retired slot as before (``retired``: slot -> space given back), so readers before runs
read it; a scan reads the run from its marker. Syscalls are counted with spies, never timed."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worldpager import segment_log
from worldpager.segment_header import (
    HEADER_SIZE,
    RetiredSlotError,
    decode_header,
    encode_header,
    encode_retired,
)
from worldpager.segment_log import INDEX_NAME, LOG_NAME, SegmentLog, slot_size_for

PAGE = 6000
SLOT = slot_size_for(2 * PAGE)
HOLE = 1000  # never-written slots in a row
NEVER = "never written: its header is all zeros"


def _segment(rng: random.Random, sid: int) -> dict[str, Any]:
    return {
        "segment_id": sid, "frame_start": 3 * sid, "frame_end": 3 * sid + 3, "pose": (0.0,) * 5,
        "codec": "bf16", "position_state": "post-rope", "position": 3 * sid,
        "payload": rng.randbytes(2 * PAGE), "page_offsets": (0, PAGE),
    }  # fmt: skip


def _log_with_a_hole(d: Path) -> dict[str, Any]:
    """Slot 0 written, slots 1 .. HOLE never written (a hole in the file), slot HOLE + 1 written (its
    bytes planted, every checksum holding); no index: a reopen scans. The planted slot's segment."""
    seg = _segment(random.Random(15), 7)
    with SegmentLog.create(d, SLOT) as log:
        assert log.append(**seg) == 0
        h, payload = log.read(0)
        log_id = log.log_id
    at = HOLE + 1
    fd = os.open(d / LOG_NAME, os.O_RDWR)
    try:
        os.pwrite(fd, encode_header(h, at, SLOT, log_id) + payload, at * SLOT)
        os.ftruncate(fd, (at + 1) * SLOT)
    finally:
        os.close(fd)
    (d / INDEX_NAME).unlink()
    return seg


class _Spy:
    """Counts the syscalls the log makes: writes, hole punches, reads, seeks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter[str] = Counter()
        for name in ("pwritev", "pwrite", "pread", "lseek", "fstat", "ftruncate"):
            monkeypatch.setattr(os, name, self._count(name, getattr(os, name)))
        monkeypatch.setattr(segment_log, "_punch_hole", self._count("punch", segment_log._punch_hole))

    def _count(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            return fn(*a, **kw)

        return call


def test_a_long_hole_is_retired_at_once_and_reopens_as_retired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = _log_with_a_hole(tmp_path)
    hole = {s: NEVER for s in range(1, HOLE + 1)}
    with SegmentLog.open(tmp_path) as log:
        assert log.index_state == "rebuilt" and log.slots() == [0, HOLE + 1]
        assert log.corrupt_slots() == hole  # reported by this reopen, for its caller to report
        spy = _Spy(monkeypatch)
        assert log.retire_corrupt() == hole  # each slot once
        monkeypatch.undo()
        # one marker naming the run and one of one over its last slot (was: 1,000)
        assert spy.calls["pwritev"] == 2
        assert spy.calls["punch"] == 2  # the run's space up to its last header, then that slot's (was: 1,000)
        assert sum(spy.calls.values()) <= 12, spy.calls  # (index write included; was: > 4,000)
        assert log.retired_slots() == hole
    path = tmp_path / LOG_NAME
    with open(path, "rb") as f:  # the marker over slot 1 names the run
        f.seek(SLOT)
        with pytest.raises(RetiredSlotError) as err:
            decode_header(f.read(HEADER_SIZE), 1)
    assert (err.value.run, err.value.reason) == (HOLE, NEVER)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["retired"] == {str(s): True for s in hole}  # per slot, as readers before runs read it
    assert index["corrupt"] == {str(s): NEVER for s in hole}
    for rebuild in (False, True):  # the index as saved, then a scan (the run read from its marker)
        if rebuild:
            (tmp_path / INDEX_NAME).unlink()
        with SegmentLog.open(tmp_path) as again:
            assert again.index_state == ("rebuilt" if rebuild else "loaded")
            assert again.retired_slots() == hole
            assert all(again._retired[s] for s in hole)  # their space given back, read so by a scan too
            assert again.corrupt_slots() == {}  # reported once: not again by a later reopen
            assert again.slots() == [0, HOLE + 1] and again.n_slots == HOLE + 2
            assert again.read(HOLE + 1)[1] == seg["payload"]
            assert again.bytes_read < 8 * SLOT  # the hole is skipped, not read
            assert again.retire_corrupt() == {}
    with SegmentLog.open(tmp_path) as log:
        assert log.append(**seg) == HOLE + 2  # slot numbers are never handed out again


def test_a_run_past_the_end_of_the_file_keeps_its_slot_numbers(tmp_path: Path) -> None:
    """Slots a stale index names but the file ends before (cut off) are retired as one run too; the file
    then reaches the run's last slot, so a scan without the index still counts them."""
    rng = random.Random(15)
    with SegmentLog.create(tmp_path, SLOT) as log:
        for i in range(40):
            log.append(**_segment(rng, i))
    os.truncate(tmp_path / LOG_NAME, 2 * SLOT)  # slots 2 .. 39 lost
    missing = {s: "missing: the index names it but the log file ends before it" for s in range(2, 40)}
    with SegmentLog.open(tmp_path) as log:
        assert log.corrupt_slots() == missing
        assert log.retire_corrupt() == missing
    for rebuild in (False, True):
        if rebuild:
            (tmp_path / INDEX_NAME).unlink()
        with SegmentLog.open(tmp_path) as again:
            assert again.retired_slots() == missing and again.corrupt_slots() == {}
            assert again.n_slots == 40 and again.slots() == [0, 1]
    with open(tmp_path / LOG_NAME, "rb") as f:  # the run's last slot has a marker of its own
        f.seek(39 * SLOT)
        with pytest.raises(RetiredSlotError) as err:
            decode_header(f.read(HEADER_SIZE), 39)
    # (a reader from before runs, scanning, read the never-written slots after the run's first
    # marker as the log's tail, cut them off, and handed slots 3 .. 39 out again; found in review)
    assert err.value.run == 1
    with SegmentLog.open(tmp_path) as log:
        assert log.append(**_segment(rng, 99)) == 40


def test_holes_with_different_reasons_and_corrupt_slots_between_them_are_separate_runs(
    tmp_path: Path,
) -> None:
    """A slot with bytes (a torn header) is checked again and retired alone; the never-written slots on
    either side are runs of their own."""
    _log_with_a_hole(tmp_path)
    with open(tmp_path / LOG_NAME, "r+b") as f:  # slot 500: a header that fails its checks
        f.seek(500 * SLOT + 100)
        f.write(b"\xff")
    with SegmentLog.open(tmp_path) as log:
        found = log.corrupt_slots()
        assert found[500] == "bad magic" and len(found) == HOLE
        assert log.retire_corrupt() == found
    for rebuild in (False, True):
        if rebuild:
            (tmp_path / INDEX_NAME).unlink()
        with SegmentLog.open(tmp_path) as again:
            assert again.retired_slots() == found and again.corrupt_slots() == {}


def test_a_marker_of_one_slot_is_byte_for_byte_the_one_before_runs() -> None:
    """Readers before runs read every marker: a run of one is written exactly as before, and a run's
    length lies past the reason, where they never look."""
    one = encode_retired(3, SLOT, "bad magic", 42)
    assert one == encode_retired(3, SLOT, "bad magic", 42, run=1)
    run = encode_retired(3, SLOT, "bad magic", 42, run=HOLE)
    differ = [i for i in range(HEADER_SIZE) if one[i] != run[i]]
    assert differ and min(differ) >= 28 + 1024  # past the fixed fields and the longest reason
    assert max(differ) >= HEADER_SIZE - 4  # (the block's crc32 covers it)
    with pytest.raises(ValueError, match="1 to 2\\*\\*64-1 slots, not 0"):
        encode_retired(3, SLOT, "x", run=0)
