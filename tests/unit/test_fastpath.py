"""The fast path between gRPC front ends and the manager's process (manager/api/fastpath.py): real
Unix sockets, the real ModelInfer servicer on a live manager with in-process device hosts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import CONFIG, run

import manager.api.fastpath as fastpath
from manager.api.fastpath import FastPathClient, FastPathServer, frame
from manager.api.oip import InferenceServicer
from manager.api.server import describer
from manager.config import load_config
from manager.live import LiveManager
from residency_proto.inference import grpc_service_pb2 as pb

OK = 0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def voice_request() -> bytes:
    req = pb.ModelInferRequest(model_name="voice", id="r1")
    req.inputs.add(name="audio", datatype="FP32", shape=[1024])
    req.raw_input_contents.append(np.zeros(1024, np.float32).tobytes())
    return req.SerializeToString()


@contextlib.asynccontextmanager
async def linked(tmp_path: Path, handler: Any) -> AsyncIterator[FastPathClient]:
    """A client connected to a fast-path server running `handler`, both closed after."""
    server = FastPathServer(handler)
    await server.start(str(tmp_path / "f.sock"))
    client = FastPathClient()
    await client.connect(str(tmp_path / "f.sock"))
    try:
        yield client
    finally:
        await client.close()
        await server.stop()


def test_model_infer_over_the_fast_path_answers_as_the_grpc_method_does(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        servicer = InferenceServicer(lm, describer(lm))
        server = FastPathServer(servicer.infer_raw)
        await server.start(str(tmp_path / "fast.sock"))
        client = FastPathClient()
        await client.connect(str(tmp_path / "fast.sock"))
        try:
            unknown = pb.ModelInferRequest(model_name="nope").SerializeToString()
            as_int64 = pb.ModelInferRequest(model_name="voice")
            as_int64.inputs.add(name="audio", datatype="INT64", shape=[512]).contents.int64_contents[:] = [
                0
            ] * 512
            # concurrent calls travel together and each gets its own answer
            answers = await asyncio.gather(
                *(client.call(voice_request(), 30.0) for _ in range(5)),
                client.call(unknown, 30.0),
                client.call(b"\xff\xff not protobuf", None),
                client.call(as_int64.SerializeToString(), 30.0),
            )
            for code, details, body in answers[:5]:
                assert (code, details) == (OK, "")
                resp = pb.ModelInferResponse.FromString(body)
                assert resp.model_name == "voice" and resp.id == "r1"
                assert [o.name for o in resp.outputs] == ["speech_prob"]
                assert list(resp.outputs[0].shape) == [2]
            assert answers[5][0] == NOT_FOUND and "unknown model 'nope'" in answers[5][1]
            assert answers[6][0] == INVALID and "not a valid inference.ModelInferRequest" in answers[6][1]
            # the fast path checks the request against the model's declared inputs as the method does
            assert answers[7][0] == INVALID and "datatype 'INT64', expected 'FP32'" in answers[7][1]
            assert server.calls == 8
            assert lm.served == 5  # the three bad calls never reached a model
        finally:
            await client.close()
            await server.stop()

    run(load_config(CONFIG), body)


def test_a_failing_handler_answers_internal_and_the_link_goes_on(tmp_path: Path) -> None:
    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        if raw == b"boom":
            raise RuntimeError("a bug")
        return OK, "", raw.upper() + str(left).encode()

    async def main() -> None:
        async with linked(tmp_path, handler) as client:
            bad, good = await asyncio.gather(client.call(b"boom", None), client.call(b"ok", 1.5))
            assert bad[0] == INTERNAL and "internal error" in bad[1]
            assert good == (OK, "", b"OK1.5")

    asyncio.run(main())


def test_a_call_whose_client_went_away_is_cancelled_in_the_manager(tmp_path: Path) -> None:
    """A front end's caller that hung up left its call running in the manager until its timeout
    (queued for its model, then run, for nobody); now the front end says so and the call ends."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        if raw != b"slow":
            return OK, "", raw
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return OK, "", raw

    async def main() -> None:
        async with linked(tmp_path, handler) as client:
            call = asyncio.ensure_future(client.call(b"slow", None))
            await asyncio.wait_for(started.wait(), 10)
            call.cancel()
            await asyncio.wait_for(cancelled.wait(), 10)  # the manager's side ended it
            assert await client.call(b"next", 1.0) == (OK, "", b"next")  # and the link goes on

    asyncio.run(main())


