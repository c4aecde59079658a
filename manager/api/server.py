"""`residency serve`: the gRPC server (grpc.aio) around a live manager.

Services: `inference.GRPCInferenceService` (OIP), `residency.v1.Residency` (admin), `grpc.health.v1`
(SERVING once the manager has started) and server reflection. Listens on `server.listen` (loopback by
default). Admin calls (residency.v1 and the repository load/unload) need `authorization: Bearer <token>`
when the env variable named by `server.auth_token_env` holds a token; listening beyond loopback
without one is refused at start. TLS from `server.tls_cert`/`tls_key`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import errno
import functools
import hashlib
import hmac
import inspect
import ipaddress
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from manager.api.admin import AdminServicer, file_identity
from manager.api.errors import details_of, status_of
from manager.api.front import receive_options, too_large
from manager.api.handlers import add_servicer
from manager.api.oip import InferenceServicer
from manager.api.runtime import (
    MAX_CALLS_PER_CLIENT,
    MAX_CONCURRENT_RPCS,
    ServeError,
    add_port,
    keepalive_options,
    limit_options,
)
from manager.api.world import WorldSessionServicer
from manager.config import Config
from manager.errors import InsufficientCapacity, InvalidRequest, ResidencyError
from manager.journal import RequestJournal
from manager.live import LiveManager
from manager.live_persist import read_outcome
from manager.reload import TunedHold
from residency_proto.inference import grpc_service_pb2
from residency_proto.v1 import residency_pb2
from workers import procs
from workers import protocol as P
from workers.bounded import SingleFlight, TimedOut
from workers.signals import STOP_SIGNALS, StopSignal, honoured_stop_signals, stop_signals_raise

logger = logging.getLogger(__name__)
T = TypeVar("T")

ADMIN_PREFIXES = (
    "/residency.v1.Residency/",
    "/inference.GRPCInferenceService/RepositoryModelLoad",
    "/inference.GRPCInferenceService/RepositoryModelUnload",
)


def is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host.lower().removesuffix(".") == "localhost":  # (host names are case-insensitive)
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admin methods need the bearer token (compared in constant time); others pass."""

    def __init__(self, token: str) -> None:
        self.expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

    def allows(self, authorization: str) -> bool:
        """Constant time in what matches: both sides are hashed to 32 bytes first, so neither a
        shared prefix nor the presented token's length changes the time `compare_digest` takes. The
        scheme's name is case-insensitive (RFC 6750: `bearer tok` is `Bearer tok`)."""
        scheme, sep, rest = authorization.partition(" ")
        if sep and scheme.lower() == "bearer":
            authorization = f"Bearer {rest}"
        return hmac.compare_digest(hashlib.sha256(authorization.encode()).digest(), self.expected)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        if details.method.startswith(ADMIN_PREFIXES):
            got = dict(details.invocation_metadata or ()).get("authorization", "")
            if not self.allows(str(got)):
                return _deny()
        return await continuation(details)


