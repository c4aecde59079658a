"""Prometheus metrics of the live manager (a private registry, without prometheus_client's `*_created`
series; served over HTTP by `residency serve` when `server.metrics_listen` is set).

loads (those their device host confirmed: a failed one is a failure, not a load) / evictions per
model and tier, load durations per transition, cold-start wait per class, resident bytes per device
and tier, queue depth per model, thrash, elastic lease size, failed worker commands per model and
error code, and requests by outcome: `ok` and `error` (it ran and failed, or it failed before it ran:
its model's load failed or did not finish in time) for requests admitted, `rejected` for those
admission refused (it can never fit, a full queue, no room within its class's max_wait), `cancelled`
for those whose client went away (hung up) before they were answered, waiting or running. A world
session counts as a request as `residency stats` counts it: when it ends (`error` when a step of it
failed), its wait for its model observed when it opens. (WorldPager stall figures join with world
sessions.)

With `server.tls_cert`/`tls_key` set, the endpoint serves HTTPS with that certificate and key (as gRPC
does: scrapers send the admin bearer token); plain HTTP is then answered 400, naming the fix.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

WAIT_BUCKETS = (
    0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip
"""Seconds, for load times and request waits. Up to 10 min: an LLM read from a disk takes a minute or
more, and a histogram_quantile that falls past the last finite bucket reads as that bucket (a 90 s
load was reported as 30 s)."""


CREATED_TYPES = ("counter", "histogram", "summary")
"""The metric types prometheus_client gives a `<name>_created` series (a timestamp per child)."""


def _without_created(metrics: Iterable[Metric]) -> Iterator[Metric]:
    """`metrics` less each counter's, histogram's and summary's `<name>_created` samples; what else they
    hold is untouched (a gauge named `…_created` stays)."""
    for m in metrics:
        if m.type in CREATED_TYPES:
            created = m.name + "_created"
            if any(s.name == created for s in m.samples):
                m = copy.copy(m)
                m.samples = [s for s in m.samples if s.name != created]
        yield m


class _Filtered:
    """A registry's view (`restricted_registry`, for `?name[]=` scrapes) with `_without_created`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Metric]:
        return _without_created(self.inner.collect())


class NoCreatedRegistry(CollectorRegistry):
    """A registry that exposes no `*_created` series: prometheus_client adds one per child of every
    counter, histogram and summary (its creation time), which doubles the series a scrape stores and
    tells a home server's Prometheus nothing it uses. Only this registry's exposition drops them;
    prometheus_client's global switch (`disable_created_metrics()`, or PROMETHEUS_DISABLE_CREATED_SERIES
    in the environment) would drop them from every registry of a process that imports this module."""

    def collect(self) -> Iterator[Metric]:
        return _without_created(super().collect())

    def restricted_registry(self, names: Iterable[str]) -> Any:
        return _Filtered(super().restricted_registry(names))


