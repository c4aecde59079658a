"""The direct data channel: inference requests from the manager to a device host on the same machine
over a Unix socket, without one Ray actor call per request (edge module).

Ray keeps placement, lifecycle and the commands; this carries only `infer` batches. A Ray actor call
costs ~1 ms p50 and ~2.5 ms p99 on a 2-core machine and tops out near 700 calls/s; a frame on a Unix
socket costs tens of microseconds.

* `ChannelServer(host)` runs in the device host's process: a socket in a directory only this user can
  open (0700; the socket 0600), one thread per connection. A frame is a 4-byte big-endian length and
  a pickle: the request is a list of `(model, inputs)`, the reply the list of `InferResult`s, in
  order (pickle is safe here: only processes of the same user, who could ptrace the host anyway,
  can connect). A bad frame closes that connection, never the host.
* A request runs once. A reply over `MAX_FRAME` is not sent: the host keeps those results (at most
  `HELD_MAX`, for `HELD_S`) and answers a `HeldReply`; the client raises `ReplyTooLarge` and the
  caller fetches them through Ray (`take`, the actor's `channel_reply`), never by running the batch
  again (a stateful model, a VAD or a world model's session, would step twice).
* Socket names are `<name>-<pid>-<random>.sock`: unique, so a host never replaces another's socket,
  even one of another container (its own pid namespace) sharing the directory. A socket is stale
  when a connection to it is refused (no process listens on it, whatever its pid says), and is
  removed when a new host starts; a host binds under `.bind` and renames to `.sock` once it listens,
  so a host that is starting is never taken for a stale one.
* A reply that does not pickle in the host (an output the model made of something pickle cannot
  write) is not a broken connection: each request whose result does not pickle is answered with an
  `internal` error saying so, the others with their results.
* `ChannelClient(address)` is the manager's side, on its event loop: `await client.infer_many(items)`
  sends one frame on a free connection (up to `connections` frames in flight) and awaits the reply.
  A connection that breaks before the request is fully sent (nothing ran) raises `ChannelError`: the
  caller falls back to Ray (which reports a dead actor the usual way). One that breaks after it
  (the reply was cut or did not decode: the batch may have run) raises `ReplyLost`, a `ChannelError`
  the caller must not answer by running the batch again. Either way the caller rediscovers the
  channel later (a restarted actor has a new socket).
* `same_machine(address)`: the channel is used only when the host's boot id is this machine's and
  its socket exists here (a host on another Ray node is reached through Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import re
import secrets
import socket
import struct
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers import protocol as P

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 30
"""Frames above 1 GiB are refused (the gRPC front end limits requests far below this)."""
_LEN = struct.Struct(">I")
_CHUNK = 1 << 20
"""A frame's body is read in pieces of at most this size: memory grows only as its bytes arrive (a
length alone, from a broken or hostile peer, makes no 1 GiB allocation)."""


class ChannelError(Exception):
    """The channel broke (the host died or closed it): fall back to Ray."""


class FrameTooLarge(ChannelError):
    """A batch too large for one frame: it goes through Ray instead; the channel stays up."""


class ReplyLost(ChannelError):
    """The channel broke after the request frame was fully sent: the host may have run the batch
    (it runs a frame once it has read all of it), and its reply was lost. Running the batch again
    would run each request in it a second time (a stateful model would step twice)."""


HELD_MAX = 4
"""Over-limit replies a host keeps at once for their fetch through Ray (the oldest goes first)."""
HELD_S = 300.0
"""How long a host keeps an over-limit reply no one fetched (its caller gave up or died)."""


@dataclass(frozen=True)
class HeldReply:
    """The host's answer to a batch whose reply is over `MAX_FRAME`: the batch ran, and its results
    wait in the host under `token` for one `ChannelServer.take`."""

    token: str
    nbytes: int


class ReplyTooLarge(Exception):
    """The batch ran, but its reply (`nbytes`) is over the frame limit: the host holds the results
    under `token`, to be fetched through Ray. Not a `ChannelError`: the channel is fine, and running
    the batch again through Ray would run every request in it twice."""

    def __init__(self, token: str, nbytes: int) -> None:
        super().__init__(f"a {nbytes}-byte reply is over the channel's {MAX_FRAME}-byte frame limit")
        self.token = token
        self.nbytes = nbytes


@dataclass(frozen=True)
class ChannelAddress:
    path: str
    boot_id: str
    pid: int


def boot_id() -> str:
    """This machine's boot id (distinct per machine and per boot); the hostname where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def same_machine(addr: ChannelAddress) -> bool:
    return addr.boot_id == boot_id() and os.path.exists(addr.path)