class _Oversized:
    """A request larger than `server.max_request_bytes`, in place of its message (`RequestLimit`)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class _Undecodable:
    """A request whose bytes are no message of its method's type, in place of its message
    (`RequestLimit`: the services grpc registers itself, Health and Reflection, parse in grpc, where
    a DecodeError was answered UNKNOWN and logged with a traceback)."""

    __slots__ = ("error",)

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class RequestLimit(grpc.aio.ServerInterceptor):
    """A request (or a stream's message) larger than `max_request_bytes` (`server.max_request_bytes`)
    is answered RESOURCE_EXHAUSTED naming that setting and both sizes (`front.too_large`), not
    handled. gRPC takes in up to `front.receive_limit` (its own refusal past that does not name the
    setting); the size is read in the method's deserializer, which gets the message's bytes."""

    def __init__(
        self, max_request_bytes: int, *, max_calls: int | None = None, per_peer: int | None = None
    ) -> None:
        self.limit = max_request_bytes
        self._made: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self.max_calls = max_calls
        """The most calls (but admin and health calls) that run at once; one more is refused
        RESOURCE_EXHAUSTED. Admin and health calls are counted, never refused: an app that fills
        the server with idle streams locks out neither the admin (with the token) nor health checks
        (gRPC's own `maximum_concurrent_rpcs` refused them too)."""
        self.per_peer = per_peer
        """The most of those one client host (its address; not a Unix socket's) runs at once."""
        self.active = 0
        self.by_peer: dict[str, int] = {}

    def _enter(self, method: str, context: Any) -> tuple[str | None, str | None]:
        """Count a call in: (why it is refused, or None; its peer's key, to count it out)."""
        peer = _peer_host(context) if self.per_peer is not None else None
        if not method.startswith(_NEVER_REFUSED):
            if self.max_calls is not None and self.active >= self.max_calls:
                return (
                    f"the server runs {self.active} calls at once, its most (server-wide): retry once "
                    "some end",
                    None,
                )
            if peer is not None and self.per_peer is not None and self.by_peer.get(peer, 0) >= self.per_peer:
                return (
                    f"this client ({peer}) runs {self.per_peer} calls at once, the most one client may: "
                    "retry once some end",
                    None,
                )
        self.active += 1
        if peer is not None:
            self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        return None, peer

    def _leave(self, peer: str | None) -> None:
        self.active -= 1
        if peer is not None:
            left = self.by_peer.get(peer, 1) - 1
            if left > 0:
                self.by_peer[peer] = left
            else:
                self.by_peer.pop(peer, None)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = str(details.method)
        made = self._made.get(method)
        if made is None or made[0] is not handler:  # (one per method: the servicers' are fixed)
            made = (handler, self._checking(method, handler))
            self._made[method] = made
        return made[1]

    def _checking(self, method: str, handler: Any) -> Any:
        """`handler` with the check: its deserializer reads the size, its function refuses a request
        too large before it runs (a stream's message as it is read)."""
        limit = self.limit
        parse = handler.request_deserializer
        kind = next((k for k in _HANDLER_KINDS if getattr(handler, k) is not None), None)
        fn = getattr(handler, kind) if kind is not None else None
        # gRPC runs a coroutine function as one (a streaming one writes with context.write: health's
        # Watch) and iterates an async generator (the servicers `add_servicer` registers): the wrapper
        # is of the same kind. Another (a plain function, which gRPC runs on a thread; none here) is
        # left as it is, to gRPC's own limit.
        if not hasattr(handler, "_replace") or kind is None:  # (grpc's handlers are namedtuples)
            return handler
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            return handler
        call: Any = fn  # (either kind: not narrowed)

        def deserialize(raw: bytes) -> Any:
            if len(raw) > limit:
                return _Oversized(len(raw))
            try:
                return raw if parse is None else parse(raw)
            except DecodeError as e:
                return _Undecodable(e)

        async def refuse(request: Any, context: Any) -> Any:
            if (e := _refusal(method, limit, request)) is not None:
                await context.abort(status_of(e), details_of(e))
            return request

        async def first(request: Any, context: Any) -> Any:
            if kind.startswith("stream"):
                return _checked(method, limit, request)
            return await refuse(request, context)

        async def as_coroutine(request: Any, context: Any) -> Any:
            why, peer = self._enter(method, context)
            if why is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            try:
                return await call(await first(request, context), context)
            except _REFUSALS as e:  # (a handler that let its read's refusal through: grpc's own)
                await context.abort(status_of(e), details_of(e))
            finally:
                self._leave(peer)

        async def as_generator(request: Any, context: Any) -> Any:
            why, peer = self._enter(method, context)
            if why is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            try:
                async for out in call(await first(request, context), context):
                    yield out
            except _REFUSALS as e:
                await context.abort(status_of(e), details_of(e))
            finally:
                self._leave(peer)

        wrapped = as_coroutine if inspect.iscoroutinefunction(call) else as_generator
        return handler._replace(request_deserializer=deserialize, **{kind: wrapped})


_NEVER_REFUSED = (*ADMIN_PREFIXES, "/grpc.health.v1.Health/")
"""Calls `RequestLimit`'s call limits count but never refuse (admin calls need the token already)."""


def _peer_host(context: Any) -> str | None:
    """The client host of a call (its address without the port), None on a Unix socket (a front end's
    relay: its clients' calls together) or when gRPC does not say."""
    try:
        peer = str(context.peer() or "")
    except Exception:  # (a test's stand-in context, say)
        return None
    if not peer.startswith(("ipv4:", "ipv6:")):
        return None
    return peer.split(":", 1)[1].rsplit(":", 1)[0]


def _refusal(method: str, limit: int, request: Any) -> ResidencyError | None:
    """What `RequestLimit` tells the client of a message too large or that does not parse; None for
    a message that is neither."""
    if isinstance(request, _Oversized):
        return InsufficientCapacity(too_large(method, request.size, limit))
    if isinstance(request, _Undecodable):
        return InvalidRequest(
            f"{method}: the request is not a valid protobuf message of its type "
            f"({request.error}); send it with a client generated from its .proto file"
        )
    return None


async def _checked(method: str, limit: int, requests: Any) -> Any:
    """A stream's messages; one refused is raised to the handler as its read's error, as a message
    that does not parse is (`handlers.add_servicer`), so a handler that holds something says what
    became of it (a world session: saved, the id to resume it with) and the requests before it are
    answered. One the handler lets through is the call's status (`RequestLimit`'s wrappers)."""
    async for request in requests:
        if (e := _refusal(method, limit, request)) is not None:
            raise e
        yield request


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
_REFUSALS = (InsufficientCapacity, InvalidRequest)
"""What `RequestLimit` raises to a stream's handler; passed through a handler, the call's status."""


def _deny() -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin call: missing or wrong bearer token")

    return grpc.unary_unary_rpc_method_handler(abort)


def check_servable_policy(config: Config) -> None:
    """ServeError when `policy.name` is one the service cannot run: `oracle` knows the whole trace in
    advance (a reference for replays); the service failed with a traceback once Ray had started."""
    if config.policy.name == "oracle":
        raise ServeError(
            "policy.name 'oracle' sees every request of a trace in advance: it is a reference for "
            "`residency replay`, not a policy the service can run; use 'residency' (or a baseline)"
        )


def auth_token(config: Config) -> str | None:
    env = config.server.auth_token_env
    token = os.environ.get(env) if env else None
    if env and token is not None and not token.strip():
        # named and set, but empty (`$(cat a-missing-file)`): admin calls would silently need no token
        raise ServeError(
            f"server.auth_token_env names ${env}, which is set but empty: put the bearer token in it, or "
            "unset it to run without one (on loopback only)"
        )
    if token and token != token.strip(" "):
        # HTTP/2 forbids a header value that ends in a space (RFC 9113 8.2.1): grpcurl and proxies
        # strip it, so no such client could ever match the token
        raise ServeError(
            f"the bearer token in ${env} starts or ends with a space (from the file it was read from?): "
            "remove it, from that variable and from the clients' token"
        )
    if token and not all(" " <= c <= "~" for c in token):
        # gRPC carries metadata values as printable ASCII only: no client could send this token
        raise ServeError(
            f"the bearer token in ${env} has a character a gRPC header cannot carry (a newline, a tab, "
            "another control character or a non-ASCII one): use printable ASCII only"
        )
    if not token and not is_loopback(config.server.listen):
        raise ServeError(
            f"server.listen {config.server.listen!r} is beyond loopback: {_token_fix(env)} (admin calls "
            "must be authenticated there)"
        )
    metrics = config.server.metrics_listen
    if not token and metrics and not is_loopback(metrics):
        raise ServeError(
            f"server.metrics_listen {metrics!r} is beyond loopback: {_token_fix(env)} (scrapers send it: "
            "the metrics show which models the home uses, and when), or listen on loopback"
        )
    return token or None


def plaintext_warnings(config: Config) -> list[str]:
    """What `serve` warns of at its start: listening beyond loopback without TLS, where the admin
    bearer token (and every request and answer) would cross the home's network in plain text, for
    any device on it to read (and replay: the token is all an admin call needs). Allowed (a home
    network may be trusted, a proxy may terminate TLS in front), said."""
    if config.server.tls_cert:
        return []
    out = []
    server = config.server
    for field, where in (("server.listen", server.listen), ("server.metrics_listen", server.metrics_listen)):
        if where and not is_loopback(where):
            out.append(
                f"{field} {where!r} is beyond loopback without TLS: the admin bearer token, which "
                "clients (and scrapers) send with each call, and the requests cross the network in plain "
                "text, readable by any device on it; set server.tls_cert and server.tls_key"
            )
    return out


def _warn_plaintext(config: Config) -> None:
    for warning in plaintext_warnings(config):
        logger.warning("%s", warning)


def _token_fix(env: str | None) -> str:
    """What to do when no bearer token is there: name a variable, or set the one named (which is
    unset: as `residency config check` says it)."""
    if not env:
        return "set server.auth_token_env and put a bearer token in that environment variable"
    return f"server.auth_token_env names ${env}, which is not set: put the bearer token in ${env}"


DESCRIBE_TIMEOUT_S = 60.0
"""How long ModelMetadata (and a request's check against the model's inputs) waits for the module to
be built on the meta device to read what it declares (its factory runs: one that hangs held the
event loop, and so every call of the service, for good)."""


def describer(
    manager: LiveManager, timeout_s: float = DESCRIBE_TIMEOUT_S
) -> Callable[[str], Awaitable[tuple[Any, Any]]]:
    """Model name -> its (inputs, outputs) TensorSpecs, read once per spec off the event loop: one
    build a model at a time, waited for at most `timeout_s`; once a build is past it, later calls are
    refused at once (the hung build is not started again) until it ends."""
    from workers.adapters import AdapterError, make_adapter

    flights: SingleFlight[tuple[Any, Any]] = SingleFlight(timeout_s, what="describe", where="in the manager")

    def build(spec: Any) -> tuple[Any, Any]:
        import torch

        a = make_adapter(spec, torch.device("cpu"))
        return a.inputs(), a.outputs()

    async def describe(name: str) -> tuple[Any, Any]:
        from manager.errors import WorkerUnavailable

        spec = manager.specs[name]
        run = flights.begin(name, spec, lambda: build(spec), f"residency-describe-{name}")
        try:
            await run.wait_async()
        except TimedOut:
            raise WorkerUnavailable(
                f"model {name!r}: reading its inputs and outputs (its module built on the meta device) "
                f"took more than {timeout_s:g} s; its factory may hang"
            ) from None
        if isinstance(run.error, AdapterError):
            raise WorkerUnavailable(run.error.message) from None
        if run.error is not None:
            raise run.error
        assert run.answer is not None
        return run.answer

    return describe


async def build_server(
    config: Config, manager: LiveManager, config_path: str | None = None, *, listen: str | None = None
) -> tuple[grpc.aio.Server, int, Any]:
    """The gRPC server on `listen` (default `server.listen`; with front ends, a private Unix socket
    that they relay to: no TLS there)."""
    token = auth_token(config)
    private = listen is not None
    limit = config.server.max_request_bytes
    server = grpc.aio.server(
        # the token first: a call it refuses is refused whatever its size
        interceptors=[
            *([AuthInterceptor(token)] if token else []),
            RequestLimit(
                limit, max_calls=MAX_CONCURRENT_RPCS, per_peer=None if private else MAX_CALLS_PER_CLIENT
            ),
        ],
        options=[
            *receive_options(limit),
            *keepalive_options(config.server.keepalive),
            *limit_options(public=not private),
            # never share the public port (grpc turns SO_REUSEPORT on by default on Linux): a second
            # `serve` on it would start and split the connections with the first, each manager
            # believing it has the whole GPU
            *([] if private else [("grpc.so_reuseport", 0)]),
        ],
    )
    oip_service = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    admin_service = residency_pb2.DESCRIPTOR.services_by_name["Residency"]
    world_service = residency_pb2.DESCRIPTOR.services_by_name["WorldSession"]
    world = WorldSessionServicer(manager)
    server.world_stopping = world.stopping  # set by `serve` at its stop
    # open ModelStreamInfer streams end at the same moment, once the requests they took are answered
    oip_servicer = InferenceServicer(
        manager, describer(manager), config.server.max_request_bytes, stopping=world.stopping
    )
    # a class above a model's own is the admin token's to ask, when the service has one
    oip_servicer.admin = world.admin = AuthInterceptor(token).allows if token else None
    add_servicer(server, oip_service, oip_servicer)
    # open Events streams end at the same moment (they never end by themselves: each held the stop
    # for its whole grace)
    add_servicer(server, admin_service, AdminServicer(manager, config_path, stopping=world.stopping))
    add_servicer(server, world_service, world)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        oip_service.full_name,
        admin_service.full_name,
        world_service.full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    listen = listen or config.server.listen
    srv = config.server
    port = add_port(
        server, listen, (srv.tls_cert, srv.tls_key) if srv.tls_cert and srv.tls_key and not private else None
    )
    if port == 0:
        raise ServeError(f"cannot listen on {listen!r} (address in use or not available)")
    return server, port, health_servicer


def _cannot_listen(listen: str, e: OSError) -> ServeError:
    return ServeError(
        f"cannot listen on {listen!r}: {e.strerror or e}"
        + (" (another server holds it?)" if e.errno == errno.EADDRINUSE else "")
    )


class StoppedAtStartUp(Exception):
    """A stop signal came before the server was ready: what had started is undone (Ray's start
    included), and nothing was served."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped during start-up ({signal.Signals(signum).name})")


class _StepsInterrupted(StopSignal):
    """A stop signal within `_stop_signals_end_start_up`; StoppedAtStartUp once out of it."""


@contextlib.contextmanager
def _stop_signals_end_start_up() -> Iterator[None]:
    """Within it (start-up's blocking steps: the listen check, the token and TLS pair, the journal and
    the store's opening, then the device hosts' pool: their modules' imports (torch, Ray), Ray's start
    and the hosts' creation), a stop signal (`honoured_stop_signals()`) ends
    start-up at once: StoppedAtStartUp. `serve`'s own handlers run on its event loop, which these
    blocking steps keep from running: the signal was acted on only once they had ended
    (`workers.signals.stop_signals_raise`)."""
    try:
        with stop_signals_raise(_StepsInterrupted):
            yield
    except _StepsInterrupted as e:
        raise StoppedAtStartUp(e.signum) from None


def _not_stopped(signals: list[int]) -> None:
    """StoppedAtStartUp when a stop signal came (`signals`: those that came, in order)."""
    if signals:
        raise StoppedAtStartUp(signals[0])


def _pool_or_stop(
    create: Callable[[], Any], store: Any, journal: RequestJournal | None = None, *, ray_here: bool = False
) -> Any:
    """`create()`, the device hosts' pool (Ray's start); when it raises, the local Ray it started
    (`ray_here`: none ran before) is shut down, `store` and `journal` are closed, and a signal that
    stopped it (ray_pool.StartInterrupted, a KeyboardInterrupt) is StoppedAtStartUp."""
    try:
        with _stop_signals_end_start_up():
            return create()
    except BaseException as e:
        if ray_here and _ray_connected():  # a signal once Ray had started (the hosts being made)
            _shutdown_ray()
        store.close()
        if journal is not None:
            journal.close()
        if isinstance(e, StoppedAtStartUp):
            raise
        if isinstance(e, KeyboardInterrupt):
            raise StoppedAtStartUp(getattr(e, "signum", signal.SIGINT)) from None
        raise


def _journal_and_store(config: Config) -> tuple[RequestJournal | None, Any]:
    """The request journal, then the store. The journal first: a second service on the same file is
    refused (`JournalInUse`) before it starts anything."""
    from manager.store import StoreError, open_store

    journal = RequestJournal(Path(config.store.journal)) if config.store.journal is not None else None
    store = None
    try:
        store = open_store(config.store.url, hold=True)
        why = store.refused()  # a wrong password is said now: waiting for the store would not mend it
        if why is not None:
            raise StoreError(store.url, why)
        return journal, store
    except BaseException:  # (a stop signal too, `_stop_signals_end_start_up`)
        if store is not None:
            store.close()
        if journal is not None:
            journal.close()
        raise


def _ray_connected() -> bool:
    """Whether this process is connected to Ray (not imported here when it is not used)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


_descendants = procs.descendants
"""This process's descendants (listed before the Ray pool, and Ray, are imported)."""


def _shutdown_ray() -> None:
    """Shut down the local Ray `serve` started (its processes stopped), as the stop's last step. Ray's
    own atexit hook did it, seconds after the stop had ended and put its handlers back: a second
    stop signal then was lost (uvloop's handler, its loop closed, only noted it) or raised in that
    hook (asyncio's, removed at the loop's close). It runs on the event loop's thread, where the
    stop's own handlers (`_StopSignals._next_exits`) still end the process at a second signal."""
    import ray

    try:
        ray.shutdown()
    except Exception:  # the service has stopped: what Ray could not end is said, not raised
        logger.warning("stopping: the local Ray did not shut down cleanly", exc_info=True)


def _remove_host_sockets(pids: list[int]) -> None:
    """The data-channel sockets of the device hosts among `pids` (the local Ray's processes, shut
    down: a host ends without a word, its socket left behind), removed (`workers.channel`)."""
    if not pids:
        return
    from workers.channel import remove_host_sockets

    try:
        remove_host_sockets(pids)
    except Exception:  # the service has stopped: a socket left is removed by the next start
        logger.warning("stopping: the device hosts' sockets were not removed", exc_info=True)


async def _stop_manager(manager: LiveManager) -> None:
    """Stop `manager` if it started; after a start that failed, its journal (and the journal's lock)
    is let go all the same."""
    if manager.started:
        await manager.stop()
    elif manager.journal is not None:
        manager.journal.close()


async def _stop_manager_bounded(manager: LiveManager, executor: StopBoundedExecutor, bound_s: float) -> bool:
    """`_stop_manager`, STOP_MANAGER_S (`bound_s`) at most: past it, the calls still running on
    `executor` (a store write that hangs) are abandoned, logged naming each, and their callers told
    so (the manager's stop ends there, failed); its journal is closed all the same (what the store did
    not take stays in it, for the next start). A stop that fails is logged, not raised: the service's
    stop goes on. Whether the manager's stop ended without any call abandoned."""
    stopping = asyncio.ensure_future(_stop_manager(manager))
    done, _ = await asyncio.wait({stopping}, timeout=bound_s)
    cut = not done
    if cut:
        executor.abandon_rest(f"{bound_s:g} s into the manager's stop")
        # (their callers have an answer now: the stop ends at once; a step that waits on something
        # else is cancelled after a moment)
        done, _ = await asyncio.wait({stopping}, timeout=STOP_ANSWER_S)
        if not done:
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=STOP_ANSWER_S)
    if stopping.done() and not stopping.cancelled() and stopping.exception() is not None:
        e = stopping.exception()
        logger.warning("stopping: the manager's stop did not finish: %s", e, exc_info=None if cut else e)
    if manager.journal is not None:
        # (a stop cut short, or failed, never came to its own catch-up: records a full disk kept out)
        manager._journal_catch_up(force=True)
        manager.journal.close()  # (idempotent)
    return not cut


async def _close_store(store: Any, bounded: bool) -> None:
    """`store.close()`; `bounded` (a store call was abandoned, which may hold the store's lock for
    good), on a thread, waited for STOP_ANSWER_S at most: past it, left to the executor's shutdown
    (which abandons it, logged)."""
    if not bounded:
        store.close()
        return
    closing = asyncio.ensure_future(asyncio.to_thread(store.close))
    closing.add_done_callback(read_outcome)  # (left running past the wait: abandoned later)
    done, _ = await asyncio.wait({closing}, timeout=STOP_ANSWER_S)
    if not done:
        logger.warning(
            "stopping: the store %s did not close in %g s; left to the process's end", store, STOP_ANSWER_S
        )
    elif closing.exception() is not None:
        logger.warning("stopping: the store did not close cleanly: %s", closing.exception())


def probe_listen(listen: str) -> tuple[Any, Any, Any, Any]:
    """Check that this process could listen on `listen` (host:port) now: a plain bind, which fails if
    anything else holds the port (another `serve`, its front ends; SO_REUSEPORT alone would share it
    with them), released at once. Port 0 (any free port) is not probed. Returns the address to bind
    (family, type, proto, sockaddr); ServeError naming `listen` when it cannot be had."""
    import socket

    host, _, port_s = listen.rpartition(":")
    port = int(port_s)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        if port:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT only
                probe.bind(addr)
    except OSError as e:
        raise _cannot_listen(listen, e) from None
    return family, kind, proto, addr


MAX_UNIX_PATH = 107
"""The longest path a Unix socket can be bound at on Linux (sun_path holds 108 bytes with its NUL)."""


FRONT_DIR_PREFIX = "residency-front-"
"""The front ends' private directory under TMPDIR: `residency-front-<manager's pid>-<random>`."""


def sweep_front_dirs(tmp: str) -> list[str]:
    """Remove the private directories (and their stale sockets) that managers killed before they
    could clean up left under `tmp`: this user's own, of a process that no longer runs. Returns the
    paths removed."""
    import shutil
    import stat

    removed: list[str] = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        pid_s = name[len(FRONT_DIR_PREFIX) :].partition("-")[0]
        if not name.startswith(FRONT_DIR_PREFIX) or not pid_s.isdigit() or int(pid_s) == os.getpid():
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # no link, nobody else's
                continue
            os.kill(int(pid_s), 0)
            continue  # its manager still runs
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):  # gone meanwhile, or a pid of another user's: leave it
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class Frontends:
    """`server.frontends` > 0: the manager's gRPC server listens on a private Unix socket, a fast
    path for ModelInfer on another, and N front-end processes (`manager.api.front`) on the public
    address. A port 0 in `server.listen` is chosen here first and held (SO_REUSEPORT, not listening)
    so that every front end, and any restarted one, binds the same port."""

    def __init__(self, config: Config, manager: LiveManager) -> None:
        import tempfile

        self.config = config
        self.manager = manager
        longest = os.path.join(
            tempfile.gettempdir(), f"{FRONT_DIR_PREFIX}{os.getpid()}-xxxxxxxx", "grpc.sock"
        )
        if len(os.fsencode(longest)) > MAX_UNIX_PATH:
            raise ServeError(
                f"server.frontends: the front ends' private sockets would be at {longest!r}, "
                f"{len(os.fsencode(longest))} bytes, too long for a Unix socket (at most {MAX_UNIX_PATH}): "
                "set TMPDIR to a shorter directory"
            )
        sweep_front_dirs(tempfile.gettempdir())
        # 0700: only this user reaches it; named by this pid, so a later start can tell it is stale
        self.dir = tempfile.mkdtemp(prefix=f"{FRONT_DIR_PREFIX}{os.getpid()}-")
        self.grpc_sock = f"{self.dir}/grpc.sock"
        self.fast_path = f"{self.dir}/fast.sock"
        self.hold: Any = None
        self.procs: Any = None
        self.fast: Any = None

    @property
    def backend(self) -> str:
        """Where the manager's own gRPC server listens (the front ends relay there)."""
        return f"unix:{self.grpc_sock}"

    def _reserve(self) -> tuple[str, int]:
        import socket

        listen = self.config.server.listen
        family, kind, proto, addr = probe_listen(listen)
        try:
            s = socket.socket(family, kind, proto)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
        except OSError as e:
            raise _cannot_listen(listen, e) from None
        self.hold = s
        return listen.rpartition(":")[0], int(s.getsockname()[1])

    async def start(self) -> int:
        from manager.api.fastpath import FastPathServer
        from manager.api.front import FrontEndProcesses
        from manager.api.oip import InferenceServicer

        host, port = self._reserve()
        servicer = InferenceServicer(
            self.manager, describer(self.manager), self.config.server.max_request_bytes
        )
        token = auth_token(self.config)  # (a front end's call carries its header here: the fast path)
        servicer.admin = AuthInterceptor(token).allows if token else None
        self.fast = FastPathServer(servicer.infer_raw)
        await self.fast.start(self.fast_path)
        srv = self.config.server
        tls = (srv.tls_cert, srv.tls_key) if srv.tls_cert and srv.tls_key else None
        self.procs = FrontEndProcesses(
            srv.frontends, f"{host}:{port}", self.grpc_sock, self.fast_path,
            tls=tls, max_message_bytes=srv.max_request_bytes, keepalive_s=srv.keepalive,
        )  # fmt: skip
        try:
            await self.procs.start()
        except RuntimeError as e:
            await self.stop()
            raise ServeError(str(e)) from None
        logger.info("%d gRPC front ends on %s:%d (pids %s)", srv.frontends, host, port, self.procs.pids())
        return port

    async def stop(self) -> None:
        import shutil

        if self.procs is not None:
            await self.procs.stop()
        if self.fast is not None:
            await self.fast.stop()
        if self.hold is not None:
            self.hold.close()
        shutil.rmtree(self.dir, ignore_errors=True)


