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


def test_an_oversized_message_mid_stream_cancels_the_requests_in_flight() -> None:
    async def main() -> tuple[list[str], float]:
        manager = types.SimpleNamespace(config=types.SimpleNamespace(classes=[]))
        servicer = InferenceServicer(manager, describe=None)  # type: ignore[arg-type]
        running: list[str] = []
        ended: list[str] = []

        async def infer(request: pb.ModelInferRequest, timeout_s: float | None) -> Any:
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


def test_an_answer_whose_streams_wrapping_passes_the_limit_is_that_requests_error() -> None:
    """Review 27: the response's own size was checked against `server.max_request_bytes`; the
    stream's wrapping (and Triton's final-response flag) added a few bytes after the check, so one
    just under the limit could not be sent, and gRPC ended the whole stream with it."""
    limit = 4096

    async def main() -> list[pb.ModelStreamInferResponse]:
        manager = types.SimpleNamespace(config=types.SimpleNamespace(classes=[]))
        servicer = InferenceServicer(manager, describe=None, max_response_bytes=limit)  # type: ignore[arg-type]

        async def infer(request: pb.ModelInferRequest, timeout_s: float | None) -> pb.ModelInferResponse:
            resp = pb.ModelInferResponse(model_name="echo", id=request.id)
            resp.raw_output_contents.append(b"")
            if request.id == "big":  # exactly at the limit on its own
                resp.raw_output_contents[0] = b"x" * (limit - resp.ByteSize() - 2)
                while resp.ByteSize() < limit:
                    resp.raw_output_contents[0] += b"x"
                assert resp.ByteSize() == limit
            return resp

        servicer.infer = infer  # type: ignore[method-assign]

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            for rid in ("big", "small"):
                yield pb.ModelInferRequest(model_name="echo", id=rid)

        return [a async for a in servicer.ModelStreamInfer(requests(), _Context())]

    answers = {a.infer_response.id: a for a in asyncio.run(asyncio.wait_for(main(), 30))}
    assert "the answer is" in answers["big"].error_message and str(limit) in answers["big"].error_message
    assert answers["big"].ByteSize() <= limit
    assert answers["small"].error_message == "" and answers["small"].ByteSize() <= limit
