"""World-model sessions on a device host: WorldPager's tiered KV runtime around the resident MG2 stand-in.

Order of use: `open(model_name, module, session_id, kv_bytes, log_dir, codec)` once the model is in the
gpu tier (``resume=True``: reopen the session saved in ``log_dir`` — after the host restarted —
continuing at ``resume_at`` at the latest); `step(session_id, pose)` per segment (returns the segment's
latents and its stall and tier figures as plain data, and in ``corrupt`` the stored segments whose log
copy failed its check when read back meanwhile: lost, never attended to, each also logged);
`resize(session_id, kv_bytes)` whenever the manager changes the model's elastic lease;
`close(session_id)`. On the CPU stand-in the lease is the session's host KV budget (its "device" memory
is RAM); on CUDA it is the GPU retrieval budget. A world model runs one session at a time: its rolling
KV window lives on the module (as MG2's `kv_cache` does), so a second session would reset it under the
first. A lease below what the runtime needs to keep working (three segments; on a GPU at least one
decoded segment per retrieval buffer) is raised to that floor, and the result says so. One lock per
session: a resize may arrive from the manager while a step runs; a step or resize that waited for it
while a close ran finds the session closed (`SessionNotOpen`).

Durability: a step returns only once its segment is in the session's log (written, not fsynced: it
survives the host process, not the machine), and the log's index is saved every `INDEX_EVERY`
segments, so a host that dies loses no segment it returned, and the session reopens from its index.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers import protocol as P
from worldpager.segment_log import OTHERS

logger = logging.getLogger(__name__)

MIN_SEGMENTS = 3
INDEX_EVERY = 8
"""Save the log's index (an fsync) every this many segments: a reopen scans only the slots after it."""


class SessionNotOpen(KeyError):
    """No open session by that id on this host (it never opened here, or the host restarted)."""


class NotResident(RuntimeError):
    """The world model left the gpu tier (a drop or demote) before its session could open."""


SAVED_FILES = (
    "session.json", "window.bin", "meta.json", "index.json", "segments.wplog", "sent.json",
    "session.json.tmp", "window.bin.tmp", "meta.json.tmp", "index.json.tmp", "sent.json.tmp",
)  # fmt: skip
"""The files of a saved session's folder that a resume reads or writes (WorldPager's, with the temporary
names its atomic writes use, and the manager's `sent.json`)."""


def not_plain(log_dir: Path) -> str | None:
    """Why the saved session in ``log_dir`` is not to be read or written (None: no reason): its folder,
    or one of its files, is a symbolic link or not a regular file. A named pipe would hold the read for
    good (and with it every later open on this host), a link to /dev/zero be read until memory ran
    out, and a link to another folder or file be written through (a resume's records, the steps'
    segments, the holes a retired slot punches). Nothing there: None (the caller says so)."""
    try:
        if stat.S_ISLNK(os.lstat(log_dir).st_mode):
            return "its folder is a symbolic link"
    except OSError:
        return None
    for name in SAVED_FILES:
        try:
            mode = os.lstat(log_dir / name).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{name} cannot be looked at ({e.strerror})"
        if stat.S_ISLNK(mode):
            return f"{name} is a symbolic link"
        if not stat.S_ISREG(mode):
            return f"{name} is not a regular file"
    return None