def test_calls_pending_when_the_manager_goes_away_get_unavailable(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        await release.wait()
        return OK, "", raw

    async def main() -> None:
        server = FastPathServer(handler)
        await server.start(str(tmp_path / "f.sock"))
        client = FastPathClient()
        await client.connect(str(tmp_path / "f.sock"))
        pending = asyncio.ensure_future(client.call(b"x", None))
        while server.calls == 0:  # the call reached the manager's side
            await asyncio.sleep(0.01)
        await server.stop()  # the manager's process ends: its side of every link closes
        code, details, _ = await asyncio.wait_for(pending, 10)
        assert code == UNAVAILABLE and "retry" in details
        assert client.closed.is_set()
        assert (await client.call(b"y", None))[0] == UNAVAILABLE  # later calls fail at once
        await client.close()

    asyncio.run(main())


def test_a_peer_sending_garbage_is_cut_off_and_the_server_keeps_serving(tmp_path: Path) -> None:
    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        return OK, "", raw

    async def main() -> None:
        server = FastPathServer(handler)
        path = str(tmp_path / "f.sock")
        await server.start(path)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write((10).to_bytes(4, "big") + b"not pickle")  # a frame that does not decode
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the server closed this link
        writer.close()
        await writer.wait_closed()
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(frame([(7, b"fine", None)]))
        head = await asyncio.wait_for(reader.readexactly(4), 10)
        body = await reader.readexactly(int.from_bytes(head, "big"))
        assert b"fine" in body  # another link is served as usual
        writer.close()
        await writer.wait_closed()
        await server.stop()

    asyncio.run(main())


def test_many_large_calls_in_one_turn_travel_in_several_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scaled down: a 1 MiB frame limit and calls of 400 KB each, legal one by one, which in one frame
    together would pass the limit (the manager then cut the link and every call got UNAVAILABLE)."""
    monkeypatch.setattr(fastpath, "MAX_FRAME", 1 << 20)
    sizes: list[int] = []
    real_frame = fastpath.frame

    def recording_frame(obj: object) -> bytes:
        data = real_frame(obj)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(fastpath, "frame", recording_frame)

    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        return OK, "", raw[:8] + str(len(raw)).encode()

    async def main() -> None:
        async with linked(tmp_path, handler) as client:
            answers = await asyncio.gather(*(client.call(bytes([i]) * 400_000, 5.0) for i in range(6)))
            assert answers == [(OK, "", bytes([i]) * 8 + b"400000") for i in range(6)]
            assert not client.closed.is_set()
            assert max(sizes) <= fastpath.MAX_FRAME

    asyncio.run(main())


def test_a_message_too_large_for_a_frame_gets_resource_exhausted_and_the_link_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scaled down (a 1 MiB frame limit): a request, or an answer, larger than one frame is refused to
    its own caller with RESOURCE_EXHAUSTED, never sent (an oversized frame broke the link or, past
    4 GiB, failed to encode in a callback and left its callers waiting for ever)."""
    monkeypatch.setattr(fastpath, "MAX_FRAME", 1 << 20)

    async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
        return OK, "", raw * (2 << 20) if raw == b"big answer" else raw

    async def main() -> None:
        async with linked(tmp_path, handler) as client:
            big, big_answer, small = await asyncio.gather(
                client.call(b"x" * (2 << 20), 5.0), client.call(b"big answer", 5.0), client.call(b"ok", 5.0)
            )
            assert big[0] == RESOURCE_EXHAUSTED and "request of 2097152 bytes" in big[1]
            assert big_answer[0] == RESOURCE_EXHAUSTED and "response of" in big_answer[1]
            assert small == (OK, "", b"ok")
            assert not client.closed.is_set()
            assert await client.call(b"again", 5.0) == (OK, "", b"again")

    asyncio.run(main())
