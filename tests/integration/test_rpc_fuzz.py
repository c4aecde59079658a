"""Bad input over the wire (hypothesis), for every RPC of our three services: random Open Inference
Protocol requests (wrong datatypes, shapes, sizes, unknown models, empty and odd payloads), random
names and parameters for the metadata, repository and admin calls, random world-session streams
(messages out of order, unknown models and codecs, NaN and huge poses), and bytes that are not a
protobuf message at all. Every call gets a proper status with a message, never INTERNAL or UNKNOWN,
no traceback, and the server keeps serving (a real socket, in-process server and hosts)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from manager.config import load_config
from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from residency_proto.v1 import residency_pb2 as adm
from residency_proto.v1 import residency_pb2_grpc as adm_grpc

from .grpc_server import serving

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,  # (a repository_name, as Triton answers it: review 20)
    grpc.StatusCode.FAILED_PRECONDITION,  # (an evict of the pinned voice: review 31)
}  # fmt: skip
DATATYPES = ["FP32", "FP16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", "BF16", "fp32", ""]


class _Server:
    """A live server on its own event loop thread, shared by the examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        config = load_config(CONFIG)
        self.tmp = tempfile.mkdtemp(prefix="rpc-fuzz-")  # world sessions and the journal: not in the checkout
        store = config.store.model_copy(
            update={"sessions": f"{self.tmp}/sessions", "journal": f"{self.tmp}/requests.journal"}
        )
        config = config.model_copy(
            update={"server": config.server.model_copy(update={"listen": "127.0.0.1:0"}), "store": store}
        )
        self.stack = contextlib.AsyncExitStack()
        target, _ = self.loop.run_until_complete(self.stack.enter_async_context(serving(config)))
        self.port = int(target.rpartition(":")[2])
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.stack.aclose(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["audio", "text", "input", "actions", "", "x" * 300]),
        "datatype": st.sampled_from(DATATYPES),
        "shape": st.lists(st.integers(min_value=-3, max_value=1 << 40), max_size=4),
        "raw": st.one_of(st.none(), st.binary(max_size=4096)),
    }
)
requests = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["voice", "embed", "world", "nope", "", "../etc/passwd"]),
        "inputs": st.lists(tensors, max_size=3),
        "priority": st.one_of(st.none(), st.integers(min_value=-5, max_value=10)),
        "cls": st.one_of(st.none(), st.sampled_from(["realtime", "background", "vip", ""])),
        "timeout_us": st.one_of(st.none(), st.integers(min_value=-10, max_value=5_000_000)),
        "keep_alive": st.one_of(
            st.none(),
            st.sampled_from(["10m", "forever", "-1", "-0", "0", "soon", "", "1e400", "-" * 3]),
            st.integers(min_value=-(10**30), max_value=10**30),
            st.floats(allow_nan=True, allow_infinity=True),
        ),
    }
)


def _request(d: dict[str, Any]) -> oip.ModelInferRequest:
    req = oip.ModelInferRequest(model_name=d["model"])
    for t in d["inputs"]:
        req.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    raws = [t["raw"] for t in d["inputs"]]
    if raws and all(r is not None for r in raws):
        req.raw_input_contents.extend(raws)
    elif any(r is not None for r in raws):
        req.raw_input_contents.extend(r for r in raws if r is not None)  # a count mismatch, on purpose
    if d["priority"] is not None:
        req.parameters["priority"].int64_param = d["priority"]
    if d["cls"] is not None:
        req.parameters["residency_class"].string_param = d["cls"]
    if d["timeout_us"] is not None:
        req.parameters["timeout"].int64_param = d["timeout_us"]
    ka = d["keep_alive"]
    if isinstance(ka, str):
        req.parameters["keep_alive"].string_param = ka
    elif isinstance(ka, int):  # (int64 or uint64, as they fit: an int beyond both, as a double)
        if -(2**63) <= ka < 2**63:
            req.parameters["keep_alive"].int64_param = ka
        elif 0 <= ka < 2**64:
            req.parameters["keep_alive"].uint64_param = ka
        else:
            req.parameters["keep_alive"].double_param = float(ka)
    elif isinstance(ka, float):
        req.parameters["keep_alive"].double_param = ka
    return req


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=requests)
def test_random_infer_requests_get_a_proper_status(server: _Server, d: dict[str, Any]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        try:
            stub.ModelInfer(_request(d), timeout=30)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        assert code in ALLOWED, (code, details)
        if code != grpc.StatusCode.OK:
            assert details and "Traceback" not in details
        assert stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ds=st.lists(requests, max_size=6))
