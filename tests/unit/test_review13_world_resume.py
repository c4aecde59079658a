"""Found in the review of world-session resume (workers/world.py, worldpager/session_store.py,
worldpager/segment_log.py) in review 13; each test failed before its fix. Real WorldPager sessions on
the "micro" stand-in (random weights, seeded) and real log files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from workers.world import WorldSessions
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.page_types import Corrupt
from worldpager.retrieval import Pose
from worldpager.segment_log import HEADER_SIZE, INDEX_NAME, LOG_NAME, SegmentLog
from worldpager.session import SESSION_PRESETS, CorruptSlot, MissingSegment, Session
from worldpager.trajectory import yaw_sweep_trajectory

CFG = SESSION_PRESETS["micro"].on_the_fly()
POSES = yaw_sweep_trajectory(14)  # comes back: later segments retrieve segment 0
SEG = SegmentLayout.from_config(CFG, "bf16", torch.float32).payload_nbytes


def _pose(p: Pose) -> tuple[float, float, float, float, float]:
    return (p.x, p.y, p.z, p.pitch, p.yaw)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _saved(d: Path, n: int) -> int:
    """A closed session of ``n`` segments in ``d`` (segment i in slot i); its slot size."""
    with Session(TinyCausalWan(CFG), log_dir=d, host_budget_bytes=16 * SEG) as s:
        s.run(POSES[:n])
        assert [s.handler.wait_written(i) for i in range(n)] == list(range(n))
        return s.log.slot_size


def _unusable(s: Session) -> tuple[dict[int, str], list[int]]:
    slots = {e.slot: e.reason for e in s.events if isinstance(e, CorruptSlot)}
    return slots, [e.segment_id for e in s.events if isinstance(e, MissingSegment)]


def test_a_slot_found_corrupt_on_read_back_stays_out_of_later_resumes(tmp_path: Path) -> None:
    """Found in review: a slot that resume's read-back found corrupt stayed in index.json as a good
    entry. A later resume with a smaller host budget did not read it back: it was registered as a
    stored segment (not reported, not missing), chosen by retrieval and failed at a step (a `Corrupt`
    event, one memory fewer). Now the read-back marks it corrupt in the log's index."""
    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    _flip(d / LOG_NAME, 0 * slot_size + HEADER_SIZE + 100)  # segment 0, retrieved on the way back
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as a:  # reads all back
        assert _unusable(a) == ({0: "payload checksum mismatch"}, [0])
    index = json.loads((d / INDEX_NAME).read_text())
    assert index["corrupt"] == {"0": "payload checksum mismatch"}
    assert [e["slot"] for e in index["entries"]] == list(range(1, 7))  # no good segment lost
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=3 * SEG) as b:  # reads 3 back
        assert _unusable(b) == ({}, [0])  # retired by the resume that found it: reported once
        recs = b.run(POSES[7:11])
        assert not [e for e in b.events if isinstance(e, Corrupt)]
    assert any(r.retrieved for r in recs)
    assert not any(0 in r.retrieved for r in recs)
    with SegmentLog.open(d) as log:
        assert log.slots() == list(range(1, 11)) and log.corrupt_slots() == {}
        assert log.retired_slots() == {0: "payload checksum mismatch"}


def test_a_slot_of_another_codec_is_skipped_not_fatal(tmp_path: Path) -> None:
    """Found in review: one slot of another codec with the same slot size made the whole resume
    fail ("slot 7 (segment 7) does not fit this session"), with every good segment of the session
    in the log. Now such a slot is reported as unusable and skipped; a good older copy of its
    segment is used."""
    d = tmp_path / "s"
    _saved(d, 7)
    with SegmentLog.open(d) as log:
        for sid in (7, 3):  # a new segment, and a later copy of segment 3, both int8
            log.append(
                segment_id=sid, frame_start=3 * sid, frame_end=3 * sid + 3, pose=(0.0,) * 5,
                codec="int8", position_state="post-rope", position=3 * sid, payload=bytes(SEG),
            )  # fmt: skip
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as s:
        slots, missing = _unusable(s)
        assert s.step_index == 7 and missing == []
        assert slots == {
            7: "does not fit this session: codec int8, expected bf16",
            8: "does not fit this session: codec int8, expected bf16",
        }
        assert [r.step for r in s.run(POSES[7:9])] == [7, 8]
    with SegmentLog.open(d) as log:  # the foreign slots stay as they were: nothing is rewritten
        assert log.header(7).codec == log.header(8).codec == "int8" and log.corrupt_slots() == {}
        assert log.find(7) == 9 and log.find(3) == 8


