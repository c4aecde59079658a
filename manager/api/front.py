"""gRPC front-end processes (`server.frontends: N`): more cores for gRPC's per-call work.

A front end listens on the service's address beside its siblings (SO_REUSEPORT: the kernel spreads
connections over them), sends each ModelInfer call to the manager's process over the fast path
(`manager.api.fastpath`: many calls per frame on a Unix socket) and relays every other call, as raw
bytes with its metadata (the admin bearer token included) and deadline, to the manager's own gRPC
server on a private Unix socket, where the usual interceptor, servicers and error mapping answer it.
So every service (health, reflection, admin, world sessions, events) works through a front end as
it does directly; only ModelInfer takes the short way. Each method is relayed as what it is (`METHODS`):
a unary request goes with its call, never written after it (grpcio's aio client loses the status of a
call that its server ended before a request was written: grpc/grpc#36066, INTERNAL "Internal error
from Core" instead of, say, UNIMPLEMENTED); a method the manager does not serve is answered here as
its server answers it (UNIMPLEMENTED "Method not found!").

This module stays light (no torch, no manager state): a front end imports grpc and the fast path.
`FrontEndProcesses` is the manager's side: it starts them, waits for each to say it is listening, starts a
new one when one dies, and stops them first at shutdown.

Run by the manager as `python -m manager.api.front --listen HOST:PORT --backend SOCK --fast SOCK
--parent PID [--tls-cert F --tls-key F] [--max-message-bytes N] [--keepalive-s S] [--grace-s S]`; it
prints `ready` on stdout once it listens, and exits when the manager's process is gone. Told to stop
(SIGTERM), it takes no new call and gives those in flight `--grace-s` to end, as the manager's own
server gives its calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from manager.api.fastpath import FastPathClient
from manager.api.runtime import (
    add_port,
    authorization_of,
    event_loop_factory,
    keepalive_options,
    limit_options,
)
from residency_proto.inference import grpc_service_pb2
from residency_proto.v1 import residency_pb2

logger = logging.getLogger(__name__)

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
READY = "ready"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 6.0
"""How long a stopping front end lets its calls in flight end: what the manager's own stop gives
them (`manager.api.server`: STOP_GRACE_S, then STOP_ANSWER_S to send what was answered), not imported
from there (a front end stays light)."""
KILL_AFTER_S = 5.0
"""How long past its grace a front end gets to exit before it is killed."""
BACKEND_WINDOW: list[tuple[str, Any]] = [("grpc.http2.bdp_probe", 0)]
"""The channel to the manager's process keeps gRPC's initial 64 KiB receive window per call: BDP
probing would grow it to megabytes on the fast Unix socket, and a world session's client that stops
reading its outputs would then have the manager's sends go through into that window (4 MiB or more:
hundreds of the micro preset's outputs) long before one was held, its `server.world_idle_timeout` send
limit firing only that much later, the world model held meanwhile. With the window fixed, a relayed
stream that its client does not read holds the manager's send within a few outputs, as a direct
client's full window does. Large messages are not slowed: gRPC still widens a call's window to take in
a message it is reading, and the socket is local (a 64 MiB response or stream message through the
relay took as long as before, within the measurement's noise)."""
MAX_GRPC_MESSAGE = 2**31 - 1
"""The largest message length gRPC takes (its limits are C ints)."""
RECEIVE_MARGIN = 64 * 2**20
"""How far past `server.max_request_bytes` gRPC still takes a request in (`receive_limit`)."""


def receive_limit(max_request_bytes: int) -> int:
    """gRPC's own receive limit for a server whose requests may be `max_request_bytes`: past it by
    that much again (at least RECEIVE_MARGIN), at most MAX_GRPC_MESSAGE. A request between the two is
    taken in and refused by the server's own check (`too_large`: RESOURCE_EXHAUSTED naming the
    setting); one past this is refused by gRPC before it is read ("Received message larger than
    max"), so a client's multi-GB message is never held in memory."""
    return min(MAX_GRPC_MESSAGE, max_request_bytes + max(max_request_bytes, RECEIVE_MARGIN))


def receive_options(max_request_bytes: int) -> list[tuple[str, Any]]:
    """gRPC's message options for a server whose requests may be `max_request_bytes`: it takes in
    up to `receive_limit` (the rest is checked by `too_large`), and sends up to the setting."""
    return [
        ("grpc.max_receive_message_length", receive_limit(max_request_bytes)),
        ("grpc.max_send_message_length", max_request_bytes),
    ]


def too_large(method: str, size: int, max_request_bytes: int) -> str | None:
    """What a client whose request to `method` (its path) is `size` bytes is told when that is more
    than `server.max_request_bytes` (RESOURCE_EXHAUSTED); None when it is not."""
    if size <= max_request_bytes:
        return None
    return (
        f"{method.rpartition('/')[2]}: the request is {size} bytes, larger than max {max_request_bytes} "
        "bytes in one message (server.max_request_bytes); send less in one request, or raise "
        "server.max_request_bytes"
    )


_STATUS = {s.value[0]: s for s in grpc.StatusCode}
_NOT_FORWARDED = frozenset({"user-agent", "content-type", "te", "host"})


def _methods() -> dict[str, tuple[bool, bool]]:
    """Every method the manager's gRPC server serves (`manager.api.server.build_server`): its path ->
    (client streaming, server streaming), read from the services' descriptors."""
    services = (
        grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
        residency_pb2.DESCRIPTOR.services_by_name["Residency"],
        residency_pb2.DESCRIPTOR.services_by_name["WorldSession"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    return {
        f"/{s.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
        for s in services
        for m in s.methods
    }


METHODS = _methods()


def forwarded(metadata: Sequence[Any] | None) -> tuple[tuple[str, Any], ...]:
    """The call's own metadata (e.g. `authorization`), without the transport's headers."""
    return tuple(
        (k, v) for k, v in metadata or () if not k.startswith((":", "grpc-")) and k not in _NOT_FORWARDED
    )


class Front(grpc.GenericRpcHandler):
    """Every method: ModelInfer over the fast path, the rest relayed to the manager's gRPC server. A
    request (or a stream's message) larger than `max_request_bytes` is answered RESOURCE_EXHAUSTED
    naming the setting (`too_large`), not passed on."""

    def __init__(
        self, fast: FastPathClient, backend: grpc.aio.Channel, max_request_bytes: int = MAX_GRPC_MESSAGE
    ) -> None:
        self.fast = fast
        self.backend = backend
        self.max_request_bytes = max_request_bytes

    async def _check(self, method: str, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        why = too_large(method, len(raw), self.max_request_bytes)
        if why is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method == MODEL_INFER:
            return grpc.unary_unary_rpc_method_handler(self._infer)
        kind = METHODS.get(method)
        if kind is None:  # not the manager's: gRPC answers UNIMPLEMENTED "Method not found!", as there
            return None
        client_streaming, server_streaming = kind
        if client_streaming:  # (the manager's own have streamed responses too: world sessions, reflection)
            return grpc.stream_stream_rpc_method_handler(functools.partial(self._relay, method))
        if server_streaming:
            return grpc.unary_stream_rpc_method_handler(functools.partial(self._relay_stream, method))
        return grpc.unary_unary_rpc_method_handler(functools.partial(self._relay_unary, method))

    async def _infer(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await self._check(MODEL_INFER, raw, context)
        # (its authorization header: the manager checks it)
        code, details, body = await self.fast.call(raw, context.time_remaining(), authorization_of(context))
        if code:
            await context.abort(_STATUS.get(code, grpc.StatusCode.UNKNOWN), details)
        return body

    @staticmethod
    def _options(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, Any]:
        """The relayed call's metadata and deadline: the client's call's."""
        return {"metadata": forwarded(context.invocation_metadata()), "timeout": context.time_remaining()}

    @staticmethod
    async def _ended(context: grpc.aio.ServicerContext[Any, Any], call: Any, e: Any = None) -> None:
        """The relayed call's end, the client's: its trailing metadata, and its status if it failed."""
        trailing = forwarded(await call.trailing_metadata() if e is None else e.trailing_metadata())
        if trailing:
            context.set_trailing_metadata(trailing)
        if e is not None:
            await context.abort(e.code(), e.details() or "")

    async def _relay_unary(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        await self._check(method, request, context)
        call = self.backend.unary_unary(method)(request, **self._options(context))
        try:
            response: bytes = await call
            await self._ended(context, call)
            return response
        except grpc.aio.AioRpcError as e:
            await self._ended(context, call, e)
            raise AssertionError("unreachable") from None  # context.abort raises
        finally:
            call.cancel()  # the client went away (or it ended): end the relayed call too

    async def _relay_stream(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        await self._check(method, request, context)
        call = self.backend.unary_stream(method)(request, **self._options(context))
        try:
            async for msg in call:
                yield msg
            await self._ended(context, call)
        except grpc.aio.AioRpcError as e:
            await self._ended(context, call, e)
        finally:
            call.cancel()

    async def _relay(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        # a stream's messages go as they came, one too large included: the manager refuses it as its
        # handler reads it (`server.RequestLimit`), so the handler says what became of what it holds
        # (a world session saved, the id to resume it with); its channel sends up to what this front
        # end takes in (`receive_limit`), as the manager's own server takes in
        call = self.backend.stream_stream(method)(requests, **self._options(context))
        try:
            async for msg in call:
                yield msg
            await self._ended(context, call)
        except grpc.aio.AioRpcError as e:
            await self._ended(context, call, e)
        finally:
            call.cancel()


async def run_front(a: argparse.Namespace) -> int:
    fast = FastPathClient()
    await fast.connect(a.fast)
    backend = grpc.aio.insecure_channel(
        f"unix:{a.backend}",
        options=[
            ("grpc.max_receive_message_length", a.max_message_bytes),
            ("grpc.max_send_message_length", receive_limit(a.max_message_bytes)),
            *BACKEND_WINDOW,
        ],
    )
    server = grpc.aio.server(
        # (no server-wide call limit here: gRPC's would refuse admin calls too; the manager counts
        # the calls relayed to it, `RequestLimit`, and one connection takes MAX_STREAMS_PER_CONNECTION)
        options=[
            ("grpc.so_reuseport", 1),
            *receive_options(a.max_message_bytes),
            *keepalive_options(a.keepalive_s),
            *limit_options(public=True),
        ],
    )
    server.add_generic_rpc_handlers((Front(fast, backend, a.max_message_bytes),))
    port = add_port(server, a.listen, (a.tls_cert, a.tls_key) if a.tls_cert and a.tls_key else None)
    if port == 0:
        print(f"residency front end: cannot listen on {a.listen!r}", file=sys.stderr, flush=True)
        return 2
    await server.start()
    print(READY, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # (the manager's stop; SIGINT, SIGHUP: `main`)

    async def orphaned() -> None:  # the manager's process died without stopping us
        while os.getppid() == a.parent:
            await asyncio.sleep(1.0)

    waits = [asyncio.ensure_future(w) for w in (stop.wait(), fast.closed.wait(), orphaned())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    await server.stop(grace=a.grace_s)
    await fast.close()
    await backend.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The manager stops its front ends (SIGTERM), and they end when it dies (`orphaned`): a signal to
    # the process group is the manager's to take. A SIGHUP (the terminal closed) killed them, and a
    # SIGINT stopped them, while a manager started with both ignored (`nohup`, a shell's `&`) served
    # on: each was restarted, the calls and streams open through it broken.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="python -m manager.api.front", description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True)
    ap.add_argument("--backend", required=True, help="the manager's gRPC Unix socket")
    ap.add_argument("--fast", required=True, help="the manager's fast-path Unix socket")
    ap.add_argument("--parent", type=int, required=True, help="the manager's pid")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--max-message-bytes", type=int, default=64 * 2**20)
    ap.add_argument("--keepalive-s", type=float, default=30.0, help="server.keepalive")
    ap.add_argument("--grace-s", type=float, default=STOP_GRACE_S, help="for the calls in flight at a stop")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s front: %(message)s")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # as the manager's
        return runner.run(run_front(a))


class FrontEndProcesses:
    """The manager's side: `n` front-end processes on `listen`, kept running until `stop()`."""

    def __init__(
        self,
        n: int,
        listen: str,
        backend: str,
        fast: str,
        *,
        tls: tuple[str, str] | None = None,
        max_message_bytes: int = 64 * 2**20,
        keepalive_s: float = 30.0,
        grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.n = n
        self.grace_s = grace_s
        self.args = ["--listen", listen, "--backend", backend, "--fast", fast, "--parent", str(os.getpid())]
        self.args += ["--max-message-bytes", str(max_message_bytes), "--keepalive-s", str(keepalive_s)]
        self.args += ["--grace-s", str(grace_s)]
        if tls is not None:
            self.args += ["--tls-cert", tls[0], "--tls-key", tls[1]]
        self.procs: list[asyncio.subprocess.Process | None] = [None] * n
        self.restarts = 0
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []

    async def _spawn(self, i: int) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "manager.api.front", *self.args, stdout=asyncio.subprocess.PIPE
        )
        self.procs[i] = proc
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if line.decode().strip() != READY:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"gRPC front end {i} did not start (exit {proc.returncode}); its errors are in this log above"
            )

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(i) for i in range(self.n)))
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(self.n)]

    async def _watch(self, i: int) -> None:
        while not self._stopping:
            proc = self.procs[i]
            assert proc is not None
            rc = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            logger.warning("gRPC front end %d exited with %s; starting a new one", i, rc)
            await asyncio.sleep(1.0)
            try:
                await self._spawn(i)
            except (RuntimeError, OSError) as e:  # tried again a second later (EMFILE, ENOMEM pass)
                logger.error("front end %d could not be started again: %s", i, e)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.returncode is None]

    async def stop(self) -> None:
        self._stopping = True
        for w in self._watchers:
            w.cancel()
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in live:
            try:
                await asyncio.wait_for(p.wait(), self.grace_s + KILL_AFTER_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()


if __name__ == "__main__":
    raise SystemExit(main())
