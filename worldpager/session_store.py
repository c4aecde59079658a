"""A `Session`'s saved state: ``session.json`` and ``window.bin`` written and read back on resume.

Save / resume: the log directory holds the `SegmentLog` (segments, ``index.json``, ``meta.json``) and
``session.json`` (seed, codec, model config, the next step, the last poses; written at creation and by
``close()``); ``close()`` also writes ``window.bin``, the rolling window's K/V exactly as the model holds
it. `Session.resume` reopens the log and its index, registers every stored segment with the PageManager
(the newest that fit the host budget are read back into host, verified; the rest stay on NVMe),
restores the rolling window (from ``window.bin`` when it matches the log, else rebuilt from the last
segments in the log at codec precision: keys are stored post-RoPE at their true positions, as the cache
holds them) and continues at the next frame. A ``window.bin`` whose size is not the one
``session.json`` and the model imply, or that is not a regular file, is refused (ValueError naming it
and both sizes) before anything of it is read. Slots found corrupt when the log is reopened or on
read-back, and slots that do not fit the session (another codec or shape, a segment id past the log's
slot count: `misfit`), are reported as `CorruptSlot` events and never attended to. A corrupt slot is
reported once: the resume that finds it (or the step whose read-back finds it: a `Corrupt` event)
retires it in the log (`SegmentLog.retire_corrupt`, `SegmentLog.mark_corrupt`: its space given back,
a marker over its header), and a later resume neither reads, uses nor reports it; the segment it held
is reported as missing (`MissingSegment`) as long as the log holds no other copy. Slots that do not
fit are left as they are (another codec's segments, not damaged) and reported at every resume.

``window.bin`` matches the log when ``session.json`` names the step it was saved at and no segment it
holds has another copy in the log than the one recorded with it (``window.segments``). A resume
rewrites ``session.json`` without the window at once: a crash before the next ``close()`` rebuilds the
window from the log. A roll-back (``resume_at``) is recorded in ``session.json`` (``rollbacks``: the
segment and the log's slot count then): the copies it abandoned, generated again or not yet, are never
taken for history by a later resume (`abandoned`). `read_saved_state` refuses (ValueError naming the
file and field) a ``session.json`` whose values are not what `save_state` writes.

A window that is neither in ``window.bin`` nor whole in the log (a segment of it lost) cannot be
restored: `WindowLostError` names the lost segment and the latest step the log still holds a whole
window for (`resumable_step`), the ``resume_at`` to continue at instead. A save the disk refuses
(ENOSPC, EDQUOT) leaves the file it would replace as it was and no ``.tmp`` behind, and its OSError
names that file.

This module does not import `worldpager.session` (the session calls into it).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import stat
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from worldpager.codecs import CODECS
from worldpager.layout import SegmentLayout
from worldpager.model import KV, TinyCausalWan, TinyConfig
from worldpager.page_types import SegState
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo, check_pose
from worldpager.segment_log import (
    LOG_NAME,
    META_NAME,
    CorruptSlotError,
    RetiredSlotError,
    SegmentHeader,
    SegmentLog,
    SegmentLogError,
    open_fresh,
    read_small_text,
    refuse_existing,
    slot_size_for,
    whole,
)
from worldpager.session_records import CorruptSlot
from worldpager.transfer import TransferHandler

logger = logging.getLogger(__name__)

__all__ = [
    "SESSION_FILE",
    "WINDOW_FILE",
    "WindowLostError",
    "abandoned",
    "checkpoint_window",
    "config_dict",
    "misfit",
    "open_log",
    "read_saved_state",
    "register_stored",
    "resumable_step",
    "save_state",
    "save_window",
    "set_window",
    "stored_segments",
    "window_from_log",
    "window_segments",
]

SESSION_FILE, WINDOW_FILE = "session.json", "window.bin"
_FORMAT, _VERSION = "worldpager-session", 1

Stored = dict[int, tuple[int, SegmentHeader]]  # segment id -> (slot, header)


# ---- saving -----------------------------------------------------------------------------------------


def _failed_write(tmp: Path, path: Path, e: OSError) -> OSError:
    """After a write of ``path`` through ``tmp`` failed with ``e`` (a full disk): ``tmp`` removed (its
    space given back; ``path`` is as it was), and the error to raise: ``e``, naming ``path`` when the
    OS named no file."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return e if e.filename is not None else OSError(e.errno, e.strerror, str(path))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open_fresh(tmp) as f:  # (never through a link planted as the .tmp)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise _failed_write(tmp, path, e) from e
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_saved_state(log_dir: str | Path) -> dict[str, Any] | None:
    """The ``session.json`` of a saved session, or None when it is missing, unreadable or of another
    format. ValueError naming the file and the field when a value in it is not what `save_state`
    writes (a hand-edited or damaged file): resuming on it would fail later, or continue wrongly."""
    path = Path(log_dir) / SESSION_FILE
    try:
        state = json.loads(read_small_text(path))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict) or state.get("format") != _FORMAT or state.get("version") != _VERSION:
        return None
    _check_state(state, path)
    log_id = state.get("log_id", 0)
    if not whole(log_id) or log_id >= 1 << 64:
        raise ValueError(f"{path}: log_id is {log_id!r}, expected the 64-bit id of the session's log")
    return state


