"""ModelStreamInfer and a client that stops reading its answers (28th session: manager/api/oip.py). A
client that keeps its stream open but reads nothing (a frozen app) fills its HTTP/2 receive window; the
server's next send then waited on flow control for as long as the connection lived, holding up to
STREAM_IN_FLIGHT answers (each up to server.max_request_bytes) in memory. Now an answer that cannot be
sent within STREAM_SEND_LIMIT_S ends the stream DEADLINE_EXCEEDED, saying so; a client that reads
slowly, each answer within the limit, gets them all. Real components: the service's gRPC server on a
free port over in-process device hosts with the real MiniLM model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from live_helpers import grpc_service, local_config, until

import manager.api.oip as oip
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

LIMIT_S = 1.5
"""The send limit here: long enough that a loaded 2-core machine never stalls a reading client past it."""

CLIENT = [("grpc.http2.bdp_probe", 0)]
"""The client's window stays gRPC's initial 64 KiB (BDP probing would grow it on a fast loopback)."""

TEXTS = 64
"""Texts a request: an answer of 64 x 384 floats (96 KiB), more than the client's window."""


def _request(i: int) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="embed", id=str(i))
    t = r.inputs.add(name="text", datatype="BYTES", shape=[TEXTS])
    t.contents.bytes_contents.extend([f"text {i} {k}".encode() for k in range(TEXTS)])
    return r


@pytest.fixture
def short_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oip, "STREAM_SEND_LIMIT_S", LIMIT_S)


def test_a_client_that_reads_nothing_has_its_stream_ended(tmp_path: Path, short_limit: None) -> None:
    async def main() -> None:
        async with (
            grpc_service(local_config(tmp_path, ("embed",))) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT) as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer()
            for i in range(8):
                await call.write(_request(i))
            await until(lambda: manager.engine.models["embed"].last_arrival > 0, "the first request admitted")
            await asyncio.sleep(LIMIT_S + 3)  # (reading nothing)
            read: list[str] = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while True:  # (bounded only so that a regression fails instead of hanging)
                    answer = await asyncio.wait_for(call.read(), 30)
                    assert isinstance(answer, pb.ModelStreamInferResponse), answer  # (no EOF: an error)
                    assert answer.error_message == ""
                    read.append(answer.infer_response.id)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
            details = e.value.details() or ""
            assert details.startswith(
                f"ModelStreamInfer: the client read no answer for {LIMIT_S}s (an answer could not be sent "
                "within that time): the stream is ended,"
            ), details
            assert 0 < len(read) < 8  # those sent before the window filled, and the one held
            # nothing of the stream is left in the manager
            await until(
                lambda: not manager.queued.get("background") and not any(manager.queued.values()), "no queue"
            )

    asyncio.run(main())


def test_a_client_that_reads_slowly_gets_every_answer(tmp_path: Path, short_limit: None) -> None:
    async def main() -> None:
        async with (
            grpc_service(local_config(tmp_path, ("embed",))) as (port, _, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT) as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def requests():  # type: ignore[no-untyped-def]
                for i in range(6):
                    yield _request(i)

            got = []
            async for answer in stub.ModelStreamInfer(requests()):
                assert answer.error_message == "", answer.error_message
                got.append(answer.infer_response.id)
                await asyncio.sleep(LIMIT_S / 3)  # slow, each answer well within the limit
            assert sorted(got) == [str(i) for i in range(6)]

    asyncio.run(main())