SETTLE_S = 0.25
"""A changed config file is reloaded once it has not changed again for this long: an editor that
writes it in place (truncate, then write) was caught half-way, its part applied or rejected."""


async def watch_config(
    manager: LiveManager, path: str, every_s: float = 2.0, seen: tuple[int, int, int, int] | None = None
) -> None:
    """Hot reload when the config file changes (a bad or structural change is logged, not applied).
    `seen`: the file's identity (`file_identity`) when the service read it, so that an edit saved
    during the start-up (Ray's start, the pinned models' loads) is reloaded too; default: as it is now."""
    from manager.api.admin import reload_from_file_on_loop
    from manager.errors import ResidencyError

    # each look at the file on a thread: a config on a mount that hangs (NFS, a sleeping USB disk)
    # would hold the event loop, and every request, for as long as its stat does
    seen = await asyncio.to_thread(file_identity, path) if seen is None else seen
    while True:
        await asyncio.sleep(every_s)
        now = await asyncio.to_thread(file_identity, path)
        if now == seen:
            continue
        await asyncio.sleep(SETTLE_S)
        if await asyncio.to_thread(file_identity, path) != now:
            continue  # still being written (in place): looked at again next time
        seen = now
        try:
            changes = await reload_from_file_on_loop(manager, path)
            logger.info("config %s reloaded: %s", path, ", ".join(changes) or "no changes")
        except ResidencyError as e:
            logger.warning("%s", e)
            manager._publish("config_rejected", "", str(e), "", manager.clock())
        except Exception:  # the watcher outlives whatever a reload raises (it would end silently)
            logger.exception("config %s: the reload failed; the running config is kept", path)
            manager._publish(
                "config_rejected", "", f"{path}: the reload failed (see the log)", "", manager.clock()
            )


