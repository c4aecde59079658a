"""worldpager fixes from review 14: a slot found corrupt is retired (its payload's disk space given back,
a marker written over its header, never read as good again, never reported again), and a resume
reports a corrupt slot once, not at every later resume. Real log files on disk, and real sessions on
the "micro" stand-in (random weights, seeded); each test failed before its fix."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.world import WorldSessions
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.segment_log import (
    HEADER_SIZE,
    INDEX_NAME,
    LOG_NAME,
    MAGIC,
    META_NAME,
    CorruptSlotError,
    LogFullError,
    RetiredSlotError,
    SegmentLog,
    decode_header,
    slot_size_for,
)
from worldpager.session import SESSION_PRESETS, CorruptSlot, MissingSegment, Session
from worldpager.trajectory import yaw_sweep_trajectory

PAGE = 6000
SLOT = slot_size_for(2 * PAGE)
CFG = SESSION_PRESETS["micro"].on_the_fly()
POSES = yaw_sweep_trajectory(14)  # comes back: later segments retrieve segment 0
SEG = SegmentLayout.from_config(CFG, "bf16", torch.float32).payload_nbytes


def _segment(rng: random.Random, sid: int) -> dict[str, Any]:
    return {
        "segment_id": sid, "frame_start": 3 * sid, "frame_end": 3 * sid + 3, "pose": (0.0,) * 5,
        "codec": "bf16", "position_state": "post-rope", "position": 3 * sid,
        "payload": rng.randbytes(2 * PAGE), "page_offsets": (0, PAGE),
    }  # fmt: skip


def _filled(d: Path, n: int, **create: Any) -> tuple[SegmentLog, list[dict[str, Any]]]:
    rng = random.Random(14)
    log = SegmentLog.create(d, SLOT, **create)
    segs = [_segment(rng, i) for i in range(n)]
    for i, seg in enumerate(segs):
        assert log.append(**seg) == i
    return log, segs


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _holds_data(path: Path, start: int, end: int) -> bool:
    """Whether any disk block of [start, end) of the file holds data (not a hole)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        at = os.lseek(fd, start, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data from start to the end of the file
            return False
        raise
    finally:
        os.close(fd)
    return at < end


def _payload_held(path: Path, slot: int, slot_size: int) -> bool:
    return _holds_data(path, slot * slot_size + HEADER_SIZE, (slot + 1) * slot_size)


# ---- 1: a corrupt slot's space is given back, and it is never read as good again --------------------


def test_a_slot_marked_corrupt_gives_its_disk_space_back(tmp_path: Path) -> None:
    """Found in review: mark_corrupt took a slot out of the index, but its bytes stayed on disk for
    good: the log file grew past corrupt slots and never gave their space back. Now the slot is
    retired: its payload's blocks are given back (the file keeps its length: slot numbers are never
    reused, later slots stay where they are) and a marker replaces its header."""
    log, segs = _filled(tmp_path, 3)
    path = tmp_path / LOG_NAME
    _flip(path, SLOT + HEADER_SIZE + PAGE + 7)  # page 1 of slot 1
    assert _payload_held(path, 1, SLOT)
    with log:
        with pytest.raises(CorruptSlotError, match="payload checksum mismatch") as err:
            log.read(1)
        log.mark_corrupt(1, err.value.reason)
        assert not _payload_held(path, 1, SLOT)
        assert _payload_held(path, 0, SLOT) and _payload_held(path, 2, SLOT)
        assert path.stat().st_size == 3 * SLOT
        assert log.retired_slots() == {1: "payload checksum mismatch"}
        assert log.corrupt_slots() == {1: "payload checksum mismatch"}  # found by this log object
        assert [log.read(s)[1] for s in (0, 2)] == [segs[0]["payload"], segs[2]["payload"]]
        assert log.append(**segs[1]) == 3  # a slot number is never handed out again
    with open(path, "rb") as f:  # the old header is gone: no scan can take the slot for a segment
        assert f.read(len(MAGIC)) == MAGIC
        f.seek(SLOT)
        assert f.read(len(MAGIC)) != MAGIC
    for rebuild in (False, True):
        if rebuild:
            (tmp_path / INDEX_NAME).unlink()
        with SegmentLog.open(tmp_path) as again:
            assert again.index_state == ("rebuilt" if rebuild else "loaded")
            assert again.slots() == [0, 2, 3] and again.find(1) == 3
            with pytest.raises(CorruptSlotError, match="slot 1: payload checksum mismatch"):
                again.read(1)
            assert [again.read(s)[1] for s in (0, 2, 3)] == [segs[0]["payload"], segs[2]["payload"],
                                                            segs[1]["payload"]]  # fmt: skip


def test_a_retired_slot_is_not_reported_as_newly_corrupt_by_a_later_open(tmp_path: Path) -> None:
    """A log reopened lists in corrupt_slots() what it found corrupt itself, not the slots an earlier
    run retired (retired_slots()), with the index as saved or rebuilt by a scan."""
    log, _ = _filled(tmp_path, 3)
    _flip(tmp_path / LOG_NAME, 2 * SLOT + 40)  # the header of slot 2
    with log:
        with pytest.raises(CorruptSlotError, match="header checksum mismatch"):
            log.read(2)
        log.mark_corrupt(2, "header checksum mismatch")
    for rebuild in (False, True):
        if rebuild:
            (tmp_path / INDEX_NAME).unlink()
        with SegmentLog.open(tmp_path) as again:
            assert again.corrupt_slots() == {}
            assert again.retired_slots() == {2: "header checksum mismatch"}
            assert again.slots() == [0, 1]


def test_retire_corrupt_gives_back_what_a_reopen_found(tmp_path: Path) -> None:
    """Slots a reopen finds corrupt (here: a scan) are reported by it; retire_corrupt() retires them,
    and the index keeps them under ``corrupt`` too (an index without ``retired``, as written before,
    still reads: its corrupt slots are reported once more, then retired)."""
    log, segs = _filled(tmp_path, 4)
    log.close()
    path = tmp_path / LOG_NAME
    _flip(path, 1 * SLOT + HEADER_SIZE + 3)
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:  # an inspection: nothing destroyed by open alone
        assert again.corrupt_slots() == {1: "payload checksum mismatch"} and again.retired_slots() == {}
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index.pop("retired", None)  # as the index was written before retiring existed
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    assert _payload_held(path, 1, SLOT)
    with SegmentLog.open(tmp_path) as third:
        assert third.index_state == "loaded"
        assert third.corrupt_slots() == {1: "payload checksum mismatch"}
        assert third.retire_corrupt() == {1: "payload checksum mismatch"}
        assert third.corrupt_slots() == {1: "payload checksum mismatch"}  # this run still reports it
    assert not _payload_held(path, 1, SLOT)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["corrupt"] == {"1": "payload checksum mismatch"}  # headers + corrupt: every slot
    assert [e["slot"] for e in index["entries"]] == [0, 2, 3]
    with SegmentLog.open(tmp_path) as fourth:
        assert fourth.corrupt_slots() == {} and fourth.retired_slots() == {1: "payload checksum mismatch"}
        assert [fourth.read(s)[1] for s in (0, 2, 3)] == [segs[s]["payload"] for s in (0, 2, 3)]


def test_the_budget_counts_a_retired_slot_as_given_back(tmp_path: Path) -> None:
    """max_bytes bounds the disk space the log holds: a retired slot's payload no longer counts (its
    4 KiB marker does)."""
    log, segs = _filled(tmp_path, 3, max_bytes=3 * SLOT + HEADER_SIZE)
    with log:
        with pytest.raises(LogFullError):
            log.append(**segs[0])
        _flip(tmp_path / LOG_NAME, HEADER_SIZE + 1)
        with pytest.raises(CorruptSlotError) as err:
            log.read(0)
        log.mark_corrupt(0, err.value.reason)
        assert log.append(**segs[0]) == 3
    with SegmentLog.open(tmp_path) as again:  # the budget is full again, counted the same after a reopen
        with pytest.raises(LogFullError):
            again.append(**segs[1])
        assert again.read(3)[1] == segs[0]["payload"]


def test_a_slot_that_verifies_on_disk_is_never_destroyed(tmp_path: Path) -> None:
    """Never a lost good segment: a slot reported corrupt whose bytes verify in full when checked
    again (a transient read error) is kept and indexed again, and a slot written for another log
    (a file copied in) is left as it is for whoever owns it: neither is retired."""
    log, segs = _filled(tmp_path / "a", 3)
    with log:
        log.mark_corrupt(1, "payload checksum mismatch")  # the read failed, the bytes are good
        assert log.retired_slots() == {} and log.corrupt_slots() == {}
        assert log.slots() == [0, 1, 2] and log.read(1)[1] == segs[1]["payload"]
    other, _ = _filled(tmp_path / "b", 3)
    other.close()
    (tmp_path / "a" / LOG_NAME).write_bytes((tmp_path / "b" / LOG_NAME).read_bytes())
    (tmp_path / "a" / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path / "a") as copied:
        assert sorted(copied.corrupt_slots()) == [0, 1, 2]
        assert copied.retire_corrupt() == {}
        assert copied.retired_slots() == {}
    assert all(_payload_held(tmp_path / "a" / LOG_NAME, s, SLOT) for s in range(3))
    assert (tmp_path / "a" / LOG_NAME).read_bytes() == (tmp_path / "b" / LOG_NAME).read_bytes()


def test_a_retired_slot_marker_reads_as_retired_and_names_the_slot_size(tmp_path: Path) -> None:
    """The marker over a retired slot's header: decoded as retired (a damaged marker as corrupt), and
    with meta.json lost, a retired slot 0 still gives the log's slot size and id."""
    log, segs = _filled(tmp_path, 2)
    _flip(tmp_path / LOG_NAME, 100)  # slot 0's header
    with log:
        with pytest.raises(CorruptSlotError) as err:
            log.read(0)
        log.mark_corrupt(0, err.value.reason)
        log_id = log.log_id
    block = (tmp_path / LOG_NAME).read_bytes()[:HEADER_SIZE]
    with pytest.raises(RetiredSlotError) as retired:
        decode_header(block, 0)
    assert (retired.value.reason, retired.value.slot_size, retired.value.log_id) == (
        "header checksum mismatch", SLOT, log_id,
    )  # fmt: skip
    with pytest.raises(CorruptSlotError, match="header checksum mismatch"):
        decode_header(block[:50] + bytes([block[50] ^ 1]) + block[51:], 0)
    (tmp_path / META_NAME).unlink()
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:
        assert (again.slot_size, again.log_id) == (SLOT, log_id)
        assert again.slots() == [1] and again.read(1)[1] == segs[1]["payload"]
        assert again.retired_slots() == {0: "header checksum mismatch"} and again.corrupt_slots() == {}


# ---- 2: a resume reports a corrupt slot once ------------------------------------------------------


def _saved(d: Path, n: int) -> int:
    """A closed session of ``n`` segments in ``d`` (segment i in slot i); its slot size."""
    with Session(TinyCausalWan(CFG), log_dir=d, host_budget_bytes=16 * SEG) as s:
        s.run(POSES[:n])
        assert [s.handler.wait_written(i) for i in range(n)] == list(range(n))
        return s.log.slot_size


def _unusable(s: Session) -> tuple[dict[int, str], list[int]]:
    slots = {e.slot: e.reason for e in s.events if isinstance(e, CorruptSlot)}
    return slots, [e.segment_id for e in s.events if isinstance(e, MissingSegment)]


def test_a_resume_reports_a_corrupt_slot_once_and_gives_its_space_back(tmp_path: Path) -> None:
    """Found in review: every resume listed the same corrupt slots again (`CorruptSlot` events, the
    world host's ``corrupt_slots``, the client's ``unusable``), resume after resume, and the slots
    kept their disk space. Now the resume that finds a slot corrupt reports it and retires it; later
    resumes (with the index as saved, or rebuilt by a scan) report it no more. The segment it held
    is still reported missing each time (the log does not hold it), and no good segment is lost."""
    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    path = d / LOG_NAME
    _flip(path, 0 * slot_size + HEADER_SIZE + 100)  # met by the read-back of a trusted index
    _flip(path, 5 * slot_size + 40)  # met by the scan of a rebuilt index
    (d / INDEX_NAME).unlink()
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as a:  # reads all back
        assert _unusable(a) == ({0: "payload checksum mismatch", 5: "header checksum mismatch"}, [0, 5])
    assert not _payload_held(path, 0, slot_size) and not _payload_held(path, 5, slot_size)
    assert all(_payload_held(path, s, slot_size) for s in (1, 2, 3, 4, 6))
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=3 * SEG) as b:
        assert _unusable(b) == ({}, [0, 5])
        recs = b.run(POSES[7:11])
    assert any(r.retrieved for r in recs) and not any({0, 5} & set(r.retrieved) for r in recs)
    (d / INDEX_NAME).unlink()
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as c:
        assert c.log.index_state == "rebuilt"
        assert _unusable(c) == ({}, [0, 5]) and c.step_index == 11
    with SegmentLog.open(d) as log:
        assert log.slots() == [1, 2, 3, 4, *range(6, 11)] and log.corrupt_slots() == {}
        assert log.retired_slots() == {0: "payload checksum mismatch", 5: "header checksum mismatch"}


