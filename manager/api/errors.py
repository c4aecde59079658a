"""The one mapping from domain errors to gRPC status codes, applied by every servicer method."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from manager.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InsufficientCapacity,
    InvalidRequest,
    ModelFailed,
    ModelNotFound,
    PermissionDenied,
    ResidencyError,
    Unauthenticated,
    Unsupported,
    WorkerUnavailable,
)

logger = logging.getLogger(__name__)

STATUS: dict[type[ResidencyError], grpc.StatusCode] = {
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    InsufficientCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerUnavailable: grpc.StatusCode.UNAVAILABLE,
    ModelFailed: grpc.StatusCode.INTERNAL,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
}

T = TypeVar("T")

MAX_DETAILS_BYTES = 2000
"""Status details longer than this (UTF-8) are cut: they travel in a header, percent-encoded, and a
client drops a response whose headers pass its metadata limit (16 KiB for grpcio), so an echoed
4 KiB model name would turn NOT_FOUND into RESOURCE_EXHAUSTED."""
TRUNCATED = "… (truncated)"


def details_of(e: BaseException | str, tail: str = "") -> str:
    """What a client is told: the error's message, cut to `MAX_DETAILS_BYTES`; `tail` (what the
    client must be told, e.g. how to resume) follows it, never cut."""
    msg = str(e) + tail
    raw = msg.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return msg
    room = max(0, MAX_DETAILS_BYTES - len(tail.encode()))
    return str(e).encode()[:room].decode(errors="ignore") + TRUNCATED + tail


def status_of(e: ResidencyError) -> grpc.StatusCode:
    for cls in type(e).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def mapped(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Servicer method decorator: domain errors → their status; anything else → INTERNAL, logged once,
    with no traceback sent to the client."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> T:
        try:
            return await fn(self, request, context)
        except ResidencyError as e:
            await context.abort(status_of(e), details_of(e))
        except Exception:
            logger.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error (see the server log)"
            )
        raise AssertionError("unreachable")  # context.abort raises

    return wrapper