def _socket_folder() -> Path:
    """Where the hosts' sockets are: `$TMPDIR/residency-<uid>` (`_socket_dir` makes and checks it)."""
    return Path(tempfile.gettempdir()) / f"residency-{os.getuid()}"


def _socket_dir() -> Path:
    d = _socket_folder()
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{d} must belong to uid {os.getuid()} with mode 0700 (it is {oct(st.st_mode)})"
        )
    return d


_SUN_PATH_MAX = 107
"""The longest socket path `bind` takes (sockaddr_un's sun_path, less its terminating NUL)."""
STALE_BIND_S = 60.0
"""A `.bind` (a host between bind and listen) older than this is one whose host died starting."""


def _socket_path(d: Path, name: str) -> Path:
    """A new, unique socket path in `d` for host `name`: `<name>-<pid>-<random>.sock`, the name made
    safe for a file name and cut to what fits in a socket address (the pid and random part stay)."""
    tail = f"-{os.getpid()}-{secrets.token_hex(6)}.sock"
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    room = _SUN_PATH_MAX - len(os.fsencode(d)) - 1 - len(tail)
    return d / (safe[: max(room, 0)] + tail)


def _refused(p: Path) -> bool:
    """Is a connection to the socket at `p` refused (no process listens on it, in any container)?
    A full backlog, a path gone meanwhile, or anything else is not taken for that."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)  # a live host's full backlog answers EAGAIN at once, not a wait
        try:
            s.connect(str(p))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _remove_stale(d: Path) -> None:
    """Remove the sockets of hosts that are gone: those no process listens on (a connection is
    refused). A pid says nothing here: it may run again as another process, or belong to another
    pid namespace (a container sharing this directory) whose live host must keep its socket."""
    now = time.time()
    for p in d.iterdir():
        try:
            if p.suffix == ".bind" and now - p.lstat().st_mtime < STALE_BIND_S:
                continue  # a host between bind and listen, most likely
            if p.suffix in (".sock", ".bind") and _refused(p):
                p.unlink()
        except OSError:
            pass


HOST_END_WAIT_S = 2.0
"""How long `remove_host_sockets` waits, in all, for the hosts' sockets to be let go (their processes
ending)."""


def _host_pid(p: Path) -> int | None:
    """The pid in a socket's name (`<name>-<pid>-<random>.sock`, `.bind`); None where it has none."""
    parts = p.stem.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def remove_host_sockets(
    pids: list[int] | set[int],
    wait_s: float = HOST_END_WAIT_S,
    *,
    clock: Any = time.monotonic,
    sleep: Any = time.sleep,
) -> list[str]:
    """Remove the sockets of the hosts that ran as `pids` (processes of this pid namespace that were
    ended: the device hosts of a local Ray shut down, which end without a word (SIGKILL, no
    `ChannelServer.close`) and left their sockets until a later host's start). Each goes once no
    process listens on it (`_refused`): a host still ending holds it, waited for (`wait_s` at most,
    in all); one still listened on then (a host that lives on, or another container's with the same
    pid) is left. The paths removed."""
    d = _socket_folder()
    want = set(pids)
    try:
        left = [p for p in d.iterdir() if p.suffix in (".sock", ".bind") and _host_pid(p) in want]
    except OSError:  # (no directory: no host ran here)
        return []
    removed: list[str] = []
    deadline = clock() + wait_s
    while left:
        held = []
        for p in left:
            if _refused(p):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(str(p))
            elif os.path.lexists(p):
                held.append(p)
        left = held
        if not left or clock() >= deadline:
            break
        sleep(0.05)
    return removed


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    parts = []
    while n > 0:
        part = bytearray(min(n, _CHUNK))
        view, got = memoryview(part), 0
        while got < len(part):
            k = conn.recv_into(view[got:], len(part) - got)
            if k == 0:
                return None
            got += k
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class ChannelServer:
    """Serves `host.infer` batches on a Unix socket, in the host's process (see the module doc)."""

    def __init__(self, host: Any, name: str) -> None:
        self.host = host
        d = _socket_dir()
        _remove_stale(d)
        path = _socket_path(d, name)
        binding = path.with_suffix(".bind")  # the same length: it fits where the path fits
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                self.sock.bind(str(binding))
            finally:
                os.umask(old)
            self.sock.listen(64)
            os.rename(binding, path)  # under its `.sock` name only once it listens (see the module doc)
        except OSError:
            self.sock.close()
            with contextlib.suppress(OSError):
                binding.unlink()
            raise
        self.address = ChannelAddress(self.path, boot_id(), os.getpid())
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._held: dict[str, tuple[float, Any]] = {}  # token -> (when, results): see `take`
        threading.Thread(target=self._accept, name="residency-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="residency-channel-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            with conn:
                self._frames(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _frames(self, conn: socket.socket) -> None:
        while True:
            try:
                head = _recv_exact(conn, _LEN.size)
                if head is None:
                    return
                (n,) = _LEN.unpack(head)
                if n > MAX_FRAME:
                    logger.warning("channel %s: a %d-byte frame is over the limit; closing", self.path, n)
                    return
                body = _recv_exact(conn, n)
                if body is None:
                    return
                items = pickle.loads(body)
                results = self.host.infer_many(items)
                out = self._encode(results)
                if len(out) > MAX_FRAME:  # held for a fetch through Ray: the batch never runs twice
                    held = HeldReply(self._hold(results), len(out))
                    out = pickle.dumps(held, protocol=pickle.HIGHEST_PROTOCOL)
                conn.sendall(_LEN.pack(len(out)) + out)
            except (OSError, EOFError):
                return
            except Exception:  # a frame that is not a request: drop this connection only
                logger.exception("channel %s: bad frame; closing the connection", self.path)
                return

    def _encode(self, results: list[P.InferResult]) -> bytes:
        """The reply frame's body. A result that does not pickle (an output of something pickle cannot
        write) becomes an `internal` error saying so: the batch ran, so its requests get an answer,
        not a closed connection (the caller could not tell whether they ran)."""
        try:
            return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return pickle.dumps([self._picklable(r) for r in results], protocol=pickle.HIGHEST_PROTOCOL)

    def _picklable(self, r: P.InferResult) -> P.InferResult:
        try:
            pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)
            return r
        except Exception as e:
            device = getattr(self.host, "name", self.path)
            logger.warning("channel %s: the result of model %r does not pickle: %r", self.path, r.model, e)
            why = (
                f"model {r.model!r} ran on device {device!r}, but its result could not be sent back "
                f"(it does not pickle: {type(e).__name__}: {e})"
            )
            return P.InferResult(r.model, False, error_code=P.INTERNAL, error=why)

    def _hold(self, results: Any) -> str:
        """Keep `results` (an over-limit reply) for one `take`; the token to take it with."""
        token = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            while len(self._held) >= HELD_MAX:  # the oldest (dicts keep insertion order)
                del self._held[next(iter(self._held))]
            self._held[token] = (now, results)
        return token

    def _expire(self, now: float) -> None:
        for token in [t for t, (at, _) in self._held.items() if now - at > HELD_S]:
            del self._held[token]

    def take(self, token: str) -> list[P.InferResult] | None:
        """The results of the batch whose over-limit reply was held under `token`, once; None when
        there are none (taken already, or dropped: older than HELD_S, or beyond HELD_MAX)."""
        with self._lock:
            self._expire(time.monotonic())
            got = self._held.pop(token, None)
        return None if got is None else list(got[1])

    def close(self) -> None:
        """Stop listening and end the open connections (their clients see the channel break)."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, set()
            self._held.clear()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (a close alone does not)
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ChannelClient:
    """The manager's side: `infer_many` over up to `connections` Unix-socket connections. The sockets
    are plain non-blocking sockets driven with `loop.sock_*`, so the client is bound to no event loop
    (and closing it needs none)."""

    def __init__(self, address: ChannelAddress, connections: int = 2) -> None:
        self.address = address
        self._free: list[socket.socket] = []
        self._want = connections
        self._opened = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.broken = False

    async def _conn(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        while not self._free:
            if self._opened < self._want:
                self._opened += 1
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, self.address.path)
                except OSError as e:
                    sock.close()
                    self._opened -= 1
                    self.broken = True
                    raise ChannelError(f"cannot connect to {self.address.path}: {e}") from None
                return sock
            waiter = loop.create_future()  # woken by the next release, in arrival order
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: pass it on
                    self._wake_next()
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return self._free.pop()

    def _release(self, sock: socket.socket | None) -> None:
        if sock is not None and self.broken:  # closed meanwhile: a connection back from its frame ends
            sock.close()
            sock = None
        if sock is None:
            self._opened -= 1
        else:
            self._free.append(sock)
        self._wake_next()

    def _wake_next(self) -> None:
        """Wake the first caller still waiting for a connection (a free one, or room to open one)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                with contextlib.suppress(RuntimeError):  # a waiter of a closed event loop
                    waiter.set_result(None)
                    return

    async def _recv(self, sock: socket.socket, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        parts = []
        while n > 0:  # in pieces, as `_recv_exact`
            part = bytearray(min(n, _CHUNK))
            view, got = memoryview(part), 0
            while got < len(part):
                k = await loop.sock_recv_into(sock, view[got:])
                if k == 0:
                    raise ConnectionResetError("the device host closed the channel")
                got += k
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    async def infer_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> list[P.InferResult]:
        if self.broken:
            raise ChannelError("channel broken")
        body = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > MAX_FRAME:  # the host would refuse it; the channel itself is fine
            raise FrameTooLarge(
                f"a {len(body)}-byte batch is over the channel's {MAX_FRAME}-byte frame limit"
            )
        sock = await self._conn()
        loop = asyncio.get_running_loop()
        sent = False  # the whole request frame written: from then on the host may have run it
        try:
            await loop.sock_sendall(sock, _LEN.pack(len(body)) + body)
            sent = True
            (n,) = _LEN.unpack(await self._recv(sock, _LEN.size))
            if n > MAX_FRAME:
                raise ValueError(f"a {n}-byte reply is over the limit")
            reply: list[P.InferResult] | HeldReply = pickle.loads(await self._recv(sock, n))
        except Exception as e:  # a broken connection or a reply that does not decode (not a cancel)
            self.broken = True
            sock.close()
            self._release(None)
            why = f"channel {self.address.path}: {type(e).__name__}: {e}"
            if sent:  # a host reads a frame whole before it runs it: a partial one never ran
                raise ReplyLost(f"{why} (after the request was sent)") from None
            raise ChannelError(why) from None
        except BaseException:  # cancelled mid-frame: this connection's stream position is unknown
            sock.close()
            self._release(None)
            raise
        self._release(sock)
        if isinstance(reply, HeldReply):  # it ran; its results are fetched through Ray
            raise ReplyTooLarge(reply.token, reply.nbytes)
        return reply

    def close(self) -> None:
        """Close the idle connections (those in flight close when their frame ends)."""
        self.broken = True
        for sock in self._free:
            sock.close()
        self._free.clear()
