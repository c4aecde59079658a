"""`WorldSessionServicer._send`, the bounded write of one WorldOutput (the end-to-end cases, over a real
socket, are in tests/integration/test_review15_world_unread.py): a write that gRPC's flow control holds
is given up at the limit (ClientNotReading) or at the server's stop (ServerStopping), and its write is
cancelled, also when the handler itself is cancelled; gRPC's own errors from a write pass through."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc._cython import cygrpc

from manager.api.world import ClientNotReading, ServerStopping, WorldSessionServicer
from residency_proto.v1 import residency_pb2 as pb


class HeldContext:
    """A servicer context whose writes never complete (the client's window is full), or fail."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.written: list[Any] = []
        self.cancelled = 0
        self.aborted: list[tuple[Any, str]] = []

    async def write(self, out: Any) -> None:
        if self.error is not None:
            raise self.error
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.written.append(out)

    async def abort(self, code: Any, details: str) -> None:
        self.aborted.append((code, details))
        raise AssertionError("aborted")

    def time_remaining(self) -> None:
        return None  # (a stream without a deadline)


OUT = pb.WorldOutput(session_id="s", segment=0)


def test_a_held_write_is_given_up_at_the_limit_and_cancelled() -> None:
    async def main() -> None:
        servicer = WorldSessionServicer(manager=None)  # type: ignore[arg-type]  # (_send uses none)
        context = HeldContext()
        with pytest.raises(ClientNotReading) as e:
            await servicer._send(context, OUT, 0.05)
        assert e.value.waited_s == 0.05 and context.cancelled == 1 and context.written == []

    asyncio.run(main())


def test_a_stop_ends_a_held_write_without_a_limit() -> None:
    async def main() -> None:
        servicer = WorldSessionServicer(manager=None)  # type: ignore[arg-type]
        context = HeldContext()
        send = asyncio.ensure_future(servicer._send(context, OUT, None))
        await asyncio.sleep(0.05)
        assert not send.done()  # no limit: it waits
        servicer.stopping.set()
        with pytest.raises(ServerStopping):
            await send
        assert context.cancelled == 1

    asyncio.run(main())


def test_a_cancelled_handler_cancels_its_write() -> None:
    # the client cancelled its call: gRPC cancels the handler's task, and the write goes with it
    async def main() -> None:
        servicer = WorldSessionServicer(manager=None)  # type: ignore[arg-type]
        context = HeldContext()
        send = asyncio.ensure_future(servicer._send(context, OUT, None))
        await asyncio.sleep(0.05)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        await asyncio.sleep(0)  # (the write's task runs its cancellation)
        assert context.cancelled == 1

    asyncio.run(main())


class OneSession:
    """The manager's side of one world session, as `_run` uses it."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(server=SimpleNamespace(world_idle_timeout=600.0))
        self.sessions: dict[str, Any] = {}
        self.closed: list[str] = []

    async def open_session(self, model: str, **_: Any) -> tuple[str, dict[str, Any]]:
        self.sessions["s1"] = (model, 0.0, 0)
        return "s1", {"lease_bytes": 1}

    async def close_session(self, sid: str) -> None:
        self.sessions.pop(sid)
        self.closed.append(sid)


def test_grpcs_own_write_error_passes_through_and_the_session_is_closed() -> None:
    # the stream is gone (the client cancelled, the server stopped): nothing can be told, so no abort
    # (it would fail too) and no "internal error"; gRPC handles its error, and the session is closed
    async def main() -> None:
        manager = OneSession()
        servicer = WorldSessionServicer(manager=manager)  # type: ignore[arg-type]
        gone = cygrpc.ExecuteBatchError("Failed grpc_call_start_batch")
        context = HeldContext(gone)

        async def inputs() -> Any:
            yield pb.WorldInput(start=pb.WorldStart(model="world"))

        with pytest.raises(grpc.aio.BaseError) as e:
            async for _ in servicer.Run(inputs(), context):
                pass
        assert e.value is gone and context.aborted == [] and manager.closed == ["s1"]

    asyncio.run(main())


def test_a_write_that_fails_as_the_client_cancels_leaves_no_unretrieved_error() -> None:
    """A client's cancel fails the held write and cancels the handler in one turn of the loop: the
    handler's cancel went on up, and the write's error was never read, so asyncio logged "Task
    exception was never retrieved" (an ERROR with a traceback) at each such cancel (found in review)."""
    import gc

    seen: list[str] = []

    class FailsWhenTold:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def write(self, out: Any) -> None:
            await self.gate.wait()
            raise RuntimeError("the stream is gone")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx["message"]))
        servicer = WorldSessionServicer(manager=None)  # type: ignore[arg-type]  # (_send uses none)
        context = FailsWhenTold()
        send = asyncio.ensure_future(servicer._send(context, OUT, None))
        for _ in range(3):
            await asyncio.sleep(0)  # the write waits, the send waits for it
        context.gate.set()  # the write fails ...
        send.cancel()  # ... as the handler is cancelled, in the same turn
        with pytest.raises(asyncio.CancelledError):
            await send
        del send
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [m for m in seen if "never retrieved" in m], seen
