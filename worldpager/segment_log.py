"""Append-only NVMe log of finished segments' KV payloads (reference §6 "Segment record on NVMe").

One directory per session holds three files:

* ``segments.wplog`` -- fixed-size slots; slot ``n`` starts at ``n * slot_size`` (4 KiB aligned, so
  O_DIRECT is possible as in LMCache's disk backend). A slot is one 4 KiB header block followed by the
  payload (layer-major pages). The header (`worldpager.segment_header`) carries the magic
  ``WPSEG\\0\\1\\0``, the format version, the slot number and slot size, the segment's metadata,
  per-page offsets and crc32s, the payload crc32 and, in its last 4 bytes, a crc32 of the header block
  itself.
* ``meta.json`` -- immutable settings (slot size, optional ``max_bytes`` budget, ``log_id``), written at
  create(). open() checks them (a slot size that is no multiple of 4 KiB, or differs from slot 0's
  header, is a `SegmentLogError`); when meta.json is lost, slot 0's header gives the slot size and id.
  ``log_id`` is a random 64-bit id given at create() and written into every slot's header (and the
  index): a slot of another log (a log file copied from another session) is corrupt to this one. Logs
  written before it have id 0 and are read as before (no check).
* ``index.json`` -- slot -> header, written atomically (tmp + fsync + rename + dir fsync) by flush(),
  close() and open() after a recovery (on a full disk open() leaves that to the next flush(): reading
  a log needs no space). open() trusts a flushed index (data was fsynced before it) once
  the file is no shorter than it says and the last indexed header on disk matches; slots past the index
  (appended after the last flush) are verified in full (header and payload). A missing or stale index
  (or one whose slots are not exactly ``0 .. n_slots-1``, or with an entry no slot header could
  hold: a non-finite pose, reversed frames) is rebuilt by scanning every slot. Corrupt
  or truncated slots are reported (corrupt_slots()), never indexed; their slot numbers are not reused.
  A scan skips holes unread: never-written slots (a hole, an all-zero header) after the last written
  one are the end of the log (cut off), between written ones corrupt; with a ``max_bytes`` budget it
  stops at the first slot whose header alone would pass it (see `SegmentLog._scan`).
  A slot a reader later finds corrupt is taken out of the index the same way (mark_corrupt()).

Retiring: a corrupt slot is retired by mark_corrupt() and by retire_corrupt() (called by whoever
reported the slots a reopen found): a retired-slot marker (`encode_retired`) is written over its
header and its payload's disk blocks are given back (a hole punched: the file keeps its length, so
later slots stay where they are, and slot numbers are still never reused: a session's roll-backs
count on that). A run of adjacent never-written slots (a hole between written ones, found for the
same reason) is retired at once: one marker over its first slot's header names the run's length, and
one hole is punched over the rest of the run; a run of more than one slot also gets a marker of one
over its last slot's header (a run past the end of the file so reaches its last slot, and a scan
still counts its slots). A retired slot is never read as good again, even by a
scan, and a later open lists it in retired_slots(), not corrupt_slots(). ``index.json`` keeps it under
``corrupt`` and names it under ``retired`` (slot -> whether its space was given back: every slot of a
run, as before runs, so older readers read the index as it is; an index without ``retired``, as
written before, reads as retiring nothing). An older reader that scans sees a run's first and last
slots retired and the slots between as never written (corrupt), as before they were retired, and
never takes them for the log's tail. Only slots
whose bytes fail verification when checked again are retired: a slot that verifies in full (a
transient read error) is indexed again, and one written for another log (`ForeignSlotError`: a file
copied in) is left as it is. ``max_bytes`` bounds the bytes the log holds: the file's length less the
payload space retired slots gave back.

Atomic writes (index.json, meta.json) go through a ``.tmp`` file created afresh (`open_fresh`: a link
planted under its name is never written through).

Privacy: a log holds a user's world state, so what it creates is its user's alone: files 0600
(`PRIVATE_FILE`), its folder and any missing parent folder 0700 (`PRIVATE_DIR`; `make_private_dirs`).
Folders that exist already are left as they are (a caller tightens what it owns).

Writes: append() does one ``os.pwritev`` of header + payload (a torn write fails the header or payload
checksum), then extends the file to the slot boundary; no fsync per append (flush() does that). Reads
verify the header against the on-disk block and the payload/page crc32s; corrupt bytes are never returned:
a `CorruptSlotError` names the log file and the slot (``<dir>/segments.wplog: slot N: <reason>``).

Processes: one at a time. create() and open() take an exclusive lock of ``segments.wplog`` (a POSIX
record lock: the process's, see `_lock`), held until close(): another process opening the log (a
second resume of the same folder) gets a `SegmentLogError` naming the file ("in use by another
process") instead of handing out the same slots and overwriting the first one's segments.

Threads: writers (append/flush, serialised by a write lock: a `TransferHandler`'s I/O thread and a
write-through from the runtime's thread) and any number of reader threads (read/read_page/header/
slots/find) may share a log: I/O is pread/pwrite on one fd and the index sits behind a lock. close()
only once every thread is done with the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import stat
import sys
import threading
import zlib
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, TypeGuard

from worldpager.segment_header import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_NAME,
    MAX_PAGES,
    MAX_POSE,
    SLOT_ALIGN,
    CorruptSlotError,
    ForeignSlotError,
    RetiredSlotError,
    SegmentHeader,
    SegmentLogError,
    decode_header,
    encode_header,
    encode_retired,
    log_id_of,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "INDEX_NAME",
    "LOG_NAME",
    "MAGIC",
    "MAX_NAME",
    "MAX_PAGES",
    "MAX_POSE",
    "META_NAME",
    "OTHERS",
    "SLOT_ALIGN",
    "CorruptSlotError",
    "DiskFullError",
    "ForeignSlotError",
    "LogFullError",
    "RetiredSlotError",
    "SegmentHeader",
    "SegmentLog",
    "SegmentLogError",
    "decode_header",
    "encode_header",
    "is_disk_full",
    "open_fresh",
    "slot_size_for",
]

LOG_NAME, INDEX_NAME, META_NAME = "segments.wplog", "index.json", "meta.json"
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
"""The modes a log's files and folders are created with (the process's umask can only take more away):
its owner's alone, never readable by another local user."""
OTHERS = 0o077
"""The group's and others' permission bits: none on a saved session's folders and files (a folder or
file made by an earlier version with them is tightened when found: `workers.world.make_private`,
`manager.live_sessions`)."""
_CHUNK = 16 << 20
_INT_FIELDS = ("segment_id", "frame_start", "frame_end", "position", "payload_len", "checksum")


