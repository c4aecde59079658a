"""World sessions of the live manager: opening one (admitted like a long request, or resumed from
its saved state), its steps (reopened from the saved state when its device host died under it),
closing it (`end_session`: on its stream's error, saying whether it can be resumed), pruning the
saved ones, and the ordering of lease changes (a session resize) against the commands submitted on
the same device.

`WorldSessionsMixin` is one of `manager.live.LiveManager`'s bases; it holds no state of its own
(`LiveManager.__init__` sets the attributes it declares).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from manager.config import Config
from manager.errors import (
    DeadlineExceeded,
    InsufficientCapacity,
    InvalidRequest,
    ModelFailed,
    ModelNotFound,
    WorkerUnavailable,
)
from manager.live_persist import read_outcome
from manager.policy.engine import Engine
from manager.policy.types import ActionKind
from manager.units import format_duration
from manager.units import format_size as fmt_bytes
from workers import protocol as P
from worldpager.retrieval import Pose, check_pose

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from manager.live import _Live
    from manager.metrics import Metrics

logger = logging.getLogger("manager.live")  # the live manager's one logger (operators' log config)


LEASE_WAIT_S = 10.0
"""A grown lease that has waited this long for the commands that free its room is logged (it goes on
waiting: applied earlier, the device would hold more than it has)."""
SESSION_RECOVER_S = 60.0
"""A world session whose device host died has this long to be reopened (model reload included)."""


def worker_error(code: str | None, message: str) -> Exception:
    """The domain error for a worker's error code: what the caller sent is wrong (bad input, or a
    call the model does not offer: BAD_INPUT), or the worker could not do it (UNAVAILABLE: a device
    host stopping, one the cluster cannot place, a CUDA device without CUDA, all NOT_AVAILABLE, which
    are the server's state, not the request's fault: a client may try again)."""
    if code == P.BAD_INPUT:
        return InvalidRequest(message)
    if code == P.INTERNAL:  # it ran and failed (the model's code raised): not UNAVAILABLE (retried)
        return ModelFailed(message)
    if code == P.DEADLINE:  # no answer in time (the request's own deadline, or a slow model)
        return DeadlineExceeded(message)
    return WorkerUnavailable(message)


def _with_replaced(reply: P.SessionReply, client_next: int, sid: str) -> P.SessionReply:
    """`reply` to a (re)open of session `sid` whose client was sent the segments before
    `client_next`: when the session continues at an earlier segment, the segments from there on are
    ones its client was sent but whose saved copies are gone (a full disk held them in host RAM
    alone, lost with their device host) or unusable (found corrupt). They are generated again,
    replacing those the client has: ``replaced_segments`` ([first, last]) says so, and it is logged."""
    at = int(reply.data.get("next_segment", client_next))
    if at >= client_next:
        return reply
    logger.warning(
        "world session %s: segments %d-%d were sent to its client, but their saved copies are gone "
        "(never saved on a full disk, and lost with the device host) or unusable (corrupt): the "
        "session continues at segment %d, replacing them", sid, at, client_next - 1, at,
    )  # fmt: skip
    return replace(reply, data={**reply.data, "replaced_segments": [at, client_next - 1]})


class SessionResumable(WorkerUnavailable):
    """A world session's device host lost it and it could not be reopened; the message names the id
    to resume it with. `lost`: the message without that (for when no saved state is found after all)."""

    def __init__(self, message: str, lost: str) -> None:
        super().__init__(message)
        self.lost = lost


def _unsaved(d: Path) -> str | None:
    """Why `d` holds no saved session that a resume reopens (None: it holds one), read as the device
    host's resume reads it (`worldpager.session_store.read_saved_state`)."""
    from workers.world import not_plain  # (imports torch: only for a stream's error)
    from worldpager.session_store import read_saved_state

    if not_plain(d) is not None:  # (a named pipe would hold this read for good)
        return "its saved state is damaged"
    try:
        if read_saved_state(d) is not None:
            return None
    except ValueError as e:  # names the server's path: logged, not sent
        logger.warning("world session %s: its saved state is damaged: %s", d.name, e)
        return "its saved state is damaged"
    return "its device host wrote no saved state"


def _du(d: Path) -> tuple[int, float]:
    """Bytes in the files under `d`, and their latest modification time (`d`'s when it has none). A
    file that goes while it is walked (a running session renames its `*.tmp` files into place) is
    left out; FileNotFoundError when `d` itself goes."""
    size, last = 0, -math.inf
    for f in d.rglob("*"):
        try:
            st = f.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            # the blocks it holds: a segment log gives a retired slot's blocks back (a hole) and
            # keeps its length
            size += min(st.st_size, st.st_blocks * 512)
            last = max(last, st.st_mtime)
    return size, last if last > -math.inf else d.stat().st_mtime


def _ran_nothing(reply: P.SessionReply) -> bool:
    """Whether a host's close reply says the session was discarded: a new one that ran no segment,
    whose host's `worldpager.session.Session.close` saved nothing (`Session.discarded`: the host's
    word, not a guess from its segment count: a host's own reopen at step 0 saves its state)."""
    data = reply.data if reply.ok else {}
    return bool(data.get("closed")) and data.get("discarded") is True


