"""Bad input over the wire (hypothesis): random Open Inference Protocol requests — wrong datatypes,
shapes, sizes, unknown models, empty and odd payloads — always get a proper status with a message,
never INTERNAL, and the server keeps serving (a real socket, in-process server and hosts)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
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
}  # fmt: skip
DATATYPES = ["FP32", "FP16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", "BF16", "fp32", ""]


class _Server:
    """A live server on its own event loop thread, shared by the examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        config = load_config(CONFIG)
        config = config.model_copy(
            update={"server": config.server.model_copy(update={"listen": "127.0.0.1:0"})}
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
