"""ModelStreamInfer over a real gRPC socket (the service's server on in-process device hosts): each
request answered on the stream, by id, failures as `error_message` with the stream going on, a
message that is not a request ending it with INVALID_ARGUMENT after those before it are answered.
(tritonclient's own stream is driven against `residency serve` in tests/e2e.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import grpc_service, local_config

from manager.api import oip
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def voice(rid: str, samples: int = 512, **params: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice", id=rid)
    r.inputs.add(name="audio", datatype="FP32", shape=[samples])
    r.raw_input_contents.append(np.zeros(samples, np.float32).tobytes())
    for key, value in params.items():
        r.parameters[key].string_param = value
    return r


def embed(rid: str, text: bytes) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="embed", id=rid)
    r.inputs.add(name="text", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    return r


async def answered(
    stub: pb_grpc.GRPCInferenceServiceStub, requests: list[pb.ModelInferRequest]
) -> dict[str, pb.ModelStreamInferResponse]:
    async def send() -> AsyncIterator[pb.ModelInferRequest]:
        for r in requests:
            yield r

    got: dict[str, pb.ModelStreamInferResponse] = {}
    async for answer in stub.ModelStreamInfer(send(), timeout=120):
        assert answer.infer_response.id not in got
        got[answer.infer_response.id] = answer
    return got


def test_each_request_is_answered_by_id_and_a_failure_does_not_end_the_stream(tmp_path: Path) -> None:
    config = local_config(tmp_path, ("voice", "embed"))

    async def main() -> None:
        async with (
            grpc_service(config) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            requests = [
                voice("a"),
                embed("b", b"hello"),
                voice("c", samples=100),  # refused by the model: not a multiple of 512
                pb.ModelInferRequest(model_name="nope", id="d"),
                voice("e", keep_alive="forever"),
                voice("f", keep_alive="soon"),  # a bad parameter, named
            ]
            got = await answered(stub, requests)
            assert set(got) == {"a", "b", "c", "d", "e", "f"}
            for rid in ("a", "b", "e"):
                assert got[rid].error_message == "", got[rid].error_message
            assert [o.name for o in got["a"].infer_response.outputs] == ["speech_prob"]
            assert got["a"].infer_response.model_name == "voice"
            emb = np.frombuffer(got["b"].infer_response.raw_output_contents[0], np.float32)
            assert emb.shape == (384,)
            assert "multiple of 512" in got["c"].error_message
            assert "unknown model 'nope'" in got["d"].error_message
            assert got["d"].infer_response.model_name == "nope"  # which request it answers
            assert "parameter 'keep_alive'" in got["f"].error_message
            assert manager.engine.models["voice"].keep_alive_cfg is not None  # e's, then f was refused
            # ModelStatistics counts them as ModelInfer calls
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="voice"))
            counted = stats.model_stats[0].inference_stats
            assert counted.success.count == 2 and counted.fail.count == 2

    asyncio.run(main())


def test_a_message_that_is_not_a_request_ends_the_stream_after_those_before_it(tmp_path: Path) -> None:
    config = local_config(tmp_path, ("voice",))

    async def main() -> None:
        async with (
            grpc_service(config) as (port, _, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            call = channel.stream_stream(STREAM)  # raw bytes: a stock stub cannot send a broken message

            async def send() -> AsyncIterator[bytes]:
                yield voice("a").SerializeToString()
                yield b"\xff\xff\xff"

            answers = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for raw in call(send(), timeout=120):
                    answers.append(pb.ModelStreamInferResponse.FromString(raw))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ModelStreamInfer: the request is not a valid inference.ModelInferRequest" in str(
                e.value.details()
            )
            assert [a.infer_response.id for a in answers] == ["a"] and answers[0].error_message == ""

    asyncio.run(main())


def test_no_more_than_its_limit_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream reads the next request as one ends: with a limit of 2, the third request is not
    taken before one of the first two is answered (a client sending thousands does not start
    thousands of waits)."""
    monkeypatch.setattr(oip, "STREAM_IN_FLIGHT", 2)
    config = local_config(tmp_path, ("voice",))

    async def main() -> None:
        async with (
            grpc_service(config) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            now = most = 0
            real = manager.infer

            async def counted(*args: Any, **kw: Any) -> Any:
                nonlocal now, most
                now += 1
                most = max(most, now)
                try:
                    await asyncio.sleep(0.05)
                    return await real(*args, **kw)
                finally:
                    now -= 1

            manager.infer = counted  # type: ignore[method-assign]
            got = await answered(stub, [voice(str(i)) for i in range(8)])
            assert len(got) == 8 and all(a.error_message == "" for a in got.values())
            assert most == 2

    asyncio.run(main())


class _Aborted(Exception):
    pass


class _Call:
    """A stand-in servicer context: no deadline; `abort` raises with its status; `write` is held until
    the client reads the answer (`read`), as a full flow-control window holds it. `start` runs the
    handler (an async generator that yields nothing: it writes) as the call's task."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[tuple[pb.ModelStreamInferResponse, asyncio.Future[None]]] = asyncio.Queue()
        self.task: asyncio.Future[None] | None = None

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # (a client that sent no header)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    async def write(self, answer: pb.ModelStreamInferResponse) -> None:
        read = asyncio.get_running_loop().create_future()
        self.sent.put_nowait((answer, read))
        await read

    def start(self, servicer: oip.InferenceServicer, requests: AsyncIterator[pb.ModelInferRequest]) -> _Call:
        async def handler() -> None:
            async for _ in servicer.ModelStreamInfer(requests, self):
                raise AssertionError("ModelStreamInfer writes its answers: it yields none")

        self.task = asyncio.ensure_future(handler())
        return self

    async def read(self) -> pb.ModelStreamInferResponse | None:
        """The next answer; None once the call ended OK; its status as _Aborted when it ended so."""
        assert self.task is not None
        get = asyncio.ensure_future(self.sent.get())
        await asyncio.wait((get, self.task), return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            answer, read = get.result()
            if not read.done():
                read.set_result(None)
            return answer
        get.cancel()
        self.task.result()
        return None

    async def answers(self) -> list[pb.ModelStreamInferResponse]:
        out = []
        while (answer := await self.read()) is not None:
            out.append(answer)
        return out

    async def end(self) -> None:
        """The call ends under the handler (the client cancelled it): gRPC cancels the handler's task."""
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class _Servicer(oip.InferenceServicer):
    """The stream's own logic over a stand-in `infer` that counts the requests it was given."""

    def __init__(self, stopping: asyncio.Event | None = None) -> None:
        self.stopping = stopping if stopping is not None else asyncio.Event()
        self.stream_send_limit_s = oip.STREAM_SEND_LIMIT_S
        self.started: list[str] = []

    async def infer(self, request: pb.ModelInferRequest, seconds_left: float | None, **_: Any) -> Any:
        self.started.append(request.id)
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)


