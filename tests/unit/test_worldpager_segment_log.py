"""worldpager.segment_log: the append-only NVMe log of segment KV payloads (reference §6)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldpager import segment_log as sl
from worldpager.segment_log import (
    HEADER_SIZE,
    INDEX_NAME,
    LOG_NAME,
    MAGIC,
    SLOT_ALIGN,
    CorruptSlotError,
    LogFullError,
    SegmentHeader,
    SegmentLog,
    decode_header,
    encode_header,
    slot_size_for,
)

PAGE_MAX = 3000
SLOT = slot_size_for(4 * PAGE_MAX)


def segment(rng: random.Random, segment_id: int, n_pages: int | None = None) -> dict[str, Any]:
    """append() keyword arguments for a random segment of 2-4 layer pages."""
    pages = [rng.randbytes(rng.randint(1, PAGE_MAX)) for _ in range(n_pages or rng.randint(2, 4))]
    offsets = [sum(len(p) for p in pages[:i]) for i in range(len(pages))]
    return {
        "segment_id": segment_id,
        "frame_start": 3 * segment_id,
        "frame_end": 3 * segment_id + 3,
        "pose": (rng.uniform(-50, 50), 0.0, rng.uniform(-50, 50), rng.uniform(-30, 30), rng.random()),
        "codec": rng.choice(["bf16", "int4-g64"]),
        "position_state": rng.choice(["post-rope", "pre-rope"]),
        "position": 3 * segment_id,
        "payload": b"".join(pages),
        "page_offsets": offsets,
    }


def pages_of(seg: dict[str, Any]) -> list[bytes]:
    ends = [*seg["page_offsets"][1:], len(seg["payload"])]
    return [seg["payload"][a:b] for a, b in zip(seg["page_offsets"], ends, strict=True)]


def assert_matches(h: SegmentHeader, seg: dict[str, Any]) -> None:
    assert (h.segment_id, h.frame_start) == (seg["segment_id"], seg["frame_start"])
    assert h.frame_end == seg["frame_end"]
    assert h.pose == tuple(seg["pose"])
    assert (h.codec, h.position_state, h.position) == (seg["codec"], seg["position_state"], seg["position"])
    assert h.payload_len == len(seg["payload"])
    assert h.page_offsets == tuple(seg["page_offsets"])


def filled(directory: Path, n: int, seed: int = 0, **create: Any) -> tuple[SegmentLog, list[dict[str, Any]]]:
    rng = random.Random(seed)
    log = SegmentLog.create(directory, SLOT, **create)
    segs = [segment(rng, 10 + i) for i in range(n)]
    for i, seg in enumerate(segs):
        assert log.append(**seg) == i
    return log, segs


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ---- layout ------------------------------------------------------------------------------------


def test_slot_size_for_is_a_header_block_plus_the_payload_rounded_to_4k() -> None:
    assert slot_size_for(0) == HEADER_SIZE == SLOT_ALIGN == 4096
    assert slot_size_for(1) == slot_size_for(4096) == 8192
    assert slot_size_for(4097) == 12288
    with pytest.raises(ValueError):
        slot_size_for(-1)


def test_create_rejects_unaligned_slots_and_an_existing_log(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        SegmentLog.create(tmp_path / "a", 4096 + 512)
    SegmentLog.create(tmp_path / "b", 8192).close()
    with pytest.raises(FileExistsError):
        SegmentLog.create(tmp_path / "b", 8192)


def test_round_trip(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 6)
    with log:
        assert log.slots() == list(range(6))
        for slot, seg in enumerate(segs):
            h, payload = log.read(slot)
            assert_matches(h, seg)
            assert payload == seg["payload"]
            assert log.header(slot) == h
            assert log.find(seg["segment_id"]) == slot
        assert log.find(999) is None
        assert log.bytes_written == sum(HEADER_SIZE + len(s["payload"]) for s in segs)


def test_every_slot_is_4k_aligned_and_the_file_is_slots_times_slot_size(tmp_path: Path) -> None:
    log, _ = filled(tmp_path, 5)
    with log:
        raw = (tmp_path / LOG_NAME).read_bytes()
        assert len(raw) == 5 * SLOT == log.n_slots * log.slot_size
        for slot in log.slots():
            offset = slot * log.slot_size
            assert offset % SLOT_ALIGN == 0
            assert raw[offset : offset + len(MAGIC)] == MAGIC
            h, _ = decode_header(raw[offset : offset + HEADER_SIZE], slot)
            assert h == log.header(slot)


def test_read_page_returns_exactly_that_page_and_reads_only_it(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 4)
    with log:
        for slot, seg in enumerate(segs):
            for layer, page in enumerate(pages_of(seg)):
                before = log.bytes_read
                assert log.read_page(slot, layer) == page
                assert log.bytes_read - before == len(page)
            with pytest.raises(IndexError):
                log.read_page(slot, len(seg["page_offsets"]))


def test_reopen_after_close_gives_the_same_log(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 5)
    headers = [log.header(s) for s in log.slots()]
    log.close()
    log.close()  # idempotent
    with SegmentLog.open(tmp_path) as again:
        assert again.index_state == "loaded"
        assert again.slots() == list(range(5))
        assert [again.header(s) for s in again.slots()] == headers
        assert again.read(3)[1] == segs[3]["payload"]
        assert again.append(**segment(random.Random(9), 99)) == 5
        assert again.find(99) == 5


def test_reopen_after_a_crash_scans_the_slots_appended_since_the_last_flush(tmp_path: Path) -> None:
    log, segs = filled(tmp_path / "live", 3)
    with log:
        log.flush()
        extra = [segment(random.Random(5), 50 + i) for i in range(2)]
        for seg in extra:
            log.append(**seg)
        shutil.copytree(tmp_path / "live", tmp_path / "crashed")  # index.json still says 3 slots
    with SegmentLog.open(tmp_path / "crashed") as again:
        assert again.index_state == "extended"
        assert again.slots() == list(range(5))
        for slot, seg in enumerate(segs + extra):
            assert again.read(slot)[1] == seg["payload"]
    with SegmentLog.open(tmp_path / "crashed") as third:
        assert third.index_state == "loaded"


def test_reopen_without_the_index_rebuilds_it_by_scanning(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 4)
    headers = [log.header(s) for s in log.slots()]
    log.close()
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:
        assert again.index_state == "rebuilt"
        assert [again.header(s) for s in again.slots()] == headers
        assert again.corrupt_slots() == {}
    assert (tmp_path / INDEX_NAME).exists()
    (tmp_path / INDEX_NAME).write_text("{not json")
    with SegmentLog.open(tmp_path) as third:
        assert third.index_state == "rebuilt"
        assert third.read(2)[1] == segs[2]["payload"]


def test_reopen_without_meta_reads_the_slot_size_from_a_header(tmp_path: Path) -> None:
    log, _ = filled(tmp_path, 2, max_bytes=10 * SLOT)
    log.close()
    (tmp_path / sl.META_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:
        assert again.slot_size == SLOT
        assert again.slots() == [0, 1]


# ---- corruption --------------------------------------------------------------------------------


def test_a_corrupt_payload_byte_fails_read_and_its_page_but_not_the_other_pages(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 3)
    seg = segs[1]
    pages = pages_of(seg)
    flip_byte(tmp_path / LOG_NAME, SLOT + HEADER_SIZE + seg["page_offsets"][1] + 5)  # page 1 of slot 1
    with log:
        with pytest.raises(CorruptSlotError, match="payload checksum") as err:
            log.read(1)
        assert err.value.slot == 1
        assert log.read_page(1, 0) == pages[0]
        with pytest.raises(CorruptSlotError, match="page 1 checksum") as err:
            log.read_page(1, 1)
        assert err.value.slot == 1
        assert log.read(0)[1] == segs[0]["payload"]
        assert log.read(2)[1] == segs[2]["payload"]
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:  # a full scan checks payloads too
        assert again.corrupt_slots() == {1: "payload checksum mismatch"}
        assert again.slots() == [0, 2]
        with pytest.raises(CorruptSlotError):
            again.read_page(1, 0)


def test_a_corrupt_header_magic_is_reported_not_indexed(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 3)
    flip_byte(tmp_path / LOG_NAME, SLOT + 0)
    with pytest.raises(CorruptSlotError, match="bad magic") as err:
        log.read(1)
    assert err.value.slot == 1
    log.close()
    (tmp_path / INDEX_NAME).unlink()
    with SegmentLog.open(tmp_path) as again:
        assert again.corrupt_slots() == {1: "bad magic"}
        assert again.slots() == [0, 2]
        assert again.find(segs[1]["segment_id"]) is None
        with pytest.raises(CorruptSlotError, match="bad magic"):
            again.header(1)
        assert again.read(2)[1] == segs[2]["payload"]
        assert again.append(**segs[1]) == 3  # a corrupt slot is never reused
        assert again.find(segs[1]["segment_id"]) == 3


def test_a_header_byte_flip_fails_the_header_checksum(tmp_path: Path) -> None:
    log, _ = filled(tmp_path, 2)
    flip_byte(tmp_path / LOG_NAME, 2 * 8 * 6)  # inside the fixed fields of slot 0
    with log, pytest.raises(CorruptSlotError, match="header checksum"):
        log.read(0)


def test_a_truncated_file_is_detected_and_reported_on_open(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 3)
    os.truncate(tmp_path / LOG_NAME, 2 * SLOT + HEADER_SIZE + 100)  # slot 2 cut inside its payload
    with pytest.raises(CorruptSlotError, match="truncated") as err:
        log.read(2)
    assert err.value.slot == 2
    with pytest.raises(CorruptSlotError, match="beyond end"):
        log.read(7)
    log.close()
    with SegmentLog.open(tmp_path) as again:
        assert again.index_state == "rebuilt"  # the file is shorter than the index says
        assert 2 not in again.slots()
        assert "truncated" in again.corrupt_slots()[2]
        with pytest.raises(CorruptSlotError, match="truncated"):
            again.read(2)
        assert again.read(1)[1] == segs[1]["payload"]
        new = segment(random.Random(3), 77)
        assert again.append(**new) == 3
    with SegmentLog.open(tmp_path) as third:
        assert third.index_state == "loaded"
        assert third.slots() == [0, 1, 3]
        assert third.read(3)[1] == new["payload"]
        assert "truncated" in third.corrupt_slots()[2]


def test_slots_the_index_names_past_a_cut_file_are_reported_missing_and_never_reused(tmp_path: Path) -> None:
    """The log file was cut at a slot boundary (or replaced by a shorter one) after its index was saved:
    the slots the index names that are wholly gone are reported missing, not silently dropped, and
    their numbers are not handed out again."""
    log, segs = filled(tmp_path, 5)
    log.close()  # index.json names slots 0-4
    os.truncate(tmp_path / LOG_NAME, 3 * SLOT)  # slots 3 and 4 gone whole: nothing of them to scan
    with SegmentLog.open(tmp_path) as again:
        assert again.index_state == "rebuilt"
        assert again.slots() == [0, 1, 2]
        assert set(again.corrupt_slots()) == {3, 4}
        assert all(r.startswith("missing") for r in again.corrupt_slots().values())
        assert again.find(segs[3]["segment_id"]) is None and again.find(segs[4]["segment_id"]) is None
        for slot in (3, 4):
            with pytest.raises(CorruptSlotError, match="missing"):
                again.read(slot)
        assert again.read(2)[1] == segs[2]["payload"]
        assert again.append(**segs[3]) == 5  # a missing slot is never reused
    with SegmentLog.open(tmp_path) as third:  # the saved index keeps the report
        assert third.index_state == "loaded"
        assert third.slots() == [0, 1, 2, 5] and set(third.corrupt_slots()) == {3, 4}
        assert third.read(5)[1] == segs[3]["payload"]


def test_a_file_cut_inside_a_header_is_reported_too(tmp_path: Path) -> None:
    log, _ = filled(tmp_path, 2)
    log.close()
    os.truncate(tmp_path / LOG_NAME, SLOT + 100)
    with SegmentLog.open(tmp_path) as again:
        assert again.slots() == [0]
        assert again.corrupt_slots() == {1: "truncated: header past end of file"}


# ---- full disk, bad input ------------------------------------------------------------------------


def test_the_max_bytes_budget_raises_log_full_and_keeps_the_log_consistent(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 3, max_bytes=3 * SLOT + 100)
    size = (tmp_path / LOG_NAME).stat().st_size
    with pytest.raises(LogFullError):
        log.append(**segment(random.Random(1), 500))
    assert (tmp_path / LOG_NAME).stat().st_size == size
    assert log.slots() == [0, 1, 2] and log.find(500) is None
    for slot, seg in enumerate(segs):
        assert log.read(slot)[1] == seg["payload"]
    log.close()
    with SegmentLog.open(tmp_path) as again:
        assert again.index_state == "loaded"
        assert again.slots() == [0, 1, 2] and again.corrupt_slots() == {}
        with pytest.raises(LogFullError):  # the budget is kept in meta.json
            again.append(**segs[0])
    with SegmentLog.open(tmp_path, max_bytes=4 * SLOT) as bigger:
        assert bigger.append(**segs[0]) == 3


def test_enospc_raises_log_full_and_undoes_the_partial_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log, _ = filled(tmp_path, 2)
    real = os.pwritev

    def half_then_full(fd: int, buffers: Any, offset: int) -> int:
        monkeypatch.setattr(os, "pwritev", disk_full)
        return real(fd, [memoryview(buffers[0])[:1000]], offset)  # a torn write, then ENOSPC

    def disk_full(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", half_then_full)
    with pytest.raises(LogFullError):
        log.append(**segment(random.Random(2), 600))
    monkeypatch.setattr(os, "pwritev", real)
    assert (tmp_path / LOG_NAME).stat().st_size == 2 * SLOT
    assert log.slots() == [0, 1] and log.n_slots == 2
    new = segment(random.Random(4), 601)
    assert log.append(**new) == 2
    log.close()
    with SegmentLog.open(tmp_path) as again:
        assert again.slots() == [0, 1, 2]
        assert again.read(2)[1] == new["payload"]


def test_a_payload_larger_than_the_slot_is_refused(tmp_path: Path) -> None:
    with SegmentLog.create(tmp_path, slot_size_for(1000)) as log:
        seg = segment(random.Random(0), 1)
        seg["payload"], seg["page_offsets"] = bytes(4097), (0,)
        with pytest.raises(ValueError, match="slot capacity"):
            log.append(**seg)
        seg["payload"] = bytes(4096)  # exactly the capacity fits
        assert log.append(**seg) == 0
        assert (tmp_path / LOG_NAME).stat().st_size == 8192


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("codec", "x" * 17),
        ("position_state", "a\0b"),
        ("pose", tuple(range(9))),
        ("pose", (0.0, float("nan"))),
        ("page_offsets", (0, 100, 50)),
        ("page_offsets", (0, 10**6)),
        ("frame_end", -1),
    ],
)
def test_invalid_headers_are_refused_before_writing(tmp_path: Path, field: str, value: object) -> None:
    with SegmentLog.create(tmp_path, SLOT) as log:
        seg = segment(random.Random(0), 1)
        seg[field] = value
        with pytest.raises(ValueError):
            log.append(**seg)
        assert log.n_slots == 0 and (tmp_path / LOG_NAME).stat().st_size == 0


def test_a_closed_log_refuses_io(tmp_path: Path) -> None:
    log, segs = filled(tmp_path, 1)
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.read(0)
    with pytest.raises(ValueError, match="closed"):
        log.append(**segs[0])


def test_encode_decode_header_round_trip_and_slot_check() -> None:
    pose = (1.5, -2.0, 0.25)
    h = SegmentHeader(7, 21, 24, pose, "int4-g64", "pre-rope", 21, 300, (0, 100, 200), 1, (2, 3, 4))
    block = encode_header(h, 5, SLOT)
    assert len(block) == HEADER_SIZE
    assert decode_header(block, 5) == (h, SLOT)
    with pytest.raises(CorruptSlotError, match="belongs to slot 5"):
        decode_header(block, 6)
    assert h.page_range(2) == (200, 300) and h.n_pages == 3


def test_one_writer_and_several_readers_share_a_log(tmp_path: Path) -> None:
    rng = random.Random(11)
    segs = [segment(rng, i) for i in range(40)]
    errors: list[BaseException] = []
    with SegmentLog.create(tmp_path, SLOT) as log:

        def reader() -> None:
            try:
                while log.n_slots < len(segs):
                    for slot in log.slots():
                        assert log.read(slot)[1] == segs[log.header(slot).segment_id]["payload"]
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for seg in segs:
            log.append(**seg)
        for t in threads:
            t.join()
    assert errors == []


# ---- property ----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(
        st.lists(st.integers(0, 1500), min_size=1, max_size=4).filter(lambda ps: sum(ps) <= 4096),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_appends_read_back_identical(sizes: list[list[int]], seed: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        written = []
        with SegmentLog.create(d, slot_size_for(4096)) as log:
            for i, page_sizes in enumerate(sizes):
                pages = [rng.randbytes(n) for n in page_sizes]
                offsets = [sum(page_sizes[:j]) for j in range(len(pages))]
                payload = b"".join(pages)
                slot = log.append(
                    segment_id=i, frame_start=i, frame_end=i + 1, pose=(float(i),), codec="raw",
                    position_state="post-rope", position=i, payload=memoryview(payload), page_offsets=offsets,
                )  # fmt: skip
                written.append((slot, payload, pages))
            for slot, payload, pages in written:
                assert log.read(slot)[1] == payload
                assert [log.read_page(slot, j) for j in range(len(pages))] == pages
        with SegmentLog.open(d) as again:
            assert again.slots() == [slot for slot, _, _ in written]
            for slot, payload, _ in written:
                assert again.read(slot)[1] == payload