def _check_state(state: dict[str, Any], path: Path) -> None:
    """ValueError unless every field of a ``session.json`` has the type and range `save_state` writes."""

    def bad(field: str, want: str) -> ValueError:
        return ValueError(f"{path}: {field} is {state.get(field)!r}, expected {want}")

    if not whole(state.get("next_step")):
        raise bad("next_step", "a whole number >= 0")
    if not whole(state.get("seed"), None):
        raise bad("seed", "a whole number")
    if state.get("codec") not in CODECS:
        raise bad("codec", f"one of {', '.join(CODECS)}")
    if not isinstance(state.get("config"), dict):
        raise bad("config", "an object (the model's config)")
    if not isinstance(state.get("metadata", {}), dict):
        raise bad("metadata", "an object")
    poses = state.get("poses", {})
    if not isinstance(poses, dict):
        raise bad("poses", "an object: step -> [x, y, z, pitch, yaw]")
    for key, pose in poses.items():
        ok = key.isdigit() and isinstance(pose, list) and len(pose) == 5
        if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in pose):
            raise ValueError(f"{path}: poses[{key!r}] is {pose!r}, expected [x, y, z, pitch, yaw] numbers")
        try:
            check_pose(Pose(*pose))
        except ValueError as e:
            raise ValueError(f"{path}: poses[{key!r}]: {e}") from None
    w = state.get("window")
    if w is not None:
        if not isinstance(w, dict):
            raise bad("window", "an object or null")
        for name in ("tokens", "global_end", "nbytes", "crc32"):
            if not whole(w.get(name)):
                raise ValueError(f"{path}: window.{name} is {w.get(name)!r}, expected a whole number >= 0")
        if not isinstance(w.get("dtype"), str):
            raise ValueError(f"{path}: window.dtype is {w.get('dtype')!r}, expected a dtype name")
        segs = w.get("segments", [])
        if not isinstance(segs, list) or not all(
            isinstance(e, list) and len(e) == 2 and whole(e[0]) and (e[1] is None or whole(e[1]))
            for e in segs
        ):
            raise ValueError(f"{path}: window.segments is {segs!r}, expected [[segment, slot or null], ...]")
    rollbacks = state.get("rollbacks", [])
    if not isinstance(rollbacks, list) or not all(
        isinstance(e, list) and len(e) == 2 and whole(e[0]) and whole(e[1]) for e in rollbacks
    ):
        raise bad("rollbacks", "[[segment, slots], ...] of whole numbers >= 0")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def config_dict(cfg: TinyConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def window_segments(cfg: TinyConfig, nxt: int) -> range:
    """The ids of the segments whose K/V the rolling window holds before step ``nxt``."""
    tokens = min(cfg.window_tokens, nxt * cfg.frames_per_block * cfg.tokens_per_frame)
    return range(nxt - -(-tokens // (cfg.frames_per_block * cfg.tokens_per_frame)), nxt)


def save_window(
    model: TinyCausalWan, log_dir: Path, segments: Sequence[tuple[int, int | None]]
) -> dict[str, Any]:
    """Write the rolling window's K/V (every layer, exactly as cached) to ``window.bin``; ``segments``:
    (segment id, log slot or None) of the copies the window holds (checked on resume)."""
    caches = model.kv_cache
    tokens = int(caches[0]["local_end_index"].item()) if caches else 0
    global_end = int(caches[0]["global_end_index"].item()) if caches else 0
    crc, nbytes = 0, 0
    tmp = log_dir / (WINDOW_FILE + ".tmp")
    try:
        with open_fresh(tmp) as f:  # (never through a link planted as the .tmp)
            for cache in caches:
                for name in ("k", "v"):
                    data = _tensor_bytes(cache[name][:, :tokens])
                    crc, nbytes = zlib.crc32(data, crc), nbytes + len(data)
                    f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, log_dir / WINDOW_FILE)
    except OSError as e:  # (a full disk: the window written so far is removed, the old one kept)
        raise _failed_write(tmp, log_dir / WINDOW_FILE, e) from e
    dtype = str(model.head.weight.dtype).removeprefix("torch.")
    return {
        "tokens": tokens, "global_end": global_end, "dtype": dtype, "nbytes": nbytes, "crc32": crc,
        "segments": [[sid, slot] for sid, slot in segments],
    }  # fmt: skip


def save_state(
    log_dir: Path,
    *,
    seed: int,
    codec: str,
    cfg: TinyConfig,
    next_step: int,
    poses: Mapping[int, Pose],
    window: dict[str, Any] | None,
    metadata: dict[str, Any],
    rollbacks: Sequence[tuple[int, int]] = (),
) -> None:
    """Write ``session.json`` (atomically), with the id of the segment log in ``log_dir`` (its
    ``meta.json``; 0 when it has none). ``rollbacks``: (segment, slots) of each roll-back
    (`abandoned`)."""
    log_id = 0
    with contextlib.suppress(OSError, ValueError, RecursionError, AttributeError):
        log_id = json.loads(read_small_text(log_dir / META_NAME)).get("log_id", 0)
    state = {
        "format": _FORMAT,
        "version": _VERSION,
        "seed": seed,
        "codec": codec,
        "config": config_dict(cfg),
        "next_step": next_step,
        "poses": {str(i): dataclasses.astuple(p) for i, p in sorted(poses.items())},
        "window": window,
        "metadata": metadata,
        "rollbacks": [[at, slots] for at, slots in rollbacks],
        "log_id": log_id if whole(log_id) else 0,
    }
    _atomic_write(log_dir / SESSION_FILE, json.dumps(state).encode("utf-8"))


# ---- resume -------------------------------------------------------------------------------------------


def open_log(log_dir: Path, segment_bytes: int, max_bytes: int | None, *, resume: bool) -> SegmentLog:
    """The session's `SegmentLog`: created (FileExistsError naming the file when ``log_dir`` holds
    any file a new session writes, or its ``.tmp``: someone's own ``session.json`` is never written
    over, nor deleted by `Session.close` as the session's), or reopened (``resume``; its slots must
    fit the segments, and it must be the log ``session.json`` was written with, when that names
    one). On a resume the
    slots the reopen found corrupt are retired (`SegmentLog.retire_corrupt`): its corrupt_slots()
    still lists them, for this resume to report, and a later reopen does not."""
    if not resume:
        names = (LOG_NAME, SESSION_FILE, WINDOW_FILE, SESSION_FILE + ".tmp", WINDOW_FILE + ".tmp")
        refuse_existing(log_dir, names, "a new session")  # (the log first: it names a saved session)
        return SegmentLog.create(log_dir, slot_size_for(segment_bytes), max_bytes=max_bytes)
    log = SegmentLog.open(log_dir, max_bytes=max_bytes)
    if log.slot_size != slot_size_for(segment_bytes):
        log.close()
        raise ValueError(
            f"{log_dir}: log slots of {log.slot_size} bytes do not match this "
            f"session's {segment_bytes}-byte segments"
        )
    saved = (read_saved_state(log_dir) or {}).get("log_id", 0)
    if saved and saved != log.log_id:
        log.close()
        raise ValueError(
            f"{log_dir}: the segment log is another one than {SESSION_FILE} was saved with (log id "
            f"{log.log_id:x}, expected {saved:x}): a log copied from another session cannot be resumed"
        )
    try:
        log.retire_corrupt()  # (after the checks: a log refused is left as it is)
    except OSError as e:  # the index could not be saved: the next index write saves it
        logger.warning(
            "%s: the segment log's index was not saved at the resume (saved later): %s", log_dir, e
        )
    except BaseException:
        log.close()
        raise
    return log


def abandoned(segment_id: int, slot: int, rollbacks: Sequence[Sequence[int]]) -> bool:
    """Whether the copy of ``segment_id`` in ``slot`` belongs to a timeline a roll-back abandoned: a
    resume at segment ``at`` when the log had ``slots`` slots drops every copy of a segment >= ``at``
    written before, including those not generated again yet."""
    return any(segment_id >= at and slot < slots for at, slots in rollbacks)


def misfit(h: SegmentHeader, layout: SegmentLayout, n_slots: int | None = None) -> str | None:
    """Why a stored segment's header does not fit a session of ``layout`` (None when it fits): such a
    slot (another codec or model shape, written by something else) is never used. ``n_slots``: the
    log's slot count. A session's ids start at 0 and each segment it writes takes a slot of its own, so an id
    at or past the slot count is taken for none of its own (a valid header with a huge id would have
    the resume walk every id up to it); a segment written ahead of earlier ones that never reached a
    full log is taken so too, and generated again."""
    if n_slots is not None and not 0 <= h.segment_id < n_slots:
        return f"segment id {h.segment_id}, past the log's {n_slots} slots"
    fpb = layout.frames
    if h.codec != layout.codec:
        return f"codec {h.codec}, expected {layout.codec}"
    if h.payload_len != layout.payload_nbytes or h.page_offsets != tuple(layout.page_offsets):
        want = f"{layout.payload_nbytes} bytes in {layout.layers} pages"
        return f"a payload of {h.payload_len} bytes in {h.n_pages} pages, expected {want}"
    if h.position_state != "post-rope":
        return f"keys {h.position_state}, expected post-rope"
    if (h.frame_start, h.frame_end) != (h.segment_id * fpb, (h.segment_id + 1) * fpb):
        return f"frames [{h.frame_start}, {h.frame_end}) for segment {h.segment_id}"
    if len(h.pose) != 5:
        return f"a pose of {len(h.pose)} values, expected 5"
    return None


def stored_segments(
    log: SegmentLog,
    layout: SegmentLayout,
    cfg: TinyConfig,
    log_dir: Path,
    rollbacks: Sequence[Sequence[int]] = (),
) -> Stored:
    """segment id -> (slot, header) of every readable stored segment: the latest copy of each that
    fits the session (`misfit`), unless a roll-back abandoned it (see `abandoned`). Slots that do not
    fit are skipped here and reported by `register_stored`. (``cfg`` and ``log_dir``: kept for
    callers; ``layout`` says what fits.)"""
    stored: Stored = {}
    for slot in sorted(log.slots(), reverse=True):  # latest first: an older copy is superseded
        h = log.header(slot)
        if h.segment_id in stored or abandoned(h.segment_id, slot, rollbacks):
            continue  # superseded by a later copy, or of an abandoned timeline
        if misfit(h, layout, log.n_slots) is None:
            stored[h.segment_id] = (slot, h)
    return dict(sorted(stored.items()))


def register_stored(
    stored: Stored, log: SegmentLog, pm: PageManager, handler: TransferHandler, segment_bytes: int
) -> tuple[list[SegmentInfo], list[CorruptSlot]]:
    """Tell the PageManager about every stored segment: the newest that fit the host budget with a
    host copy read back (and verified), the others NVMe-only (registered oldest first through a
    placeholder that the newer ones evict before anything can read it). Returns the registered
    segments (id order) and the slots found unusable: every slot of the log that does not fit the
    session (`misfit` against ``handler.layout``; left as it is in the log) and those found corrupt
    on read-back (dropped from ``stored`` and retired in the log, so a later reopen neither trusts,
    reads nor reports them: `SegmentLog.mark_corrupt`). A slot that reads back as retired already (a
    run that retired it stopped before saving the index) is dropped and marked, not reported again."""
    corrupt = [
        CorruptSlot(slot, f"does not fit this session: {why}")
        for slot in log.slots()
        if (why := misfit(log.header(slot), handler.layout, log.n_slots)) is not None
    ]
    while True:  # the newest segments that fit the budget, each read back and verified
        resident: dict[int, bytes] = {}
        room, bad = pm.host_budget_bytes, None
        for sid in sorted(stored, reverse=True):
            if room < segment_bytes:
                break
            try:
                _, resident[sid] = log.read(stored[sid][0])
            except CorruptSlotError as e:
                bad = (sid, e)
                break
            room -= segment_bytes
        if bad is None:
            break
        if not isinstance(bad[1], RetiredSlotError):  # (retired: reported when it was found)
            corrupt.append(CorruptSlot(bad[1].slot, bad[1].reason))  # never used: out of the index
        log.mark_corrupt(bad[1].slot, bad[1].reason)
        del stored[bad[0]]
    placeholder = bytes(segment_bytes) if len(resident) < len(stored) else b""
    infos: list[SegmentInfo] = []
    for sid in sorted(stored):
        slot, h = stored[sid]
        info = SegmentInfo(sid, h.frame_start, h.frame_end, Pose(*h.pose))
        added = handler.add_segment(info, resident.get(sid, placeholder), on_disk_slot=slot)
        assert added, f"segment {sid}: no host room with nothing protected"
        infos.append(info)
    for sid in stored.keys() - resident.keys():
        loc = pm.lookup(sid)
        assert loc is not None and loc.state is SegState.NVME, f"segment {sid} left in host"
    handler.take_events()  # the registration's evictions are not the session's events
    return infos, corrupt


def checkpoint_window(
    saved: dict[str, Any] | None, nxt: int, model: TinyCausalWan, log_dir: Path, stored: Stored
) -> list[KV] | None:
    """The rolling window from ``window.bin`` if it matches the log and the model, else None. It
    matches the log when no segment it holds has another copy in ``stored`` than the one it was
    saved with (a roll-back generates segments again: the window of the old ones is stale)."""
    w = (saved or {}).get("window")
    if saved is None or not isinstance(w, dict) or int(saved.get("next_step", -1)) < nxt:
        return None
    segments = w.get("segments")
    if not isinstance(segments, list):
        return None  # written before the segments were recorded: cannot be checked
    for sid, slot in segments:
        if sid in stored and stored[sid][0] != slot:
            return None
    cfg, p = model.cfg, model.head.weight
    tokens = int(w.get("tokens", -1))
    expect = int(saved["next_step"]) * cfg.frames_per_block * cfg.tokens_per_frame
    if not 0 <= tokens <= cfg.window_tokens or int(w.get("global_end", -1)) != expect:
        return None
    if w.get("dtype") != str(p.dtype).removeprefix("torch."):
        return None
    per = tokens * cfg.heads * cfg.head_dim * p.element_size()
    if w.get("nbytes") != 2 * cfg.layers * per:
        return None
    data = _read_window(log_dir / WINDOW_FILE, 2 * cfg.layers * per, tokens)
    if data is None:
        return None
    if zlib.crc32(data) != w.get("crc32"):  # (damaged on disk: said, as a file of the wrong size is)
        logger.warning(
            "%s: its checksum does not match the one %s records: the window is rebuilt from the log",
            log_dir / WINDOW_FILE, SESSION_FILE,
        )  # fmt: skip
        return None
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    shape = (1, tokens, cfg.heads, cfg.head_dim)
    parts = [flat[i * per : (i + 1) * per].view(p.dtype).view(shape) for i in range(2 * cfg.layers)]
    return [(parts[2 * i], parts[2 * i + 1]) for i in range(cfg.layers)]


def _read_window(path: Path, nbytes: int, tokens: int) -> bytes | None:
    """The ``nbytes`` of ``window.bin``, or None (the window is then rebuilt from the log, as for any
    other mismatch) when it cannot be opened, is not a regular file or is not that size. Its size is
    checked on the open file before anything is read: a huge or sparse file is never read into
    memory. What is wrong with it is logged, naming the file and both sizes."""
    try:  # (O_NONBLOCK: a named pipe does not hold the open; O_NOFOLLOW: a link is not followed)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("%s: cannot be opened (%s): the window is rebuilt from the log", path, e.strerror)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "not a regular file"
            logger.warning(
                "%s: %s, expected %d (the %d-token window %s records): the window is rebuilt from the log",
                path, what, nbytes, tokens, SESSION_FILE,
            )  # fmt: skip
            return None
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes and (n := os.readv(fd, [view[got:]])):
            got += n
    finally:
        os.close(fd)
    return bytes(buf) if got == nbytes else None


class WindowLostError(SegmentLogError):
    """The rolling window cannot be restored: a segment it holds is lost from the log (corrupt,
    unreadable, never written) and ``window.bin`` does not match. ``resume_at``: the latest step at
    which the log still holds a whole rolling window (`resumable_step`): a resume with that
    ``resume_at`` continues a consistent session there, generating the segments from it on again.
    ``reason``: the message without that hint (said in a caller's own words, e.g. a CLI flag)."""

    def __init__(self, reason: str, resume_at: int) -> None:
        super().__init__(f"{reason}; {self.hint(f'resume_at={resume_at}', resume_at)}")
        self.reason, self.resume_at = reason, resume_at
        self.events: list[Any] = []
        """What the resume found before it gave up (the corrupt slots it retired: the cause, often)."""

    @staticmethod
    def hint(how: str, resume_at: int) -> str:
        """What to do, said with ``how`` (the way the caller sets the step: ``resume_at=N``, a CLI
        flag): continue at ``resume_at``, or -- 0, no segment of the session can be kept -- restart it
        from the beginning."""
        if resume_at == 0:
            return (
                "no step's rolling window is whole in the log, so the session must restart from the "
                f"beginning (step 0): resume it with {how} (every segment is generated again), or "
                "start a new session"
            )
        return (
            f"the log still holds the session up to step {resume_at}: resume it there with {how} "
            f"(the segments from {resume_at} on are generated again)"
        )

    def __reduce__(self) -> tuple[type[WindowLostError], tuple[str, int]]:
        return type(self), (self.reason, self.resume_at)  # (pickled whole: across processes too)


def resumable_step(stored: Stored, cfg: TinyConfig, below: int) -> int:
    """The latest step at most ``below`` whose rolling window the log holds whole (every segment of
    `window_segments` in ``stored``); 0 (an empty window) at worst."""
    for step in range(below, 0, -1):
        if all(sid in stored for sid in window_segments(cfg, step)):
            return step
    return 0


def window_from_log(
    stored: Stored, nxt: int, log: SegmentLog, layout: SegmentLayout, cfg: TinyConfig, log_dir: Path
) -> list[KV]:
    """The rolling window rebuilt from the last segments in the log (codec precision). A segment of
    it not in the log, or failing its check when read, is a `WindowLostError` naming the segment and
    the step to resume at instead."""
    tokens = min(cfg.window_tokens, nxt * cfg.frames_per_block * cfg.tokens_per_frame)
    per_layer: list[list[KV]] = [[] for _ in range(cfg.layers)]
    for sid in window_segments(cfg, nxt):
        if sid not in stored:
            raise WindowLostError(
                f"{log_dir}: cannot rebuild the rolling window: segment {sid} is not in the log "
                f"and {WINDOW_FILE} does not match it",
                resumable_step(stored, cfg, sid),
            )
        slot = stored[sid][0]
        try:
            _, payload = log.read(slot)
        except CorruptSlotError as e:  # (the steps up to sid need only segments before it)
            raise WindowLostError(
                f"{log_dir}: cannot rebuild the rolling window: segment {sid} ({e})",
                resumable_step(stored, cfg, sid),
            ) from e
        for i, kv in enumerate(layout.decode(payload)):
            per_layer[i].append(kv)
    return [
        (
            torch.cat([k for k, _ in kvs], dim=1)[:, -tokens:],
            torch.cat([v for _, v in kvs], dim=1)[:, -tokens:],
        )
        if tokens
        else (torch.empty(0), torch.empty(0))
        for kvs in per_layer
    ]


def set_window(model: TinyCausalWan, window: Sequence[KV], global_end_tokens: int) -> None:
    """Load ``window`` into the model's rolling KV cache (after a reset)."""
    model.reset_cache()
    for cache, (k, v) in zip(model.kv_cache, window, strict=True):
        n = k.shape[1] if k.dim() == 4 else 0
        if n:
            cache["k"][:, :n] = k.to(cache["k"].device, cache["k"].dtype)
            cache["v"][:, :n] = v.to(cache["v"].device, cache["v"].dtype)
        cache["global_end_index"].fill_(global_end_tokens if n else 0)
        cache["local_end_index"].fill_(n)