class Metrics:
    def __init__(self) -> None:
        r = self.registry = NoCreatedRegistry()
        self.loads = Counter(
            "residency_loads",
            "Model loads their device host confirmed, by target tier and source (a failed load is "
            "counted in residency_load_failures_total instead)",
            ["model", "tier", "source"],
            registry=r,
        )
        self.evictions = Counter(
            "residency_evictions", "Evictions from the GPU tier", ["model", "to"], registry=r
        )
        self.load_seconds = Histogram(
            "residency_load_seconds", "Measured transition time", ["model", "transition"],
            buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.wait = Histogram(
            "residency_request_wait_seconds", "Time a request waited before it ran (cold starts, room)",
            ["cls"], buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "residency_requests",
            "Requests by outcome: ok, error (it failed, its model's load included), rejected (refused "
            "by admission: no room, a full queue), cancelled (its client went away before the answer)",
            ["model", "cls", "outcome"],
            registry=r,
        )
        self.resident = Gauge(
            "residency_resident_bytes", "Bytes held per device and tier", ["device", "tier"], registry=r
        )
        self.queue = Gauge("residency_queue_depth", "Requests waiting for their model", ["model"], registry=r)
        self.thrash = Counter("residency_thrash", "Reloads within thrash_window of an eviction", registry=r)
        self.lease = Gauge("residency_lease_bytes", "Elastic KV lease on the device", ["model"], registry=r)
        self.failures = Counter(
            "residency_load_failures", "Failed worker commands", ["model", "code"], registry=r
        )
        self.lost = Counter(
            "residency_models_lost",
            "Models their device host no longer held (it died or restarted, or lost one): taken off the "
            "books, reloaded at their next request",
            ["model"],
            registry=r,
        )
        self.host_restarts = Counter(
            "residency_host_restarts",
            "Device hosts found running as a new process (their earlier one died or was restarted)",
            ["device"],
            registry=r,
        )
        self.log_buffered = Gauge(
            "residency_request_log_buffered",
            "Request-log records waiting to be written to the store",
            registry=r,
        )
        self.log_dropped = Counter(
            "residency_request_log_dropped",
            "Request-log records dropped: the store was down too long",
            registry=r,
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: str, *labels: str) -> Any:
        """The labelled child of a per-request metric, cached (labels() is a lookup with a lock)."""
        key = (metric, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = getattr(self, metric).labels(*labels)
        return c


HTTP_TIMEOUT_S = 10.0
"""A metrics client that sends nothing for this long is cut off (it held a thread for ever)."""
HTTP_MAX_CONNECTIONS = 32
"""Connections served at once; more are closed at once (each one is a thread)."""
HTTP_PER_CLIENT = 8
"""Connections of one client address served at once; more of its are closed at once, so one client
cannot take every slot and shut the scrapers out."""
HTTP_CONNECTION_S = 30.0
"""A connection is cut off this long after it was accepted, whatever it still sends: the read timeout
is each read's, so a client that sent a byte now and then held its slot for good."""


class _Slots:
    """The connections served at once: at most `total`, at most `per_client` of one address (shared by
    the endpoint's servers on each of its addresses)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, client: str) -> bool:
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held.get(client, 0) >= self.per_client:
                return False
            self._held[client] = self._held.get(client, 0) + 1
            return True

    def give(self, client: str) -> None:
        with self._lock:
            left = self._held.get(client, 0) - 1
            if left > 0:
                self._held[client] = left
            else:
                self._held.pop(client, None)


def _client(client_address: Any) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""


class _Handler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # StreamRequestHandler: the connection's socket timeout (and the TLS
    # handshake's whole time: `_Server._tls_accept`)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent, as prometheus_client's own handler."""


def _authorized(
    app: Callable[..., Iterable[bytes]], allows: Callable[[str], bool]
) -> Callable[..., Iterable[bytes]]:
    """`app` behind `Authorization: Bearer <token>` (`allows` compares it); 401 without it."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if allows(str(environ.get("HTTP_AUTHORIZATION", ""))):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", 'Bearer realm="residency"')],
        )
        return [b"metrics: missing or wrong bearer token (server.auth_token_env)\n"]

    return guarded


def metrics_tls(cert: str, key: str) -> ssl.SSLContext:
    """The endpoint's TLS: `server.tls_cert` and `server.tls_key` (PEM, no passphrase), TLS 1.2 and up.
    ssl.SSLError (or OSError: a file that cannot be read) when they are not a certificate and its key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password="")  # (an encrypted key fails here rather than prompting)
    return ctx


TLS_HANDSHAKE = 0x16
"""The first byte of a TLS connection (a handshake record); an HTTP request starts with a letter."""
_PLAIN_HTTP_BODY = (
    b"metrics: this endpoint serves HTTPS (server.tls_cert is set): scrape it with https:// "
    b"(Prometheus: scheme: https)\n"
)
PLAIN_HTTP_REPLY = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_PLAIN_HTTP_BODY), _PLAIN_HTTP_BODY)
)
"""The answer to plain HTTP on the HTTPS endpoint (as nginx answers it)."""


class _TLSRefused(Exception):
    """A connection to the HTTPS endpoint that is closed before HTTP: its reason is said at debug."""