STOP_TUNING_S = 30.0
"""How long a stop waits for a tuning run under way to end (it ends at its next replay, well within)."""
STOP_GRACE_S = 5.0
"""How long a stop lets the requests in flight end by themselves (a load they wait for may finish);
past it, those still waiting for a load are answered UNAVAILABLE (the service is stopping), and the
load is abandoned to its device host (a Ray actor finishes it, or not, on its own; device hosts in
this process abandon it at the pool's close, logged naming the model and device: the process's exit
does not wait for it; `residency serve` then ends the process itself when a load it abandoned still
runs: `manager.cli._exit_past_abandoned`). Those whose model's forward still runs are answered
INTERNAL "the server is stopping" (it may still run to its end: not UNAVAILABLE, which clients
retry): in this process (a forward that may never return) its thread is left to the process's end
(`StopBoundedExecutor.abandon_running`); on a device host of its own (Ray) the host runs it on
(`LiveManager.abandon_waits`)."""
STOP_ANSWER_S = 1.0
"""After the grace, how long the gRPC server gives the requests answered so to be sent, before it
cancels what is still running."""


STOP_MANAGER_S = 30.0
"""How long the manager's stop (the admin pins written, the request log flushed, the statistics
saved: store calls on `serve`'s threads, which the stop waits for) may take; past it, the calls still
running on those threads are abandoned (`StopBoundedExecutor.abandon_rest`), named in the log, and the
stop goes on (`_stop_manager_bounded`): a store write that never returns held the process for good."""

