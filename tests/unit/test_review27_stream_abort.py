"""Review 27: a ModelStreamInfer message over `server.max_request_bytes` is refused as it is read
(RESOURCE_EXHAUSTED, the call ended at once), but the requests the stream had in flight went on:
the stream waited for each of them (their queue places held, a cold load for them started) to send
answers nobody could read any more. They are cancelled now."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from manager.api.oip import InferenceServicer
from residency_proto.inference import grpc_service_pb2 as pb


class _Context:
    """A call's context (unit tests only): no deadline."""

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AbortError()

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    async def write(self, answer: Any) -> None:
        raise AssertionError(f"no request is answered here: {answer}")


def test_an_oversized_message_mid_stream_cancels_the_requests_in_flight() -> None:
    async def main() -> tuple[list[str], float]:
        manager = types.SimpleNamespace(config=types.SimpleNamespace(classes=[]))
        servicer = InferenceServicer(manager, describe=None)  # type: ignore[arg-type]
        running: list[str] = []
        ended: list[str] = []

        async def infer(request: pb.ModelInferRequest, timeout_s: float | None, **kw: Any) -> Any:
            running.append(request.id)
            try:
                await asyncio.Event().wait()  # a slow model (or a long queue): never answers by itself
            except asyncio.CancelledError:
                ended.append(request.id)
                raise

        servicer.infer = infer  # type: ignore[method-assign]

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="slow", id="first")
            while not running:
                await asyncio.sleep(0.01)
            raise grpc.aio.AbortError()  # as RequestLimit's refusal of the next message ends the call

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(grpc.aio.AbortError):
            async for _ in servicer.ModelStreamInfer(requests(), _Context()):
                pass
        return ended, loop.time() - t0

    ended, took = asyncio.run(asyncio.wait_for(main(), 30))
    assert ended == ["first"]  # cancelled, not waited for (it would never have ended)
    assert took < 10
