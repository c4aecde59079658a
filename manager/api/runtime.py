"""What the server and its gRPC front-end processes set up alike: the event loop, gRPC's message
limits and keepalive, binding the listening port, and a stream's write bounded in time. Light on
purpose (asyncio and the stdlib; grpc only where a port is bound): a front end imports it without
the manager."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ServeError(Exception):
    """The server cannot start as configured (printed, exit 2)."""


LOAD_WAIT_S = 86400.0
"""How long a load call (OIP RepositoryModelLoad, the admin's Preload) without a deadline of its
own waits for the load: as long as it takes (a load that fails or hangs ends by the device host's
own timeout), at most a day. It was 120 s, so a slow cold load answered DEADLINE_EXCEEDED to a
client that set no deadline, and went on loading."""


def call_wait_s(time_remaining: float | None, default_s: float = LOAD_WAIT_S) -> float:
    """How long a call may wait: its deadline (what `context.time_remaining()` says, less a margin -
    a tenth of it, at most a second - for the answer saying why to reach the client before its
    deadline does), else `default_s`."""
    if time_remaining is None:
        return default_s
    left = float(time_remaining)
    return max(left - min(1.0, left / 10.0), 0.01)


def quiet_grpc_fork() -> None:
    """Turn gRPC's fork support off in this process (unless the environment already chooses), before
    gRPC starts: the server forks only to exec (front ends, Ray's processes), and with it on, gRPC
    core prints "Other threads are currently calling into gRPC, skipping fork() handlers" on stderr
    at each such start, a line a user cannot act on. Inherited by the processes started here.
    gRPC core's INFO lines are off too (`GRPC_VERBOSITY=ERROR` unless the environment chooses): one
    per plaintext client on a TLS port ("Handshake failed ... WRONG_VERSION_NUMBER") let anyone on
    the network fill the log; its errors still show. Only read at gRPC's first import."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The server's event loop: uvloop's (the default where it is installed) or asyncio's, as the
    environment variable RESIDENCY_EVENT_LOOP says (`uvloop` | `asyncio`). None: asyncio's own."""
    choice = os.environ.get("RESIDENCY_EVENT_LOOP", "uvloop").strip().lower()
    if choice not in ("uvloop", "asyncio"):
        raise ServeError(f"RESIDENCY_EVENT_LOOP={choice!r}: use 'uvloop' or 'asyncio'")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        logger.info("uvloop is not installed: serving on asyncio's event loop")
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def add_port(server: Any, listen: str, tls: tuple[str, str] | None = None) -> int:
    """Bind the gRPC `server` to `listen`, with TLS from the (cert, key) files when given. Returns the
    port bound, or 0 where it cannot bind (grpcio raises "Failed to bind"; older ones returned 0)."""
    import grpc

    creds = None
    if tls is not None:
        cert, key = tls
        cert_pem, key_pem = read_tls(cert, key)
        creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    try:
        if creds is None:
            return int(server.add_insecure_port(listen))
        return int(server.add_secure_port(listen, creds))
    except RuntimeError:
        return 0


def read_tls(cert: str, key: str) -> tuple[bytes, bytes]:
    """The PEM bytes of `server.tls_cert` and `server.tls_key`, checked to be a certificate and its
    private key (gRPC would only say it cannot bind, after printing its own errors); ServeError naming
    the setting and the file otherwise."""
    import ssl

    pems = []
    for setting, path in (("server.tls_cert", cert), ("server.tls_key", key)):
        try:
            pems.append(Path(path).read_bytes())
        except OSError as e:
            raise ServeError(f"{setting} {path!r}: cannot read it: {e.strerror or e}") from None
    try:
        # no passphrase (gRPC takes none): an encrypted key fails here rather than prompting for one
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password="")
    except (ssl.SSLError, ValueError) as e:
        why = getattr(e, "reason", None)  # KEY_VALUES_MISMATCH: a key of another certificate
        raise ServeError(
            f"server.tls_cert {cert!r} and server.tls_key {key!r} are not a PEM certificate and its "
            "private key" + (f" ({why})" if why else "")
        ) from None
    return pems[0], pems[1]


def authorization_of(context: Any) -> str | None:
    """A gRPC call's `authorization` header, None when it sent none."""
    got = dict(context.invocation_metadata() or ()).get("authorization")
    return got if isinstance(got, str) else None


MAX_CONCURRENT_RPCS = 4096
"""The most calls the manager's server runs at once (admin and health calls are counted, never
refused: `server.RequestLimit`); one more is answered RESOURCE_EXHAUSTED at once. A home runs tens;
without a bound one client could open streams until the manager's memory ran out (about 33 KiB an
idle ModelStreamInfer stream: 3,000 took 96 MiB). With front ends, the calls they relay count here
(ModelInfer's fast path, a call that ends, does not)."""
MAX_CALLS_PER_CLIENT = 1024
"""The most of those calls one client host runs at once on a public listener (a quarter of the
server's: one app cannot take them all)."""
MAX_STREAMS_PER_CONNECTION = 1024
"""The most calls one client connection (HTTP/2) may have open at once on a public listener; gRPC's
default let one connection open them all (more wait in the client until one ends)."""


def limit_options(public: bool) -> list[tuple[str, Any]]:
    """The per-connection call limit of a server (`MAX_STREAMS_PER_CONNECTION`), on a public listener
    only: a front end's relay to the manager's private socket carries its clients' calls together."""
    return [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)] if public else []