STOP_EXECUTOR_GRACE_S = STOP_GRACE_S
"""How long the end of a stop (the event loop's close: its default executor's shutdown) waits for
the calls on `serve`'s threads that still run and were not abandoned at the grace (a store's write,
a file read), before it abandons them too."""


def _to_thread_target(
    fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function and arguments `asyncio.to_thread` was given (it hands the executor a
    `functools.partial(context.run, func, *args)`); others as they are."""
    if isinstance(fn, functools.partial) and isinstance(
        getattr(fn.func, "__self__", None), contextvars.Context
    ):
        return fn.args[0], fn.args[1:]
    return fn, args


def _call_named(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """A call on `serve`'s threads, for the log: "the inference of 'x' on cpu0", "the world step of
    session 's1' on cpu0", else "a call of Class.method"."""
    fn, args = _to_thread_target(fn, args)
    got = _model_call(fn, args, 0.0)
    if got is not None:
        return got[0]
    return f"a call of {getattr(fn, '__qualname__', None) or type(fn).__name__}"


def _model_call(fn: Callable[..., Any], args: tuple[Any, ...], grace_s: float) -> tuple[str, Any] | None:
    """When `fn(*args)` (as `asyncio.to_thread` was given it) runs a model's code on this process's
    device hosts, an inference (the in-process pool's `infer` or `infer_many`, a dynamic batch:
    `LocalBatcher._call`) or a world session's step: what it is ("the inference of 'x' on cpu0") and
    the answer its caller gets when the stop abandons it `grace_s` into the stop, a failed one of
    the kind it returns, saying that the server is stopping (the manager answers its request
    INTERNAL, and logs it). None for any other call (a store's write, a status read: waited for)."""
    from manager.live_batch import LocalBatcher

    fn, args = _to_thread_target(fn, args)
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    pools = sys.modules.get("workers.pool")  # (not imported: no device host in this process)
    items: list[Any]
    if isinstance(owner, LocalBatcher) and name == "_call":
        device, items = owner.device, list(args[0])
    elif pools is not None and isinstance(owner, pools.InProcessWorkerPool) and args:
        device = args[0]
        if name == "infer" and len(args) >= 2:
            items = [(args[1], None)]
        elif name == "infer_many" and len(args) >= 2:
            items = list(args[1])
        elif name == "session" and len(args) >= 3 and args[1] == "step":
            return f"the world step of session {args[2]!r} on {device}", P.SessionReply(
                False,
                error_code=P.INTERNAL,  # (it may still finish: not UNAVAILABLE, which clients retry)
                error=f"the server is stopping, and this step on {device} had not ended {grace_s:g} s into "
                "the stop; it was abandoned (its thread left running to the process's end)",
            )
        else:
            return None
    else:
        return None
    models = sorted({str(m) for m, _ in items})
    what = f"the inference of {', '.join(repr(m) for m in models)} on {device}"
    why = (
        f"the server is stopping, and its inference on {device} had not ended {grace_s:g} s into the "
        "stop; it was abandoned, its thread left running to the process's end, so it may still have "
        "run to its end"
    )
    # INTERNAL (the model may have run, its answer lost), not UNAVAILABLE: retry policies retry that,
    # and a stateful model (a voice detector) would run it twice
    names = [str(m) for m, _ in items]
    answers = [P.InferResult(n, False, error_code=P.INTERNAL, error=f"model {n!r}: {why}") for n in names]
    return what, (answers[0] if name == "infer" else answers)


@dataclasses.dataclass(eq=False)
class _Call:
    """One call on `StopBoundedExecutor`'s threads."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: concurrent.futures.Future[Any]
    since: float = 0.0
    abandoned: bool = False


_stop_executors: weakref.WeakSet[StopBoundedExecutor] = weakref.WeakSet()
"""The executors `serve` made in this process (`abandoned_calls`)."""


class StopBoundedExecutor(concurrent.futures.ThreadPoolExecutor):
    """`serve`'s event loop's default executor (what `asyncio.to_thread` runs on: in-process
    inferences and world steps, the store's writes). A ThreadPoolExecutor whose stop is bounded: its
    threads are daemon threads, which the interpreter's exit does not join; `abandon_running` answers
    the calls of a model's code running now for their callers (`_model_call`) and leaves their
    threads to the process's end; `shutdown` (the event loop's close) waits for the others at most
    `shutdown_grace_s`, then abandons them too, logged. A ThreadPoolExecutor's shutdown waits for a
    model's forward that never returns for good (Python 3.11's `shutdown_default_executor` has no
    timeout), and so did the process's exit. What an abandoned call still runs is said by
    `abandoned_calls` (`residency serve`'s exit: `manager.cli._exit_past_abandoned`)."""

    def __init__(
        self, max_workers: int | None = None, *, shutdown_grace_s: float = STOP_EXECUTOR_GRACE_S
    ) -> None:
        super().__init__(max_workers, thread_name_prefix="residency-serve")  # (its own threads unused)
        self.shutdown_grace_s = shutdown_grace_s
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._mu = threading.Lock()
        self._workers: set[threading.Thread] = set()  # the threads that take calls (not abandoned)
        self._waiting = 0  # of them, blocked waiting for a call
        self._queued = 0  # calls queued, not taken by a worker yet
        self._running: dict[threading.Thread, _Call] = {}
        self._abandoned: list[_Call] = []  # abandoned, still running
        self._closed = False
        self._names = itertools.count()
        _stop_executors.add(self)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        call = _Call(fn, args, kwargs, concurrent.futures.Future())
        with self._mu:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put(call)
            self._queued += 1
            self._staff()
        return call.future

    def _staff(self) -> None:
        """(Under self._mu.) A worker more while queued calls outnumber the workers waiting for one,
        within `max_workers`: a call never waits for a worker that is busy (or abandoned: its thread
        no longer counts) while the executor may start another."""
        if self._queued > self._waiting and len(self._workers) < self._max_workers:
            name = f"residency-serve_{next(self._names)}"
            t = threading.Thread(target=self._work, name=name, daemon=True)
            self._workers.add(t)
            self._waiting += 1  # (it is about to wait for the call it was started for)
            t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            call = self._queue.get()  # (counted in `_waiting` meanwhile)
            with self._mu:
                self._waiting -= 1
                if call is None:  # the shutdown's
                    self._workers.discard(me)
                    return
                self._queued -= 1
            if call.future.set_running_or_notify_cancel():
                call.since = time.monotonic()
                with self._mu:
                    self._running[me] = call
                try:
                    self._settle(call, call.fn(*call.args, **call.kwargs))
                except BaseException as e:
                    self._settle(call, error=e)
            with self._mu:
                self._running.pop(me, None)
                if call.abandoned:  # this thread was given up: the executor has others by now
                    self._abandoned.remove(call)
                    return
                self._waiting += 1
            del call

    def _settle(self, call: _Call, result: Any = None, *, error: BaseException | None = None) -> None:
        """Its future's answer, unless it has one (the stop's, when it was abandoned)."""
        try:
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)
        except concurrent.futures.InvalidStateError:  # (checked and set under the future's own lock)
            pass

    def _abandon(self, thread: threading.Thread, call: _Call) -> None:
        call.abandoned = True  # (under self._mu)
        self._abandoned.append(call)
        self._workers.discard(thread)
        if not self._closed:
            self._staff()  # the calls queued behind it get a thread of their own

    def abandon_running(self, grace_s: float) -> list[str]:
        """The calls of a model's code running now (`_model_call`: inferences and world steps on this
        process's device hosts, `grace_s` into the stop) are answered now, saying that the server is
        stopping, and their threads are left to the process's end, logged; the other calls run on.
        What it abandoned, one phrase each."""
        picked: list[tuple[_Call, str, Any]] = []
        with self._mu:
            for thread, call in list(self._running.items()):
                # (a call whose answer is set is ending: its worker is about to let it go)
                if call.abandoned or call.future.done():
                    continue
                if (got := _model_call(call.fn, call.args, grace_s)) is None:
                    continue
                self._abandon(thread, call)
                picked.append((call, *got))
        now = time.monotonic()
        for call, what, answer in picked:
            logger.warning(
                "stopping: %s (running %.1f s) had not ended %g s into the stop; its caller is answered "
                "that the server is stopping, and its thread is left to the process's end", what,
                now - call.since, grace_s,
            )  # fmt: skip
            self._settle(call, answer)
        return [what for _, what, _ in picked]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No call after it; with `wait`, the calls running (or queued) are waited for, at most
        `shutdown_grace_s`; those still running then are abandoned, logged, their threads left to the
        process's end (those queued are cancelled)."""
        with self._mu:
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            self._cancel_queued()
        for _ in workers:
            self._queue.put(None)
        if not wait:
            return
        deadline = time.monotonic() + self.shutdown_grace_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        self.abandon_rest(f"{self.shutdown_grace_s:g} s after the service stopped")
        self._cancel_queued()

    def abandon_rest(self, when: str) -> list[str]:
        """Every call still running (a store's write that hangs, as well as a model's code), `when`
        into the stop ("5 s after the service stopped"), abandoned now: its caller is answered with a
        RuntimeError naming it, its thread is left to the process's end (`abandoned_calls`), each
        logged. What it abandoned, one phrase each."""
        with self._mu:
            # (a call whose answer is set is ending: its worker is about to let it go)
            left = [(t, c) for t, c in self._running.items() if not c.abandoned and not c.future.done()]
            for t, c in left:
                self._abandon(t, c)
        now = time.monotonic()
        named = []
        for _, call in left:
            what = _call_named(call.fn, call.args)
            logger.warning(
                "stopping: %s (running %.1f s) had not ended %s; abandoned, its thread is left to the "
                "process's end", what, now - call.since, when,
            )  # fmt: skip
            self._settle(call, error=RuntimeError(f"abandoned at the service's stop: {what}"))
            named.append(what)
        return named

    def _cancel_queued(self) -> None:
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                return
            if call is not None:
                with self._mu:
                    self._queued -= 1
                call.future.cancel()

    def still_running(self) -> list[str]:
        """The calls it abandoned that still run, one phrase each ("the inference of 'x' on cpu0
        (running 12 s)")."""
        now = time.monotonic()
        with self._mu:
            calls = list(self._abandoned)
        return [f"{_call_named(c.fn, c.args)} (running {now - c.since:.0f} s)" for c in calls]


