"""`residency.v1.WorldSession`: a bidirectional stream driving a WorldPager session on the world model's
device host. First message: `start` (with `resume_session_id`: reopen a saved session); then one
`action` (camera pose) per segment; the session closes when the client ends its stream (or the call is
cancelled), its state kept for a later resume; a segment whose output could not be written when the
client hung up is not counted sent: the resume continues at it. One gRPC took is counted sent, though
the app may never have read it (queued on a connection that then dropped): a resume says where the app
is with `start.resume_at` (its first segment not received), and continues there when that is earlier.
A device host that dies under the session costs a reopen from the saved state (the output says
`resumed`); if that cannot be done in time the stream ends UNAVAILABLE with a message naming the
session id to resume. Any other error that ends
the stream once the session is open (a step that failed on the device host) closes the session first,
and its status says which id to resume it with when its state is saved, or that it was not saved (a
new session refused at its first action, having run no segment, is not: it leaves nothing on disk). A
client that sends no action for `server.world_idle_timeout` (default 10m; null: no limit) while its
stream stays open has its session closed the same way, its state saved, and the stream ends
DEADLINE_EXCEEDED saying how long it was idle and which id to resume it with: an idle client must not
hold the world model (busy, its KV lease held) from every other tenant. DEADLINE_EXCEEDED, not ABORTED:
a time limit ran out (gRPC's ABORTED is a concurrency conflict, to retry at once), and the session is
not lost: a new stream resumes it when the client is back.

The same limit bounds each output's send: a client that keeps its stream open (and may go on sending
actions) but stops reading its outputs (a frozen app, a stuck UI thread) fills its HTTP/2 receive window
within a few outputs, and the server's next send then waits on flow control for ever, the idle timer not
running (the server does not wait for input). An output that cannot be sent within
`server.world_idle_timeout` closes the session the same way (state saved, model freed), and the stream
ends DEADLINE_EXCEEDED saying that the client did not read its outputs for that long and which id to
resume with. One limit, not a second setting: both say how long a session waits on its client, and a
client that reads nothing for 10 minutes is as absent as one that sends nothing. The outputs already
queued, and the status after them, reach a client that reads again; one that never does holds only its
connection, no longer the world model. So the outputs are written with `context.write` (raced against the
limit and the server's stop), not yielded: an async generator's `yield` cannot be given a time limit. A
server stop closes and saves such a session at once too, but its stream's status (queued behind the
unsent output) ends the call only when the client reads again or at the stop's grace: grpc.aio has no
way to reset one stream from the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from manager.api.errors import details_of, status_of
from manager.api.oip import check_class_claim
from manager.api.runtime import authorization_of, call_wait_s, write_within
from manager.errors import DeadlineExceeded, InvalidRequest, ResidencyError
from manager.live import LiveManager
from manager.live_sessions import SessionResumable
from manager.units import format_duration, parse_keep_alive
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


IDLE_RECHECK_S = 1.0
"""How often a session waiting for its client's next action looks at `server.world_idle_timeout` again
(a reload's new limit reaches the sessions already waiting within this)."""
MAX_UNUSABLE = 100
"""The most lines of `unusable` one output carries; one more says how many were left out. A resume of
a long session whose log lost its tail lists every segment missing, at every resume: listed whole, the
first output outgrew a client's message limit (4 MiB by default) and the session could never be
resumed."""


def _cut(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_UNUSABLE:
        return lines
    return [*lines[:MAX_UNUSABLE], f"… and {len(lines) - MAX_UNUSABLE:,} more"]


def _unusable_lines(d: dict[str, Any]) -> list[str]:
    """What a reopen found unusable in the saved state (never attended to), one line each."""
    slots = [f"slot {slot}: {why}" for slot, why in sorted((d.get("corrupt_slots") or {}).items())]
    replaced = []
    if d.get("replaced_segments"):
        first, last = d["replaced_segments"]
        span = f"segment {first}" if first == last else f"segments {first}-{last}"
        them = "it" if first == last else "them"
        replaced = [
            f"{span}: sent, but {'its saved copy is' if first == last else 'their saved copies are'} "
            "gone (never saved on a full disk, and lost with the device host) or unusable (corrupt): "
            f"the session continues at segment {first}, generating {them} again"
        ]
    return replaced + slots + [f"segment {i}: missing" for i in d.get("missing_segments") or []]


def _unusable(d: dict[str, Any]) -> list[str]:
    """`_unusable_lines`, at most MAX_UNUSABLE of them, then how many more."""
    return _cut(_unusable_lines(d))


def _output(sid: str, d: dict[str, Any]) -> pb.WorldOutput:
    # a step's own reads that failed their checks (the host's log alone said so), as a reopen's are
    met = [f"segment {c['segment']}: slot {c['slot']}: {c['reason']}" for c in d.get("corrupt") or []]
    return pb.WorldOutput(
        resumed=bool(d.get("resumed")), unusable=_cut((_unusable_lines(d) if d.get("resumed") else []) + met),
        session_id=sid, segment=int(d["step"]), latents=d["latents"], shape=list(d["shape"]),
        stall_s=float(d["stall_s"]), compute_s=float(d["compute_s"]), lease_bytes=int(d["lease_bytes"]),
        host_bytes=int(d["host_bytes"]), hits=int(d["hits"]), misses=int(d["misses"]),
        bytes_read=int(d["bytes_read"]), bytes_written=int(d["bytes_written"]),
        max_position=int(d["max_position"]),
    )  # fmt: skip


def _resume_at(start: pb.WorldStart) -> int | None:
    """`start.resume_at`: the first segment the app has not received (None when not given); only with
    `resume_session_id`, and never negative (INVALID_ARGUMENT naming the field)."""
    if not start.HasField("resume_at"):
        return None
    if not start.resume_session_id:
        raise InvalidRequest("start.resume_at goes with start.resume_session_id (the session to resume)")
    if start.resume_at < 0:
        raise InvalidRequest(f"start.resume_at must be a segment number >= 0, got {start.resume_at}")
    return int(start.resume_at)


def _keep_alive(start: pb.WorldStart) -> float | None:
    """`start.keep_alive`: the session's own keep-alive, a duration as ModelInfer's `keep_alive`
    string parameter takes it ("10m", "0", "forever", "-1": forever); None when empty (the config's)."""
    if not start.keep_alive:
        return None
    try:
        return parse_keep_alive(start.keep_alive)
    except ValueError as e:
        raise InvalidRequest(f"start.keep_alive: {e}") from None


class ServerStopping(Exception):
    """The server stops while a world session's stream is open."""


class ClientIdle(Exception):
    """No action came within `server.world_idle_timeout` (`idle_s`, the wait that ran out)."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(idle_s)
        self.idle_s = idle_s


class ClientNotReading(Exception):
    """An output could not be sent within `server.world_idle_timeout` (`waited_s`): the client does
    not read its outputs (its receive window is full)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(waited_s)
        self.waited_s = waited_s


def _unread(sid: str, waited_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"world session {sid}: its client did not read its outputs for {format_duration(waited_s)} "
        "(an output could not be sent within server.world_idle_timeout): closed, its world model "
        "freed for others"
    )


def _idle(sid: str, idle_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"world session {sid} was idle for {format_duration(idle_s)} (no action within "
        "server.world_idle_timeout): closed, its world model freed for others"
    )


class WorldSessionServicer(pb_grpc.WorldSessionServicer):
    def __init__(self, manager: LiveManager) -> None:
        self.manager = manager
        self.admin: Callable[[str], bool] | None = None
        """Whether an `authorization` header holds the admin token; None without one (`build_server`):
        a session's class above its model's own is the token's to ask, as a request's is."""
        self.stopping = asyncio.Event()
        """Set when the server stops: open streams end at once, UNAVAILABLE naming the session to
        resume (they held the server's stop for its whole grace, then got gRPC's own cancel); so do
        those whose `start` has not come yet."""

    def _idle_limit(self) -> float | None:
        """`server.world_idle_timeout` as the running config has it now (a reload's from its next look)."""
        return self.manager.config.server.world_idle_timeout

    def _may_ask(self, st: pb.WorldStart, context: Any) -> None:
        """PermissionDenied for a start whose `class_name` is above its model's own while the service
        has an admin token the call does not carry (`check_class_claim`, as a ModelInfer request's)."""
        if self.admin is None or not st.class_name:
            return
        m = self.manager.engine.models.get(st.model)
        if m is None:  # (an unknown model is refused by the open, naming it)
            return
        classes = [c.name for c in self.manager.config.classes]
        check_class_claim(
            self.admin, classes, m, st.class_name, authorization_of(context), "a session",
            "leave start.class_name empty",
        )  # fmt: skip

    async def _next(
        self, it: AsyncIterator[pb.WorldInput], idle: Callable[[], float | None] | None = None
    ) -> pb.WorldInput | None:
        """The client's next message, or None when it ended its stream; ServerStopping once the server
        stops, ClientIdle when none came within `idle()` seconds (None: no limit; looked at again
        every IDLE_RECHECK_S, so a reload's `server.world_idle_timeout` reaches a session already
        waiting: one waiting under no limit waited on for ever); either way the read is given up. A
        stop wins over a message that is there already: a client that always has its next pose
        waiting kept the session stepping through the stop's whole grace, and its stream then ended
        with gRPC's own cancel, not naming the session to resume."""
        if self.stopping.is_set():
            raise ServerStopping
        read = asyncio.ensure_future(anext(it, None))
        stop = asyncio.ensure_future(self.stopping.wait())
        loop = asyncio.get_running_loop()
        began = loop.time()
        idle_s = None if idle is None else idle()
        try:
            while True:
                left = None if idle_s is None else idle_s - (loop.time() - began)
                if left is not None and left <= 0:
                    break
                slice_s = (
                    left if idle is None else min(IDLE_RECHECK_S, left if left is not None else math.inf)
                )
                done, _ = await asyncio.wait(
                    (read, stop), timeout=slice_s, return_when=asyncio.FIRST_COMPLETED
                )
                if done:
                    break
                idle_s = None if idle is None else idle()
        finally:
            stop.cancel()
        if read.done() and not self.stopping.is_set():
            return read.result()
        await self._given_up(read, idle_s, ClientIdle)

    async def _send(self, context: Any, out: pb.WorldOutput, limit_s: float | None) -> None:
        """Write `out` to the client's stream; ServerStopping once the server stops, ClientNotReading
        when it could not be sent within `limit_s` seconds (None: no limit); either way the wait is
        given up. A send that gRPC's flow control holds (the client reads nothing, its window is
        full) would otherwise wait for ever. The write given up stays queued in gRPC (its callback
        finds its waiter cancelled, as when a client cancels mid-send): the client gets it, and the
        status after it, if it ever reads again."""
        if await write_within(context, out, limit_s, self.stopping):
            return
        if self.stopping.is_set():
            raise ServerStopping
        assert limit_s is not None  # (without a limit, the wait ends only with the write or the stop)
        raise ClientNotReading(limit_s)

    async def _given_up(
        self, task: asyncio.Future[Any], limit_s: float | None, timed_out: Callable[[float], Exception]
    ) -> NoReturn:
        """A read or write given up: `task` cancelled and let end, then ServerStopping when the server
        stops, else `timed_out(limit_s)` (its limit ran out)."""
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if self.stopping.is_set():
            raise ServerStopping
        assert limit_s is not None  # (without a limit, the wait ends only with the task or the stop)
        raise timed_out(limit_s)

    async def _ended(self, sid: str | None, e: ResidencyError | str) -> str:
        """The status details of a stream that ends on error `e`: once its session is open, the session
        is closed first (its state saved) and the details say how to resume it, or that it cannot be."""
        if sid is None or sid not in self.manager.sessions:
            return details_of(e)
        saved, note = await self.manager.end_session(sid)
        if isinstance(e, SessionResumable):  # names the id to resume with already
            return details_of(e) if saved else details_of(e.lost, f"; {note}")
        return details_of(e, f"; {note}")

    async def Run(
        self, request_iterator: AsyncIterator[pb.WorldInput], context: Any
    ) -> AsyncIterator[pb.WorldOutput]:
        """An async generator (as `add_servicer` registers stream handlers) that yields nothing: its
        outputs are written with `context.write`, each send bounded (`_send`)."""
        await self._run(request_iterator, context)
        return
        yield  # (never reached: it makes this an async generator)

    async def _run(self, request_iterator: AsyncIterator[pb.WorldInput], context: Any) -> None:
        sid: str | None = None
        try:
            it = aiter(request_iterator)
            first = await self._next(it)  # (no time limit: no session is held yet; a stop ends it)
            if first is None or first.WhichOneof("msg") != "start":
                raise InvalidRequest("the first message of a world session must be `start` (with the model)")
            st = first.start
            resume = st.resume_session_id or None
            resume_at = _resume_at(st)
            self._may_ask(st, context)
            sid, opened = await self.manager.open_session(
                st.model,
                cls=st.class_name or None,
                codec=st.codec or ("" if resume else "bf16"),
                resume_id=resume,
                keep_alive=_keep_alive(st),
                resume_at=resume_at,
                # its admission and cold load wait as long as the call's deadline lets them (none: a
                # day at most, as a ModelInfer's); it was 60 s whatever the client set
                timeout_s=call_wait_s(context.time_remaining()),
            )
            opened_out = pb.WorldOutput(
                session_id=sid, segment=-1, lease_bytes=int(opened["lease_bytes"]),
                resumed=bool(opened.get("resumed")), next_segment=int(opened.get("next_segment", 0)),
                unusable=_unusable(opened),
            )  # fmt: skip
            # the limit: a send's read at the send; a wait for an action looks at it every second (a
            # reload's value reaches the sessions already waiting)
            await self._send(context, opened_out, self.manager.config.server.world_idle_timeout)
            while (msg := await self._next(it, self._idle_limit)) is not None:
                if msg.WhichOneof("msg") != "action":
                    raise InvalidRequest("after `start`, a world session takes only `action` messages")
                a = msg.action
                data = await self.manager.step_session(sid, (a.x, a.y, a.z, a.pitch, a.yaw))
                out = _output(sid, data)
                try:
                    await self._send(context, out, self.manager.config.server.world_idle_timeout)
                except (ClientNotReading, ServerStopping):
                    raise  # (given up, it stays queued in gRPC: a client that reads again gets it)
                except BaseException:  # the stream is gone (the client hung up): it never gets it
                    self.manager.unsent(sid, out.segment)
                    raise
        except ClientNotReading as unread:
            assert sid is not None  # (sends only once the session is open)
            logger.info(
                "world session %s: its client read no output for %s: closed",
                sid, format_duration(unread.waited_s),
            )  # fmt: skip
            e = _unread(sid, unread.waited_s)
            await context.abort(status_of(e), await self._ended(sid, e))
        except ClientIdle as idle:
            assert sid is not None  # (idle only once the session is open)
            logger.info("world session %s: no action for %s: closed", sid, format_duration(idle.idle_s))
            e = _idle(sid, idle.idle_s)
            await context.abort(status_of(e), await self._ended(sid, e))
        except ServerStopping:
            # closed first, so the details say what was saved (as a stream ended by an error does)
            note = f"world session {sid} is closed" if sid is not None else "no world session was opened"
            if sid is not None and sid in self.manager.sessions:
                saved, note = await self.manager.end_session(sid)
                note += " once the server is back" if saved else ""
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server is stopping: {note}")
        except grpc.aio.BaseError:
            # gRPC's own, from a write (the stream is gone: the client cancelled, the server stopped):
            # nothing can be told; gRPC handles it as when it wrote a yielded output (the session is
            # closed below)
            raise
        except ResidencyError as e:
            await context.abort(status_of(e), await self._ended(sid, e))
        except Exception:
            logger.exception("world session failed")
            await context.abort(
                grpc.StatusCode.INTERNAL,
                await self._ended(sid, "world session: internal error (see the server log)"),
            )
        finally:
            if sid is not None and sid in self.manager.sessions:
                await self.manager.close_session(sid)