def _discard_unrun(d: Path) -> bool:
    """Remove session folder `d` of a new session that ran no segment (what is left in it: the
    manager's SENT_FILE). Only a folder of its own (a link to one elsewhere is left, as a prune leaves
    it). True when `d` is gone."""
    try:
        if not stat.S_ISDIR(d.lstat().st_mode):
            return False
    except FileNotFoundError:
        return True
    except OSError:
        return False
    shutil.rmtree(d, ignore_errors=True)
    return not os.path.lexists(d)


@dataclass
class _World:
    """An open world session, as the manager tracks it to reopen it after its device host restarted."""

    codec: str
    next_segment: int = 0  # segments the client has been sent
    resumes: int = 0
    resumed: bool = False  # opened as a resume of a saved session (never discarded by its close)
    failed: bool = False  # a step failed: the session ends as an `error` in the requests metric
    keep_alive: float | None = None  # the session's own keep-alive (WorldStart.keep_alive), logged at its end
    ready: float | None = None  # when it began to run (its model admitted and loaded): its wait ended


_SESSION_ID = re.compile(r"[0-9a-f]{12}")

_HELD_BY_HOST = re.compile(r"runs world session '([0-9a-f]{12})'|^session '([0-9a-f]{12})' is already open")
"""A device host's refusal of an open for a session it holds open (`workers.world.WorldSessions.open`)."""

SENT_FILE = "sent.json"
"""In a saved session's directory, written by the manager when the session's stream ends: the next
segment its client had not been sent (`{"next_segment": n}`). The host may have generated (and logged)
more - a step whose client hung up meanwhile -: a resume continues at that segment, as a reopen after
the host died does, so no segment is lost to the client. Removed once a resume has rolled back to it."""


def _write_sent(d: Path, next_segment: int) -> None:
    """Record `next_segment` in `d`'s SENT_FILE (nothing when `d` is gone, or is no folder of its own:
    nothing left to resume). Never written through a symbolic link (a fresh file, renamed into place)."""
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(d.lstat().st_mode):
            return
        tmp = d / (SENT_FILE + ".tmp")
        tmp.unlink(missing_ok=True)  # (left by a crash, or a link: removed, not followed)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps({"next_segment": int(next_segment)}))
        tmp.replace(d / SENT_FILE)


SENT_MAX_BYTES = 4096
"""The most of a SENT_FILE that is read (it holds one small number)."""


