"""The Open Inference Protocol surface as stock clients use it (14th review: manager/api/oip.py,
convert.py, fastpath.py, front.py); the tests of a fix failed before it. Real components: the
service's gRPC server on a free port over in-process device hosts with the voice and embedding models
of configs/local-cpu.yaml and an echo model (a real safetensors-module model declaring one input and
one output of every numeric datatype), and beside it, over the same manager, a real front-end process
(`server.frontends: 1`): every case is asked of both, and both must answer byte for byte alike.
`tritonclient` runs in a child process (its generated `inference` messages and the service's cannot
share one protobuf descriptor pool)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from live_helpers import CONFIG
from torch import nn

import manager.api.front as front_mod
from manager.api.convert import CONTENTS_FIELD, decode_input
from manager.api.server import Frontends, build_server
from manager.config import Config, load_config
from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from workers.st_io import write_safetensors

NUMERIC = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
]
NUMPY = {d: np.dtype(d.lower().replace("fp", "float").replace("bool", "bool_")) for d in NUMERIC}
FACTORIES = "residency_review14_oip_factories"
MAX_REQUEST_BYTES = 1 << 20
TOKEN_ENV = "RESIDENCY_REVIEW14_OIP_TOKEN"
TOKEN = "s3cret-token"
SERVICE = "/inference.GRPCInferenceService/"


class _Echo(nn.Module):
    """Answers each input as the output of its datatype (no float parameters: nothing is cast)."""

    residency_inputs = tuple((f"in_{d}", d, (-1,)) for d in NUMERIC)
    residency_outputs = tuple((f"out_{d}", d, (-1,)) for d in NUMERIC)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, dtype=torch.int64))

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.clone() for x in xs)


def values(datatype: str) -> np.ndarray:
    """Three values of `datatype` that test its range: its extremes (or large floats) and a small one."""
    if datatype == "BOOL":
        return np.array([True, False, True])
    dt = NUMPY[datatype]
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([info.min, info.max, 1], dt)
    return np.array([1.5, -2.25, np.finfo(dt).max], dt)


def _config(tmp: Path) -> Config:
    """configs/local-cpu.yaml's voice and embed, the echo model, a 1 MiB message limit, a bearer
    token, one front end."""
    mod = types.ModuleType(FACTORIES)
    mod.echo = _Echo  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    ck = tmp / "echo.safetensors"
    write_safetensors(_Echo().state_dict(), ck)
    echo = (
        "  - {name: echo, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,\n"
        "     load_seconds: {disk: 0.1, host: 0.05},\n"
        f'     source: {{factory: "{FACTORIES}:echo", path: "{ck}"}}}}\n'
    )
    (tmp / "c.yaml").write_text(
        CONFIG.read_text().replace("policy: {name: residency}", echo + "policy: {name: residency}")
    )
    base = load_config(tmp / "c.yaml")
    return base.model_copy(
        update={
            "models": [m for m in base.models if m.name in ("voice", "embed", "echo")],
            "server": base.server.model_copy(
                update={
                    "listen": "127.0.0.1:0",
                    "frontends": 1,
                    "max_request_bytes": MAX_REQUEST_BYTES,
                    "auth_token_env": TOKEN_ENV,
                }
            ),
            "store": base.store.model_copy(
                update={"url": f"sqlite:///{tmp}/state.db", "journal": str(tmp / "requests.journal")}
            ),
        }
    )


class Service:
    """The manager's gRPC server on a TCP port (`direct`) and, over the same manager, a front end
    relaying to that manager's server on its private socket (`front`)."""

    def __init__(self, direct: int, front: int, manager: LiveManager) -> None:
        self.direct = direct
        self.front = front
        self.manager = manager

    def unary(
        self, port: int, method: str, raw: bytes, timeout: float = 30.0, metadata: Any = None
    ) -> tuple[str, str, bytes]:
        """(status code name, details, response bytes) of one unary call."""
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(SERVICE + method if "/" not in method else method)
            try:
                return "OK", "", call(raw, timeout=timeout, metadata=metadata)
            except grpc.RpcError as e:
                return e.code().name, e.details() or "", b""

    def both(self, method: str, raw: bytes, **kw: Any) -> tuple[str, str, bytes]:
        """The call's answer, asked directly and through the front end: the same (a ModelInfer
        response's timing parameters aside), or the test fails showing both."""
        direct = _normal(method, self.unary(self.direct, method, raw, **kw))
        front = _normal(method, self.unary(self.front, method, raw, **kw))
        assert direct == front, f"{method}: direct {direct[:2]}, through the front end {front[:2]}"
        return direct


