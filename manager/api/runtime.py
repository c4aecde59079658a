"""What the server and its gRPC front-end processes set up alike: the event loop and gRPC's message
limits. Light on purpose (asyncio and the stdlib): a front end imports it without the manager."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
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