def slot_size_for(payload_bytes: int) -> int:
    """Slot size holding a payload of this many bytes: one header block + payload rounded up to 4 KiB."""
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    return HEADER_SIZE + -(-payload_bytes // SLOT_ALIGN) * SLOT_ALIGN


class LogFullError(SegmentLogError):
    """The disk is full (ENOSPC/EDQUOT) or the append would exceed the max_bytes budget; the message
    names the log file (or, raised by a session, its folder)."""


class LogInUse(SegmentLogError):
    """Another process holds the log open (its lock, `_lock`): one writer at a time. Not damage: the
    log is whole, and opens once that process closes it or ends."""


class DiskFullError(LogFullError, OSError):
    """A write the full disk refused (a session's save, its index) said as `LogFullError`, naming the
    folder, and still the OSError it is (``errno`` ENOSPC or EDQUOT): callers that catch either see it."""

    def __init__(self, message: str, code: int | None = errno.ENOSPC) -> None:
        super().__init__(message)
        self.errno = code  # (set after: str() stays the message, not "[Errno 28] ...")

    def __reduce__(self) -> tuple[type[DiskFullError], tuple[str, int | None]]:
        return type(self), (str(self.args[0]), self.errno)  # (pickled whole: across processes too)


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` is the OS saying the disk (or the user's quota) is full: ENOSPC or EDQUOT."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _header_from_json(e: dict[str, Any]) -> SegmentHeader:
    ints: dict[str, Any] = {k: int(e[k]) for k in _INT_FIELDS}
    names: dict[str, Any] = {k: str(e[k]) for k in ("codec", "position_state")}
    pages: dict[str, Any] = {k: tuple(int(x) for x in e[k]) for k in ("page_offsets", "page_checksums")}
    return SegmentHeader(**ints, **names, **pages, pose=tuple(float(p) for p in e["pose"]))


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_fallocate: Any = None  # libc's fallocate, looked up on first use (False: none)


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the disk blocks of [offset, offset + length) back (they read as zeros, the file keeps its
    length): True when the filesystem did (Linux fallocate), False when it cannot."""
    global _fallocate
    if length <= 0 or not sys.platform.startswith("linux"):
        return False
    if _fallocate is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = getattr(libc, "fallocate64", None) or libc.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _fallocate = fn
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate is False:
        return False
    return bool(_fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0)


def open_fresh(path: Path) -> BinaryIO:
    """``path`` (a temporary file of an atomic write) created afresh for writing: whatever is there
    (a stale one, or a symbolic link planted in its place) is unlinked first, and the open never
    follows a link nor reuses a file (O_CREAT | O_EXCL | O_NOFOLLOW), so nothing is written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, PRIVATE_FILE), "wb")


def refuse_existing(directory: Path, names: Iterable[str], what: str) -> None:
    """FileExistsError naming the first of ``names`` that ``directory`` holds: someone's own file of
    that name, which ``what`` would write over (and a session that runs no step would then delete as
    its own)."""
    for name in names:
        if os.path.lexists(directory / name):
            raise FileExistsError(errno.EEXIST, f"exists: {what} would write over it", str(directory / name))


def _lock(fd: int, path: Path) -> None:
    """Take this process's exclusive lock of the log file ``fd`` (``path``), held until the fd is
    closed: two writers of one log (two processes resuming one folder) hand out the same slots and
    overwrite each other's segments. SegmentLogError naming the file when another process holds it
    (`LogInUse`, never a wait).

    A POSIX record lock (``lockf``), the process's: a second open in the same process is not
    refused. A world worker that takes over a session whose device host it thinks lost reopens the
    folder in the same process (the lost host's objects, still alive, hold the first open; a host
    that died released its lock with its process); closing any open of the file in the process
    releases it. (The record lock is also the one NFS carries.)"""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise LogInUse(f"{path}: in use by another process: one writer at a time") from None


def make_private_dirs(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a folder, created with any missing parent folder `PRIVATE_DIR` (0700, where
    ``Path.mkdir(parents=True)`` gives the parents the default mode); folders that exist are left as
    they are. FileExistsError when it is something else than a folder (as ``mkdir`` says)."""
    d = Path(directory)
    missing: list[Path] = []
    p = d
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (made meanwhile, by another session's open)
            os.mkdir(p, PRIVATE_DIR)
    if not d.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder", str(d))
    return d


def _atomic_write_json(path: Path, obj: object) -> None:
    """Write ``obj`` to ``path`` atomically. An OSError (a full disk) leaves ``path`` as it was and no
    ``.tmp`` behind (its space given back), and names ``path`` when the OS named no file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open_fresh(tmp) as f:
            f.write(json.dumps(obj, separators=(",", ":")).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    _fsync_dir(path.parent)


def _pwrite_all(fd: int, parts: Iterable[bytes | memoryview], offset: int) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


MAX_JSON_BYTES = 256 << 20
"""The largest ``meta.json``, ``index.json`` or ``session.json`` read (a log of a million segments'
index is about 300 MB... far past any session here: 3,000 segments' is under 1 MB)."""


def read_small_text(path: Path, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, read only when it is at most ``limit`` bytes. A
    FIFO there held a resume until something wrote into it, and a huge (or sparse) file was read
    whole into memory. OSError: FileNotFoundError when missing; one whose strerror says "not a
    regular file (a FIFO...)" or the size otherwise. ValueError (UnicodeDecodeError): not UTF-8."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # (a FIFO does not hold the open)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a folder)", str(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} read", str(path))
        chunks, got = [], 0
        while got <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - got))):
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > limit:  # (it grew while read)
        raise OSError(errno.EFBIG, f"more than the {limit} bytes read", str(path))
    return b"".join(chunks).decode("utf-8")


def whole(value: object, low: int | None = 0) -> TypeGuard[int]:
    """A JSON whole number (not a bool, a float or a string), at least `low` unless that is None."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def _valid_slot_size(value: object) -> TypeGuard[int]:
    return whole(value, HEADER_SIZE) and value % SLOT_ALIGN == 0


def _read_meta(d: Path, fd: int) -> tuple[int, int | None, int]:
    """(slot size, max_bytes, log id) of the log in ``d``: from meta.json, cross-checked against slot 0's
    header (a wrong slot size would misplace every slot); from slot 0's header when meta.json is lost or
    unreadable. SegmentLogError naming the file for a meta.json value that cannot be right."""
    path = d / META_NAME
    meta: object = None
    with contextlib.suppress(OSError, ValueError, RecursionError):
        meta = json.loads(read_small_text(path))
    first: tuple[SegmentHeader | None, int] | CorruptSlotError | None = None
    first_id = 0
    if os.fstat(fd).st_size:
        block = os.pread(fd, HEADER_SIZE, 0)
        try:
            first = decode_header(block, 0)
            first_id = log_id_of(block)
        except RetiredSlotError as e:  # a retired slot's marker names them too
            first, first_id = (None, e.slot_size), e.log_id
        except CorruptSlotError as e:
            first = e
    if not isinstance(meta, dict):  # meta.json lost: every header names its slot size
        if first is None:
            raise SegmentLogError(f"{path}: missing or unreadable, and the log is empty")
        if isinstance(first, CorruptSlotError):
            raise SegmentLogError(f"{path}: missing or unreadable, and {first}") from first
        meta = {"slot_size": first[1], "log_id": first_id}
    slot_size, budget, log_id = meta.get("slot_size"), meta.get("max_bytes"), meta.get("log_id", 0)
    if not _valid_slot_size(slot_size):
        raise SegmentLogError(
            f"{path}: slot_size {slot_size!r} is not a multiple of {SLOT_ALIGN} bytes >= {HEADER_SIZE}"
        )
    if isinstance(first, tuple) and first[1] != slot_size:
        raise SegmentLogError(f"{path}: slot_size {slot_size} differs from slot 0's header ({first[1]})")
    if budget is not None and not whole(budget):
        raise SegmentLogError(f"{path}: max_bytes {budget!r} is not a number of bytes >= 0 (or null)")
    if not whole(log_id) or log_id >= 1 << 64:
        raise SegmentLogError(f"{path}: log_id {log_id!r} is not a 64-bit whole number")
    return slot_size, budget, log_id


class SegmentLog:
    """Append-only log of fixed-size segment slots in ``directory``; build with create() or open()."""

    def __init__(
        self, directory: Path, fd: int, slot_size: int, max_bytes: int | None, log_id: int = 0
    ) -> None:
        self.directory, self.slot_size, self.max_bytes = directory, slot_size, max_bytes
        self.log_id = log_id  # written into every slot's header; 0: a log from before ids (no check)
        self.path = str(directory / LOG_NAME)  # named in every CorruptSlotError the log raises
        self.index_state = "new"  # open(): "loaded", "extended" (tail scanned) or "rebuilt" (full scan)
        self._fd = fd
        self._lock = threading.Lock()  # index, counters
        self._write_lock = threading.Lock()  # appends, index writes
        self._headers: dict[int, SegmentHeader] = {}
        self._by_id: dict[int, int] = {}
        self._corrupt: dict[int, str] = {}  # unusable slots, retired ones included: slot -> reason
        self._retired: dict[int, bool] = {}  # retired slots: slot -> whether its space was given back
        self._retired_before: set[int] = set()  # retired when this object opened the log
        self._n_slots = 0
        self._claimed = 0  # slots a consistent index file named when the log was reopened (trusted or not)
        self.bytes_written = 0  # header + payload bytes appended by this object
        self.bytes_read = 0  # bytes read from the log file by this object, recovery scans included

    # ---- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls, directory: str | os.PathLike[str], slot_size: int, *, max_bytes: int | None = None
    ) -> SegmentLog:
        """A new, empty log; FileExistsError if ``directory`` already holds one, or any file named as
        the log's (``index.json``, ``meta.json`` or their ``.tmp``: never written over). ``max_bytes``
        caps the log file's size (appends past it raise LogFullError) and is kept in meta.json. A
        create that fails part-way removes what it wrote (the folder is left as a new one)."""
        if slot_size < HEADER_SIZE or slot_size % SLOT_ALIGN:
            raise ValueError(f"slot_size must be a multiple of {SLOT_ALIGN} and >= {HEADER_SIZE}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        d = make_private_dirs(directory)
        refuse_existing(d, (INDEX_NAME, META_NAME, INDEX_NAME + ".tmp", META_NAME + ".tmp"), "a new log")
        fd = os.open(d / LOG_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            _lock(fd, d / LOG_NAME)  # (opened meanwhile by another process: the file is that one's now)
        except BaseException:
            os.close(fd)
            raise
        made = [d / LOG_NAME]  # what this create wrote: removed again when it fails
        try:
            log = cls(d, fd, slot_size, max_bytes, secrets.randbits(64) or 1)
            meta = {"format": "worldpager-segment-log", "version": FORMAT_VERSION, "slot_size": slot_size}
            _atomic_write_json(d / META_NAME, {**meta, "max_bytes": max_bytes, "log_id": log.log_id})
            made.append(d / META_NAME)
            log._write_index()
        except BaseException:
            # A half-made log (a full disk refused meta.json, say) is neither a new folder nor a
            # saved session: a new run and --resume would both refuse it. Gone, the folder is new again.
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            os.close(fd)  # (after the unlinks: the lock keeps another create out meanwhile)
            raise
        log.index_state = "loaded"
        return log

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, max_bytes: int | None = None) -> SegmentLog:
        """Reopen an existing log (after a restart), recovering the index as described in the module
        docstring. ``max_bytes`` None keeps the budget given to create()."""
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        d = Path(directory)
        fd = os.open(d / LOG_NAME, os.O_RDWR | os.O_CLOEXEC)
        try:
            _lock(fd, d / LOG_NAME)
            slot_size, budget, log_id = _read_meta(d, fd)
            log = cls(d, fd, slot_size, budget if max_bytes is None else max_bytes, log_id)
            log._recover()
        except BaseException:
            os.close(fd)
            raise
        return log

    def flush(self) -> None:
        """fsync the log's data, then write index.json atomically."""
        self._write_index()

    def close(self) -> None:
        """flush() and close the file; a second close does nothing."""
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- writing ------------------------------------------------------------------------------
    def append(
        self,
        *,
        segment_id: int,
        frame_start: int,
        frame_end: int,
        pose: Iterable[float],
        codec: str,
        position_state: str,
        position: int,
        payload: bytes | bytearray | memoryview,
        page_offsets: Iterable[int] = (0,),
    ) -> int:
        """Write one segment into the next slot and return its number. ValueError for a payload larger
        than the slot or an invalid header; LogFullError when the disk or the budget is full (the log
        stays as it was)."""
        view = memoryview(payload).cast("B")
        n = len(view)
        if n > self.slot_size - HEADER_SIZE:
            raise ValueError(
                f"payload of {n} bytes exceeds the slot capacity of {self.slot_size - HEADER_SIZE} bytes"
            )
        offsets = tuple(int(o) for o in page_offsets)
        ends = (*offsets[1:], n)
        crcs = tuple(zlib.crc32(view[a:b]) for a, b in zip(offsets, ends, strict=True))
        fields = (segment_id, frame_start, frame_end, tuple(float(p) for p in pose), codec, position_state)
        h = SegmentHeader(*fields, position, n, offsets, zlib.crc32(view), crcs)
        with self._write_lock:
            self._require_open()
            slot = self._n_slots
            offset, end = slot * self.slot_size, (slot + 1) * self.slot_size
            block = encode_header(h, slot, self.slot_size, self.log_id)
            held = end - self._given_back()
            if self.max_bytes is not None and held > self.max_bytes:
                raise LogFullError(
                    f"{self.path}: slot {slot} would bring the log to {held} bytes, past "
                    f"max_bytes={self.max_bytes}"
                )
            old_size = os.fstat(self._fd).st_size
            try:
                _pwrite_all(self._fd, (block, view), offset)
                os.ftruncate(self._fd, end)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, old_size)
                if is_disk_full(e):
                    raise LogFullError(
                        f"{self.path}: disk full writing slot {slot}: {e.strerror or e}"
                    ) from e
                raise
            with self._lock:
                self._n_slots = slot + 1
                self._install(slot, h)
                self.bytes_written += HEADER_SIZE + n
        return slot

    # ---- reading ------------------------------------------------------------------------------
    def header(self, slot: int) -> SegmentHeader:
        """The indexed header of ``slot``; CorruptSlotError if it is corrupt or past the end."""
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        with self._lock:
            h = self._headers.get(slot)
            if h is not None:
                return h
            reason = self._corrupt.get(slot) or (
                "beyond end of log" if slot >= self._n_slots else "not indexed"
            )
        raise CorruptSlotError(slot, reason, self.path)

    def read(self, slot: int) -> tuple[SegmentHeader, bytes]:
        """Header and payload of ``slot``, both verified against the disk and their checksums."""
        h = self.header(slot)
        offset = slot * self.slot_size
        try:
            disk = self._decode(self._pread(HEADER_SIZE, offset), slot)[0]
        except CorruptSlotError as e:
            e.path = self.path  # (its class kept: a retired slot's marker reads as RetiredSlotError)
            raise e from None
        if disk != h:
            raise CorruptSlotError(slot, "header on disk differs from the index", self.path)
        payload = self._pread(h.payload_len, offset + HEADER_SIZE)
        if len(payload) != h.payload_len:
            raise CorruptSlotError(slot, "truncated: payload past end of file", self.path)
        if zlib.crc32(payload) != h.checksum:
            raise CorruptSlotError(slot, "payload checksum mismatch", self.path)
        return h, payload

    def read_page(self, slot: int, layer: int) -> bytes:
        """Only page ``layer``'s bytes of ``slot`` (one pread), verified against its page checksum."""
        h = self.header(slot)
        start, end = h.page_range(layer)
        data = self._pread(end - start, slot * self.slot_size + HEADER_SIZE + start)
        if len(data) != end - start:
            raise CorruptSlotError(slot, f"truncated: page {layer} past end of file", self.path)
        if zlib.crc32(data) != h.page_checksums[layer]:
            raise CorruptSlotError(slot, f"page {layer} checksum mismatch", self.path)
        return data

    def slots(self) -> list[int]:
        """Readable (indexed) slot numbers, ascending."""
        with self._lock:
            return sorted(self._headers)

    def find(self, segment_id: int) -> int | None:
        """The latest slot holding ``segment_id``, or None."""
        with self._lock:
            return self._by_id.get(segment_id)

    def corrupt_slots(self) -> dict[int, str]:
        """Slots this object found corrupt, truncated or missing when the index was recovered, or
        marked so by mark_corrupt(): slot -> reason. Slots retired before this object opened the log
        are not listed (they were reported when found): see retired_slots()."""
        with self._lock:
            return {s: r for s, r in self._corrupt.items() if s not in self._retired_before}

    def retired_slots(self) -> dict[int, str]:
        """Retired slots (see the module docstring): slot -> why."""
        with self._lock:
            return {s: self._corrupt[s] for s in sorted(self._retired)}

    def mark_corrupt(self, slot: int, reason: str) -> None:
        """Take ``slot`` out of the index as corrupt (a reader found its bytes failing their checks)
        and retire it: never returned again, its payload's space given back, recorded by the next
        index write, so a reopen neither trusts, reads nor reports it; find() gives the latest other
        copy of its segment, if any. If its bytes verify in full when checked again (a transient read
        error), it is indexed again instead; if they are another log's, they are left as they are.
        A slot not indexed (already corrupt, or past the end) is left as it is."""
        with self._lock:
            h = self._headers.pop(slot, None)
            if h is None:
                return
            self._corrupt[slot] = reason
            self._drop_id(slot, h.segment_id)
        with self._write_lock:
            if self._fd >= 0:  # (closed: out of the index only, as its reader was told)
                self._retire(slot)

    def retire_corrupt(self) -> dict[int, str]:
        """Retire every corrupt slot not retired yet (those a reopen found: call once they have been
        reported) and save the index; returns the slots retired: slot -> reason. Slots whose bytes
        verify in full when checked again are indexed again; slots of another log are left as
        they are (both unlisted)."""
        retired: dict[int, str] = {}
        with self._write_lock:
            self._require_open()
            with self._lock:
                todo = [s for s in sorted(self._corrupt) if s not in self._retired]
                reasons = {s: self._corrupt[s] for s in todo}
            unwritten = self._unwritten(todo) if todo else set()
            i = 0
            while i < len(todo):
                first, j = todo[i], i + 1
                if first not in unwritten:  # bytes there: checked again in full, retired alone
                    if self._retire(first):
                        retired[first] = reasons[first]
                    i = j
                    continue
                while (  # a run: adjacent never-written slots, found so for the same reason
                    j < len(todo)
                    and todo[j] == todo[j - 1] + 1
                    and todo[j] in unwritten
                    and reasons[todo[j]] == reasons[first]
                ):
                    j += 1
                if self._retire_run(first, todo[j - 1] + 1, reasons[first]):
                    retired.update((s, reasons[first]) for s in todo[i:j])
                i = j
        if todo:
            self._write_index()
        return retired

    @property
    def n_slots(self) -> int:
        """Slots used so far, corrupt ones included (the next append goes here)."""
        return self._n_slots

    # ---- internals ----------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._fd < 0:
            raise ValueError("segment log is closed")

    def _pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at end of file)."""
        self._require_open()
        data = os.pread(self._fd, n, offset)
        if 0 < len(data) < n:
            buf = bytearray(data)
            while len(buf) < n and (more := os.pread(self._fd, n - len(buf), offset + len(buf))):
                buf += more
            data = bytes(buf)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def _decode(self, block: bytes, slot: int) -> tuple[SegmentHeader, int]:
        """`decode_header`, and ForeignSlotError for a slot (or a retired slot's marker) written for
        another log than this one."""
        try:
            h, slot_size = decode_header(block, slot)
            other = log_id_of(block)
        except RetiredSlotError as e:
            if not self.log_id or e.log_id == self.log_id:
                raise
            other = e.log_id
        if self.log_id and other != self.log_id:
            raise ForeignSlotError(
                slot, f"written for another log (id {other:x}, this log's {self.log_id:x})"
            )
        return h, slot_size

    def _install(self, slot: int, h: SegmentHeader) -> None:
        self._headers[slot] = h
        if self._by_id.get(h.segment_id, -1) < slot:
            self._by_id[h.segment_id] = slot

    def _drop_id(self, slot: int, segment_id: int) -> None:
        """find() of ``segment_id`` no longer gives ``slot`` (taken out of the index), but the latest
        other copy, if any. Under self._lock."""
        if self._by_id.get(segment_id) == slot:
            copies = [s for s, o in self._headers.items() if o.segment_id == segment_id]
            if copies:
                self._by_id[segment_id] = max(copies)
            else:
                del self._by_id[segment_id]

    def _given_back(self) -> int:
        """Bytes of the file whose disk space retired slots gave back (their payloads)."""
        return sum(self._retired.values()) * (self.slot_size - HEADER_SIZE)

    def _retire(self, slot: int) -> bool:
        """Retire corrupt ``slot`` (under self._write_lock): checked again in full first; True when
        retired. One that verifies is indexed again; one of another log, or whose marker cannot be
        written (an I/O error: retried by the next retire_corrupt()), is left as it is."""
        try:
            h = self._verify(slot, os.fstat(self._fd).st_size)
        except OSError:
            return False  # cannot be read to tell: nothing destroyed
        except RetiredSlotError:
            pass  # its marker is there (a run that stopped before its index write): give back again
        except ForeignSlotError:
            return False
        except CorruptSlotError:
            with self._lock:
                reason = self._corrupt[slot]
            marker = encode_retired(slot, self.slot_size, reason, self.log_id)
            try:
                _pwrite_all(self._fd, (marker,), slot * self.slot_size)
            except OSError:
                return False
        else:
            with self._lock:
                del self._corrupt[slot]
                self._install(slot, h)
            return False
        given_back = _punch_hole(self._fd, slot * self.slot_size + HEADER_SIZE, self.slot_size - HEADER_SIZE)
        with self._lock:
            self._retired[slot] = given_back
        return True

    def _unwritten(self, slots: list[int]) -> set[int]:
        """Which of ``slots`` (ascending) were never written: their header block a hole, past the end
        of the file, or all zeros (under self._write_lock). Holes are skipped unread: one lseek per run
        of them (one read per slot only where the filesystem cannot tell holes)."""
        ss, size = self.slot_size, os.fstat(self._fd).st_size
        out: set[int] = set()
        i = 0
        while i < len(slots):
            slot = slots[i]
            offset = slot * ss
            at = None if offset >= size else self._next_data(offset)
            if at is None or at >= offset + HEADER_SIZE:  # this header, and those up to the data: holes
                stop = None if at is None else at // ss + (at % ss >= HEADER_SIZE)
                while i < len(slots) and (stop is None or slots[i] < stop):
                    out.add(slots[i])
                    i += 1
                continue
            if not self._pread(HEADER_SIZE, offset).strip(b"\0"):
                out.add(slot)
            i += 1
        return out

    def _retire_run(self, first: int, stop: int, reason: str) -> bool:
        """Retire the never-written slots ``first .. stop-1`` at once (under self._write_lock): one
        marker over ``first``'s header naming the run, one hole punched over the rest of the run; True
        when retired. Never-written slots hold nothing to check again. A run of more than one slot
        also gets a marker of one over its last slot's header (so the file reaches that slot and a
        scan still counts its slots, and a reader from before runs sees the run end there)."""
        ss, last = self.slot_size, stop - 1
        marker = encode_retired(first, ss, reason, self.log_id, run=stop - first)
        try:
            _pwrite_all(self._fd, (marker,), first * ss)
            if last > first:
                # and a marker of one over its last slot: a reader from before runs, scanning, would
                # take the never-written slots after the first marker for the log's tail, when the
                # run ends the file, and hand their numbers out again (the new reader skips it)
                _pwrite_all(self._fd, (encode_retired(last, ss, reason, self.log_id),), last * ss)
        except OSError:
            return False  # (a marker written is found again by the next retire_corrupt())
        given_back = _punch_hole(self._fd, first * ss + HEADER_SIZE, (last - first or 1) * ss - HEADER_SIZE)
        if last > first:
            given_back = _punch_hole(self._fd, last * ss + HEADER_SIZE, ss - HEADER_SIZE) and given_back
        with self._lock:
            for slot in range(first, stop):
                self._retired[slot] = given_back
        return True

    def _verify(self, slot: int, size: int, block: bytes | None = None) -> SegmentHeader:
        """The header of ``slot`` verified in full (header and payload) against the disk (``block``:
        its header block, read already); CorruptSlotError (of its kind) saying why not."""
        offset = slot * self.slot_size
        if block is None:
            block = self._pread(HEADER_SIZE, offset)
        h, slot_size = self._decode(block, slot)
        if slot_size != self.slot_size:
            raise ForeignSlotError(slot, f"slot size {slot_size} != log's {self.slot_size}")
        if offset + HEADER_SIZE + h.payload_len > size:
            raise CorruptSlotError(slot, "truncated: payload past end of file")
        crc, pos, left = 0, offset + HEADER_SIZE, h.payload_len
        while left:
            chunk = self._pread(min(left, _CHUNK), pos)
            if not chunk:
                raise CorruptSlotError(slot, "truncated: payload past end of file")
            crc, pos, left = zlib.crc32(chunk, crc), pos + len(chunk), left - len(chunk)
        if crc != h.checksum:
            raise CorruptSlotError(slot, "payload checksum mismatch")
        return h

    def _scan_slot(self, slot: int, size: int, block: bytes | None = None, last: int = 0) -> int:
        """Verify ``slot`` in full (header and payload) and index it, or record why it is corrupt
        (or retired: a marker; whether its space was given back is read from the file's holes). For a
        marker of a run of slots, where the run stops (at most ``last``, the file's slot count; its
        other slots are the scan's to retire), else ``slot + 1``."""
        try:
            h = self._verify(slot, size, block)
        except RetiredSlotError as e:
            stop = max(slot + 1, min(slot + e.run, last))
            self._corrupt[slot] = e.reason
            # (up to the marker of one over a run's last slot, which has its own)
            end = (stop - 1 if stop - slot > 1 else stop) * self.slot_size
            self._retired[slot] = self._is_hole(slot * self.slot_size + HEADER_SIZE, end)
            return stop
        except CorruptSlotError as e:
            self._corrupt[slot] = e.reason
            return slot + 1
        self._install(slot, h)
        return slot + 1

    def _is_hole(self, start: int, end: int) -> bool:
        """Whether [start, end) of the file holds no data (a hole, or past its end)."""
        seek_data = getattr(os, "SEEK_DATA", None)
        if seek_data is None:
            return False
        try:
            return os.lseek(self._fd, start, seek_data) >= end
        except OSError as e:
            return e.errno == errno.ENXIO  # no data from start on (else: cannot tell, count it held)

    def _next_data(self, offset: int) -> int | None:
        """Where the first data of the file at or after ``offset`` is (``offset`` when the filesystem
        cannot tell holes), None when there is none (a hole, or the end of the file)."""
        seek_data = getattr(os, "SEEK_DATA", None)
        if seek_data is None:
            return offset
        try:
            return os.lseek(self._fd, offset, seek_data)
        except OSError as e:
            return None if e.errno == errno.ENXIO else offset

    def _scan(self, start: int, n: int, size: int) -> int:
        """Scan slots ``start .. n-1`` (each verified in full and indexed, or recorded corrupt) and
        return where the written log ends: after its last written slot. A never-written slot (its
        header a hole or all zeros) is no slot when none is written after it: a sparse or zero tail
        (cut off here) is the end of the log, not thousands of corrupt slots; between written slots
        it is corrupt. Holes are skipped, never read. A marker retiring a run of slots retires the
        never-written slots it names (within the file; a run reaching past the last written slot ends
        the log there). With a ``max_bytes`` budget the scan stops at the first slot the log could
        not have appended (its header alone would pass the budget): when something is there, the log
        is taken to end there, so no append ever cuts it off."""
        ss = self.slot_size
        limit = n if self.max_bytes is None else min(n, max(start, self.max_bytes // HEADER_SIZE))
        end = slot = start
        run: tuple[int, int, str] = (-1, 0, "")  # the last run marker's (slot, run stop, reason)
        while slot < limit:
            offset = slot * ss
            at = self._next_data(offset)
            if at is None:
                break  # nothing written from here on
            if at >= offset + HEADER_SIZE:  # the header is a hole: skip to the slot the data is in
                slot = max(slot + 1, at // ss)
                continue
            block = self._pread(HEADER_SIZE, offset)
            if not block.strip(b"\0"):
                slot += 1
                continue
            self._never_written(end, slot, run)  # never written, yet a written slot follows
            stop = self._scan_slot(slot, size, block, n)
            if stop > slot + 1:
                run = (slot, stop, self._corrupt[slot])
            end = slot = slot + 1
        budget_end = limit < n and self._next_data(limit * ss) is not None
        if budget_end:  # (the budget's end: appends past it fail, cut nothing)
            self._never_written(end, limit, run)
            end = max(end, limit)
        if run[1] > end:  # the last run reaches past the last written slot: the log ends after it
            self._never_written(end, run[1], run)
            end = run[1]
        if not budget_end and end * ss < size:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end * ss)  # never-written bytes (an append would cut them too)
        return end

    def _never_written(self, start: int, stop: int, run: tuple[int, int, str]) -> None:
        """Record the never-written slots ``start .. stop-1`` a scan found between written ones:
        retired where the run marker ``run`` names them (its reason; their space given back when the
        run's was), else corrupt."""
        marker, run_stop, reason = run
        for never in range(start, stop):
            if marker < never < run_stop:
                self._corrupt[never] = reason
                self._retired[never] = self._retired[marker]
            else:
                self._corrupt[never] = "never written: its header is all zeros"

    def _load_index(self, size: int) -> int | None:
        """Install a trustworthy index.json and return how many slots it covers, or None if stale."""
        try:
            idx = json.loads(read_small_text(self.directory / INDEX_NAME))
            if idx["version"] != FORMAT_VERSION or idx["slot_size"] != self.slot_size:
                return None
            if idx.get("log_id", 0) != self.log_id:  # (an index of another log, or from before ids)
                return None
            n_idx, recorded = int(idx["n_slots"]), int(idx["file_size"])
            headers = {int(e["slot"]): _header_from_json(e) for e in idx["entries"]}
            corrupt = {int(k): str(v) for k, v in idx["corrupt"].items()}
            retired = {int(k): bool(v) for k, v in idx.get("retired", {}).items()}  # (none before)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
            return None  # (OverflowError: int() of an Infinity that json.loads accepts)
        # Its slots must be exactly 0..n_slots-1, each indexed or corrupt: checked by count first, so a
        # corrupt n_slots costs nothing (no range of it is ever built).
        if n_idx < 0 or n_idx != len(headers) + len(corrupt) or set(headers) & set(corrupt):
            return None
        if set(headers) | set(corrupt) != set(range(n_idx)) or not set(retired) <= set(corrupt):
            return None
        self._claimed = n_idx  # a consistent index, though maybe stale: its slots are not reused
        if size < recorded or recorded > n_idx * self.slot_size:
            return None
        if any(s * self.slot_size + HEADER_SIZE + h.payload_len > size for s, h in headers.items()):
            return None  # an indexed slot no longer fits in the file
        try:  # each entry as a header on disk must be (a non-finite pose, reversed frames: damaged)
            for slot, h in headers.items():
                encode_header(h, slot, self.slot_size, self.log_id)
        except ValueError:
            return None
        if headers:
            last = max(headers)
            try:
                disk = self._decode(self._pread(HEADER_SIZE, last * self.slot_size), last)[0]
            except CorruptSlotError:
                return None
            if disk != headers[last]:
                return None
        for slot in sorted(headers):
            self._install(slot, headers[slot])
        self._corrupt.update(corrupt)
        self._retired.update(retired)
        return n_idx

    def _recover(self) -> None:
        size = os.fstat(self._fd).st_size
        n = -(-size // self.slot_size)
        trusted = self._load_index(size)
        end = self._scan(trusted or 0, n, size)
        n = -(-os.fstat(self._fd).st_size // self.slot_size)  # (a never-written tail was cut off)
        for slot in range(end, self._claimed):  # named by a stale index, never written or cut off
            self._corrupt[slot] = (
                "missing: the index names it but the log file ends before it"
                if slot >= n
                else "missing: the index names it but it was never written (an all-zero header)"
            )
        self._n_slots = max(end, trusted or 0, self._claimed)
        self._retired_before = set(self._retired)
        if trusted is None:
            self.index_state = "rebuilt"
        else:
            self.index_state = "loaded" if trusted >= n else "extended"
        if self.index_state != "loaded":
            try:
                self._write_index()
            except OSError as e:  # reading the log needs no space: the next flush() writes the index
                if not is_disk_full(e):
                    raise

    def _write_index(self) -> None:
        with self._write_lock:
            self._require_open()
            os.fsync(self._fd)
            with self._lock:
                entries = [{"slot": s, **asdict(h)} for s, h in sorted(self._headers.items())]
                corrupt = {str(s): r for s, r in sorted(self._corrupt.items())}
                retired = {str(s): given for s, given in sorted(self._retired.items())}
                n_slots = self._n_slots
            size = os.fstat(self._fd).st_size
            index = {"version": FORMAT_VERSION, "slot_size": self.slot_size, "n_slots": n_slots}
            index["log_id"] = self.log_id
            _atomic_write_json(
                self.directory / INDEX_NAME,
                {**index, "file_size": size, "entries": entries, "corrupt": corrupt, "retired": retired},
            )
