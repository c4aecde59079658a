"""Prometheus metrics of the live manager (a private registry; served over HTTP by `residency serve`
when `server.metrics_listen` is set).

loads / evictions per model and tier, load durations per transition, cold-start wait per class,
resident bytes per device and tier, queue depth per model, thrash, elastic lease size, and requests
by outcome. (WorldPager stall figures join with world sessions.)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

WAIT_BUCKETS = (
    0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip
"""Seconds, for load times and request waits. Up to 10 min: an LLM read from a disk takes a minute or
more, and a histogram_quantile that falls past the last finite bucket reads as that bucket (a 90 s
load was reported as 30 s)."""


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.loads = Counter(
            "residency_loads", "Model loads by target tier", ["model", "tier", "source"], registry=r
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
            "residency_requests", "Requests by outcome", ["model", "cls", "outcome"], registry=r
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
        self.log_buffered = Gauge(
            "residency_request_log_buffered", "Served requests waiting to be written to the store", registry=r
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


class _Handler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # StreamRequestHandler: the connection's socket timeout

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


def serve_metrics(
    host: str, port: int, registry: CollectorRegistry, allows: Callable[[str], bool] | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Prometheus' exposition over HTTP on host:port in a daemon thread, as prometheus_client's
    `start_http_server`, but with a bearer token when `allows` is given, a read timeout and a bound
    on the connections served at once (an idle or slow client held a thread each, without end).
    Returns (server, thread): `server.shutdown()` and `server_close()` stop it. OSError if the
    address cannot be had."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    family, bind_host = info[0], str(info[4][0])
    slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)

    class Server(ThreadingWSGIServer):
        address_family = family

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):  # too many at once: this one is closed unanswered
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

    app = make_wsgi_app(registry)
    httpd = make_server(
        bind_host, port, app if allows is None else _authorized(app, allows), Server, _Handler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="residency-metrics", daemon=True)
    thread.start()
    return httpd, thread
