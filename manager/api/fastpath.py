"""The in-host link between gRPC front-end processes and the manager's process (`server.frontends`).

One Python process serves about one core's worth of gRPC calls: the per-call work inside grpcio (its
C core, the Cython glue and the event loop) is about as much as the service's own. With
`server.frontends: N`, N front processes (`manager.api.front`) share the listening address
(SO_REUSEPORT: the kernel spreads connections over them) and do that per-call work on the other
cores. They send ModelInfer calls here over a Unix socket, many per frame, and relay every other call
to the manager's own gRPC server on a private Unix socket (`front.Front`).

Wire format, both ways: frames of a 4-byte big-endian length and a pickle (both ends are this
program, on one host, through a socket in a private 0700 directory):
  front -> manager: [(call id, ModelInferRequest bytes, seconds left or None, arrived, authorization),
                    ...]: the seconds left of the call's deadline as it stood when the call reached
                    the front end, at `arrived` (its time.monotonic(): one clock for every process of
                    a boot), and the call's `authorization` header or None (the manager checks it:
                    a class above its model's own needs the admin token, `caller_authorization`);
                    a call whose client went away: (call id, None, None), and the manager cancels it
  manager -> front: [(call id, grpc status code (int), details, ModelInferResponse bytes), ...]
Calls that arrive in one turn of a loop travel in one frame, and so do their answers, up to
`FLUSH_BYTES` a frame: past it the frame goes at once and the next begins, so many large calls never
add up to a frame over `MAX_FRAME`. A single message too large for a frame is answered
RESOURCE_EXHAUSTED to its caller, never sent.

The time from a call's arrival at its front end to its handler in the manager's process (the outbox,
the socket, a busy loop that has not read it yet) is the call's: the handler finds it in `waited_s`
and counts the call's deadline and `timeout` from the front end's arrival, not its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 31
"""A frame larger than this is a broken peer (a message is at most `server.max_request_bytes`)."""
FLUSH_BYTES = 1 << 24
"""An outbox holding this much writes its frame at once, not at the end of the loop's turn."""
ITEM_OVERHEAD = 256
WRITE_HIGH = 2 * FLUSH_BYTES
"""A front end whose link to the manager holds this much unsent waits before it queues more calls
(the manager's event loop is held up): memory bounded, not the calls' bytes kept for ever."""
WRITE_LOW = FLUSH_BYTES // 2
"""What one item costs in a frame besides its bytes and details (pickle's framing of the tuple)."""

Answer = tuple[int, str, bytes]
"""(grpc status code, details, response bytes) - code 0 is OK."""

Handler = Callable[[bytes, float | None], Awaitable[Answer]]

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

waited_s: ContextVar[float] = ContextVar("waited_s", default=0.0)
"""In a handler's call: the seconds from the call's arrival at its front end to the handler (0.0
where unknown, or outside the fast path). Its `seconds left` stood as they were that long ago."""


MAX_AUTHORIZATION = 4096
"""The longest `authorization` header a front end passes on (a longer one is passed as none)."""
caller_authorization: ContextVar[str | None] = ContextVar("caller_authorization", default=None)
"""In a ModelInfer handler's call: the call's `authorization` header (None when it sent none), set by
the fast path for a front end's call and by the gRPC handler for a direct one."""


def fits(nbytes: int) -> bool:
    """Whether an item carrying `nbytes` fits in a frame (on its own)."""
    return nbytes + ITEM_OVERHEAD <= MAX_FRAME


def too_large(what: str, nbytes: int) -> str:
    return (
        f"ModelInfer: the {what} of {nbytes} bytes is larger than the front end's link to the manager "
        f"carries ({MAX_FRAME - ITEM_OVERHEAD} bytes); send a smaller one"
    )


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; None at a clean end of the stream."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the peer closed in the middle of a frame header") from None
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes: the peer is not a residency front end")
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(
            f"the peer closed in the middle of a frame ({len(e.partial)} of {n} bytes)"
        ) from None
    try:
        return pickle.loads(body)
    except Exception as e:  # not a frame of this program's (an empty body, a class not here, ...)
        raise ConnectionError(f"a frame that does not decode ({type(e).__name__}: {e})") from None