def abandoned_calls() -> list[str]:
    """What the stops of `serve` in this process abandoned on their threads (a model's forward that
    never returns) and still runs, one phrase each; empty when none."""
    return sorted(x for ex in list(_stop_executors) for x in ex.still_running())


def _exit_now(signum: int) -> None:
    """A second stop signal while the stop is under way: the process ends at once, 128 + `signum`,
    one line on stderr. Nothing else is done (it may run in a signal handler, between any two steps
    of the code it interrupted, whose locks it may hold): each served request is in the request
    journal already (appended in one write(2): in the OS), which the next start sends to the store;
    without a journal (`store.journal: null`) the last second's request log, not yet in the store, is
    lost, and so are the statistics the stop would have saved."""
    name = signal.Signals(signum).name
    line = f"residency: second {name}: exiting now, without waiting for the stop to finish\n"
    with contextlib.suppress(OSError):
        os.write(2, line.encode())
    os._exit(128 + signum)


def _say(line: str) -> None:
    """One line of `serve`'s own on stderr (its stop's), as `residency serve` says it serves."""
    print(line, file=sys.stderr, flush=True)


SAME_STOP_S = 0.2
"""A stop signal within this long of the first is taken for the same stop, not a second one: a
supervisor that signals the whole process group while the `make` above the service forwards its own
signal delivers two at once (a person's second Ctrl-C comes later than this)."""


