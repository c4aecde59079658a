"""Found in the 13th review of the gRPC surface (manager/api/oip.py, manager/api/world.py,
manager/live_sessions.py); each test failed before its fix. Real components: the service's gRPC
server on a free port over in-process device hosts, the real voice and world (micro stand-in) models."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import POSES, grpc_service, local_config, on_port_0, run, served_world_config

import manager.api.oip as oip_mod
from manager.api.convert import decode_input
from manager.api.oip import InferenceServicer
from manager.api.server import describer
from manager.config import Config
from manager.errors import DeadlineExceeded, InvalidRequest
from manager.live import LiveManager
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from residency_proto.v1 import residency_pb2 as rpb
from residency_proto.v1 import residency_pb2_grpc as rpb_grpc


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[grpc.aio.Channel, LiveManager, Any]]:
    """The service's gRPC server on a free port over in-process hosts: a channel to it, the manager,
    and the pool."""
    async with (
        grpc_service(config) as (port, manager, _, pool),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield channel, manager, pool


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value


def voice_request(**params: tuple[str, Any]) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice", id="req-1")
    r.inputs.add(name="audio", datatype="FP32", shape=[512])
    r.raw_input_contents.append(np.zeros(512, np.float32).tobytes())
    for key, (field, value) in params.items():
        setattr(r.parameters[key], field, value)
    return r


class TestATimeoutOfZero:
    """A ModelInfer with the `timeout` parameter 0 was refused INVALID_ARGUMENT ("must be a positive
    integer"); in Triton a timeout of 0, as one not given, means no timeout of the request's own."""

    def test_it_is_served_as_a_request_without_one(self, tmp_path: Path) -> None:
        cfg = on_port_0(local_config(tmp_path, ("voice",)), tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, _, _):
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                for field in ("int64_param", "uint64_param"):
                    resp = await stub.ModelInfer(voice_request(timeout=(field, 0)), timeout=30)
                    assert resp.id == "req-1" and [o.name for o in resp.outputs] == ["speech_prob"]
                e = await rpc_error(stub.ModelInfer(voice_request(timeout=("int64_param", -1)), timeout=30))
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "parameter 'timeout'" in (e.details() or "") and "got -1" in (e.details() or "")

        asyncio.run(main())

    def test_the_call_deadline_or_the_default_still_holds(self) -> None:
        req = pb.ModelInferRequest(model_name="voice")
        req.parameters["timeout"].int64_param = 0
        servicer: Any = object.__new__(InferenceServicer)
        assert servicer._timeout(req, None) == oip_mod.DEFAULT_TIMEOUT_S
        assert servicer._timeout(req, 3.0) == pytest.approx(2.95)
        req.parameters["timeout"].int64_param = -5
        with pytest.raises(InvalidRequest, match=r"parameter 'timeout' must be .* or 0 .* got -5"):
            servicer._timeout(req, None)


class _Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class TestDecodingIsTheCallsTime:
    """The wait budget handed to admission was the call's deadline (or `timeout`) as it stood
    before its inputs were decoded: a large input's decoding was not charged to it, so a call
    could wait for room (and run) well past the deadline its client set."""

    def _serve(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decode_s: float, req: pb.ModelInferRequest,
        seconds_left: float | None,
    ) -> tuple[list[float], BaseException | None, int]:  # fmt: skip
        """Serve `req` through the servicer (its clock fake) with decoding that takes `decode_s`:
        the timeouts the manager's infer got, the error raised, and the requests served."""
        clock = _Clock()
        real = decode_input

        def slow_decode(*args: Any) -> np.ndarray:
            clock.t += decode_s
            return real(*args)

        monkeypatch.setattr(oip_mod, "decode_input", slow_decode)
        cfg = local_config(tmp_path, ("voice",))

        async def body(manager: LiveManager) -> tuple[list[float], BaseException | None, int]:
            got: list[float] = []
            infer = manager.infer

            async def recording(model: str, inputs: Any, **kw: Any) -> Any:
                got.append(kw["timeout_s"])
                return await infer(model, inputs, **kw)

            manager.infer = recording  # type: ignore[method-assign]
            servicer = InferenceServicer(manager, describer(manager), clock=clock)
            error = None
            try:
                await servicer.infer(req, seconds_left)
            except DeadlineExceeded as e:
                error = e
            return got, error, manager.served

        result: tuple[list[float], BaseException | None, int] = run(cfg, body)
        return result

    def test_the_admission_budget_is_reduced_by_the_decode_time(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        got, error, served = self._serve(tmp_path, monkeypatch, 3.0, voice_request(), seconds_left=10.0)
        assert error is None and served == 1
        assert got == [pytest.approx(10.0 - 0.05 - 3.0)]  # was 9.95: the deadline before decoding

    def test_a_call_whose_decoding_outlasts_its_timeout_is_never_admitted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        req = voice_request(timeout=("int64_param", 1_000_000))  # 1 s
        got, error, served = self._serve(tmp_path, monkeypatch, 2.0, req, seconds_left=None)
        assert got == [] and served == 0  # was admitted with a 1 s budget, and served
        assert isinstance(error, DeadlineExceeded)
        assert "decoding the request's inputs took 2.000 s" in str(error) and "model 'voice'" in str(error)


class _FailingStep:
    """The in-process device host's world sessions, the `fail_at`th step (counted from 1) raising as a
    device error would (`cuda_error`); `lose` also deletes the session's saved state first."""

    def __init__(self, world: Any, fail_at: int, lose: Path | None = None) -> None:
        self.world, self.fail_at, self.lose, self.steps = world, fail_at, lose, 0

    def __getattr__(self, k: str) -> Any:
        return getattr(self.world, k)

    def step(self, session_id: str, pose: Any) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            if self.lose is not None:
                shutil.rmtree(self.lose / session_id)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.world.step(session_id, pose)


async def _open(channel: grpc.aio.Channel, resume: str = "") -> tuple[Any, rpb.WorldOutput]:
    call = rpb_grpc.WorldSessionStub(channel).Run()
    await call.write(rpb.WorldInput(start=rpb.WorldStart(model="world", resume_session_id=resume)))
    return call, await call.read()


async def _step(call: Any, i: int) -> Any:
    x, y, z, pitch, yaw = POSES[i]
    await call.write(rpb.WorldInput(action=rpb.WorldAction(x=x, y=y, z=z, pitch=pitch, yaw=yaw)))
    return await call.read()


class TestAWorldSessionWhoseHostFailsMidSession:
    """A step that failed on the device host (an error there, not its death) ended the stream
    UNAVAILABLE with only the host's error ("world session 1a2b...: world session: RuntimeError(...)"):
    nothing said that the session was saved (it is, when its stream ends) nor how to resume it."""

    def test_the_status_names_the_session_to_resume_and_the_resume_works(self, tmp_path: Path) -> None:
        cfg = served_world_config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, pool):
                host = pool.hosts["cpu0"]
                host.world = _FailingStep(host.world, fail_at=3)
                call, opened = await _open(channel)
                sid = opened.session_id
                assert [(await _step(call, i)).segment for i in range(2)] == [0, 1]
                e = await rpc_error(_step(call, 2))
                details = e.details() or ""
                # (INTERNAL since review 20: the model's code raised, as an inference's is; it was
                # UNAVAILABLE, which clients retry, against the README's error table)
                assert e.code() == grpc.StatusCode.INTERNAL
                assert "illegal memory access" in details  # the host's error is still told
                assert f"world session {sid} is saved" in details
                assert f"(start.resume_session_id={sid!r}) at segment 2" in details
                assert not manager.sessions  # closed (its state saved) before the status went out
                again, reopened = await _open(channel, resume=sid)
                assert reopened.session_id == sid and reopened.resumed and reopened.next_segment == 2
                assert (await _step(again, 2)).segment == 2
                await again.done_writing()
                assert await again.read() == grpc.aio.EOF

        asyncio.run(main())

    def test_the_status_says_when_nothing_was_saved(self, tmp_path: Path) -> None:
        cfg = served_world_config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, pool):
                host = pool.hosts["cpu0"]
                host.world = _FailingStep(host.world, fail_at=2, lose=manager.session_dir)
                call, opened = await _open(channel)
                sid = opened.session_id
                assert (await _step(call, 0)).segment == 0
                e = await rpc_error(_step(call, 1))
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.INTERNAL  # (see above)
                assert "illegal memory access" in details
                assert f"world session {sid} was not saved" in details and "cannot be resumed" in details
                assert "resume_session_id" not in details
                e = await rpc_error(_open(channel, resume=sid))
                assert e.code() == grpc.StatusCode.NOT_FOUND  # as the status said

        asyncio.run(main())

    def test_a_lost_session_whose_state_is_gone_is_not_called_saved(self, tmp_path: Path) -> None:
        """The host restarted (empty) and the session's saved state was gone too: the reopen failed,
        and the stream's status still said "its state is saved: resume it with ...", which then
        answered NOT_FOUND."""
        from workers.host import DeviceHost

        cfg = served_world_config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, pool):
                call, opened = await _open(channel)
                sid = opened.session_id
                assert (await _step(call, 0)).segment == 0
                old = pool.hosts["cpu0"]
                pool.hosts["cpu0"] = DeviceHost(old.name, old.kind, index=old.index)  # as Ray restarts it
                shutil.rmtree(manager.session_dir / sid)
                e = await rpc_error(_step(call, 1))
                details = e.details() or ""
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert "could not be reopened" in details  # why it ended is still told
                assert f"world session {sid} was not saved" in details and "cannot be resumed" in details
                assert "its state is saved" not in details and "resume_session_id" not in details

        asyncio.run(main())