def test_a_world_resume_does_not_list_again_a_slot_a_step_reported(tmp_path: Path) -> None:
    """The world host: a slot a step found corrupt is in that step's ``corrupt`` list; the next
    resume's ``corrupt_slots`` no longer lists it (its segment is still in ``missing_segments``)."""
    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    _flip(d / LOG_NAME, 0 * slot_size + HEADER_SIZE + 100)
    ws = WorldSessions(torch.device("cpu"))
    opened = ws.open("world", TinyCausalWan(CFG), "s", 3 * SEG, d, resume=True)  # reads 3 back
    assert opened["corrupt_slots"] == {}
    try:
        steps = [ws.step("s", (p.x, p.y, p.z, p.pitch, p.yaw)) for p in POSES[7:12]]
    finally:
        ws.close("s")
    assert [c for r in steps for c in r["corrupt"]] == [
        {"segment": 0, "slot": 0, "reason": "payload checksum mismatch"}
    ]
    assert not _payload_held(d / LOG_NAME, 0, slot_size)
    for _ in range(2):
        again = ws.open("world", TinyCausalWan(CFG), "s", 3 * SEG, d, resume=True)
        try:
            assert again["corrupt_slots"] == {} and again["missing_segments"] == [0]
        finally:
            ws.close("s")


