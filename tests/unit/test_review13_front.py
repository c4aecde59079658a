"""Review of the gRPC front ends' path to the manager (manager/api/front.py, manager/api/fastpath.py)
and the device hosts' data channel (workers/channel.py): real Unix sockets, the real ModelInfer
servicer on a live manager with in-process device hosts."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import local_config, run

import manager.api.front as front_mod
import manager.api.server as server_mod
import manager.workers_bridge as bridge
from manager.api.fastpath import FastPathClient, FastPathServer, frame, read_frame, waited_s
from manager.api.oip import InferenceServicer
from manager.api.server import describer
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import protocol as P

OK = 0
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def voice_request(timeout_us: int | None = None) -> bytes:
    req = pb.ModelInferRequest(model_name="voice", id="r1")
    req.inputs.add(name="audio", datatype="FP32", shape=[1024])
    req.raw_input_contents.append(np.zeros(1024, np.float32).tobytes())
    if timeout_us is not None:
        req.parameters["timeout"].int64_param = timeout_us
    data: bytes = req.SerializeToString()
    return data


class TestTheWayToTheManagerIsTheCallsTime:
    """A ModelInfer call through a front end was given its deadline (or `timeout`) as it stood when
    the front end got it, counted again from when the manager's process began to parse it: the time
    in between (the front end's outbox, the socket, a busy manager's loop not reading it) was charged
    to nobody, so a call could wait for room (and run) past the deadline its client set."""

    STALL_S = 0.5

    def _serve(
        self, tmp_path: Path, raw: bytes, seconds_left: float | None
    ) -> tuple[tuple[int, str, bytes], list[float], int]:
        """`raw` through a fast-path client and server (the real servicer), the loop held for
        STALL_S after the call left the front end's side: its answer, the timeouts the manager's
        infer got, and the requests served."""

        async def body(manager: LiveManager) -> tuple[tuple[int, str, bytes], list[float], int]:
            got: list[float] = []
            infer = manager.infer

            async def recording(model: str, inputs: Any, **kw: Any) -> Any:
                got.append(kw["timeout_s"])
                return await infer(model, inputs, **kw)

            manager.infer = recording  # type: ignore[method-assign]
            servicer = InferenceServicer(manager, describer(manager))
            server = FastPathServer(servicer.infer_raw)
            await server.start(str(tmp_path / "fast.sock"))
            client = FastPathClient()
            await client.connect(str(tmp_path / "fast.sock"))
            try:
                call = asyncio.ensure_future(client.call(raw, seconds_left))
                await asyncio.sleep(0)  # the call is in the front end's outbox
                time.sleep(self.STALL_S)  # a busy process: the frame has not reached the manager
                answer = await asyncio.wait_for(call, 30)
            finally:
                await client.close()
                await server.stop()
            return answer, got, manager.served

        result: tuple[tuple[int, str, bytes], list[float], int] = run(
            local_config(tmp_path, ("voice",)), body
        )
        return result

    def test_the_admission_budget_is_reduced_by_the_time_on_the_way(self, tmp_path: Path) -> None:
        (code, details, _), got, served = self._serve(tmp_path, voice_request(), 10.0)
        assert (code, details, served) == (OK, "", 1)
        assert len(got) == 1 and got[0] <= 10.0 - 0.05 - self.STALL_S  # was ~9.95

    def test_a_call_whose_deadline_passed_on_the_way_is_never_admitted(self, tmp_path: Path) -> None:
        (code, details, _), got, served = self._serve(tmp_path, voice_request(), 0.3)
        assert got == [] and served == 0  # was admitted with a 0.25 s budget, and served
        assert code == DEADLINE_EXCEEDED and "model 'voice'" in details

    def test_the_timeout_parameter_counts_from_the_front_end_too(self, tmp_path: Path) -> None:
        (code, details, _), got, served = self._serve(tmp_path, voice_request(timeout_us=300_000), None)
        assert got == [] and served == 0
        assert code == DEADLINE_EXCEEDED and "model 'voice'" in details

    @pytest.mark.parametrize("item", [(7, b"x", None), (7, b"x", None, None)], ids=["no-arrival", "none"])
    def test_a_call_without_its_front_ends_arrival_counts_from_the_managers(
        self, tmp_path: Path, item: tuple[Any, ...]
    ) -> None:
        """A frame item of the old shape (or one without a time) is served as before, from now."""
        seen: list[float | None] = []

        async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
            seen.append(waited_s.get())
            return OK, "", raw

        async def main() -> Any:
            server = FastPathServer(handler)
            path = str(tmp_path / "f.sock")
            await server.start(path)
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(frame([item]))
                return await asyncio.wait_for(read_frame(reader), 10)
            finally:
                writer.close()
                await writer.wait_closed()
                await server.stop()

        assert asyncio.run(main()) == [(7, OK, "", b"x")]
        assert seen == [0.0]

    def test_a_front_end_in_another_process_has_the_same_clock(self, tmp_path: Path) -> None:
        """The arrival a front end's process sends is its time.monotonic(), read in the manager's
        process by its own: one clock for both (a call that waited 0.5 s there is seen so here)."""
        path = str(tmp_path / "f.sock")
        seen: list[float] = []

        async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
            seen.append(waited_s.get())
            return OK, "", raw

        front = (
            "import socket, sys, time\n"
            "from manager.api.fastpath import frame\n"
            "arrived = time.monotonic()\n"
            "time.sleep(0.5)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "s.connect(sys.argv[1])\n"
            "s.sendall(frame([(1, b'x', None, arrived)]))\n"
            "s.recv(1)\n"
        )

        async def main() -> None:
            server = FastPathServer(handler)
            await server.start(path)
            try:
                proc = await asyncio.create_subprocess_exec(sys.executable, "-c", front, path)
                assert await asyncio.wait_for(proc.wait(), 60) == 0
            finally:
                await server.stop()

        asyncio.run(main())
        assert len(seen) == 1 and 0.5 <= seen[0] < 30


def gate(pool: Any, model: str, what: str) -> tuple[threading.Event, threading.Event]:
    """Make `model`'s loads (`what` "load": a long disk→gpu load) or its inferences ("infer": a long
    call of the model) on the in-process `pool` block until the returned gate is set; the other
    event is set once one has started on its device host."""
    gate, entered = threading.Event(), threading.Event()
    for host in pool.hosts.values():
        real_apply, real_infer = host.apply, host.infer

        def apply(cmd: P.Command, op_id: str, real: Any = real_apply) -> P.CommandResult:
            if what == "load" and isinstance(cmd, P.Load) and cmd.model.name == model:
                entered.set()
                gate.wait(120.0)
            result: P.CommandResult = real(cmd, op_id)
            return result

        def infer(name: str, inputs: Any, real: Any = real_infer) -> P.InferResult:
            if what == "infer" and name == model:
                entered.set()
                gate.wait(120.0)
            result: P.InferResult = real(name, inputs)
            return result

        host.apply, host.infer = apply, infer
    return gate, entered


class TestAStopThroughAFrontEnd:
    """`serve`'s stop gives the calls in flight STOP_GRACE_S to end by themselves, then answers what
    still waits for a model's load UNAVAILABLE "the service is stopping". Through a front end the
    front end's own stop gave its calls 2 s and then cancelled them ("Cancelling all calls"): a call
    that would have been answered 3 s into the stop never was."""

    def _stop_during(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, release_after_s: float | None
    ) -> dict[str, Any]:
        """`serve` with one front end stopped (SIGTERM) while a ModelInfer call through it waits for
        its model's load (`what` "load": of the embedding model) or runs ("infer": the voice model),
        which ends `release_after_s` after the signal (None: not before the stop is done with it): the
        call's answer (or error) and how long after the signal it came."""
        model = "embed" if what == "load" else "voice"
        cfg = local_config(tmp_path, ("voice", "embed"), frontends=1)
        config = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"name": "lru-keepalive"})})
        gates: list[tuple[threading.Event, threading.Event]] = []

        def create(*args: Any, **kwargs: Any) -> Any:
            pool = create_pool(*args, **kwargs)
            gates.append(gate(pool, model, what))
            return pool

        monkeypatch.setattr(bridge, "create_pool", create)
        seen: dict[str, Any] = {}

        def client(port: int) -> None:
            gate, entered = gates[0]
            request = pb.ModelInferRequest(model_name=model)
            if model == "embed":
                contents = pb.InferTensorContents(bytes_contents=[b"hi"])
                request.inputs.add(name="text", datatype="BYTES", shape=[1], contents=contents)
            else:
                request.inputs.add(name="audio", datatype="FP32", shape=[1024])
                request.raw_input_contents.append(np.zeros(1024, np.float32).tobytes())
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                    call = stub.ModelInfer.future(request, timeout=60.0)
                    assert entered.wait(30.0), f"the {what} of {model!r} did not start"
                    stopped_at = time.monotonic()
                    os.kill(os.getpid(), signal.SIGTERM)  # caught by serve's handler: a clean stop
                    if release_after_s is not None:
                        threading.Timer(release_after_s, gate.set).start()
                    try:
                        seen["answer"] = call.result(timeout=60.0)
                    except grpc.RpcError as e:
                        seen["error"] = e
                    seen["after_s"] = time.monotonic() - stopped_at
            finally:
                gate.set()

        def ready(port: int) -> None:
            threading.Thread(target=client, args=(port,), daemon=True).start()

        def release() -> None:  # whatever happens, the load ends within 40 s
            for g, _ in gates:
                g.set()

        safety = threading.Timer(40.0, release)
        safety.start()
        try:
            asyncio.run(server_mod.serve(config, in_process=True, ready=ready))
        finally:
            safety.cancel()
            release()
        return seen

    def test_a_call_that_ends_within_the_grace_is_answered(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen = self._stop_during(tmp_path, monkeypatch, "infer", release_after_s=3.0)
        assert "error" not in seen, seen["error"]  # was UNAVAILABLE "Cancelling all calls" at 2 s
        assert seen["answer"].model_name == "voice"

    def test_the_front_ends_grace_is_the_managers(self) -> None:
        assert front_mod.STOP_GRACE_S >= server_mod.STOP_GRACE_S + server_mod.STOP_ANSWER_S

    def test_a_call_whose_load_ends_within_the_grace_is_served(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Review 16: the stop waited STOP_GRACE_S for the manager's own gRPC server's calls alone;
        through a front end a ModelInfer call is none of them (it comes over the fast path), so the
        requests waiting for a load were answered "the service is stopping" at once, not after the
        grace. Now the grace waits for the front ends' calls too: a load that ends 1 s into the
        stop serves its request (with 4 s of the grace left for the load itself and the inference,
        its imports done before: a cold import of transformers alone takes seconds on a loaded
        machine)."""
        importlib.import_module("transformers.models.bert.modeling_bert")
        importlib.import_module("tokenizers")
        seen = self._stop_during(tmp_path, monkeypatch, "load", release_after_s=1.0)
        assert "error" not in seen, seen["error"]
        assert seen["answer"].model_name == "embed"
        assert seen["after_s"] >= 1.0

    def test_a_call_waiting_for_a_load_is_answered_that_the_service_is_stopping(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen = self._stop_during(tmp_path, monkeypatch, "load", release_after_s=None)
        error = seen["error"]
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "model 'embed': the service is stopping" in (error.details() or ""), error.details()
