"""A stream's message over `server.max_request_bytes` (28th session: manager/api/server.py RequestLimit).
It was refused by aborting the call as the message was read, under the stream's handler: a world
session was closed (its state saved) but the status did not name the id to resume it with, and a
ModelStreamInfer stream cancelled the requests it had in flight (review 27), their answers lost. Now
the refusal is raised to the handler as its read's error, as a message that does not parse is: the
world session is closed and saved first and the status names the id to resume it with; a
ModelStreamInfer stream answers the requests before it, then ends RESOURCE_EXHAUSTED. Real components:
the service's gRPC server on a free port over in-process device hosts (the real silero-vad model; the
world model's micro stand-in)."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from live_helpers import grpc_service, local_config, served_world_config

from manager.api.server import serve
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from residency_proto.v1 import residency_pb2 as rpb
from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

LIMIT = 256 * 2**10
"""server.max_request_bytes here: above a world output of the micro stand-in, below the big message."""


def _voice(rid: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice", id=rid)
    r.inputs.add(name="audio", datatype="FP32", shape=[1024])
    r.raw_input_contents.append(np.zeros(1024, "<f4").tobytes())
    return r


def test_model_stream_infer_answers_the_requests_before_it_then_ends(tmp_path: Path) -> None:
    config = local_config(tmp_path, ("voice",), max_request_bytes=LIMIT)
    big = pb.ModelInferRequest(model_name="voice", id="big", raw_input_contents=[b"\0" * LIMIT])

    async def main() -> None:
        async with (
            grpc_service(config) as (port, _, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def requests() -> AsyncIterator[pb.ModelInferRequest]:
                yield _voice("a")
                yield _voice("b")
                yield big

            got: list[str] = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for answer in stub.ModelStreamInfer(requests(), timeout=120):
                    assert answer.error_message == "", answer.error_message
                    got.append(answer.infer_response.id)
            assert sorted(got) == ["a", "b"]  # answered, though the refused message came before they ended
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = e.value.details() or ""
            assert details.startswith(
                f"ModelStreamInfer: the request is {big.ByteSize()} bytes, larger than max {LIMIT}"
            )
            assert "server.max_request_bytes" in details

    asyncio.run(main())


def test_a_world_session_refused_a_message_names_the_id_to_resume(tmp_path: Path) -> None:
    base = served_world_config(tmp_path)
    config = base.model_copy(update={"server": base.server.model_copy(update={"max_request_bytes": LIMIT})})
    big = rpb.WorldInput(start=rpb.WorldStart(model="x" * LIMIT))

    async def main() -> None:
        async with (
            grpc_service(config) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = rpb_grpc.WorldSessionStub(channel)
            call = stub.Run(timeout=120)
            await call.write(rpb.WorldInput(start=rpb.WorldStart(model="world")))
            opened = await call.read()
            sid = opened.session_id
            await call.write(rpb.WorldInput(action=rpb.WorldAction(x=1.0)))
            assert (await call.read()).segment == 0
            await call.write(big)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = e.value.details() or ""
            assert details.startswith(f"Run: the request is {big.ByteSize()} bytes, larger than max {LIMIT}")
            assert f"start.resume_session_id={sid!r}) at segment 1" in details, details
            assert manager.sessions == {}
            assert (tmp_path / "sessions" / sid / "session.json").is_file()  # its state saved
            # resumed by that id
            outs = [o async for o in stub.Run(_inputs(sid), timeout=120)]
            assert outs[0].resumed and outs[0].next_segment == 1 and outs[1].segment == 1

    asyncio.run(main())


async def _inputs(sid: str) -> AsyncIterator[rpb.WorldInput]:
    yield rpb.WorldInput(start=rpb.WorldStart(model="world", resume_session_id=sid))
    yield rpb.WorldInput(action=rpb.WorldAction(x=2.0))


def test_through_a_front_end_too(tmp_path: Path) -> None:
    """With `server.frontends`, the front end relays a stream's messages as they came, the one too
    large included (it refused it itself before, aborting the call), so the manager's handler says
    what became of the session."""
    base = served_world_config(tmp_path)
    config = base.model_copy(
        update={"server": base.server.model_copy(update={"max_request_bytes": LIMIT, "frontends": 1})}
    )
    big = rpb.WorldInput(start=rpb.WorldStart(model="x" * LIMIT))
    out: list[object] = []

    def client(port: int) -> None:
        sent: queue.Queue[rpb.WorldInput] = queue.Queue()

        def inputs() -> Iterator[rpb.WorldInput]:
            while True:
                yield sent.get()

        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpb_grpc.WorldSessionStub(channel)  # type: ignore[no-untyped-call]
                sent.put(rpb.WorldInput(start=rpb.WorldStart(model="world")))
                outputs = stub.Run(inputs(), timeout=120)
                sid = next(outputs).session_id
                sent.put(rpb.WorldInput(action=rpb.WorldAction(x=1.0)))
                assert next(outputs).segment == 0
                sent.put(big)
                try:
                    next(outputs)
                    out.append("no error")
                except grpc.RpcError as e:
                    out.append((sid, e.code(), e.details() or ""))
        except BaseException as e:
            out.append(e)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by serve's handler: a clean stop

    def ready(port: int) -> None:
        threading.Thread(target=client, args=(port,), daemon=True).start()

    asyncio.run(serve(config, in_process=True, ready=ready))
    (got,) = out
    assert isinstance(got, tuple), got
    sid, code, details = got
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert details.startswith(f"Run: the request is {big.ByteSize()} bytes, larger than max {LIMIT}"), details
    assert f"start.resume_session_id={sid!r}) at segment 1" in details, details
    assert (tmp_path / "sessions" / str(sid) / "session.json").is_file()