def test_a_client_that_reads_no_answer_stops_the_stream_taking_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: a slot was given back when a request ended, not when its answer was sent, so
    a client that sent requests and read nothing had every one of them run and its answer held."""
    monkeypatch.setattr(oip, "STREAM_IN_FLIGHT", 2)

    async def main() -> None:
        servicer = _Servicer()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            for i in range(8):
                yield pb.ModelInferRequest(model_name="voice", id=str(i))

        call = _Call().start(servicer, requests())
        first = await call.read()
        await asyncio.sleep(0.2)  # the client reads nothing more
        assert first is not None and first.infer_response.id == "0"
        assert servicer.started == ["0", "1", "2"]  # two answers held, one slot given back by the read
        rest = [a.infer_response.id for a in await call.answers()]  # it reads: the others are taken
        assert sorted(rest) == [str(i) for i in range(1, 8)] and len(servicer.started) == 8

    asyncio.run(main())


def test_a_stop_ends_an_open_stream_once_its_requests_are_answered() -> None:
    """Found in review: an idle open stream (tritonclient keeps one open until stop_stream) held the
    service's stop for its whole grace, taking new requests meanwhile."""

    async def main() -> None:
        stopping = asyncio.Event()
        servicer = _Servicer(stopping)
        never = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="voice", id="a")
            await never.wait()  # an open stream with nothing more to send
            yield pb.ModelInferRequest(model_name="voice", id="b")

        call = _Call().start(servicer, requests())
        first = await call.read()
        assert first is not None and first.infer_response.id == "a"
        stopping.set()
        with pytest.raises(_Aborted) as e:
            await asyncio.wait_for(call.read(), 5)
        assert e.value.args[0] == grpc.StatusCode.UNAVAILABLE and "stopping" in e.value.args[1]
        assert servicer.started == ["a"]

    asyncio.run(main())


def test_a_stream_closed_under_its_read_leaves_no_task_behind() -> None:
    """Found in review: a stream whose call ended (the client cancelled, its deadline passed) while it
    waited for the next request left that read's task pending; it ended later with an exception
    nobody retrieved, which asyncio logged as an error, once per such stream."""

    async def main() -> None:
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="voice", id="a")
            await ended.wait()  # the transport's read, pending until the call is torn down

        before = set(asyncio.all_tasks())
        call = _Call().start(_Servicer(), requests())
        first = await call.read()
        assert first is not None and first.infer_response.id == "a"
        await asyncio.sleep(0.05)
        await call.end()  # the call ends: the stream's finally runs
        await asyncio.sleep(0.05)
        left = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]
        assert left == []

    asyncio.run(main())


def test_a_read_that_ends_when_cancelled_is_not_logged_as_an_error() -> None:
    """Found in review (an operator's walkthrough): gRPC ends a request read cancelled under it with
    StopAsyncIteration rather than CancelledError; left unread, asyncio logged it as an error with a
    traceback at each stream a client left while one of its requests ran."""
    unread: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unread.append(ctx["message"]))
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="voice", id="a")
            try:
                await ended.wait()
            except asyncio.CancelledError:
                return  # as gRPC's read ends: the stream is over, no exception of its own

        call = _Call().start(_Servicer(), requests())
        first = await call.read()
        assert first is not None and first.infer_response.id == "a"
        await asyncio.sleep(0.05)
        await call.end()
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    gc.collect()
    assert not [m for m in unread if "never retrieved" in m], unread


def test_an_answer_is_flagged_final_when_the_client_asks_as_triton_flags_it() -> None:
    """tritonclient's `enable_empty_final_response=True`: the client waits for an answer flagged
    `triton_final_response`, which Triton sets on every answer of a model that is not decoupled."""

    async def main() -> list[pb.ModelStreamInferResponse]:
        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            for rid in ("a", "b"):
                r = pb.ModelInferRequest(model_name="voice", id=rid)
                r.parameters["triton_enable_empty_final_response"].bool_param = rid == "a"
                yield r

        return await _Call().start(_Servicer(), requests()).answers()

    answers = {a.infer_response.id: a.infer_response.parameters for a in asyncio.run(main())}
    assert answers["a"]["triton_final_response"].bool_param is True
    assert "triton_final_response" not in answers["b"]