class _StopSignals:
    """`serve`'s stop signals (`stops`), on its event loop: the first stops the service (`stop` set,
    and each one's number in `came`), said on stderr; before it serves (`starting`: start-up's task),
    it abandons the start instead (that task cancelled: start-up's next step is not taken), said by
    the one line of StoppedAtStartUp. A second, while the stop is under way, ends the process at once
    (`_exit_now`), and the processes of the local Ray `serve` started with it (`started`: the stop's
    last step shuts that Ray down, which the signal cuts short); one within SAME_STOP_S of the first
    is the same stop (said on stderr). Once `closed` (`serve` has returned), one is not acted on."""

    def __init__(
        self,
        stop: asyncio.Event,
        came: list[int],
        clock: Callable[[], float] = time.monotonic,
        *,
        stops: tuple[int, ...] = STOP_SIGNALS,
    ) -> None:
        self.stop = stop
        self.came = came
        self.clock = clock
        self.stops = stops
        self.starting: asyncio.Task[Any] | None = None
        self._cancelled = False  # the first signal cancelled `starting`
        self.closed = False
        self.first_at: float | None = None
        self.held: dict[int, Any] = {}  # the handlers the first signal replaced
        self.started: Callable[[], list[int]] | None = None
        """The pids of the processes `serve` started that a second signal ends with it (the local
        Ray's: its shutdown, the stop's last step, is what that signal cuts short), read at the
        first signal; None: none."""
        self.ends_too: list[tuple[int, bool]] = []  # (a pidfd, True) each, or (its pid, False)

    def on_signal(self, sig: int) -> None:
        if self.closed:
            return
        if self.came:  # another one while the stop is under way
            self._again(sig)
            return
        self.first_at = self.clock()
        self.came.append(sig)
        if self.starting is not None:  # not serving yet: the rest of the start is abandoned
            self._cancelled = True
            self.starting.cancel()
        else:
            name = signal.Signals(sig).name
            _say(f"residency: stopping ({name}); a second {name} exits at once")
        self.stop.set()
        self._hold_started()
        self._next_exits()

    def serving(self) -> None:
        """The service serves: a stop signal from now on stops it (said), no longer the start."""
        self.starting = None

    def abandoned_start(self) -> bool:
        """Whether a stop signal cancelled the start (`on_signal`); the cancel is taken back, so that
        the stop's own steps then run as usual."""
        if not self._cancelled or self.starting is None:
            return False
        self._cancelled = False
        self.starting.uncancel()
        return True

    def _hold_started(self) -> None:
        """The processes `started` names, held for a second signal to end: a pidfd each, so that a
        pid the OS gives to another process meanwhile is not hit (the pid itself where the OS has
        no pidfds)."""
        if self.started is None:
            return
        try:
            pids = self.started()
        except Exception:  # (the process table changed under psutil) nothing is held then
            logger.debug("the processes serve started could not be listed", exc_info=True)
            return
        for pid in pids:
            try:
                self.ends_too.append((os.pidfd_open(pid), True))
            except ProcessLookupError:
                continue
            except (OSError, AttributeError):
                self.ends_too.append((pid, False))

    def _end_started(self) -> None:
        """SIGKILL to the processes held (`_hold_started`). It may run in a signal handler: system
        calls alone."""
        for held, is_fd in self.ends_too:
            with contextlib.suppress(OSError):
                if is_fd:
                    signal.pidfd_send_signal(held, signal.SIGKILL)
                else:
                    os.kill(held, signal.SIGKILL)

    def release(self) -> None:
        """The pidfds held, closed (the stop is done)."""
        for held, is_fd in self.ends_too:
            if is_fd:
                with contextlib.suppress(OSError):
                    os.close(held)
        self.ends_too.clear()

    def _again(self, sig: int) -> None:
        """A signal after the first: the same stop when it came with it, else the process ends now.
        It may run in a signal handler: it writes with os.write alone (no lock it could hold)."""
        if self.first_at is not None and self.clock() - self.first_at < SAME_STOP_S:
            name = signal.Signals(sig).name
            line = f"residency: {name} came with the first stop signal: the same stop\n"
            with contextlib.suppress(OSError):
                os.write(2, line.encode())
            return
        self._end_started()
        _exit_now(sig)

    def _next_exits(self) -> None:
        """After the first stop signal, the next one ends the process from Python's own handler,
        which runs even while the event loop is held (a blocking step of the stop): the loop's own
        handler (`on_signal`) would run only once the loop is free again."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.stops:
            self.held[s] = signal.signal(s, lambda signum, frame: self._again(signum))

    def put_back(self) -> None:
        """The handlers from before the first signal (the event loop's: `on_signal` says a second
        one, until the loop closes)."""
        for s, h in self.held.items():
            signal.signal(s, h)
        self.held.clear()


class _ReloadOnLoop:
    """The manager as the tuning thread sees it: its config, and a reload and a reload's check that
    run on the event loop's thread (the manager is not thread-safe), waiting for their result."""

    CHECK_S = 60.0
    """How long `check_reload` waits for the event loop: as long as a reload does."""

    def __init__(self, manager: LiveManager, loop: asyncio.AbstractEventLoop) -> None:
        self.manager = manager
        self.loop = loop

    def check_reload(self, new: Config) -> list[str]:
        """`LiveManager.check_reload(new)` on the event loop: what a reload would apply, or the error
        it would raise, changing nothing. CheckNotAnswered: no answer in CHECK_S (the check given up
        on is not made late)."""
        from manager.reload import CheckNotAnswered

        given_up = threading.Event()

        async def on_loop() -> list[str]:
            return [] if given_up.is_set() else self.manager.check_reload(new)

        answer = asyncio.run_coroutine_threadsafe(on_loop(), self.loop)
        try:
            return answer.result(timeout=self.CHECK_S)
        except TimeoutError:
            given_up.set()
            answer.cancel()
            raise CheckNotAnswered(
                f"the service did not answer the check of the tuned config in {self.CHECK_S:g} s"
            ) from None

    def live_sizes(self) -> dict[str, tuple[int, bool]]:
        """`LiveManager.live_sizes()` read on the event loop: each model's measured weights and
        whether it is pinned (admin pins included). CheckNotAnswered: no answer in CHECK_S."""
        return self._read(self.manager.live_sizes, "its models' measured sizes and pins")

    def measured(self) -> dict[str, tuple[int, dict[str, float]]]:
        """`LiveManager.measured()` read on the event loop: each model's weights and load seconds
        as measured. CheckNotAnswered: no answer in CHECK_S."""
        return self._read(self.manager.measured, "its models' measured load times")

    def _read(self, read: Callable[[], T], what: str) -> T:
        """`read()` run on the event loop, its answer waited for CHECK_S at most (CheckNotAnswered,
        saying the service did not say `what`)."""
        from manager.reload import CheckNotAnswered

        async def on_loop() -> T:
            return read()

        answer = asyncio.run_coroutine_threadsafe(on_loop(), self.loop)
        try:
            return answer.result(timeout=self.CHECK_S)
        except TimeoutError:
            answer.cancel()
            raise CheckNotAnswered(f"the service did not say {what} in {self.CHECK_S:g} s") from None

    @property
    def config(self) -> Config:
        return self.manager.config

    @property
    def tuning_overrides(self) -> TunedHold:
        return self.manager.tuning_overrides

    RELOAD_S = 60.0
    """How long `reload` waits for the event loop (it then goes on there, and says how it ended)."""

    def reload(self, new: Config, hold: TunedHold | None = None) -> list[str]:
        async def on_loop() -> list[str]:
            return self.manager.reload(new) if hold is None else self.manager.reload(new, hold)

        answer = asyncio.run_coroutine_threadsafe(on_loop(), self.loop)
        try:
            return answer.result(timeout=self.RELOAD_S)  # never hangs
        except TimeoutError:
            answer.add_done_callback(_late_reload)
            raise


def _late_reload(answer: Any) -> None:
    """How the tuned config's reload, answered after the tuning stopped waiting, ended: logged."""
    if answer.cancelled():
        logger.warning("scheduled tuning: the late reload of the tuned config was cancelled")
    elif answer.exception() is not None:
        logger.warning(
            "scheduled tuning: the late reload of the tuned config was refused: %s; the running config "
            "stays (where the tuning wrote the tuned values into the config file, as its line before "
            "says, the file holds them still: edit them back)",
            answer.exception(),
        )
    else:
        logger.info("scheduled tuning: the late reload of the tuned config took it: %s", answer.result())


async def tuning_loop(manager: LiveManager, path: str, store: Any, check_s: float = 60.0) -> None:
    """Run the built-in tuning when its schedule says it is due (in a thread: it replays weeks). A
    failed run is logged, said in a "tuning" event and tried again later (`scheduled_tuning`).
    Cancelled (the service stopping), a run under way ends at its next replay, writing nothing, and
    the cancellation waits for that (at most STOP_TUNING_S), so the store it uses is still open."""

    from manager.tuning_job import ScheduleMemo, scheduled_tuning

    on_loop = _ReloadOnLoop(manager, asyncio.get_running_loop())
    stopping = threading.Event()
    memo = ScheduleMemo()  # (a run the store could not record is tried again an hour on, not each check)
    while True:
        now = manager.clock()
        run = asyncio.ensure_future(
            asyncio.to_thread(scheduled_tuning, on_loop, Path(path), store, now, stopping.is_set, memo)
        )
        run.add_done_callback(read_outcome)  # (a stop waits STOP_TUNING_S at most, then leaves it)
        try:
            detail = await asyncio.shield(run)
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.wait([run], timeout=STOP_TUNING_S)
            raise
        if detail is not None:  # (said when it ended: an applied run's reload comes before)
            if detail.startswith("failed"):
                logger.warning("scheduled tuning %s", detail)
            else:  # what it found, and what it applied (the reload it made says only its fields)
                logger.info("scheduled tuning: %s", detail)
            manager._publish("tuning", "", detail, "", manager.clock())
        await asyncio.sleep(check_s)


async def serve(
    config: Config,
    *,
    config_path: str | None = None,
    in_process: bool = False,
    cpu_fallback: frozenset[str] = frozenset(),
    ready: Callable[[int], None] | None = None,
    server_overrides: dict[str, Any] | None = None,
    config_seen: tuple[int, int, int, int] | None = None,
) -> None:
    """Serve `config` until a signal. `server_overrides`: the `server` fields the command line set
    (`--listen`), which a reload of the file at `config_path` keeps. `config_seen`: that file's
    identity (`file_identity`) from before `config` was read from it (default: as it is now)."""
    # the config file as the service read it: the watcher, started once the service is up, reloads
    # an edit saved during the start-up (it took the file as it was then for the one it runs)
    file_seen = config_seen if config_seen is not None or not config_path else file_identity(config_path)
    stop = asyncio.Event()
    stopped_by: list[int] = []  # the signals that came
    loop = asyncio.get_running_loop()
    # its threads (asyncio.to_thread: in-process inferences, world steps, the store's writes) do not
    # hold the stop, nor the process's exit, when a model's forward never returns
    executor = StopBoundedExecutor()
    loop.set_default_executor(executor)
    signals = _StopSignals(stop, stopped_by, stops=honoured_stop_signals())
    signals.starting = asyncio.current_task()  # until it serves, a stop signal abandons the start
    try:
        await _serve(
            config,
            signals,
            executor,
            config_path,
            in_process,
            cpu_fallback,
            ready,
            server_overrides,
            file_seen,
        )
    finally:
        # a signal the loop still has to hand on (one that came in a blocking step of the start, which
        # that step's own handler acted on, or during the stop) is not a stop of its own now
        signals.closed = True