LOOPBACKS = ("127.0.0.1", "::1")
"""What `localhost` binds: both loopback addresses, whatever the resolver says (as gRPC binds
`server.listen: localhost:…`), so a scraper of either finds it."""


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[Any, ...]]]:
    """(family, sockaddr) of each address `host` stands for, in the resolver's order, once each."""
    seen: list[tuple[socket.AddressFamily, tuple[Any, ...]]] = []
    for h in LOOPBACKS if host == "localhost" else (host,):
        for family, _, _, _, sockaddr in socket.getaddrinfo(
            h, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            if (family, sockaddr) not in seen:
                seen.append((family, tuple(sockaddr)))
    return seen


UNAVAILABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
"""Bind errors of an address this host does not have (::1 where IPv6 is off): skipped when another
address of the name binds. Any other error (a port another server holds) fails the whole start."""


class _Server(ThreadingWSGIServer):
    """The endpoint on one address, listening: a connection past `slots` is closed unanswered.
    `peers`: the same endpoint on the name's other addresses, stopped and closed with this one."""

    def __init__(
        self,
        family: socket.AddressFamily,
        sockaddr: tuple[Any, ...],
        slots: _Slots,
        v6only: bool,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.address_family = family  # (read by the constructor, which makes the socket)
        self.slots = slots
        self.tls = tls
        self.peers: list[_Server] = []
        super().__init__(sockaddr, _Handler, bind_and_activate=False)
        try:
            if v6only and family == socket.AF_INET6:  # `::` beside `0.0.0.0` would clash
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.take(_client(client_address)):  # too many at once (in all, or of this
            self.shutdown_request(request)  # client): this one is closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.give(_client(client_address))
            raise

    def setup_environ(self) -> None:
        super().setup_environ()
        if self.tls is not None:  # wsgi.url_scheme: https
            self.base_environ["HTTPS"] = "on"

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        limit = float(self.RequestHandlerClass.timeout or HTTP_TIMEOUT_S)  # type: ignore[attr-defined]
        current = [request]  # the connection's socket: its TLS socket once wrapped (it detaches this)
        cut = threading.Timer(max(HTTP_CONNECTION_S, limit), _cut_off, (current,))
        cut.daemon = True
        cut.start()
        try:
            if self.tls is not None:  # the handshake is this connection's thread's, not the accept loop's
                try:
                    request = current[0] = self._tls_accept(request, self.tls)
                except Exception:
                    self.handle_error(request, client_address)
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.give(_client(client_address))

    def _tls_accept(self, request: socket.socket, tls: ssl.SSLContext) -> ssl.SSLSocket:
        """`request` after its TLS handshake, which must end within the read timeout as a whole (a client
        that connects and sends nothing, or a byte at a time, is cut off: TimeoutError). Plain HTTP is
        answered PLAIN_HTTP_REPLY (_TLSRefused); a handshake that fails raises ssl.SSLError. On any
        error `request` is left to close (the TLS socket made of it is closed here)."""
        limit = float(self.RequestHandlerClass.timeout or HTTP_TIMEOUT_S)  # type: ignore[attr-defined]
        deadline = time.monotonic() + limit
        request.settimeout(limit)
        first = request.recv(1, socket.MSG_PEEK)
        if not first:
            raise _TLSRefused("it closed before its TLS handshake")
        if first[0] != TLS_HANDSHAKE:
            request.recv(65536)  # (what came of its request: unread, the close would reset the reply)
            request.sendall(PLAIN_HTTP_REPLY)
            raise _TLSRefused("plain HTTP to the HTTPS endpoint: answered 400")
        request.setblocking(False)
        conn = tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        try:
            with selectors.DefaultSelector() as sel:
                while True:
                    try:
                        conn.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        want = selectors.EVENT_READ
                    except ssl.SSLWantWriteError:
                        want = selectors.EVENT_WRITE
                    left = deadline - time.monotonic()
                    sel.register(conn, want)
                    ready = left > 0 and sel.select(left)
                    sel.unregister(conn)
                    if not ready:
                        raise TimeoutError(f"its TLS handshake did not end within {limit:g} s")
            conn.settimeout(limit)
            return conn
        except BaseException:
            conn.close()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection whose client sent nothing for HTTP_TIMEOUT_S, or went away, is closed with a
        line at debug (socketserver printed an "Exception occurred" block and a traceback on stderr
        for each: a port scan, a TCP health check); anything else is logged, with its traceback."""
        e = sys.exc_info()[1]
        peer = _shown(tuple(client_address)) if isinstance(client_address, tuple) else str(client_address)
        # (a handshake that failed: the client's TLS is not ours, or it refused the certificate)
        if isinstance(e, TimeoutError | ConnectionError | ssl.SSLError | _TLSRefused):
            logger.debug("metrics: the connection from %s was closed: %s", peer, e or type(e).__name__)
            return
        logger.error("metrics: serving the request from %s failed", peer, exc_info=e)

    def shutdown(self) -> None:
        super().shutdown()
        for p in self.peers:
            p.shutdown()

    def server_close(self) -> None:
        super().server_close()
        for p in self.peers:
            p.server_close()


def _cut_off(current: list[socket.socket]) -> None:
    """End a connection past HTTP_CONNECTION_S (`current[0]`: its socket, or its TLS socket once the
    handshake wrapped it): its thread's read or write fails, and it ends. The OS socket is shut down
    under TLS too (socket's own shutdown, not the TLS socket's, which would drop its TLS state under
    the thread that reads it)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(current[0], socket.SHUT_RDWR)


def _shown(sockaddr: tuple[Any, ...]) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_all(host: str, port: int, slots: _Slots, tls: ssl.SSLContext | None = None) -> list[_Server]:
    """A listening server on each address of `host` that this host has, all on one port (port 0:
    the first one's); OSError when one cannot be had for another reason, or none can."""
    addresses = _addresses(host, port)
    bound: list[_Server] = []
    skipped: OSError | None = None
    try:
        for family, sockaddr in addresses:
            if bound:
                sockaddr = (sockaddr[0], bound[0].server_address[1], *sockaddr[2:])
            try:
                bound.append(_Server(family, sockaddr, slots, v6only=len(addresses) > 1, tls=tls))
            except OSError as e:
                # which of the name's addresses failed is said (`localhost` is two)
                where = OSError(e.errno, f"{e.strerror or e} on {_shown(sockaddr)}")
                if e.errno not in UNAVAILABLE:
                    raise where from None
                skipped = skipped or where
                logger.warning("metrics: %s: not served there", where.strerror)
    except BaseException:
        for s in bound:
            s.server_close()
        raise
    if not bound:
        assert skipped is not None
        raise skipped
    return bound


def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    allows: Callable[[str], bool] | None = None,
    *,
    tls: ssl.SSLContext | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Prometheus' exposition over HTTP on host:port in a daemon thread, as prometheus_client's
    `start_http_server`, but with a bearer token when `allows` is given, a read timeout, a time limit
    on each connection and a bound on the connections served at once, in all and per client address
    (an idle or slow client held a thread each, without end).
    Every address `host` stands for is bound (`localhost`: 127.0.0.1 and ::1), on one port: only the
    first one was, so a scraper of the other loopback address found nothing there.
    Returns (server, thread): `server.shutdown()` and `server_close()` stop it on every address, and
    the thread ends once it has. OSError if the address cannot be had. `tls` (`metrics_tls`): HTTPS,
    each connection's handshake done on its own thread within the read timeout."""
    app = make_wsgi_app(registry)
    app = app if allows is None else _authorized(app, allows)
    slots = _Slots(HTTP_MAX_CONNECTIONS, min(HTTP_PER_CLIENT, HTTP_MAX_CONNECTIONS))
    first, *others = _bind_all(host, port, slots, tls)
    first.peers = others
    threads = [
        threading.Thread(target=s.serve_forever, name="residency-metrics", daemon=True) for s in others
    ]
    for s in (first, *others):
        s.set_app(app)
    for t in threads:
        t.start()

    def serve_all() -> None:
        try:
            first.serve_forever()
        finally:  # `first.shutdown()` stops the peers next: this thread ends with the last of them
            for t in threads:
                t.join()

    thread = threading.Thread(target=serve_all, name="residency-metrics", daemon=True)
    thread.start()
    return first, thread
