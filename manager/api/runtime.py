"""What the server and its gRPC front-end processes set up alike: the event loop, gRPC's message
limits and keepalive, and binding the listening port. Light on purpose (asyncio and the stdlib; grpc
only where a port is bound): a front end imports it without the manager."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ServeError(Exception):
    """The server cannot start as configured (printed, exit 2)."""


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

    try:
        if tls is None:
            return int(server.add_insecure_port(listen))
        cert, key = tls
        creds = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
        return int(server.add_secure_port(listen, creds))
    except RuntimeError:
        return 0


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
    ]


def message_options(max_bytes: int) -> list[tuple[str, Any]]:
    """gRPC options: messages up to `max_bytes` either way (`server.max_request_bytes`)."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