def _normal(method: str, answer: tuple[str, str, bytes]) -> tuple[str, str, bytes]:
    """A ModelInfer response without its timing parameters (residency_wait_s, residency_cold)."""
    code, details, body = answer
    if method == "ModelInfer" and code == "OK":
        r = pb.ModelInferResponse.FromString(body)
        del r.parameters["residency_wait_s"]
        del r.parameters["residency_cold"]
        body = r.SerializeToString(deterministic=True)
    return code, details, body


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for the whole module, its event loop on a thread; the tests call it with
    blocking clients."""
    tmp = tmp_path_factory.mktemp("oip")
    os.environ[TOKEN_ENV] = TOKEN
    cfg = _config(tmp)
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()

    async def start() -> Service:
        pool = create_pool(cfg, in_process=True)
        stack.callback(pool.close)
        manager = LiveManager(cfg, pool)
        direct, port, _ = await build_server(cfg, manager)
        fronts = Frontends(cfg, manager)
        backend, _, _ = await build_server(cfg, manager, listen=fronts.backend)
        stack.push_async_callback(manager.stop)
        stack.push_async_callback(backend.stop, None)
        stack.push_async_callback(direct.stop, None)
        await direct.start()
        await backend.start()
        stack.push_async_callback(fronts.stop)
        front = await fronts.start()
        await manager.start()
        return Service(port, front, manager)

    svc = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield svc
    asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()
    sys.modules.pop(FACTORIES, None)
    os.environ.pop(TOKEN_ENV, None)


def voice(n: int = 1024, **fields: Any) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice", id="rid-7", **fields)
    r.inputs.add(name="audio", datatype="FP32", shape=[n])
    r.raw_input_contents.append(np.zeros(n, np.float32).tobytes())
    return r


def echo(typed: bool, only: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    """An echo request with every datatype's `values`, as typed contents or raw bytes."""
    r = pb.ModelInferRequest(model_name="echo", id="echo-1")
    for d in NUMERIC:
        a = values(d)
        t = r.inputs.add(name=f"in_{d}", datatype=d, shape=[len(a)])
        if typed:
            getattr(t.contents, CONTENTS_FIELD[d]).extend(a.tolist())
        else:
            r.raw_input_contents.append(a.astype(NUMPY[d].newbyteorder("<")).tobytes())
    for name in only:
        r.outputs.add(name=name)
    return r


def ser(r: Any) -> bytes:
    data: bytes = r.SerializeToString()
    return data


# ---------------------------------------------------------------------------------------------------
# The fix: a front end answered a relayed call that the manager's server ended at once INTERNAL
# "Internal error from Core"


UNSERVED = [  # (ModelConfig and ModelStatistics are served since review 19)
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "CudaSharedMemoryStatus",
    "TraceSetting",
    "LogSettings",
]