def test_a_slot_retired_by_a_run_that_stopped_before_its_index_write_is_not_reported_again(
    tmp_path: Path,
) -> None:
    """A run retired a slot but stopped before saving the index: the saved index still names the slot
    as a segment. The next resume's read-back meets its marker: the slot is dropped, not reported
    again (its segment is reported missing)."""
    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    _flip(d / LOG_NAME, 0 * slot_size + HEADER_SIZE + 100)
    stale = (d / INDEX_NAME).read_bytes()  # names slot 0 as segment 0
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as a:
        assert _unusable(a) == ({0: "payload checksum mismatch"}, [0])
    (d / INDEX_NAME).write_bytes(stale)  # as if a stopped before its index write
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as b:
        assert b.log.index_state == "loaded"
        assert _unusable(b) == ({}, [0]) and b.step_index == 7
    with SegmentLog.open(d) as log:
        assert log.retired_slots() == {0: "payload checksum mismatch"} and log.slots() == list(range(1, 7))


def test_the_sessions_keep_total_counts_the_blocks_a_retired_slot_gave_back(tmp_path: Path) -> None:
    """`sessions_keep` summed each file's length, so a segment log whose corrupt slots were retired
    (their blocks given back, the file's length kept) still counted them, and old sessions were
    pruned for room that was free."""
    from manager.live_sessions import _du

    f = tmp_path / "segments.log"
    with open(f, "wb") as out:
        out.truncate(64 * 1024 * 1024)  # a hole of 64 MiB: no block on disk
        out.write(b"x" * 4096)
    size, _ = _du(tmp_path)
    assert f.stat().st_size >= 64 * 1024 * 1024
    assert size < 1024 * 1024