def _read_sent(d: Path) -> int | None:
    """The next segment recorded in `d`'s SENT_FILE (None when there is none, or it is not ours: not a
    regular file - a named pipe would hold the read for good -, too long, or not what we write)."""
    try:
        fd = os.open(d / SENT_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(SENT_MAX_BYTES + 1)
        if len(data) > SENT_MAX_BYTES:
            return None
        n = json.loads(data.decode("utf-8")).get("next_segment")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _private_sessions_dir(d: Path) -> None:
    """Make `store.sessions` (`d`) its user's alone (0700): it lists the saved sessions' ids, and an id
    is all a resume needs. Created so when missing (with any missing parent, as WorldPager creates a
    session's folder: `worldpager.segment_log.make_private_dirs`); one that exists with group or other
    access (made by an earlier version, or by hand) is tightened, logged. Only this folder: a parent
    of it, the user's, is left as it is. A failure is logged: a session still opens (its own folder
    and files are private whatever this one's mode)."""
    from worldpager.segment_log import OTHERS, make_private_dirs

    try:
        make_private_dirs(d)
        mode = d.stat().st_mode  # (a link the user put there: the folder it names is the sessions')
        if stat.S_IMODE(mode) & OTHERS:
            os.chmod(d, stat.S_IMODE(mode) & ~OTHERS)
            logger.warning("store.sessions %s was open to other users: made private", d)
    except OSError as e:
        logger.warning("store.sessions %s: cannot make it private: %s", d, e)


_CLOSING = "world-session-close:"
"""The name of a session close's background task, followed by the session id (`_closing`)."""


def session_lease(m: Any) -> int:
    """The KV lease a session of world model `m` runs with now: its elastic lease, or its minimum when
    the books hold none yet."""
    return int(m.lease or m.lease_min)


class WorldSessionsMixin:
    """World sessions of `LiveManager` (see the module's docstring)."""

    config: Config
    pool: Any
    store: Any
    clock: Callable[[], float]
    poll_s: float
    started: bool
    engine: Engine
    live: dict[str, _Live]
    keep_alive_said: set[str]
    served: int
    failed_runs: int
    cold_starts: int
    metrics: Metrics
    sessions: dict[str, tuple[str, float, int]]
    session_dir: Path
    _world: dict[str, _World]
    _world_opening: set[str]
    _opening_ids: set[str]
    _left_ids: set[str]
    _reopening: dict[str, asyncio.Task[Any]]
    _ops: dict[str, tuple[str, ActionKind]]
    _background: set[asyncio.Task[Any]]
    _lease_chain: dict[str, asyncio.Task[Any]]

    if TYPE_CHECKING:  # LiveManager's

        def _flush(self) -> None: ...
        def _resync_soon(self, device: str, why: str) -> None: ...
        def _model(self, name: str) -> Any: ...
        def rank_of(self, m: Any, cls: str | None) -> int: ...
        async def _queue_for(
            self,
            m: Any,
            rank: int,
            cls_name: str,
            deadline: float,
            *,
            retry: bool = False,
            seen: list[float] | None = None,
        ) -> tuple[float, bool]: ...
        def _lost(self, m: Any, why: str) -> None: ...
        def _count_wait(self, cls_name: str, arrival: float, start: float) -> float: ...
        def _count_unserved(self, m: Any, cls_name: str, outcome: str) -> None: ...
        def _deferred_evict(self, m: Any) -> None: ...
        def _log_request(
            self,
            t: float,
            model: str,
            busy: float,
            cls: str | None,
            wait: float,
            outcome: str,
            keep_alive: float | None = None,
            kind: str | None = None,
        ) -> None: ...
        def _log_unserved(
            self,
            t: float,
            model: str,
            cls: str | None,
            e: BaseException | str,
            keep_alive: float | None = None,
            kind: str | None = None,
        ) -> None: ...
        def _publish(
            self, kind: str, model: str, detail: str, device: str, t: float, **extra: Any
        ) -> None: ...

    # ---- world sessions -------------------------------------------------------------------------
    def _in_order(self, device: str, coro: Any, *, after_ops: bool = False) -> None:
        """Run `coro` (a session resize, or a command submission deferred behind one) after what was
        decided before it on `device`: a shrunk lease is applied before the load that takes its room
        is submitted, and a grown one (`after_ops`) only once the commands that freed the room (a
        drop, a demote) have finished. Never more than the device really holds."""
        prev = self._lease_chain.get(device)
        on_device = {n for n, m in self.engine.models.items() if m.device == device}
        before = [op for op, (name, _) in self._ops.items() if name in on_device] if after_ops else []

        async def run() -> None:
            if prev is not None:
                with contextlib.suppress(Exception):
                    await prev
            warn_at = self.clock() + LEASE_WAIT_S
            while any(op in self._ops for op in before):  # a grown lease never outruns its room
                if not self.started:  # stopping: the results will not come; the lease is not grown
                    coro.close()
                    return
                if warn_at and self.clock() >= warn_at:
                    logger.warning("device %s: a grown lease still waits for the room it needs", device)
                    warn_at = 0.0
                await asyncio.sleep(self.poll_s)
            await coro

        task = self._in_background(run())
        self._lease_chain[device] = task

        def done(t: asyncio.Task[Any]) -> None:
            if self._lease_chain.get(device) is t:
                del self._lease_chain[device]

        task.add_done_callback(done)

    def _in_background(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as a task of its own, which a stop waits for (5 s at most)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _submit(self, device: str, cmd: P.Command, op: str) -> None:
        self.pool.submit(device, cmd, op)

    def _prune_sessions(self, keep: set[str]) -> list[str]:
        """Delete saved sessions (not open, not in `keep`), least recently written first, until the
        others fit in `store.sessions_keep`. Returns the ids deleted."""
        if not self.session_dir.is_dir():
            return []
        saved = []
        for d in self.session_dir.iterdir():
            if not _SESSION_ID.fullmatch(d.name):
                continue  # only what looks like a session of ours
            try:
                if not stat.S_ISDIR(d.lstat().st_mode):
                    continue  # a folder, not a link to one elsewhere: never counted nor deleted
                size, last = _du(d)
            except FileNotFoundError:
                continue  # deleted meanwhile
            saved.append((last, d.name, size, d))
        total = sum(size for _, _, size, _ in saved)
        gone = []
        for _, name, size, d in sorted(saved):
            if total <= self.config.store.sessions_keep:
                break
            if name in keep or self._in_use(name):
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            gone.append(name)
        if gone:
            logger.info("deleted saved world sessions %s (store.sessions_keep)", ", ".join(gone))
        return gone

    def _in_use(self, sid: str) -> bool:
        """Whether session `sid` is open, opening or closing now. A prune runs on a thread while the
        event loop goes on: a session another world model began to open (or resume) after the prune
        started is looked at again just before its folder would go. (Membership tests and one copy of
        a set: atomic under the GIL.)"""
        return sid in self.sessions or sid in self._opening_ids or sid in self._closing()

    async def _resize_session(self, device: str, sid: str, lease: int) -> int | None:
        """Apply `lease` to session `sid`; the lease in force on the host then (None: not applied)."""
        model = self.sessions.get(sid, ("", 0.0, 0))[0]  # (before the reply: a close may come meanwhile)
        reply = await asyncio.to_thread(self.pool.session, device, "resize", sid, lease)
        if not reply.ok and sid not in self.sessions:  # closed meanwhile: no lease left to change
            logger.debug("world session %s closed before its lease change: %s", sid, reply.error)
            return None
        detail = (
            f"session {sid}: lease {reply.data.get('lease_bytes')} bytes" if reply.ok else (reply.error or "")
        )
        self._publish("lease_applied" if reply.ok else "lease_failed", model, detail, device, self.clock())
        applied = reply.data.get("lease_bytes") if reply.ok else None
        return int(applied) if applied is not None else None

    async def open_session(
        self,
        model: str,
        *,
        cls: str | None = None,
        timeout_s: float = 60.0,
        codec: str = "bf16",
        resume_id: str | None = None,
        keep_alive: float | None = None,
        resume_at: int | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Admit a world session like a long request, then open it on the model's device host with the
        model's current lease. The model stays busy (never evicted) until `close_session`.
        ``resume_id``: reopen that session from its saved state instead (it continues at its next
        segment; ``codec`` empty: the saved one); NOT_FOUND when nothing is saved under that id.
        ``keep_alive``: the session's own (seconds, inf: forever), as a request's (`infer`): once the
        session is admitted it holds for the idle time after it ends, until the next admitted request
        or session of the model says otherwise (None: the config's). ``resume_at``: with ``resume_id``,
        the first segment the client has not received: the session continues there when that is
        before the segments counted sent (outputs gRPC took that the client never read)."""
        m = self._model(model)
        if m.cfg.elastic is None:
            raise InvalidRequest(f"model {model!r} has no elastic KV lease: it is not a world model")
        if resume_id is not None and not _SESSION_ID.fullmatch(resume_id):
            raise InvalidRequest(f"resume_session_id {resume_id!r} is not a session id (12 hex digits)")
        if codec and codec not in P.SESSION_CODECS:  # (before admission: nothing loaded for it)
            raise InvalidRequest(f"unknown codec {codec!r}: expected one of {', '.join(P.SESSION_CODECS)}")
        self._not_open(resume_id)
        rank = self.rank_of(m, cls)
        cls_name = self.config.classes[rank].name
        asked = self.clock()
        running = next((sid for sid, (name, _, _) in self.sessions.items() if name == model), None)
        if running is not None or model in self._world_opening:
            # asked for all the same (the statistics learn the demand, the request log keeps it), as
            # a request refused at admission is, and counted rejected
            self.engine.observe(m, asked)
            self._count_unserved(m, cls_name, "rejected")
            self._log_unserved(asked, model, cls_name, "rejected", keep_alive, "session")
            # not naming the session: its id is all a resume needs, and this client is another one
            raise InsufficientCapacity(
                f"world model {model!r} runs a session{'' if running else ' (opening)'}; a world model "
                "runs one at a time (its rolling KV window is the model's): retry when it ends"
            )
        deadline = asked + timeout_s
        self._world_opening.add(model)  # until the open below is over, even for a client gone
        opening: asyncio.Future[tuple[str, dict[str, Any]]] | None = None
        try:
            # as a request: waited for (never expired or evicted while its load is unconfirmed), and
            # under its class's queue limit
            seen: list[float] = []  # when the engine observed it, if it did (`_queue_for`)
            try:
                arrival, cold = await self._queue_for(m, rank, cls_name, deadline, seen=seen)
            except BaseException as e:  # never opened: its demand goes to the request log
                if seen:
                    self._log_unserved(seen[0], model, cls_name, e, keep_alive, "session")
                raise
            ready = self.clock()  # its wait (admission, a cold start) ends here, as a request's does
            try:  # (again: another world model may have opened it meanwhile)
                self._not_open(resume_id)
            except WorkerUnavailable:  # refused after admission: counted and logged as the others
                self._count_unserved(m, cls_name, "rejected")
                self._log_unserved(arrival, model, cls_name, "rejected", keep_alive, "session")
                raise
            self.keep_alive_said.add(model)
            if keep_alive is not None or m.keep_alive_req is not None:
                self.engine.request_keep_alive(m, keep_alive)
            self.cold_starts += cold
            m.busy_until = math.inf
            self.live[model].inflight += 1
            sid = resume_id or uuid.uuid4().hex[:12]
            # shielded: a client that hangs up mid-open (its RPC cancelled) must not leave the model
            # busy and the session open on its host with nobody to close it: it is closed once open
            opening = asyncio.ensure_future(
                self._open_on_host(
                    m, rank, sid, codec, resume_id, arrival, deadline, ready, keep_alive, resume_at
                )
            )
            self._opening_ids.add(sid)
            opening.add_done_callback(lambda _: self._world_opening.discard(model))
            opening.add_done_callback(lambda _: self._opening_ids.discard(sid))
            try:
                return await asyncio.shield(opening)
            except Exception:  # its open failed on the host (counted there): it never ran
                if sid not in self.sessions:  # (one that opened and failed after is closed, and logged)
                    self._log_unserved(arrival, model, cls_name, "unserved", keep_alive, "session")
                raise
            except asyncio.CancelledError:
                self._left_ids.add(sid)  # (until it is closed: a retry of its resume is told to wait)
                opening.add_done_callback(lambda t: self._abandoned(sid, t))
                raise
        finally:
            if opening is None:
                self._world_opening.discard(model)

    def _not_open(self, resume_id: str | None) -> None:
        """WorkerUnavailable (to retry) when session `resume_id` is open, or being opened (on another
        world model: its host would refuse the second open, and the manager take the first for an
        orphan there), or when the stream that opened it has ended and it is being closed. Open, it is
        most often the app's own earlier stream, gone with a dropped link (a Wi-Fi drop, the app
        restarted) before the server has found its connection dead: it was INVALID_ARGUMENT, which
        clients do not retry, with advice ("end its stream first") the app could not follow."""
        if resume_id is not None and resume_id in self._left_ids:
            raise WorkerUnavailable(
                f"world session {resume_id!r} is still being closed (the stream that opened it ended "
                "while it opened): retry in a moment"
            )
        if resume_id is not None and (resume_id in self.sessions or resume_id in self._opening_ids):
            every = format_duration(self.config.server.keepalive)
            raise WorkerUnavailable(
                f"world session {resume_id!r} is open on another stream: retry once it ends (a stream "
                "ended by its client ends at once; one whose connection dropped, once the server finds "
                f"it gone: within server.keepalive, {every}, and 20 s more)"
            )

    def _abandoned(self, sid: str, opening: asyncio.Future[Any]) -> None:
        """The client of a session that was opening hung up: close the session if it opened (a
        failed open has nobody left to tell: its error is taken here, not left unretrieved)."""
        if (not opening.cancelled() and opening.exception() is not None) or sid not in self.sessions:
            self._left_ids.discard(sid)
            return
        self._in_background(self._close_left(sid))

    async def _close_left(self, sid: str) -> None:
        """Close session `sid`, whose client hung up while it opened."""
        try:
            await self.close_session(sid)
        finally:
            self._left_ids.discard(sid)

    async def _open_on_host(
        self,
        m: Any,
        rank: int,
        sid: str,
        codec: str,
        resume_id: str | None,
        arrival: float,
        deadline: float,
        ready: float,
        keep_alive: float | None = None,
        resume_at: int | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Open (or resume) session `sid` on `m`'s device host, `m` already counted busy for it; it is
        counted idle again on any failure. Once open, its wait (`arrival` to `ready`: its model
        admitted and loaded) is counted as a served request's is, in Stats and the wait metric; the
        session itself is counted a request when it ends (`close_session`). An open that fails here,
        after admission, is counted a request that failed (Stats' `errors`, outcome `error`), as an
        inference that fails after admission is."""
        cls_name = self.config.classes[rank].name
        try:
            reply, sent = await self._open_reply(
                m, rank, sid, codec, resume_id is not None, deadline, resume_at
            )
        except BaseException as e:
            self._end_busy(m, arrival)
            if isinstance(e, Exception):
                self._count_unserved(m, cls_name, "error")
            raise
        if not reply.ok:
            self._end_busy(m, arrival)
            self._count_unserved(m, cls_name, "error")
            if reply.error_code == P.NO_SESSION:
                raise ModelNotFound(f"no saved world session {sid!r} to resume")
            raise worker_error(reply.error_code, f"world session on {m.name!r} could not open: {reply.error}")
        data = dict(reply.data)
        self._lease_floor(m, data)
        self.sessions[sid] = (m.name, arrival, rank)
        self._count_wait(cls_name, arrival, ready)
        self._world[sid] = _World(
            str(data.get("codec", codec)),
            int(data.get("next_segment", 0)),
            resumed=resume_id is not None,
            keep_alive=keep_alive,
            ready=ready,
        )
        shrunk = await self._lease_caught_up(m, sid, sent)
        if shrunk is not None:  # the lease the session holds now, not the one it opened with
            data["lease_bytes"] = shrunk
        kind = "session_resumed" if resume_id is not None else "session_opened"
        self._publish(kind, m.name, f"session {sid}", m.device, self.clock(), lease=m.lease)
        # what the policy expects right after it (a request's successors, as the replay has them at
        # a session's start): a session runs long, so not at its end, when they have come already
        self.engine.after_request(m, self.clock())
        self._flush()
        return sid, data

    async def _open_reply(
        self,
        m: Any,
        rank: int,
        sid: str,
        codec: str,
        resume: bool,
        deadline: float,
        client_at: int | None = None,
    ) -> tuple[P.SessionReply, int]:
        """The host's reply to the open, and the lease the open was sent with. `client_at`: a resume's
        first segment its client has not received (the earlier of it and the count of those sent)."""
        # a session whose stream ended is closed on its host in the background: that close goes first,
        # or the host would refuse this open for it (taken for an orphan of an earlier run) and the
        # prune below delete its directory while the host still saves its state there
        closing = self._closing()
        if closing:
            await asyncio.wait(closing.values(), timeout=max(0.0, deadline - self.clock()))
        await asyncio.to_thread(_private_sessions_dir, self.session_dir)
        # not one open, nor one opening (another world model may be resuming one this moment)
        keep = {*self.sessions, *self._opening_ids, *self._closing(), sid}
        await asyncio.to_thread(self._prune_sessions, keep=keep)
        # resumed: at the segment its client had not been sent when its last stream ended (at the latest)
        counted = await asyncio.to_thread(_read_sent, self.session_dir / sid) if resume else None
        resume_at = counted
        if resume and client_at is not None:  # (segments gRPC took that the client never read)
            resume_at = client_at if counted is None else min(counted, client_at)
        orphan_closed = lost_retried = False
        while True:
            sent = session_lease(m)
            reply: P.SessionReply = await asyncio.to_thread(
                self.pool.session, m.device, "open", m.name, sid, sent,
                (codec or None) if resume else codec, str(self.session_dir / sid), resume, resume_at,
            )  # fmt: skip
            if reply.ok and resume_at is not None:  # rolled back: recorded in the session's own state
                with contextlib.suppress(OSError):
                    await asyncio.to_thread((self.session_dir / sid / SENT_FILE).unlink, missing_ok=True)
                if counted is not None:  # (the client's word alone, past what the session has, is no
                    # segment sent and lost: the host continues at its own, "at the latest")
                    reply = _with_replaced(reply, resume_at, sid)
            orphan = None if orphan_closed else self._orphan(reply)
            if orphan is not None:  # closed (its state saved, so it can be resumed), then opened again
                orphan_closed = True
                logger.warning(
                    "world session %s was left open on %s by an earlier run: closed", orphan, m.device
                )
                await asyncio.to_thread(self.pool.session, m.device, "close", orphan)
                detail = f"session {orphan}: left open on the device host by an earlier run of the manager"
                self._publish("session_closed", m.name, detail, m.device, self.clock())
                continue
            lost = reply.error_code in (P.WORKER_DIED, P.BAD_TRANSITION)
            if reply.ok or not lost or lost_retried or self.clock() >= deadline:
                break
            lost_retried = True  # a host that lost the model (it restarted) loads it again, in time
            self._resync_soon(
                m.device, f"{reply.error_code} on the open of world session {sid}: {reply.error}"
            )
            if not await self._host_holds(m):
                self._lost(m, reply.error or "the device host lost the model")
            with contextlib.suppress(DeadlineExceeded, InsufficientCapacity, WorkerUnavailable):
                await self._queue_for(m, rank, self.config.classes[rank].name, deadline, retry=True)
            m.busy_until = math.inf
        return reply, sent

    def _closing(self) -> dict[str, asyncio.Task[Any]]:
        """The sessions whose close is still on its way to their host, and those closes."""
        return {
            t.get_name().removeprefix(_CLOSING): t
            for t in list(self._background)
            if t.get_name().startswith(_CLOSING) and not t.done()
        }

    def _orphan(self, reply: P.SessionReply) -> str | None:
        """The session the host refused an open for because it holds it open (that one, or another on
        the same world model: `workers.world.WorldSessions.open`'s words) when this manager has no
        such session open: one a killed earlier run of the manager left there (device hosts outlive
        it on a cluster), which nobody would ever close. None otherwise. The fallback: adoption at
        start closes those the host's status lists (`PersistenceMixin._close_orphans`); this catches
        one left open after it (by a manager killed mid-open, say)."""
        if reply.ok or reply.error_code != P.BAD_INPUT:
            return None
        hit = _HELD_BY_HOST.search(reply.error or "")
        held = hit and (hit.group(1) or hit.group(2))
        return held if held and held not in self.sessions else None

    def _lease_floor(self, m: Any, data: Any) -> None:
        """The device host keeps at least `lease_floor_bytes` of KV for a session of `m` whatever
        lease it is given (three segments; on a GPU two decoded slots): a floor above the books'
        minimum (`elastic.min` set below it) becomes the minimum, and a lease below it grows to it,
        so the books, `ps` and the metrics count the bytes the device holds (they counted the lease
        asked for, and gave the difference to other models). Said once per model, with the fix."""
        floor = data.get("lease_floor_bytes") if isinstance(data, dict) else None
        if not isinstance(floor, int) or isinstance(floor, bool) or floor <= m.lease_min:
            return
        logger.warning(
            "world model %r: a session on its device host keeps at least %s of KV whatever its lease "
            "(three segments; on a GPU, two decoded slots), more than its elastic.min %s: %s is its "
            "minimum lease from now on; set elastic.min to at least that",
            m.name, fmt_bytes(floor), fmt_bytes(m.lease_min), fmt_bytes(floor),
        )  # fmt: skip
        self.engine.measured_lease_floor(m, floor, self.clock())
        self._flush()

    async def _lease_caught_up(self, m: Any, sid: str, sent: int) -> int | None:
        """Session `sid` opened with lease `sent`; a lease change the engine decided meanwhile had no
        session to go to yet: it goes now, a shrink before the open's reply (so before any step
        fills the session's KV), a grow in order behind the commands that free its room. Returns the
        lease a shrink left in force on the host (None: none applied now)."""
        lease = session_lease(m)
        if lease < sent:
            return await self._resize_session(m.device, sid, lease)
        if lease > sent:
            self._in_order(m.device, self._resize_session(m.device, sid, lease), after_ops=True)
        return None

    async def _reopen_session(self, sid: str, why: str, deadline: float) -> dict[str, Any]:
        """The device host lost session `sid` (it died, or restarted empty): load the model again if the
        host lost it too, then reopen the session from its saved state at the next segment the client
        has not been sent. WorkerUnavailable (saying it can be resumed) when that fails or runs late."""
        model, _, rank = self.sessions[sid]
        m, w, live = self.engine.models[model], self._world[sid], self.live[model]
        self._publish("session_lost", model, f"session {sid}: {why}", m.device, self.clock())
        self._resync_soon(m.device, f"the device host lost world session {sid} ({why})")  # its other models

        def unavailable(detail: str) -> WorkerUnavailable:
            return self._resumable(sid, why, detail)

        if live.ready.is_set() and not live.loads_pending and not await self._host_holds(m):
            self._lost(m, why)
        try:
            await self._queue_for(m, rank, self.config.classes[rank].name, deadline, retry=True)
        except (DeadlineExceeded, InsufficientCapacity, WorkerUnavailable) as e:
            raise unavailable(str(e)) from e
        m.busy_until = math.inf
        # shielded, and known to close_session: a client that hangs up meanwhile has its session
        # closed on the host after the reopen, not before it (which would leave it open there)
        sent = session_lease(m)
        call = self._in_background(asyncio.to_thread(
            self.pool.session, m.device, "open", model, sid, sent, w.codec,
            str(self.session_dir / sid), True, w.next_segment,
        ))  # fmt: skip
        self._reopening[sid] = call

        def done(t: asyncio.Task[Any]) -> None:
            if self._reopening.get(sid) is t:
                del self._reopening[sid]
            read_outcome(t)  # (if nobody waits)

        call.add_done_callback(done)
        reply = await asyncio.shield(call)
        if not reply.ok:
            raise unavailable(reply.error or "the reopen failed")
        reply = _with_replaced(reply, w.next_segment, sid)
        self._lease_floor(m, reply.data)
        await self._lease_caught_up(m, sid, sent)
        w.resumes += 1
        data = dict(reply.data)
        detail = f"session {sid}: reopened at segment {data.get('next_segment')}"
        self._publish("session_resumed", model, detail, m.device, self.clock(), lease=m.lease)
        return data

    def _resumable(self, sid: str, why: str, detail: str) -> SessionResumable:
        lost = f"world session {sid}: its device host lost it ({why}) and it could not be reopened: {detail}"
        return SessionResumable(
            f"{lost}; its state is saved: resume it with a new stream (start.resume_session_id="
            f"{sid!r}) at segment {self._world[sid].next_segment}",
            lost,
        )

    async def _host_holds(self, m: Any) -> bool:
        """Whether `m`'s device host holds it in the gpu tier now (False when the host does not answer)."""
        try:
            st = await asyncio.to_thread(self.pool.status, m.device)
        except Exception:
            return False
        ms = st.models.get(m.name)
        return ms is not None and ms.tier == "gpu"

    def _end_busy(self, m: Any, start: float) -> None:
        live = self.live[m.name]
        live.inflight -= 1
        end = self.clock()
        if live.inflight == 0:
            m.busy_until = end
        self.engine.finish(m, start, end - start)
        self._flush()
        self._deferred_evict(m)

    async def step_session(
        self,
        sid: str,
        pose: tuple[float, float, float, float, float],
        *,
        recover_s: float = SESSION_RECOVER_S,
    ) -> dict[str, Any]:
        """One segment. A device host that died (or restarted) under the session costs a reopen from
        the session's saved state within `recover_s` (the model reloaded if need be), then the same
        pose again: the reply then carries ``resumed`` and what the reopen found unusable."""
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model = self.sessions[sid][0]
        m = self.engine.models[model]
        w = self._world[sid]
        try:  # the client's mistake (a pose out of range) is refused here: the session did not fail
            check_pose(Pose(*pose))
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"world session {sid}: {e}") from None
        try:
            return await self._step(sid, model, m, w, pose, recover_s)
        except Exception:  # (not a cancel: the client hung up, the step did not fail)
            w.failed = True  # the session ends as an `error` in the requests metric
            raise

    async def _step(
        self,
        sid: str,
        model: str,
        m: Any,
        w: _World,
        pose: tuple[float, float, float, float, float],
        recover_s: float,
    ) -> dict[str, Any]:
        """`step_session`'s segment (its open session `sid` on `m`, tracked as `w`)."""
        deadline = self.clock() + recover_s
        reopened: dict[str, Any] | None = None
        for attempt in range(3):  # a host that dies again during a reopen gets another go, in time
            reply = await asyncio.to_thread(self.pool.session, m.device, "step", sid, pose)
            if reply.ok or reply.error_code not in (P.WORKER_DIED, P.NO_SESSION):
                break
            why = reply.error or "the device host lost it"
            if attempt == 2 or self.clock() >= deadline:
                raise self._resumable(sid, why, "no time left to reopen it")
            reopened = await self._reopen_session(sid, why, deadline)
        if not reply.ok:
            raise worker_error(reply.error_code, f"world session {sid}: {reply.error}")
        self.live[model].last_used = self.clock()
        data = dict(reply.data)
        data["manager_lease_bytes"] = int(m.lease)
        data["resumed"] = reopened is not None
        if reopened is not None:
            data["corrupt_slots"] = reopened.get("corrupt_slots", {})
            data["missing_segments"] = reopened.get("missing_segments", [])
            data["replaced_segments"] = reopened.get("replaced_segments", [])
        w.next_segment = int(data["step"]) + 1
        return data

    def unsent(self, sid: str, segment: int) -> None:
        """The output of `segment` of open session `sid` never reaches its client (its stream went,
        the client hung up, while it was on its way): the session continues at that segment, not after
        it (a resume, or a reopen after its host died), and its client is told so."""
        w = self._world.get(sid)
        if w is not None:
            w.next_segment = min(w.next_segment, segment)

    async def end_session(self, sid: str) -> tuple[bool, str]:
        """Close open session `sid`, whose stream ends on an error (a step that failed on its device
        host, say), and say what its client can do: (True, the id to resume it with and the segment it
        continues at) when its state is saved, else (False, that it cannot be resumed, and why)."""
        w = self._world.get(sid)
        at = w.next_segment if w is not None else 0
        why = ""
        try:
            reply = await self.close_session(sid)
            if reply.get("discarded"):
                return False, (
                    f"world session {sid} was not saved (it ran no segment: there is nothing to "
                    "resume): it cannot be resumed; start a new session"
                )
            if not reply.get("closed"):
                why = "its device host could not close it"
        except Exception as e:  # (the reply's own error is the host's log's)
            logger.warning("world session %s: the close at its stream's error failed: %r", sid, e)
            why = "its device host could not close it"
        unsaved = await asyncio.to_thread(_unsaved, self.session_dir / sid)
        if unsaved is None:
            return True, (
                f"world session {sid} is saved: resume it with a new stream (start.resume_session_id="
                f"{sid!r}) at segment {at}"
            )
        causes = "; ".join(c for c in (why, unsaved) if c)
        return False, f"world session {sid} was not saved ({causes}): it cannot be resumed"

    async def close_session(self, sid: str) -> dict[str, Any]:
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model, opened, rank = self.sessions.pop(sid)
        w = self._world.pop(sid, None)
        m = self.engine.models[model]
        # shielded: cancelled while the call still waited for a worker thread, the close would be
        # dropped from the pool's queue and the host would keep the session (and its KV) open
        reopening = self._reopening.get(sid)
        if w is not None:  # what its client got, before a resume can look (a small file, no fsync)
            _write_sent(self.session_dir / sid, w.next_segment)

        async def close_on_host() -> P.SessionReply:
            if reopening is not None:  # a reopen under way: the session is closed once it is open
                await asyncio.wait([reopening])
            reply: P.SessionReply = await asyncio.to_thread(self.pool.session, m.device, "close", sid)
            # a new session refused at its first pose: nothing to resume, its folder goes (here, so an
            # open or a prune that waits for this close finds it gone)
            unrun = w is not None and not w.resumed and _ran_nothing(reply)
            if unrun and await asyncio.to_thread(_discard_unrun, self.session_dir / sid):
                reply = replace(reply, data={**reply.data, "discarded": True})
            return reply

        host_close = self._in_background(close_on_host())
        host_close.set_name(_CLOSING + sid)  # (an open waits for it, a prune keeps its directory)
        host_close.add_done_callback(read_outcome)  # (if nobody waits)
        # it ran from its `ready` (its wait, from `opened`, was counted at its open): as a request's,
        # its busy time in the engine and the request log is its run, not its wait too
        ran = opened if w is None or w.ready is None else max(opened, w.ready)
        try:  # the books are closed even when this is cancelled (or the host fails) midway
            reply = await asyncio.shield(host_close)
        finally:
            self._end_busy(m, ran)
            live = self.live[model]
            live.requests += 1
            live.last_used = self.clock()  # in use until now (as the request log's record says)
            self.served += 1  # a request in Stats, and so in the requests metric (its wait: at its open)
            outcome = "error" if w is not None and w.failed else "ok"
            self.failed_runs += outcome == "error"
            cls_name = self.config.classes[rank].name
            self.metrics.child("requests", model, cls_name, outcome).inc()
            busy, keep_alive = max(0.0, self.clock() - ran), w.keep_alive if w is not None else None
            self._log_request(opened, model, busy, cls_name, ran - opened, outcome, keep_alive, "session")
            self._publish("session_closed", model, f"session {sid}", m.device, self.clock())
        return dict(reply.data)