class TestUnservedMethodsThroughAFrontEnd:
    """The OIP methods this server does not serve (tritonclient's shared-memory and trace calls;
    get_model_config and get_inference_statistics until review 19) are UNIMPLEMENTED "Method not
    found!" directly; through a front end most calls of them (16 to 46 of 60 here) were INTERNAL
    "Internal error from Core". The front end relayed every method but ModelInfer as a stream, and
    grpcio's aio client overwrites the status of a call whose server ended it before the request
    was written (grpc/grpc#36066): the manager's answer was lost. Now a front end relays each unary
    method as unary (the request goes with the call: nothing is written after) and answers a method
    the manager does not serve itself, as the manager's server does."""

    @pytest.mark.parametrize("method", UNSERVED)
    def test_every_call_is_unimplemented_as_directly(self, service: Service, method: str) -> None:
        request = ser(pb.ModelMetadataRequest(name="echo"))  # a message to write: what lost the race
        for _ in range(15):
            assert service.both(method, request) == ("UNIMPLEMENTED", "Method not found!", b"")

    def test_a_stream_of_an_unserved_method_is_unimplemented_as_directly(self, service: Service) -> None:
        """A bidirectional stream to a method neither serves (ModelStreamInfer was the example until it
        was served, 2026-12-06)."""
        answers = set()
        for port in (service.direct, service.front):
            for _ in range(10):
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = channel.stream_stream(SERVICE + "ModelStreamInferV3")
                    with pytest.raises(grpc.RpcError) as e:
                        list(call(iter([ser(voice()), ser(voice())]), timeout=30))
                answers.add((port == service.front, e.value.code().name, e.value.details()))
        assert answers == {
            (False, "UNIMPLEMENTED", "Method not found!"),
            (True, "UNIMPLEMENTED", "Method not found!"),
        }

    def test_model_stream_infer_is_served_directly_and_through_a_front_end(self, service: Service) -> None:
        for port in (service.direct, service.front):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream(SERVICE + "ModelStreamInfer")
                raw = list(call(iter([ser(voice()), ser(voice())]), timeout=30))
            answers = [pb.ModelStreamInferResponse.FromString(r) for r in raw]
            assert [a.error_message for a in answers] == ["", ""], port
            assert all(a.infer_response.model_name == "voice" for a in answers)

    def test_the_front_end_knows_every_method_the_managers_server_serves(self, service: Service) -> None:
        """The front end answers UNIMPLEMENTED for a method it does not know: it must know them all
        (read here from the manager's server by reflection), each with its streaming kinds."""
        served: dict[str, tuple[bool, bool]] = {}
        with grpc.insecure_channel(f"127.0.0.1:{service.direct}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest
            (listed,) = stub.ServerReflectionInfo(iter([ask(list_services="")]), timeout=30)
            for svc in listed.list_services_response.service:
                (files,) = stub.ServerReflectionInfo(iter([ask(file_containing_symbol=svc.name)]), timeout=30)
                for raw in files.file_descriptor_response.file_descriptor_proto:
                    fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
                    for s in fd.service:
                        if f"{fd.package}.{s.name}" == svc.name:
                            for m in s.method:
                                served[f"/{svc.name}/{m.name}"] = (m.client_streaming, m.server_streaming)
        assert SERVICE + "ModelInfer" in served and "/grpc.health.v1.Health/Check" in served
        assert served == front_mod.METHODS


class TestRelayedCallsAnswerAsDirectly:
    """Every other method through a front end: the same answer, status and details as directly
    (metadata, the bearer token, the deadline and malformed requests included)."""

    def test_health_metadata_and_readiness(self, service: Service) -> None:
        assert service.both("ServerLive", b"")[2] == ser(pb.ServerLiveResponse(live=True))
        assert service.both("ServerReady", b"")[2] == ser(pb.ServerReadyResponse(ready=True))
        meta = pb.ServerMetadataResponse.FromString(service.both("ServerMetadata", b"")[2])
        assert meta.name == "residency" and "model_repository" in meta.extensions
        for version in ("", "1"):
            m = pb.ModelMetadataResponse.FromString(
                service.both("ModelMetadata", ser(pb.ModelMetadataRequest(name="echo", version=version)))[2]
            )
            assert (m.name, list(m.versions), m.platform) == ("echo", ["1"], "residency/safetensors-module")
            assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == [
                (f"in_{d}", d, [-1]) for d in NUMERIC
            ]
            assert [(t.name, t.datatype) for t in m.outputs] == [(f"out_{d}", d) for d in NUMERIC]
            ready = service.both("ModelReady", ser(pb.ModelReadyRequest(name="voice", version=version)))
            assert ready[2] == ser(pb.ModelReadyResponse(ready=True))
        meta = pb.ModelMetadataRequest(name="echo", version="2")
        code, details, _ = service.both("ModelMetadata", ser(meta))
        assert (code, details) == ("NOT_FOUND", "model 'echo' has no version '2'; versions: 1")
        # not ready, answered OK, as Triton answers an unknown version or model (review 16)
        for req in (pb.ModelReadyRequest(name="echo", version="2"), pb.ModelReadyRequest(name="nope")):
            code, _, body = service.both("ModelReady", ser(req))
            assert (code, pb.ModelReadyResponse.FromString(body).ready) == ("OK", False)
        code, details, _ = service.both("ModelMetadata", ser(pb.ModelMetadataRequest(name="nope")))
        assert code == "NOT_FOUND" and "unknown model 'nope'" in details
        index = pb.RepositoryIndexResponse.FromString(service.both("RepositoryIndex", b"")[2])
        assert {m.name: m.version for m in index.models} == {"voice": "1", "embed": "1", "echo": "1"}

    def test_malformed_and_oversize_requests(self, service: Service) -> None:
        for method in ("ServerLive", "ModelMetadata", "ModelInfer", "RepositoryIndex"):
            code, details, _ = service.both(method, b"\xff\xff\xff")
            assert code == "INVALID_ARGUMENT" and f"{method}: the request is not a valid" in details
        code, details, _ = service.both("ModelInfer", ser(voice(300_000)))
        assert code == "RESOURCE_EXHAUSTED" and "larger than max" in details
        code, _, _ = service.both(
            "ModelMetadata", b"\x0a" + b"\x80\x80\x80\x01" + b"x" * (2 * MAX_REQUEST_BYTES)
        )
        assert code == "RESOURCE_EXHAUSTED"

    def test_the_bearer_token_and_custom_headers_are_relayed(self, service: Service) -> None:
        unload = ser(pb.RepositoryModelUnloadRequest(model_name="nope"))
        for refused in (None, [("authorization", "Bearer wrong")]):
            code, details, _ = service.both("RepositoryModelUnload", unload, metadata=refused)
            assert (code, details) == ("UNAUTHENTICATED", "admin call: missing or wrong bearer token")
        for scheme in ("Bearer", "bearer"):
            md: list[tuple[str, Any]] = [("authorization", f"{scheme} {TOKEN}"), ("x-custom", "1")]
            md.append(("x-trace-bin", b"\x00\x01"))
            code, details, _ = service.both("RepositoryModelUnload", unload, metadata=md)
            known = "echo, embed, voice"
            assert (code, details) == ("NOT_FOUND", f"unknown model 'nope'; this server has: {known}")
        # ModelInfer needs no token, and the front end's fast path takes none
        assert service.both("ModelInfer", ser(voice()), metadata=[("authorization", "Bearer x")])[0] == "OK"

    def test_streamed_answers(self, service: Service) -> None:
        """A server stream (health's Watch, the admin Events) and a bidirectional one (reflection)."""
        answers = []
        for port in (service.direct, service.front):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                watch = channel.unary_stream("/grpc.health.v1.Health/Watch")(
                    health_pb2.HealthCheckRequest(service="").SerializeToString(), timeout=30
                )
                first = health_pb2.HealthCheckResponse.FromString(next(watch))
                watch.cancel()
                events = channel.unary_stream("/residency.v1.Residency/Events")(b"", timeout=30)
                with pytest.raises(grpc.RpcError) as e:
                    next(events)
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                (listed,) = stub.ServerReflectionInfo(iter([ask]), timeout=30)
                names = sorted(s.name for s in listed.list_services_response.service)
                answers.append((first.status, e.value.code(), e.value.details(), names))
        assert answers[0] == answers[1]
        status, code, details, names = answers[0]
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert (code, details) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "admin call: missing or wrong bearer token",
        )
        assert "inference.GRPCInferenceService" in names

    def test_a_response_over_the_message_limit(self, service: Service) -> None:
        """An echo whose response passes server.max_request_bytes (its request just under it)."""
        request = pb.ModelInferRequest(model_name="echo")
        for d in NUMERIC:
            request.inputs.add(name=f"in_{d}", datatype=d, shape=[1])
            request.raw_input_contents.append(np.ones(1, NUMPY[d]).tobytes())
        n = MAX_REQUEST_BYTES - request.ByteSize() - 16
        request.inputs[1].shape[:] = [n]  # in_UINT8
        request.raw_input_contents[1] = b"\x01" * n
        assert request.ByteSize() < MAX_REQUEST_BYTES
        code, details, _ = service.both("ModelInfer", ser(request))
        assert code == "RESOURCE_EXHAUSTED" and "model 'echo': the response is" in details

    def test_a_stream_answer_whose_wrapping_passes_the_limit_is_that_requests_error(
        self, service: Service
    ) -> None:
        """Review 27: the response's own size was checked against server.max_request_bytes; the
        stream's message (and Triton's final-response flag) around it came after the check, so a
        response just under the limit could not be sent, and gRPC ended the whole stream."""
        from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

        def echo(n: int) -> pb.ModelInferRequest:
            request = pb.ModelInferRequest(model_name="echo", id=f"n{n}")
            for d in NUMERIC:  # (echo takes one of each; in_UINT8 carries the size)
                size = n if d == "UINT8" else 1
                request.inputs.add(name=f"in_{d}", datatype=d, shape=[size])
                request.raw_input_contents.append(np.ones(size, NUMPY[d]).tobytes())
            request.parameters["triton_enable_empty_final_response"].bool_param = True
            return request

        with grpc.insecure_channel(f"127.0.0.1:{service.direct}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            small = stub.ModelInfer(echo(10), timeout=60)
            # a response a few bytes under the limit (its lengths' varints grow with it: ~24 bytes)
            n = MAX_REQUEST_BYTES - (small.ByteSize() - 10) - 24
            alone = stub.ModelInfer(echo(n), timeout=60)
            assert MAX_REQUEST_BYTES - 32 < alone.ByteSize() <= MAX_REQUEST_BYTES  # sent on its own
            answers = list(stub.ModelStreamInfer(iter([echo(n), echo(10)]), timeout=60))
        by_id = {a.infer_response.id: a for a in answers}
        assert set(by_id) == {f"n{n}", "n10"}  # the stream went on after it
        assert "in a stream's answer" in by_id[f"n{n}"].error_message, by_id[f"n{n}"].error_message
        assert by_id["n10"].error_message == ""

    def test_a_deadline_too_short_is_deadline_exceeded(self, service: Service) -> None:
        assert service.both("ModelInfer", ser(voice()), timeout=0.0001)[:2] == (
            "DEADLINE_EXCEEDED",
            "Deadline Exceeded",
        )


# ---------------------------------------------------------------------------------------------------
# ModelInfer's conformance, directly and through a front end


def _bytes_input(*elements: bytes, lengths: tuple[int, ...] = ()) -> bytes:
    out = b""
    for i, e in enumerate(elements):
        out += struct.pack("<I", lengths[i] if i < len(lengths) else len(e)) + e
    return out


def _infer_cases() -> dict[str, tuple[pb.ModelInferRequest, str, str]]:
    """name -> (request, the status expected, what its details must say)."""
    cases: dict[str, tuple[pb.ModelInferRequest, str, str]] = {}

    mixed = voice()
    mixed.inputs[0].contents.fp32_contents.extend([0.0] * 1024)
    cases["raw and typed"] = (mixed, "INVALID_ARGUMENT", "has both raw_input_contents and typed contents")
    two = voice()
    two.raw_input_contents.append(b"")
    cases["2 raw for 1 input"] = (two, "INVALID_ARGUMENT", "2 raw_input_contents for 1 inputs")
    cases["zero elements"] = (voice(0), "INVALID_ARGUMENT", "input 'audio' has 0 samples")
    neg = voice()
    neg.inputs[0].shape[:] = [-1]
    cases["negative dim"] = (neg, "INVALID_ARGUMENT", "shape [-1] has a negative dimension")
    huge = voice()
    huge.inputs[0].shape[:] = [2**62]
    cases["huge dim"] = (huge, "INVALID_ARGUMENT", "has a dimension of 4611686018427387904")
    short = voice()
    short.raw_input_contents[0] = b"\0" * 100
    cases["raw length"] = (short, "INVALID_ARGUMENT", "100 raw bytes, expected 4096")
    rank = voice()
    rank.inputs[0].shape[:] = [1, 1024]
    cases["rank"] = (rank, "INVALID_ARGUMENT", "shape [1, 1024], expected [-1]")
    fp64 = voice()
    fp64.inputs[0].datatype = "FP64"
    cases["datatype"] = (fp64, "INVALID_ARGUMENT", "datatype 'FP64', expected 'FP32'")
    cases["no inputs"] = (pb.ModelInferRequest(model_name="voice"), "INVALID_ARGUMENT", "missing input audio")
    unknown_out = voice()
    unknown_out.outputs.add(name="nope")
    cases["unknown output"] = (
        unknown_out,
        "INVALID_ARGUMENT",
        "has no output 'nope'; its outputs: speech_prob",
    )
    cases["version 2"] = (voice(model_version="2"), "NOT_FOUND", "model 'voice' has no version '2'")
    cases["unknown model"] = (pb.ModelInferRequest(model_name="nope"), "NOT_FOUND", "unknown model 'nope'")
    for name, (raw, shape, says) in {
        "BYTES overrun": (_bytes_input(b"hi", lengths=(200,)), [1], "BYTES element 0 claims 200 bytes past"),
        "BYTES short": (b"\x02\x00", [1], "1 BYTES elements need at least 4 raw bytes, got 2"),
        "BYTES extra": (_bytes_input(b"hi", b"x"), [1], "bytes left after 1 BYTES elements"),
    }.items():
        r = pb.ModelInferRequest(model_name="embed")
        r.inputs.add(name="text", datatype="BYTES", shape=shape)
        r.raw_input_contents.append(raw)
        cases[name] = (r, "INVALID_ARGUMENT", says)
    typed_bytes = pb.ModelInferRequest(model_name="embed")
    typed_bytes.inputs.add(name="text", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a"])
    cases["BYTES count"] = (typed_bytes, "INVALID_ARGUMENT", "1 elements given in contents.bytes_contents")
    for d, bad in (("UINT8", 300), ("INT8", -129), ("FP16", 1e6)):
        r = echo(typed=True)
        t = next(t for t in r.inputs if t.datatype == d)
        getattr(t.contents, CONTENTS_FIELD[d])[0] = bad
        cases[f"{d} out of range"] = (
            r,
            "INVALID_ARGUMENT",
            f"outside {d}'s range" if d != "FP16" else "FP16's range",
        )
    bool_byte = echo(typed=False)
    bool_byte.raw_input_contents[0] = bytes([1, 2, 0])
    cases["BOOL byte 2"] = (bool_byte, "INVALID_ARGUMENT", "BOOL element 1 is the byte 2")
    return cases


INFER_CASES = _infer_cases()


class TestModelInferConformance:
    @pytest.mark.parametrize("case", list(INFER_CASES))
    def test_bad_requests_are_refused_naming_the_fault_alike(self, service: Service, case: str) -> None:
        request, code, says = INFER_CASES[case]
        got_code, details, _ = service.both("ModelInfer", ser(request))
        assert (got_code, says in details) == (code, True), details

    @pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
    def test_every_datatype_round_trips(self, service: Service, typed: bool) -> None:
        code, details, body = service.both("ModelInfer", ser(echo(typed)))
        assert code == "OK", details
        r = pb.ModelInferResponse.FromString(body)
        assert (r.model_name, r.model_version, r.id) == ("echo", "1", "echo-1")
        assert [(o.name, o.datatype, list(o.shape)) for o in r.outputs] == [
            (f"out_{d}", d, [3]) for d in NUMERIC
        ]
        assert len(r.raw_output_contents) == len(NUMERIC)
        for o, raw in zip(r.outputs, r.raw_output_contents, strict=True):
            got = np.frombuffer(raw, NUMPY[o.datatype].newbyteorder("<"))
            np.testing.assert_array_equal(got, values(o.datatype))

    def test_outputs_asked_for_by_name_are_the_only_ones_sent(self, service: Service) -> None:
        _, _, body = service.both("ModelInfer", ser(echo(False, only=("out_INT8", "out_FP16"))))
        r = pb.ModelInferResponse.FromString(body)
        assert [o.name for o in r.outputs] == ["out_INT8", "out_FP16"] and len(r.raw_output_contents) == 2

    def test_version_and_id_are_echoed(self, service: Service) -> None:
        for version in ("", "1"):
            r = pb.ModelInferResponse.FromString(
                service.both("ModelInfer", ser(voice(model_version=version)))[2]
            )
            assert (r.model_name, r.model_version, r.id) == ("voice", "1", "rid-7")
            assert [(o.name, o.datatype, list(o.shape)) for o in r.outputs] == [("speech_prob", "FP32", [2])]

    def test_bytes_inputs_raw_and_typed(self, service: Service) -> None:
        raw = pb.ModelInferRequest(model_name="embed")
        raw.inputs.add(name="text", datatype="BYTES", shape=[2])
        raw.raw_input_contents.append(_bytes_input(b"hello", b""))
        typed = pb.ModelInferRequest(model_name="embed")
        typed.inputs.add(name="text", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
            [b"hello", b""]
        )
        a = pb.ModelInferResponse.FromString(service.both("ModelInfer", ser(raw))[2])
        b = pb.ModelInferResponse.FromString(service.both("ModelInfer", ser(typed))[2])
        assert [(o.name, o.datatype, list(o.shape)) for o in a.outputs] == [("embedding", "FP32", [2, 384])]
        assert a.raw_output_contents == b.raw_output_contents

    def test_parameters_of_other_types_are_ignored_and_known_ones_checked(self, service: Service) -> None:
        r = voice()
        r.parameters["custom"].double_param = 1.5
        r.parameters["sequence_id"].int64_param = 5  # tritonclient's; no model here keeps a sequence
        r.parameters["unset"].CopyFrom(pb.InferParameter())
        r.inputs[0].parameters["note"].string_param = "x"
        assert service.both("ModelInfer", ser(r))[0] == "OK"
        for key, field, value, says in (
            ("priority", "double_param", 1.0, "parameter 'priority' must be a non-negative integer"),
            ("timeout", "string_param", "5", "parameter 'timeout' must be a positive integer"),
            ("residency_class", "int64_param", 1, "parameter 'residency_class' must be a string"),
        ):
            r = voice()
            setattr(r.parameters[key], field, value)
            code, details, _ = service.both("ModelInfer", ser(r))
            assert code == "INVALID_ARGUMENT" and says in details


# ---------------------------------------------------------------------------------------------------
# The fix: tensor parameters whose meaning this server does not implement were ignored


class TestTensorParametersNotImplemented:
    """A requested output's `classification` parameter (tritonclient's `class_count`) was ignored:
    the client asked for the top classes as strings and got the raw scores, as if it had not asked;
    the shared-memory parameters of an input (tritonclient's `set_shared_memory`) were ignored and the
    input refused as having "0 elements given in contents.fp32_contents". Each is now INVALID_ARGUMENT
    naming the parameter, the tensor and that this server does not support it, before any data is
    decoded."""

    def test_classification_is_refused(self, service: Service) -> None:
        r = voice()
        r.outputs.add(name="speech_prob").parameters["classification"].int64_param = 2
        code, details, _ = service.both("ModelInfer", ser(r))
        assert code == "INVALID_ARGUMENT", details  # was OK, the scores sent as they were
        assert "output 'speech_prob'" in details and "'classification'" in details
        assert "not supported" in details

    @pytest.mark.parametrize("where", ["input", "output"])
    def test_shared_memory_is_refused(self, service: Service, where: str) -> None:
        r = voice()
        tensor: Any = r.inputs[0] if where == "input" else r.outputs.add(name="speech_prob")
        if where == "input":
            del r.raw_input_contents[:]
        tensor.parameters["shared_memory_region"].string_param = "region0"
        tensor.parameters["shared_memory_byte_size"].int64_param = 4096
        code, details, _ = service.both("ModelInfer", ser(r))
        assert code == "INVALID_ARGUMENT", details  # an output's: was OK, sent in the response
        name = "audio" if where == "input" else "speech_prob"
        assert f"{where} '{name}'" in details and "shared memory" in details and "not supported" in details


# ---------------------------------------------------------------------------------------------------
# The fix: typed values in another datatype's field were ignored


class TestTypedValuesInAnotherField:
    """An input's typed values in a field other than its datatype's (FP32 values in int_contents)
    were ignored: beside its values in the right field the request was served as if they were not
    there, and without them it was refused "0 elements given in contents.fp32_contents", not naming
    where the values were. Now INVALID_ARGUMENT names both fields."""

    def test_decode_names_both_fields(self) -> None:
        contents = pb.InferTensorContents(fp32_contents=[1.0, 2.0], int_contents=[7])
        with pytest.raises(
            InvalidRequest, match=r"contents\.int_contents holds 1 value.*contents\.fp32_contents"
        ):
            decode_input("x", "FP32", [2], None, contents)
        empty = pb.InferTensorContents(int64_contents=[1, 2])
        with pytest.raises(InvalidRequest, match=r"input 'x'.*contents\.int64_contents holds 2 values"):
            decode_input("x", "INT32", [0], None, empty)  # was: an empty array, the values dropped

    def test_refused_by_the_service(self, service: Service) -> None:
        r = echo(typed=True)
        r.inputs[10].contents.int_contents.extend([1, 2, 3])  # in_FP32's values are in fp32_contents
        code, details, _ = service.both("ModelInfer", ser(r))
        assert code == "INVALID_ARGUMENT", details  # was OK
        assert "input 'in_FP32'" in details and "contents.int_contents" in details


# ---------------------------------------------------------------------------------------------------
# tritonclient itself, directly and through the front end

TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

NUMERIC = json.loads(sys.argv[1])
out = {}
for port in sys.argv[2:]:
    c = tc.InferenceServerClient(f"127.0.0.1:{port}")
    got = out[port] = {}
    got["live"] = [c.is_server_live(), c.is_server_ready()]
    got["live"] += [c.is_model_ready("echo"), c.is_model_ready("echo", "1")]
    meta = c.get_model_metadata("echo", "1")
    outs = [(t.name, t.datatype, list(t.shape)) for t in meta.outputs]
    got["meta"] = [meta.name, list(meta.versions), outs[:2]]
    inputs = []
    for d in NUMERIC:
        dt = {"BOOL": "bool_", "FP16": "float16", "FP32": "float32", "FP64": "float64"}.get(d, d.lower())
        if d == "BOOL":
            a = np.array([True, False, True])
        elif d.startswith("FP"):
            a = np.array([1.5, -2.25, np.finfo(dt).max], dt)
        else:
            info = np.iinfo(dt)
            a = np.array([info.min, info.max, 1], dt)
        i = tc.InferInput(f"in_{d}", [3], d)
        i.set_data_from_numpy(a)
        inputs.append((i, a))
    tensors = [i for i, _ in inputs]
    res = c.infer("echo", tensors, request_id="t-1", model_version="1", priority=2, timeout=10_000_000)
    r = res.get_response()
    got["echo"] = [r.model_name, r.model_version, r.id]
    got["equal"] = all(np.array_equal(res.as_numpy(f"out_{d}"), a) for d, (_, a) in zip(NUMERIC, inputs))
    sub = c.infer("echo", tensors, outputs=[tc.InferRequestedOutput("out_UINT64")])
    got["subset"] = [o.name for o in sub.get_response().outputs]
    ranked = [tc.InferRequestedOutput("out_FP32", class_count=2)]
    for what, call in (
        ("class_count", lambda: c.infer("echo", tensors, outputs=ranked)),
        ("config", lambda: c.get_model_config("echo")),
        ("statistics", lambda: c.get_inference_statistics("echo")),
        ("version 3", lambda: c.get_model_metadata("echo", "3")),
    ):
        try:
            call()
            got[what] = "OK"
        except InferenceServerException as e:
            got[what] = [e.status(), e.message()]
    c.close()
print(json.dumps(out))
"""


def test_tritonclient_sees_the_same_service_directly_and_through_a_front_end(service: Service) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT, json.dumps(NUMERIC), str(service.direct), str(service.front)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    direct, front = got[str(service.direct)], got[str(service.front)]
    assert direct == front
    assert direct["live"] == [True, True, True, True]
    assert direct["meta"] == ["echo", ["1"], [["out_BOOL", "BOOL", [-1]], ["out_UINT8", "UINT8", [-1]]]]
    assert direct["echo"] == ["echo", "1", "t-1"] and direct["equal"] is True
    assert direct["subset"] == ["out_UINT64"]
    assert direct["config"] == direct["statistics"] == "OK"  # served since review 19
    assert direct["version 3"] == ["StatusCode.NOT_FOUND", "model 'echo' has no version '3'; versions: 1"]
    status, message = direct["class_count"]
    assert status == "StatusCode.INVALID_ARGUMENT" and "'classification'" in message
