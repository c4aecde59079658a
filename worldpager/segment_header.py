"""The 4 KiB header block at the start of every `SegmentLog` slot (reference §6 "Segment record on NVMe").

Pure Python (no torch, no I/O). A header block carries the magic ``WPSEG\\0\\1\\0``, the format
version, the slot number and slot size, the segment's metadata (`SegmentHeader`: id, true frame range,
pose, codec, position state and position), per-page offsets and crc32s, the payload crc32, in the 8
bytes before the last 4 the id of the log it was written for (0: none, as logs before it wrote) and,
in its last 4 bytes, a crc32 of the header block itself. `encode_header` builds the block (ValueError
if the header does not fit); `decode_header` parses and verifies it (`CorruptSlotError` if it fails a
check); `log_id_of` reads a verified block's log id.

A retired slot (found corrupt, its payload's space given back) has a retired-slot marker in place of
its header (`encode_retired`): the magic ``WPRET\0\1\0``, the format version, the slot number and
slot size, why it was retired, the log id and the block's crc32 at the same places. A marker may
retire a *run* of never-written slots at once (its first slot's header block holds it, the run's
other slots stay holes): the run's length is a u64 past the longest reason, where a reader before
runs never looks (it reads the marker as retiring its own slot; 0 there, as such readers wrote, is a
run of one). `decode_header` raises `RetiredSlotError` for a valid marker (a reader before markers
sees "bad magic": corrupt, never a segment). A header block intact but written for another slot or
format version raises `ForeignSlotError`: its bytes are left as they are, never retired.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from itertools import pairwise

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_NAME",
    "MAX_PAGES",
    "MAX_POSE",
    "MAX_REASON",
    "RETIRED_MAGIC",
    "SLOT_ALIGN",
    "CorruptSlotError",
    "ForeignSlotError",
    "RetiredSlotError",
    "SegmentHeader",
    "SegmentLogError",
    "decode_header",
    "encode_header",
    "encode_retired",
    "log_id_of",
]

SLOT_ALIGN = 4096
HEADER_SIZE = SLOT_ALIGN
MAGIC = b"WPSEG\0\1\0"
RETIRED_MAGIC = b"WPRET\0\1\0"
MAX_REASON = 1024  # UTF-8 bytes of a retired slot's reason kept in its marker
FORMAT_VERSION = 1
MAX_POSE = 8
MAX_NAME = 16
# magic, version, n_pose, n_pages, flags, slot, slot_size, segment_id, frame_start, frame_end, position,
# payload_len, payload crc32, codec, position_state; then pose (f64), page offsets (u64), page crc32s (u32).
_FIXED = struct.Struct("<8sHHHHQQqqqqQI16s16s")
# retired-slot marker: magic, version, reason length, slot, slot_size; then the reason (UTF-8).
_RETIRED = struct.Struct("<8sHHQQ")
_CRC = struct.Struct("<I")
_LOG_ID = struct.Struct("<Q")
_BODY = HEADER_SIZE - _CRC.size
_LOG_ID_AT = _BODY - _LOG_ID.size  # no field reaches it: the tail ends there at most
# a marker's run length (slots it retires; 0 = 1, as markers before runs have there): past the longest
# reason, so a reader before runs never reads it
_RUN = struct.Struct("<Q")
_RUN_AT = _RETIRED.size + MAX_REASON
assert _RUN_AT + _RUN.size <= _LOG_ID_AT
MAX_PAGES = (_LOG_ID_AT - _FIXED.size - 8 * MAX_POSE) // 12
assert _FIXED.size + 8 * MAX_POSE + 12 * MAX_PAGES <= _LOG_ID_AT


class SegmentLogError(Exception):
    """Base of the segment log's own errors."""


class CorruptSlotError(SegmentLogError):
    """A slot failed verification (magic, header/payload/page checksum, truncation, beyond the end).
    ``path``: the log file it was read from (a `SegmentLog` sets it), named first in the message."""

    def __init__(self, slot: int, reason: str, path: str | None = None) -> None:
        super().__init__(slot, reason)
        self.slot, self.reason, self.path = slot, reason, path

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{where}slot {self.slot}: {self.reason}"


class ForeignSlotError(CorruptSlotError):
    """A slot whose header block is intact but was written for another log, slot, slot size or
    format version: unusable here, but its bytes may be another log's segment, so never retired."""