class _Outbox:
    """Items written as one frame at the end of the current turn of the event loop, or as soon as
    they add up to `FLUSH_BYTES`: a frame is at most that, or one larger item (which `fits`)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.items: list[Any] = []
        self.size = 0
        self.loop = asyncio.get_running_loop()

    def put(self, item: Any, nbytes: int) -> None:
        """Queue `item`, which carries `nbytes` of messages and details (the caller checked `fits`)."""
        limit = min(FLUSH_BYTES, MAX_FRAME)
        nbytes += ITEM_OVERHEAD
        if self.items and self.size + nbytes > limit:
            self.flush()
        if not self.items:
            self.loop.call_soon(self.flush)
        self.items.append(item)
        self.size += nbytes
        if self.size >= limit:
            self.flush()

    def flush(self) -> None:
        items, self.items, self.size = self.items, [], 0
        if items and not self.writer.is_closing():
            self.writer.write(frame(items))


def _forget(tasks: dict[int, asyncio.Task[None]], cid: int, _: asyncio.Task[None]) -> None:
    tasks.pop(cid, None)


class FastPathServer:
    """The manager's end: runs `handler` for every call a front end sends, answers in frames."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.calls = 0

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def stop(self) -> None:
        """Stop listening and close every link: the front ends answer what is pending UNAVAILABLE."""
        for w in list(self._links):
            w.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out = _Outbox(writer)
        loop = asyncio.get_running_loop()
        tasks: dict[int, asyncio.Task[None]] = {}
        self._links.add(writer)

        async def one(cid: int, raw: bytes, left: float | None, arrived: float | None, auth: Any) -> None:
            if arrived is not None:  # this task's own context: only its handler sees it
                waited_s.set(max(0.0, time.monotonic() - arrived))
            caller_authorization.set(auth if isinstance(auth, str) else None)
            try:
                code, details, body = await self.handler(raw, left)
            except Exception:
                logger.exception("fast path: a ModelInfer call failed")
                code, details, body = INTERNAL, "ModelInfer: internal error (see the server log)", b""
            if not fits(len(body) + len(details.encode())):
                code, details, body = RESOURCE_EXHAUSTED, too_large("response", len(body)), b""
            out.put((cid, code, details, body), len(body) + len(details.encode()))

        try:
            while (batch := await read_frame(reader)) is not None:
                for cid, raw, left, *rest in batch:  # (no arrival: counted from now)
                    if raw is None:  # its client went away: the call ends here too
                        gone = tasks.get(cid)
                        if gone is not None:
                            gone.cancel()
                        continue
                    self.calls += 1
                    arrived = rest[0] if rest else None
                    t = loop.create_task(one(cid, raw, left, arrived, rest[1] if len(rest) > 1 else None))
                    tasks[cid] = t
                    t.add_done_callback(functools.partial(_forget, tasks, cid))
                if writer.transport.get_write_buffer_size() > 1 << 24:
                    await writer.drain()  # a front that stopped reading: do not buffer without end
        except (ConnectionError, pickle.UnpicklingError, ValueError, TypeError) as e:
            logger.warning("fast path: a front end's connection ended: %s", e)
        finally:
            self._links.discard(writer)
            for t in list(tasks.values()):
                t.cancel()
            writer.close()


class FastPathClient:
    """A front end's end: `call(raw, seconds_left)` -> (code, details, response bytes)."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Answer]] = {}
        self._out: _Outbox | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    async def connect(self, path: str) -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        self._out = _Outbox(writer)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the manager's process closed the link"
        try:
            while (batch := await read_frame(reader)) is not None:
                for cid, code, details, body in batch:
                    fut = self._pending.pop(cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result((code, details, body))
        except (ConnectionError, pickle.UnpicklingError, ValueError, TypeError) as e:
            why = f"the link to the manager's process broke: {e}"
        finally:
            self.closed.set()
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_result((UNAVAILABLE, f"{why}; retry", b""))
            self._pending.clear()

    async def call(self, raw: bytes, seconds_left: float | None, authorization: str | None = None) -> Answer:
        if self._out is None or self.closed.is_set():
            return UNAVAILABLE, "the manager's process is not reachable from this front end; retry", b""
        if authorization is not None and len(authorization) > MAX_AUTHORIZATION:
            authorization = None  # (no token is that long: read as none, not a frame over its bound)
        size = len(raw) + (len(authorization) if authorization is not None else 0)
        if not fits(size):
            return RESOURCE_EXHAUSTED, too_large("request", len(raw)), b""
        arrived = time.monotonic()  # the manager counts the call's time from here
        try:  # (at once unless WRITE_HIGH bytes wait to be sent: the manager reads them first)
            await self._out.writer.drain()
        except ConnectionError:
            return UNAVAILABLE, "the manager's process is not reachable from this front end; retry", b""
        if self.closed.is_set():
            return UNAVAILABLE, "the manager's process is not reachable from this front end; retry", b""
        cid = next(self._ids)
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        self._out.put((cid, raw, seconds_left, arrived, authorization), size)
        try:
            return await fut
        except asyncio.CancelledError:  # the client went away: so does its call in the manager
            # (still pending: not answered meanwhile; awaiting it, the task's cancel cancelled it)
            if cid in self._pending and self._out is not None and not self.closed.is_set():
                self._out.put((cid, None, None), 0)
            raise
        finally:
            self._pending.pop(cid, None)

    async def close(self) -> None:
        if self._out is not None:
            self._out.writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task


__all__ = ["FastPathClient", "FastPathServer", "frame", "read_frame"]