def make_private(session_id: str, log_dir: Path) -> None:
    """Take group and other access away from the saved session in ``log_dir``: its folder and its
    files (`SAVED_FILES`). WorldPager creates them private (folders 0700, files 0600); a session saved
    before that was not (0755 and 0644), and is made so when it is resumed. Each is opened without
    following a link (nothing is changed through one) and changed through that descriptor; one that
    cannot be (another user's, say) is logged and left as it is: the resume goes on."""
    tightened = []
    for path in (log_dir, *(log_dir / name for name in SAVED_FILES)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # not there (or a link, refused before this)
            continue
        try:
            mode = os.fstat(fd).st_mode
            if (stat.S_ISDIR(mode) or stat.S_ISREG(mode)) and mode & OTHERS:
                os.fchmod(fd, stat.S_IMODE(mode) & ~OTHERS)
                tightened.append(path.name if path != log_dir else "its folder")
        except OSError as e:
            logger.warning("world session %r: cannot make %s private: %s", session_id, path, e)
        finally:
            os.close(fd)
    if tightened:
        logger.info(
            "world session %r: %s in %s was open to other users: made private",
            session_id, ", ".join(tightened), log_dir,
        )  # fmt: skip


def _unpathed(message: str, log_dir: Path) -> str:
    """``message`` without ``log_dir``'s path (a client is told the file and the field, not where the
    server keeps its sessions)."""
    d = str(log_dir)
    return message.replace(f"{d}: ", "").replace(d + os.sep, "").replace(d, "its folder")


class SavedStateDamaged(ValueError):
    """A saved session cannot be resumed: its folder's files are damaged, missing or not plain files."""


def _damaged(session_id: str, log_dir: Path, why: str) -> SavedStateDamaged:
    """The refusal of a resume of the damaged saved state in ``log_dir`` (logged with its path)."""
    logger.warning("world session %r: its saved state in %s is damaged: %s", session_id, log_dir, why)
    return SavedStateDamaged(
        f"world session {session_id!r}: its saved state is damaged: {_unpathed(why, log_dir)}"
    )


@dataclass
class _Open:
    session: Any
    model: str
    segment_bytes: int
    kind: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    lease: int = 0
    min_lease: int = 0
    """The least lease the runtime takes: three segments; on a GPU also one decoded slot per buffer."""
    corrupt_seen: int = 0
    """`Corrupt` events of the session already reported by a step."""


class WorldSessions:
    def __init__(self, device: torch.device, release: Callable[[], None] | None = None) -> None:
        self.device = device
        self.release = release
        """Gives the device memory a session let go of back to the driver (on CUDA the caching
        allocator keeps freed blocks reserved, so other processes, and the device host's own
        free-memory probe, would not see a shrunk lease or a closed session's buffers as free):
        called after a shrink and after a close; a failure is logged, never raised."""
        self.open_sessions: dict[str, _Open] = {}
        # held by an open and by a close (re-entered by `closing`): an open never runs while a close
        # saves a session's state and rolling window (read from the model's KV cache, which the open
        # resets), nor reads a session's state before its close has written it (a prompt resume)
        self._opening = threading.RLock()

    def _floor(self, o: _Open, kv_bytes: int) -> int:
        return max(int(kv_bytes), MIN_SEGMENTS * o.segment_bytes, o.min_lease)

    def open(
        self,
        model: str,
        module: Any,
        session_id: str,
        kv_bytes: int,
        log_dir: Path,
        codec: str | None = "bf16",
        *,
        resume: bool = False,
        resume_at: int | None = None,
        resident: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """Open a new session in ``log_dir``, or (``resume``) reopen the one saved there. The reply
        says where it continues (``next_segment``) and, on a resume, what was found unusable: slots
        (``corrupt_slots``: slot -> reason) and segments (``missing_segments``), never attended to.
        ``resident`` (checked under the lock `closing` holds while a model leaves the gpu tier) says
        whether ``module`` is still the model's; NotResident when it is not."""
        from worldpager.layout import SegmentLayout
        from worldpager.session import CorruptSlot, MissingSegment, Session

        with self._opening:  # one open at a time: the check below holds until the session is in
            if resident is not None and not resident():
                raise NotResident(
                    f"model {model!r} left the gpu tier before its session {session_id!r} opened"
                )
            # (the manager knows these two refusals' words: `manager.live_sessions._HELD_BY_HOST`)
            if session_id in self.open_sessions:
                raise ValueError(f"session {session_id!r} is already open")
            running = next((sid for sid, o in self.open_sessions.items() if o.model == model), None)
            if running is not None:
                raise ValueError(
                    f"model {model!r} runs world session {running!r}: one session at a time per world "
                    "model (its rolling KV window is the model's)"
                )
            saved = self._saved(session_id, log_dir) if resume else None
            if resume:
                assert saved is not None
                owner = (saved.get("metadata") or {}).get("model", model)
                if owner != model:
                    raise ValueError(
                        f"world session {session_id!r} belongs to model {owner!r}, not {model!r}"
                    )
                codec = codec or str(saved.get("codec", "bf16"))  # none given: the saved one
            codec = codec or "bf16"
            layout = SegmentLayout.from_config(module.cfg, codec, module.head.weight.dtype)
            seg = layout.payload_nbytes
            kind = self.device.type
            host = max(int(kv_bytes), MIN_SEGMENTS * seg) if kind == "cpu" else 64 * seg
            opts: dict[str, Any] = {"host_budget_bytes": host, "device": self.device, "keep_outputs": True}
            session = None
            try:
                if resume:
                    session = self._resumed(session_id, log_dir, lambda: Session.resume(
                        log_dir, module, codec=codec, resume_at=resume_at, **opts
                    ))  # fmt: skip
                else:
                    session = Session(module, codec=codec, log_dir=log_dir, metadata={"model": model}, **opts)
                o = _Open(session, model, seg, kind, lease=host)
                if kind != "cpu":
                    o.min_lease = 2 * layout.decoded_nbytes  # the GPU buffers' floor (worldpager.pages)
                    session.resize_lease(gpu_budget_bytes=self._floor(o, kv_bytes))
                    o.lease = self._floor(o, kv_bytes)
            except BaseException:  # not opened after all: its threads and log go, its device memory back
                try:
                    if session is not None:
                        session.close()
                finally:
                    self._release()
                raise
            self.open_sessions[session_id] = o
            events = session.events if resume else []
            return {
                "session_id": session_id, "segment_bytes": seg, "lease_bytes": o.lease, "codec": codec,
                "lease_floor_bytes": self._floor(o, 0), "resumed": resume, "next_segment": session.step_index,
                "corrupt_slots": {e.slot: e.reason for e in events if isinstance(e, CorruptSlot)},
                "missing_segments": [e.segment_id for e in events if isinstance(e, MissingSegment)],
            }  # fmt: skip

    @staticmethod
    def _saved(session_id: str, log_dir: Path) -> dict[str, Any]:
        """The saved state of the session in ``log_dir`` (its ``session.json``). SessionNotOpen when
        nothing is saved there; `SavedStateDamaged` when what is there cannot be resumed."""
        from worldpager.segment_log import LOG_NAME
        from worldpager.session import SESSION_FILE, read_saved_state

        why = not_plain(log_dir)
        if why is not None:
            raise _damaged(session_id, log_dir, why)
        try:
            saved = read_saved_state(log_dir)
        except ValueError as e:  # a value that is not what `save_state` writes: names the file and field
            raise _damaged(session_id, log_dir, str(e)) from None
        has_log = (log_dir / LOG_NAME).exists()
        if saved is None and (has_log or (log_dir / SESSION_FILE).exists()):
            state = "unreadable" if (log_dir / SESSION_FILE).exists() else "missing"
            raise _damaged(session_id, log_dir, f"{SESSION_FILE} is {state}")
        if saved is None:
            raise SessionNotOpen(f"no saved world session {session_id!r} to resume")
        if not has_log:
            raise _damaged(session_id, log_dir, f"{LOG_NAME} is missing")
        make_private(session_id, log_dir)  # (saved before its files were created private)
        return saved

    @staticmethod
    def _resumed(session_id: str, log_dir: Path, resume: Callable[[], Any]) -> Any:
        """``resume()``, a saved state it finds damaged (a log it cannot reopen, a file gone meanwhile)
        said as `SavedStateDamaged`, and its other refusals without the server's paths."""
        from worldpager.segment_log import DiskFullError, LogFullError, LogInUse, SegmentLogError

        try:
            return resume()
        except FileNotFoundError as e:
            raise _damaged(session_id, log_dir, f"{Path(e.filename or '?').name} is missing") from None
        except SegmentLogError as e:
            if isinstance(e, LogFullError):  # (the server's path in the log, not to the client)
                logger.warning("world session %r: its resume was refused: %s", session_id, e)
                said = _unpathed(str(e), log_dir)
                if isinstance(e, DiskFullError):
                    raise DiskFullError(said, e.errno) from None
                raise LogFullError(said) from None
            if isinstance(e, LogInUse):  # (whole, not damaged: another process has it open)
                logger.warning("world session %r: its resume was refused: %s", session_id, e)
                raise LogInUse(
                    f"world session {session_id!r} is open in another process (its log is locked): "
                    "resume it once that one has closed it"
                ) from None
            raise _damaged(session_id, log_dir, str(e)) from None
        except ValueError as e:  # the session's own (another model config, codec or log than saved)
            raise ValueError(_unpathed(str(e), log_dir)) from None

    def status(self) -> tuple[P.SessionStatus, ...]:
        """The open sessions, for the host's status (what a restarted manager reconciles with)."""
        return tuple(
            P.SessionStatus(sid, o.model, o.lease)
            for sid, o in self.open_sessions.copy().items()  # a copy, in one C call: opens change it
        )

    def get(self, session_id: str) -> _Open:
        if session_id not in self.open_sessions:
            raise SessionNotOpen(f"no open world session {session_id!r}")
        return self.open_sessions[session_id]

    @staticmethod
    def _flush_index(session_id: str, o: _Open) -> None:
        """Save the log's index (housekeeping: a resume rebuilds a stale one from the log). The step has
        run by then, so a write the disk refuses is logged, not the step's error: its answer stands
        (its `durable` says whether its segment reached the log), and the next flush tries again."""
        from worldpager.segment_log import LogFullError

        try:
            o.session.flush_index()
        except (OSError, LogFullError) as e:
            logger.warning(
                "world session %s: its log's index was not saved (tried again later): %s", session_id, e
            )

    def step(self, session_id: str, pose: tuple[float, float, float, float, float]) -> dict[str, Any]:
        from worldpager.retrieval import Pose

        o = self.get(session_id)
        with o.lock:
            self._still_open(session_id, o)
            rec = o.session.step(Pose(*pose))
            outs = o.session.outputs
            latents = outs.pop() if outs else torch.empty(0)
            outs.clear()
            durable = o.session.wait_written(rec.step)  # acknowledged only once in the log
            if (rec.step + 1) % INDEX_EVERY == 0:
                self._flush_index(session_id, o)
            lease = o.lease  # the lease this segment ran with (a resize waiting for the lock comes after)
            corrupt = self._new_corrupt(session_id, o)
        lat = latents.detach().float().cpu().contiguous()
        return {
            "step": rec.step, "stall_s": rec.stall_s, "compute_s": rec.compute_s, "hits": rec.hits,
            "misses": rec.misses, "bytes_read": rec.bytes_read, "bytes_written": rec.bytes_written,
            "host_bytes": rec.host_bytes, "max_position": rec.max_position, "lease_bytes": lease,
            "durable": durable, "retrieved": list(rec.retrieved), "latents": lat.numpy().tobytes(),
            "shape": tuple(lat.shape), "corrupt": corrupt,
        }  # fmt: skip

    def _new_corrupt(self, session_id: str, o: _Open) -> list[dict[str, Any]]:
        """Under ``o.lock``: the segments whose log copy failed its check when read back since the last
        step (`Corrupt` events: lost, never attended to), as ``{"segment", "slot", "reason"}``; each
        logged once, naming the log file and the slot."""
        from worldpager.page_types import Corrupt

        if o.session.event_counts().get("Corrupt", 0) <= o.corrupt_seen:
            return []
        events = [e for e in o.session.events if isinstance(e, Corrupt)]  # (all kept: notable)
        new, o.corrupt_seen = events[o.corrupt_seen :], len(events)
        for e in new:
            logger.warning(
                "world session %r: segment %d (slot %s of %s): %s; never used",
                session_id, e.seg_id, e.slot, o.session.log.path, e.reason or "failed its check",
            )  # fmt: skip
        return [{"segment": e.seg_id, "slot": e.slot, "reason": e.reason} for e in new]

    def _still_open(self, session_id: str, o: _Open) -> None:
        """Under ``o.lock``: a close that ran while this call waited for the lock has ended it."""
        if self.open_sessions.get(session_id) is not o:
            raise SessionNotOpen(f"world session {session_id!r} was closed")

    def resize(self, session_id: str, kv_bytes: int) -> int:
        """Apply a new lease; returns the lease in force (the floor when asked for less)."""
        o = self.get(session_id)
        lease = self._floor(o, kv_bytes)
        with o.lock:
            self._still_open(session_id, o)
            if o.kind == "cpu":
                o.session.resize_lease(host_budget_bytes=lease)
            else:
                o.session.resize_lease(gpu_budget_bytes=lease)
            shrunk, o.lease = lease < o.lease, lease
        if shrunk:
            self._release()
        return lease

    def _release(self) -> None:
        if self.release is None:
            return
        try:
            self.release()
        except Exception:  # the memory stays reserved, the session goes on
            logger.exception("could not give a world session's freed device memory back")

    def close(self, session_id: str) -> dict[str, Any]:
        with self._opening:  # an open waits until the session is closed and its state saved
            o = self.open_sessions.pop(session_id, None)
            if o is None:
                return {"session_id": session_id, "closed": False}
            try:
                with o.lock:
                    o.session.close()
                    segments = o.session.step_index
                    discarded = o.session.discarded  # (a new one that ran nothing: nothing saved)
            finally:  # (also when its state could not be saved: its buffers are gone all the same)
                self._release()
        return {"session_id": session_id, "closed": True, "segments": segments, "discarded": discarded}

    def close_model(self, model: str) -> list[str]:
        """Close every session of `model` (before its weights leave the gpu tier)."""
        with self.closing(model) as ids:
            return ids

    @contextmanager
    def closing(self, model: str) -> Iterator[list[str]]:
        """Close every session of `model` and hold off new opens until the block ends, so the model
        can leave the gpu tier with no session opening on it meanwhile. Yields the ids closed."""
        with self._opening:
            ids = [sid for sid, o in list(self.open_sessions.items()) if o.model == model]
            for sid in ids:
                self.close(sid)
            yield ids