class RetiredSlotError(CorruptSlotError):
    """A retired slot: its header is a retired-slot marker (`encode_retired`). ``reason``: why it was
    retired; ``slot_size`` and ``log_id``: the marker's; ``run``: how many slots from this one it
    retires (1: this one; more: the never-written slots after it too)."""

    def __init__(
        self,
        slot: int,
        reason: str,
        path: str | None = None,
        *,
        slot_size: int = 0,
        log_id: int = 0,
        run: int = 1,
    ) -> None:
        super().__init__(slot, reason, path)
        self.slot_size, self.log_id, self.run = slot_size, log_id, run


@dataclass(frozen=True)
class SegmentHeader:
    """What a slot says about its segment. Checksums are zlib.crc32 values."""

    segment_id: int
    frame_start: int  # true latent-frame range, end exclusive
    frame_end: int
    pose: tuple[float, ...]  # (x, y, z, pitch, yaw), at most MAX_POSE values
    codec: str
    position_state: str  # e.g. "post-rope", "pre-rope"
    position: int  # latent frame the stored keys are rotated to
    payload_len: int
    page_offsets: tuple[int, ...]  # byte offset of each layer page in the payload
    checksum: int
    page_checksums: tuple[int, ...]

    @property
    def n_pages(self) -> int:
        return len(self.page_offsets)

    def page_range(self, layer: int) -> tuple[int, int]:
        """[start, end) of page ``layer`` in the payload; a page ends where the next starts."""
        if not 0 <= layer < len(self.page_offsets):
            raise IndexError(f"page {layer} out of range (segment has {len(self.page_offsets)} pages)")
        end = self.page_offsets[layer + 1] if layer + 1 < len(self.page_offsets) else self.payload_len
        return self.page_offsets[layer], end


def _name(value: str, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > MAX_NAME or b"\0" in raw:
        raise ValueError(f"{what} must be at most {MAX_NAME} UTF-8 bytes without NUL, got {value!r}")
    return raw


def _check(h: SegmentHeader, slot_size: int) -> None:
    if h.payload_len < 0 or h.payload_len > slot_size - HEADER_SIZE:
        raise ValueError(f"payload of {h.payload_len} bytes does not fit a slot of {slot_size} bytes")
    if len(h.pose) > MAX_POSE or not all(math.isfinite(p) for p in h.pose):
        raise ValueError(f"pose must be at most {MAX_POSE} finite values, got {h.pose}")
    if len(h.page_offsets) > MAX_PAGES or len(h.page_checksums) != len(h.page_offsets):
        raise ValueError(f"{len(h.page_offsets)} pages / {len(h.page_checksums)} page checksums")
    bounds = (0, *h.page_offsets, h.payload_len)
    if any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"page offsets {h.page_offsets} must be non-decreasing within the payload")
    if h.frame_end < h.frame_start:
        raise ValueError(f"frame range [{h.frame_start}, {h.frame_end}) is reversed")


def _tail_format(n_pose: int, n_pages: int) -> str:
    return f"<{n_pose}d{n_pages}Q{n_pages}I"


def encode_header(h: SegmentHeader, slot: int, slot_size: int, log_id: int = 0) -> bytes:
    """The 4 KiB header block of ``h`` stored in ``slot`` of the log ``log_id`` (0: none); ValueError if
    ``h`` does not fit."""
    _check(h, slot_size)
    n_pose, n_pages = len(h.pose), len(h.page_offsets)
    names = (_name(h.codec, "codec"), _name(h.position_state, "position_state"))
    try:
        fields = (h.segment_id, h.frame_start, h.frame_end, h.position, h.payload_len, h.checksum)
        body = _FIXED.pack(MAGIC, FORMAT_VERSION, n_pose, n_pages, 0, slot, slot_size, *fields, *names)
        body += struct.pack(_tail_format(n_pose, n_pages), *h.pose, *h.page_offsets, *h.page_checksums)
        block = body.ljust(_LOG_ID_AT, b"\0") + _LOG_ID.pack(log_id)
    except struct.error as e:
        raise ValueError(f"header field out of range: {e}") from e
    return block + _CRC.pack(zlib.crc32(block))