CLIENT_PING_MIN_S = 5.0
"""The shortest interval between a client's keepalive pings the server takes (a client that pings more
often, with no data flowing, is told GOAWAY "too_many_pings" after a few, as gRPC does)."""


def keepalive_options(every_s: float) -> list[tuple[str, Any]]:
    """Server-side gRPC keepalive (`server.keepalive`): ping each connection every `every_s`, with or
    without data flowing (a paused world session sends none), and drop it if a ping goes unanswered
    for `every_s` (20 s at most): its calls are cancelled."""
    ms = max(int(every_s * 1000), 1)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", min(ms, 20_000)),
        ("grpc.http2.ping_timeout_ms", min(ms, 20_000)),
        ("grpc.http2.max_pings_without_data", 0),
        # a client's own keepalive pings (the usual advice for long streams: a paused world session
        # sends nothing): gRPC's default took any ping within 5 minutes of the last one, while no
        # data flowed, for abuse, and its third closed the connection (GOAWAY "too_many_pings"),
        # ending the session; pings every CLIENT_PING_MIN_S or more are welcome, calls or none
        ("grpc.http2.min_ping_interval_without_data_ms", int(CLIENT_PING_MIN_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


async def write_within(
    context: Any, message: Any, limit_s: float | None, stop: asyncio.Event | None = None
) -> bool:
    """Write `message` to a call's stream (`context.write`): True once sent (gRPC's own error raised,
    a grpc.aio.BaseError: the stream is gone); False when it was not sent within `limit_s` seconds
    (None: no limit) or `stop` was set first. A send that gRPC's flow control holds (the client reads
    nothing, its window is full) would otherwise wait for ever. The write given up is cancelled and
    let end; it stays queued in gRPC (its callback finds its waiter cancelled, as when a client
    cancels mid-send), so the client gets it, and the status after it, if it ever reads again. The
    write is cancelled too when this task is (the client cancelled its call)."""
    write = asyncio.ensure_future(context.write(message))
    # its error read whatever becomes of it (a client's cancel fails the write and cancels the
    # handler in one turn: asyncio logged "Task exception was never retrieved" at each)
    write.add_done_callback(lambda t: t.cancelled() or t.exception())
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        waits = (write,) if stopped is None else (write, stopped)
        await asyncio.wait(waits, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stopped is not None:
            stopped.cancel()
        sent = write.done()
        if not sent:
            write.cancel()
    if sent:
        write.result()
        return True
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await write
    return False