def test_what_a_client_must_be_told_survives_the_cut_of_a_long_error() -> None:
    """The resume note follows the host's error, which can be long (a repr of its exception): cut to
    the status details' limit with it, the note (the session id to resume) was lost."""
    from manager.api.errors import MAX_DETAILS_BYTES, TRUNCATED, details_of

    tail = "; world session 0123456789ab is saved: resume it (start.resume_session_id='0123456789ab')"
    out = details_of(RuntimeError("x" * 5000), tail)
    assert out.endswith(TRUNCATED + tail) and out.startswith("xxx")
    assert len(out.encode()) <= MAX_DETAILS_BYTES + len(TRUNCATED.encode())
    assert details_of("short", tail) == "short" + tail
    assert details_of("y" * 3000) == "y" * MAX_DETAILS_BYTES + TRUNCATED  # as before, without a tail


def test_raw_bool_bytes_other_than_0_and_1_are_invalid_before_admission() -> None:
    """OIP's BOOL is one byte per element, 0 or 1. Raw bytes 2 or 255 decoded to bools holding bytes
    no bool has (kernels may read them as 2 or 255); the worker now refuses them, and the front door
    before a model is loaded for them."""
    with pytest.raises(InvalidRequest, match=r"input 'mask': BOOL element 2 is the byte 255; a BOOL"):
        decode_input("mask", "BOOL", [2, 2], bytes([1, 0, 255, 1]), None)
    ok = decode_input("mask", "BOOL", [2, 2], bytes([1, 0, 0, 1]), None)
    assert ok.tolist() == [[True, False], [False, True]]