def encode_retired(slot: int, slot_size: int, reason: str, log_id: int = 0, run: int = 1) -> bytes:
    """The 4 KiB retired-slot marker written over the header of ``slot`` of the log ``log_id``,
    retiring ``run`` slots from ``slot`` on (ValueError unless 1 <= run < 2**64); ``reason`` is cut
    to MAX_REASON bytes (at a character boundary)."""
    if not 1 <= run < 1 << 64:
        raise ValueError(f"a retired-slot marker retires 1 to 2**64-1 slots, not {run}")
    raw = reason.encode("utf-8")[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    body = _RETIRED.pack(RETIRED_MAGIC, FORMAT_VERSION, len(raw), slot, slot_size) + raw
    body = body.ljust(_RUN_AT, b"\0") + (_RUN.pack(run) if run > 1 else bytes(_RUN.size))
    block = body.ljust(_LOG_ID_AT, b"\0") + _LOG_ID.pack(log_id)
    return block + _CRC.pack(zlib.crc32(block))


def _retired(block: bytes, slot: int) -> RetiredSlotError:
    """The `RetiredSlotError` of a marker block whose crc32 was checked; CorruptSlotError if its
    fields cannot be a marker's, ForeignSlotError if it belongs to another slot or version."""
    _, version, n, at, slot_size = _RETIRED.unpack_from(block)
    if version != FORMAT_VERSION:
        raise ForeignSlotError(slot, f"unsupported format version {version}")
    if at != slot:
        raise ForeignSlotError(slot, f"retired-slot marker belongs to slot {at}")
    if n > MAX_REASON:
        raise CorruptSlotError(slot, f"retired-slot marker with a reason of {n} bytes")
    reason = block[_RETIRED.size : _RETIRED.size + n].decode("utf-8", "replace")
    run = max(1, int(_RUN.unpack_from(block, _RUN_AT)[0]))
    return RetiredSlotError(slot, reason, slot_size=slot_size, log_id=log_id_of(block), run=run)


def log_id_of(block: bytes) -> int:
    """The id of the log a header block (verified by `decode_header`) was written for; 0: none."""
    return int(_LOG_ID.unpack_from(block, _LOG_ID_AT)[0])


def decode_header(block: bytes, slot: int) -> tuple[SegmentHeader, int]:
    """(header, slot_size) from a header block read at ``slot``; CorruptSlotError if it fails checks
    (`RetiredSlotError` for a retired-slot marker, `ForeignSlotError` for an intact header of another
    slot or format version)."""
    if len(block) < HEADER_SIZE:
        raise CorruptSlotError(slot, "truncated: header past end of file")
    magic = block[: len(MAGIC)]
    if magic not in (MAGIC, RETIRED_MAGIC):
        raise CorruptSlotError(slot, "bad magic")
    if zlib.crc32(block[:_BODY]) != _CRC.unpack_from(block, _BODY)[0]:
        raise CorruptSlotError(slot, "header checksum mismatch")
    if magic == RETIRED_MAGIC:
        raise _retired(block, slot)
    f = _FIXED.unpack_from(block)
    n_pose, n_pages = f[2], f[3]
    if f[1] != FORMAT_VERSION:
        raise ForeignSlotError(slot, f"unsupported format version {f[1]}")
    if n_pose > MAX_POSE or n_pages > MAX_PAGES:
        raise CorruptSlotError(slot, f"header counts out of range ({n_pose} pose, {n_pages} pages)")
    if f[5] != slot:
        raise ForeignSlotError(slot, f"header belongs to slot {f[5]}")
    tail = struct.unpack_from(_tail_format(n_pose, n_pages), block, _FIXED.size)
    try:
        codec, state = (raw.rstrip(b"\0").decode("utf-8") for raw in f[13:15])
    except UnicodeDecodeError as e:
        raise CorruptSlotError(slot, f"undecodable name: {e}") from e
    pose, offsets, crcs = tail[:n_pose], tail[n_pose : n_pose + n_pages], tail[n_pose + n_pages :]
    h = SegmentHeader(f[7], f[8], f[9], pose, codec, state, f[10], f[11], offsets, f[12], crcs)
    try:
        _check(h, f[6])
    except ValueError as e:
        raise CorruptSlotError(slot, f"inconsistent header: {e}") from e
    return h, f[6]