def _serve_metrics(config: Config, manager: LiveManager, token: str | None) -> Any:
    """The Prometheus endpoint at `server.metrics_listen` (its HTTP server and thread): HTTPS with
    `server.tls_cert`/`tls_key` when they are set (the bearer token scrapers send is the admin one)."""
    from manager.api.runtime import read_tls
    from manager.metrics import metrics_tls, serve_metrics

    where = config.server.metrics_listen or ""
    host, _, mport = where.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [::1]:9100, as server.listen takes it
        host = host[1:-1]
    # beyond loopback, scrapers need the admin bearer token (auth_token refused it without one)
    allows = None if is_loopback(where) else AuthInterceptor(token or "").allows
    cert, key = config.server.tls_cert, config.server.tls_key
    tls = None
    if cert and key:
        read_tls(cert, key)  # ServeError naming the setting and the file (`serve` checked them at start)
        try:
            tls = metrics_tls(cert, key)
        except (OSError, ValueError) as e:  # (a file replaced since the check; ssl.SSLError is an OSError)
            raise ServeError(f"server.tls_cert {cert!r} / server.tls_key {key!r}: {e}") from None
    try:
        return serve_metrics(host, int(mport), manager.metrics.registry, allows, tls=tls)
    except OSError as e:
        raise ServeError(f"server.metrics_listen {where!r}: cannot listen: {e.strerror or e}") from None


async def _serve(
    config: Config,
    signals: _StopSignals,
    executor: StopBoundedExecutor,
    config_path: str | None,
    in_process: bool,
    cpu_fallback: frozenset[str],
    ready: Callable[[int], None] | None,
    server_overrides: dict[str, Any] | None,
    file_seen: tuple[int, int, int, int] | None,
) -> None:
    from manager.workers_bridge import create_pool

    stop, stopped_by = signals.stop, signals.came
    loop = asyncio.get_running_loop()
    # a Ctrl-C during start-up stops it cleanly; SIGHUP (its terminal closed) stops it as cleanly, the
    # request log flushed, instead of killing it (a signal the process was started with ignored stays
    # so: `honoured_stop_signals`). While start-up's steps block the event loop (up to the device
    # hosts' pool made: Ray's start, where `ensure_ray` holds them itself), `_stop_signals_end_start_up`
    # holds these signals: one stops the start at once. These handlers are back after each; from
    # then until it serves, one cancels the start's next step (`_StopSignals.on_signal`).
    for sig in signals.stops:
        loop.add_signal_handler(sig, signals.on_signal, sig)
    with _stop_signals_end_start_up():
        check_servable_policy(config)  # (before anything starts)
        probe_listen(config.server.listen)  # a port in use is said now, not after Ray has started
        token = auth_token(config)  # so is a missing or unusable token
        _warn_plaintext(config)
        if config.server.tls_cert and config.server.tls_key:
            from manager.api.runtime import read_tls

            read_tls(config.server.tls_cert, config.server.tls_key)  # and an unusable TLS pair
        journal, store = _journal_and_store(config)
    # a local Ray started here is shut down by the stop, as its last step (`_shutdown_ray`)
    ray_here = not in_process and not _ray_connected()
    before = _descendants() if ray_here else set()
    pool = _pool_or_stop(
        lambda: create_pool(config, in_process=in_process, cpu_fallback=cpu_fallback),
        store,
        journal,
        ray_here=ray_here,
    )
    owns_ray = ray_here and _ray_connected()
    if owns_ray:  # a second signal during the stop ends its processes with this one
        signals.started = lambda: sorted(_descendants() - before)
    manager = LiveManager(config, pool, store=store, journal=journal)
    manager.server_overrides = dict(server_overrides or {})
    fronts: Frontends | None = None
    server: grpc.aio.Server | None = None
    served = False  # it served, and a stop signal ended that
    watcher = tuner = None
    metrics: Any = None
    try:
        if config.server.frontends:
            fronts = Frontends(config, manager)
            server, _, health_servicer = await build_server(
                config, manager, config_path, listen=fronts.backend
            )
        else:
            server, port, health_servicer = await build_server(config, manager, config_path)
        # grpc's health servicer answers SERVING for "" by default: NOT_SERVING until the manager runs
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        _not_stopped(stopped_by)  # (each step, from here on, only if no stop signal came before it)
        await server.start()
        _not_stopped(stopped_by)
        if fronts is not None:
            port = await fronts.start()
            _not_stopped(stopped_by)
        if config.server.metrics_listen:
            metrics = _serve_metrics(config, manager, token)
        _not_stopped(stopped_by)
        await manager.start()
        _not_stopped(stopped_by)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        for name in ("inference.GRPCInferenceService", "residency.v1.Residency", "residency.v1.WorldSession"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        import gc

        gc.collect()
        gc.freeze()  # what start-up built stays: the collector no longer walks it on every request burst
        _not_stopped(stopped_by)
        signals.serving()  # a stop signal from now on stops the service, said on stderr
        watcher = (
            asyncio.create_task(watch_config(manager, config_path, seen=file_seen)) if config_path else None
        )
        tuner = (
            asyncio.create_task(tuning_loop(manager, config_path, store))
            if config_path and config.tuning.schedule != "off"
            else None
        )
        if ready is not None:
            ready(port)
        await stop.wait()
        await health_servicer.enter_graceful_shutdown()
        served = True
    except asyncio.CancelledError:
        if not signals.abandoned_start():  # (cancelled from elsewhere: as it was)
            raise
        raise StoppedAtStartUp(stopped_by[0]) from None
    finally:
        tasks = [t for t in (watcher, tuner) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:  # a tuning run under way ends at its next replay, before the store closes
            await asyncio.wait(tasks, timeout=STOP_TUNING_S + 1.0)
        # the front ends stop beside this server, not before it: the calls they relay are answered by
        # it as its own are (world streams told their session, loads given up at the grace)
        fronts_stopping = asyncio.ensure_future(fronts.stop()) if fronts is not None else None
        # at the grace, the requests whose model's forward still runs in this process (it may never
        # return) are answered, from a timer: through the front ends (the fast path), this server's
        # own stop may end long before
        grace_end = loop.call_later(STOP_GRACE_S, executor.abandon_running, STOP_GRACE_S)
        if server is not None:
            server.world_stopping.set()  # open world streams end now (their sessions saved), not at grace
            closing = asyncio.ensure_future(server.stop(grace=STOP_GRACE_S + STOP_ANSWER_S))
            # requests in flight may end by themselves: this server's, and the front ends' (their
            # ModelInfer calls come over the fast path, not through this server)
            in_flight = [closing] if fronts_stopping is None else [closing, fronts_stopping]
            await asyncio.wait(in_flight, timeout=STOP_GRACE_S)
            manager.abandon_waits()  # those still waiting for a load are answered now, not cancelled
            await closing
        if fronts_stopping is not None:
            await fronts_stopping
        manager_stopped = await _stop_manager_bounded(manager, executor, STOP_MANAGER_S)
        if metrics is not None:  # prometheus' HTTP server and its thread: the port is free again
            httpd, thread = metrics
            await asyncio.to_thread(httpd.shutdown)
            httpd.server_close()
            thread.join(5.0)
        pool.close()
        await _close_store(store, bounded=not manager_stopped)
        if owns_ray:
            hosts = signals.started() if signals.started is not None else []
            _shutdown_ray()
            _remove_host_sockets(hosts)
        grace_end.cancel()  # (what still runs then is the executor's shutdown's: bounded too)
        signals.put_back()
        signals.release()
        if served:
            _say("residency: stopped")
