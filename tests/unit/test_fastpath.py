"""The fast path between gRPC front ends and the manager's process (manager/api/fastpath.py): real
Unix sockets, the real ModelInfer servicer on a live manager with in-process device hosts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
from live_helpers import CONFIG, run

from manager.api.fastpath import FastPathClient, FastPathServer, frame
from manager.api.oip import InferenceServicer
from manager.config import load_config
from manager.live import LiveManager
from residency_proto.inference import grpc_service_pb2 as pb

OK = 0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def voice_request() -> bytes:
    req = pb.ModelInferRequest(model_name="voice", id="r1")
    req.inputs.add(name="audio", datatype="FP32", shape=[1024])
    req.raw_input_contents.append(np.zeros(1024, np.float32).tobytes())
    return req.SerializeToString()


def test_model_infer_over_the_fast_path_answers_as_the_grpc_method_does(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        servicer = InferenceServicer(lm, lambda name: ([], []))
        server = FastPathServer(servicer.infer_raw)
        await server.start(str(tmp_path / "fast.sock"))
        client = FastPathClient()
        await client.connect(str(tmp_path / "fast.sock"))
        try:
            unknown = pb.ModelInferRequest(model_name="nope").SerializeToString()
            # concurrent calls travel together and each gets its own answer
            answers = await asyncio.gather(
                *(client.call(voice_request(), 30.0) for _ in range(5)),
                client.call(unknown, 30.0),
                client.call(b"\xff\xff not protobuf", None),
            )
            for code, details, body in answers[:5]:
                assert (code, details) == (OK, "")
                resp = pb.ModelInferResponse.FromString(body)
                assert resp.model_name == "voice" and resp.id == "r1"
                assert [o.name for o in resp.outputs] == ["speech_prob"]
                assert list(resp.outputs[0].shape) == [2]
            assert answers[5][0] == NOT_FOUND and "unknown model 'nope'" in answers[5][1]
            assert answers[6][0] == INVALID and "not a valid inference.ModelInferRequest" in answers[6][1]
            assert server.calls == 7
            assert lm.served == 5  # the two bad calls never reached a model
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
        server = FastPathServer(handler)
        await server.start(str(tmp_path / "f.sock"))
        client = FastPathClient()
        await client.connect(str(tmp_path / "f.sock"))
        try:
            bad, good = await asyncio.gather(client.call(b"boom", None), client.call(b"ok", 1.5))
            assert bad[0] == INTERNAL and "internal error" in bad[1]
            assert good == (OK, "", b"OK1.5")
        finally:
            await client.close()
            await server.stop()

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