def test_a_step_reports_a_corrupt_slot_it_met(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: the device host reported corrupt slots only when a session reopened; a slot
    that failed its check when a step read it back was said nowhere (the step's data had no word of
    it, the host's log neither). Now the step's data lists it (``corrupt``) and the host logs it."""
    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    _flip(d / LOG_NAME, 0 * slot_size + HEADER_SIZE + 100)
    ws = WorldSessions(torch.device("cpu"))
    opened = ws.open("world", TinyCausalWan(CFG), "s", 3 * SEG, d, resume=True)  # reads 3 back
    assert opened["corrupt_slots"] == {} and opened["next_segment"] == 7
    caplog.set_level(logging.WARNING, logger="workers.world")
    try:
        steps = [ws.step("s", _pose(p)) for p in POSES[7:12]]
    finally:
        ws.close("s")
    met = [c for r in steps for c in r["corrupt"]]
    assert met == [{"segment": 0, "slot": 0, "reason": "payload checksum mismatch"}]
    assert sum(1 for r in steps if r["corrupt"]) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.world"]
    assert lines == [
        f"world session 's': segment 0 (slot 0 of {d / LOG_NAME}): payload checksum mismatch; never used"
    ]
    # kept out of the log's index: the next resume neither counts segment 0 as stored nor reads it
    again = ws.open("world", TinyCausalWan(CFG), "s", 3 * SEG, d, resume=True)
    try:
        assert again["corrupt_slots"] == {}  # reported by the step that met it, then retired
        assert 0 in again["missing_segments"]
    finally:
        ws.close("s")


def _copy_log(src: Path, dst: Path, *names: str) -> None:
    for name in names:
        (dst / name).write_bytes((src / name).read_bytes())


def test_a_log_file_copied_from_another_session_is_not_taken_for_its_history(tmp_path: Path) -> None:
    """Found in review: with index.json missing, a segments.wplog copied from another session of the
    same preset and codec was scanned, found valid and resumed as this session's history (another
    session's frames attended to, nothing reported). Each log now has a random id, written into
    meta.json, index.json and every slot's header: a slot of another log is corrupt to this one."""
    a, b = tmp_path / "a", tmp_path / "b"
    _saved(a, 7)
    with Session(TinyCausalWan(CFG), log_dir=b, host_budget_bytes=16 * SEG, seed=5) as s:
        s.run(list(reversed(POSES))[:7])
    _copy_log(b, a, LOG_NAME)
    (a / INDEX_NAME).unlink()
    with Session.resume(a, TinyCausalWan(CFG), host_budget_bytes=16 * SEG) as s:
        slots, missing = _unusable(s)
        assert s.step_index == 7 and missing == list(range(7)) and sorted(slots) == list(range(7))
        assert all(r.startswith("written for another log (id ") for r in slots.values())
        recs = s.run(POSES[7:9])
    assert all(r.retrieved == () for r in recs)  # none of b's segments attended to
    with SegmentLog.open(b) as log:  # b's own log is as it was
        assert log.slots() == list(range(7)) and log.corrupt_slots() == {}


def test_a_log_copied_with_its_meta_from_another_session_is_refused(tmp_path: Path) -> None:
    """The log and its meta.json (and index) copied together: session.json names its own log's id."""
    a, b = tmp_path / "a", tmp_path / "b"
    _saved(a, 7)
    _saved(b, 7)
    want = json.loads((a / "meta.json").read_text())["log_id"]
    assert json.loads((a / "session.json").read_text())["log_id"] == want != 0
    _copy_log(b, a, LOG_NAME, "meta.json", INDEX_NAME)
    with pytest.raises(
        ValueError, match=rf"another one than session.json was saved with .*expected {want:x}"
    ):
        Session.resume(a, TinyCausalWan(CFG), host_budget_bytes=16 * SEG)


def test_a_log_from_before_log_ids_is_read_as_before(tmp_path: Path) -> None:
    """Compatibility: a log whose headers, meta.json, index.json and session.json carry no id (as
    written before ids) resumes with no check, and one whose index has no id is rebuilt, not lost."""
    from worldpager.segment_header import decode_header, encode_header

    d = tmp_path / "s"
    slot_size = _saved(d, 7)
    with open(d / LOG_NAME, "r+b") as f:  # the headers as the format wrote them before ids
        for slot in range(7):
            h, _ = decode_header(f.read(HEADER_SIZE), slot)
            f.seek(slot * slot_size)
            f.write(encode_header(h, slot, slot_size))
            f.seek((slot + 1) * slot_size)
    for name in ("meta.json", INDEX_NAME, "session.json"):
        doc = json.loads((d / name).read_text())
        del doc["log_id"]
        (d / name).write_text(json.dumps(doc))
    with Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=3 * SEG) as s:
        assert s.log.log_id == 0 and s.log.index_state == "loaded"
        assert _unusable(s) == ({}, []) and s.step_index == 7
        s.run(POSES[7:10])
    with SegmentLog.open(d) as log:
        assert log.log_id == 0 and log.slots() == list(range(10)) and log.corrupt_slots() == {}
    log = SegmentLog.create(tmp_path / "n", slot_size)
    log.close()
    index = json.loads((tmp_path / "n" / INDEX_NAME).read_text())
    del index["log_id"]  # an index written by the code before ids, of a log with an id
    (tmp_path / "n" / INDEX_NAME).write_text(json.dumps(index))
    with SegmentLog.open(tmp_path / "n") as again:
        assert again.index_state == "rebuilt" and again.log_id == log.log_id != 0


def test_the_stream_tells_its_client_of_a_corrupt_slot_a_step_met() -> None:
    """The step's `corrupt` list reached the host's log only: the client's `unusable` listed what a
    reopen found, never what a step's retrieval found."""
    from manager.api.world import _output

    step = {
        "step": 9, "latents": b"", "shape": [1], "stall_s": 0.0, "compute_s": 0.1, "lease_bytes": 1,
        "host_bytes": 0, "hits": 0, "misses": 1, "bytes_read": 0, "bytes_written": 0,
        "max_position": 30, "corrupt": [{"segment": 0, "slot": 0, "reason": "payload checksum mismatch"}],
    }  # fmt: skip
    assert list(_output("s", step).unusable) == ["segment 0: slot 0: payload checksum mismatch"]
    assert list(_output("s", {**step, "corrupt": []}).unusable) == []