def test_random_request_streams_get_an_answer_each_and_a_proper_end(
    server: _Server, ds: list[dict[str, Any]]
) -> None:
    """ModelStreamInfer: one answer per request (a failure as its `error_message`, never a traceback),
    then OK; the server keeps serving."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        sent = [_request(d) for d in ds]
        answers = list(stub.ModelStreamInfer(iter(sent), timeout=60))
        assert len(answers) == len(sent)
        for a in answers:
            assert "Traceback" not in a.error_message and "internal error" not in a.error_message, (
                a.error_message
            )
        assert stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live


def _infer(
    model: str, *inputs: tuple[str, str, list[int], Any], version: str = "", outputs: tuple[str, ...] = ()
) -> Any:
    req = oip.ModelInferRequest(model_name=model, model_version=version)
    for name, datatype, shape, data in inputs:
        t = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if isinstance(data, bytes):
            req.raw_input_contents.append(data)
        elif data is not None:
            t.contents.CopyFrom(data)
    for o in outputs:
        req.outputs.add(name=o)
    return req


AUDIO = np.zeros(512, "<f4").tobytes()


def test_requests_that_do_not_match_the_model_get_invalid_argument_or_not_found(server: _Server) -> None:
    """As Triton answers them: the declared datatype, rank, input names and outputs, and version "1"
    (before, these were converted silently, dropped, or answered UNAVAILABLE from the device host)."""
    bad = [
        (_infer("voice", ("audio", "BYTES", [1], oip.InferTensorContents(bytes_contents=[b"hi"]))),
         "INVALID_ARGUMENT", "input 'audio': datatype 'BYTES', expected 'FP32'"),
        (_infer("voice", ("audio", "INT64", [512], oip.InferTensorContents(int64_contents=[1] * 512))),
         "INVALID_ARGUMENT", "datatype 'INT64', expected 'FP32'"),
        (_infer("voice", ("audio", "FP32", [0, 2**40, 2**40], b"")),
         "INVALID_ARGUMENT", "shape [0, 1099511627776, 1099511627776], expected [-1]"),
        (_infer("voice", ("audio", "FP32", [512], AUDIO), ("bogus", "FP32", [1], b"\0" * 4)),
         "INVALID_ARGUMENT", "has no input 'bogus'; its inputs: audio (FP32 [-1])"),
        (_infer("voice", ("audio", "FP32", [512], AUDIO), ("audio", "FP32", [1], b"\0" * 4)),
         "INVALID_ARGUMENT", "input 'audio' is given more than once"),
        (_infer("voice", ("audio", "FP32", [512], AUDIO), outputs=("nope",)),
         "INVALID_ARGUMENT", "has no output 'nope'; its outputs: speech_prob"),
        (_infer("embed", ("text", "BYTES", [1, 1], oip.InferTensorContents(bytes_contents=[b"hi"]))),
         "INVALID_ARGUMENT", "input 'text': shape [1, 1], expected [-1]"),
        (_infer("voice", ("audio", "FP32", [512], AUDIO), version="7"),
         "NOT_FOUND", "model 'voice' has no version '7'; versions: 1"),
    ]  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        for req, code, message in bad:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req, timeout=30)
            assert (e.value.code().name, message in (e.value.details() or "")) == (code, True), (
                e.value.details()
            )
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelMetadata(oip.ModelMetadataRequest(name="voice", version="42"), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no version '42'" in (e.value.details() or "")
        # an unknown version is not ready, answered OK, as Triton answers it
        assert not stub.ModelReady(oip.ModelReadyRequest(name="voice", version="42"), timeout=30).ready
        good = stub.ModelInfer(
            _infer("voice", ("audio", "FP32", [512], AUDIO), version="1", outputs=("speech_prob",))
        )
        assert [o.name for o in good.outputs] == ["speech_prob"] and good.model_version == "1"
        assert stub.ModelReady(oip.ModelReadyRequest(name="voice", version="1"), timeout=30).ready


def test_long_names_get_their_own_status_with_the_details_cut(server: _Server) -> None:
    """A 100k-character name echoed whole overflowed the client's metadata limit: RESOURCE_EXHAUSTED."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        long = "x" * 100_000
        for call, req, code in [
            (stub.ModelInfer, oip.ModelInferRequest(model_name=long), grpc.StatusCode.NOT_FOUND),
            (
                stub.ModelInfer,
                _infer("voice", (long, "FP32", [1], b"\0" * 4)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=30)
            assert e.value.code() == code, (e.value.code(), (e.value.details() or "")[:200])
            assert (e.value.details() or "").endswith("(truncated)")
        with pytest.raises(grpc.RpcError) as e:
            list(
                adm_grpc.WorldSessionStub(ch).Run(
                    iter([adm.WorldInput(start=adm.WorldStart(model=long))]), timeout=30
                )
            )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and (e.value.details() or "").endswith(
            "(truncated)"
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(max_size=50), tier=st.text(max_size=10))
def test_random_admin_requests_get_a_proper_status(server: _Server, name: str, tier: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = adm_grpc.ResidencyStub(ch)
        for call, req in [
            (stub.Pin, adm.ModelRequest(name=name)),
            (stub.Evict, adm.EvictRequest(name=name, to=tier)),
            (stub.Preload, adm.PreloadRequest(name=name, tier=tier)),
        ]:
            try:
                call(req, timeout=60)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                assert e.details() and "Traceback" not in (e.details() or "")
            assert code in ALLOWED, (call, name, tier, code)


def _code(call: Any, req: Any, timeout: float = 60) -> grpc.StatusCode:
    try:
        call(req, timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        details = e.details() or ""
        assert details and "Traceback" not in details, (e.code(), details)
        return e.code()  # type: ignore[no-any-return]


names = st.one_of(st.sampled_from(["voice", "embed", "world", ""]), st.text(max_size=40))
param_values = st.one_of(
    st.builds(lambda v: oip.ModelRepositoryParameter(bool_param=v), st.booleans()),
    st.builds(lambda v: oip.ModelRepositoryParameter(int64_param=v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: oip.ModelRepositoryParameter(string_param=v), st.text(max_size=20)),
    st.builds(lambda v: oip.ModelRepositoryParameter(bytes_param=v), st.binary(max_size=64)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=names, version=st.text(max_size=8), repo=st.text(max_size=8), ready=st.booleans(),
       params=st.dictionaries(st.text(max_size=12), param_values, max_size=3))  # fmt: skip
def test_random_metadata_repository_and_admin_calls_get_a_proper_status(
    server: _Server, name: str, version: str, repo: str, ready: bool, params: dict[str, Any]
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        o = oip_grpc.GRPCInferenceServiceStub(ch)
        a = adm_grpc.ResidencyStub(ch)
        calls = [
            (o.ServerMetadata, oip.ServerMetadataRequest()),
            (o.ServerReady, oip.ServerReadyRequest()),
            (o.ModelReady, oip.ModelReadyRequest(name=name, version=version)),
            (o.ModelMetadata, oip.ModelMetadataRequest(name=name, version=version)),
            (o.RepositoryIndex, oip.RepositoryIndexRequest(repository_name=repo, ready=ready)),
            (o.RepositoryModelLoad, oip.RepositoryModelLoadRequest(repository_name=repo, model_name=name)),
            (
                o.RepositoryModelUnload,
                oip.RepositoryModelUnloadRequest(repository_name=repo, model_name=name),
            ),
            (a.Unpin, adm.ModelRequest(name=name)),
            (a.List, adm.ListRequest()),
            (a.Stats, adm.StatsRequest()),
            (a.ReloadConfig, adm.ReloadConfigRequest()),
        ]
        for _, req in calls[5:7]:
            for k, v in params.items():
                req.parameters[k].CopyFrom(v)
        for call, req in calls:
            code = _code(call, req)
            assert code in ALLOWED | {grpc.StatusCode.FAILED_PRECONDITION}, (call, req, code)
        assert o.ServerLive(oip.ServerLiveRequest(), timeout=10).live


SERVICES = [
    oip.DESCRIPTOR.services_by_name["GRPCInferenceService"],
    adm.DESCRIPTOR.services_by_name["Residency"],
    adm.DESCRIPTOR.services_by_name["WorldSession"],
]
# and the services grpc registers itself (parsed in grpc: garbage was UNKNOWN, a traceback in the log)
SERVICES += [
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]


def _parses(m: Any, raw: bytes) -> bool:
    try:
        GetMessageClass(m.input_type).FromString(raw)
        return True
    except DecodeError:
        return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(min_size=1, max_size=64))
def test_bytes_that_are_not_a_message_get_invalid_argument_on_every_method(
    server: _Server, raw: bytes
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        for path, m in METHODS:
            if m.client_streaming:
                call: Any = ch.stream_stream(path)
                try:
                    list(call(iter([raw]), timeout=30))
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                    assert e.details() and "Traceback" not in (e.details() or "")
            elif m.server_streaming:  # Events: a bad request ends at once; a good one waits for events
                try:
                    list(ch.unary_stream(path)(raw, timeout=0.5))
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
            else:
                code = _code(ch.unary_unary(path), raw)
            if not _parses(m, raw):
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, raw, code)
            else:
                assert code in ALLOWED | {grpc.StatusCode.FAILED_PRECONDITION}, (path, raw, code)


poses = st.floats(allow_nan=True, allow_infinity=True) | st.floats(min_value=-1e3, max_value=1e3)
starts = st.builds(
    lambda m, c, k, r: adm.WorldInput(
        start=adm.WorldStart(model=m, class_name=c, codec=k, resume_session_id=r)
    ),
    st.sampled_from(["world", "voice", "nope", ""]),
    st.sampled_from(["", "interactive", "realtime", "vip"]),
    st.sampled_from(["", "bf16", "int8", "int4", "fp8"]),
    st.sampled_from(["", "no-such-session", "../../etc"]),
)
good_starts = st.builds(
    lambda k: adm.WorldInput(start=adm.WorldStart(model="world", codec=k)),
    st.sampled_from(["", "bf16", "int8"]),
)
actions = st.builds(
    lambda x, y, z, p, w: adm.WorldInput(action=adm.WorldAction(x=x, y=y, z=z, pitch=p, yaw=w)),
    poses, poses, poses, poses, poses,
)  # fmt: skip
world_inputs = st.one_of(starts, actions, st.just(adm.WorldInput()))  # the last: neither start nor action


@st.composite
def world_streams(draw: st.DrawFn) -> list[Any]:
    """Mostly a good start then actions (NaN and huge poses among them); sometimes anything at all."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(world_inputs, max_size=4))
    first = draw(st.one_of(good_starts, good_starts, starts))
    rest = draw(st.lists(st.one_of(actions, actions, actions, actions, world_inputs), max_size=3))
    return [first, *rest]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=world_streams())
def test_random_world_session_streams_get_a_proper_status(server: _Server, msgs: list[Any]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = adm_grpc.WorldSessionStub(ch)
        outputs = []
        try:
            for out in stub.Run(iter(msgs), timeout=120):
                outputs.append(out)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert e.details() and "Traceback" not in (e.details() or ""), e.details()
        # no device host fails here: a bad message is the client's error, never UNAVAILABLE or INTERNAL
        assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}, (
            msgs,
            code,
        )
        event(f"world stream: {code.name}")
        if code == grpc.StatusCode.OK:  # only a stream that opens with a good start and goes on with actions
            assert msgs and msgs[0].WhichOneof("msg") == "start"
            assert all(m.WhichOneof("msg") == "action" for m in msgs[1:])
            a = [m.action for m in msgs[1:]]
            assert all(math.isfinite(v) and abs(v) <= 1e6 for p in a for v in (p.x, p.y, p.z, p.pitch, p.yaw))
            assert all(math.isfinite(x) for o in outputs[1:] for x in np.frombuffer(o.latents, dtype="<f4"))
            assert len(outputs) == len(msgs) and outputs[0].segment == -1
        assert oip_grpc.GRPCInferenceServiceStub(ch).ServerLive(oip.ServerLiveRequest(), timeout=10).live
