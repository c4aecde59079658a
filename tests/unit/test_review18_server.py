"""Review 18 of `residency serve` (manager/api/server.py, manager/api/front.py): what a stop says, and
an over-large request's status. `serve` runs in this process on in-process device hosts; a SIGTERM
(or SIGINT) to this process stops it, caught by its own handler. (A second signal with a real local
Ray: tests/integration/test_review18_server.py.)

- A normal stop said nothing on stderr: no line when it began, none when it was done. Now one line
  when a stop signal begins the stop (naming the signal, and that a second one exits at once) and
  one once the stop is done.
- A request larger than `server.max_request_bytes` got gRPC's own RESOURCE_EXHAUSTED, "Received
  message larger than max (N vs. M)", which does not name the setting to raise. Now the server takes
  in a message up to a margin past the setting and answers RESOURCE_EXHAUSTED naming
  `server.max_request_bytes` and both sizes, directly and through the front ends; gRPC's own limit
  stays, past the margin, so a huge message is still refused before it is read.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from live_helpers import local_config

import manager.api.front as front
from manager.api.server import serve
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from residency_proto.v1 import residency_pb2 as rpb
from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

T = TypeVar("T")
LIMIT = 64 * 2**10  # server.max_request_bytes in these tests


def serve_and_call(
    tmp_path: Path, calls: Callable[[int], T], signum: int = signal.SIGTERM, **server: Any
) -> T:
    """`serve` (the local CPU config's voice model) in this process; once it serves, `calls(port)` on
    a thread of its own, then `signum` to this process stops it. What `calls` returned."""
    cfg = local_config(tmp_path, ("voice",), **server)
    out: list[Any] = []

    def client(port: int) -> None:
        try:
            out.append(calls(port))
        except BaseException as e:  # said by the test, after the stop
            out.append(e)
        finally:
            os.kill(os.getpid(), signum)  # caught by serve's handler: a clean stop

    def ready(port: int) -> None:
        threading.Thread(target=client, args=(port,), daemon=True).start()

    asyncio.run(serve(cfg, in_process=True, ready=ready))
    (got,) = out
    if isinstance(got, BaseException):
        raise got
    result: T = got
    return result


def voice(samples: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="voice")
    request.inputs.add(name="audio", datatype="FP32", shape=[samples])
    request.raw_input_contents.append(np.zeros(samples, np.float32).tobytes())
    return request


def infer(port: int, request: pb.ModelInferRequest) -> tuple[str, str]:
    """The call's status and details ("OK", "" when answered)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.ModelInfer(request, timeout=60)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""


# ---- what a stop says


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_says_when_it_begins_and_when_it_is_done(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], signum: signal.Signals
) -> None:
    """Before: nothing on stderr from the first signal to the process's end."""
    serve_and_call(tmp_path, lambda port: None, signum=signum)
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("residency: ")]
    assert lines == [
        f"residency: stopping ({signum.name}); a second {signum.name} exits at once",
        "residency: stopped",
    ], err
    # in that order, around the stop's own steps (the manager's stop is logged in between)
    assert err.index("residency: stopping") < err.index("residency: stopped")


# ---- an over-large request


def test_an_over_large_request_names_the_setting(tmp_path: Path) -> None:
    """Before: RESOURCE_EXHAUSTED "Received message larger than max (262177 vs. 65536)"."""
    request = voice(LIMIT // 4)  # 4 bytes a sample: the audio alone is the limit
    size = request.ByteSize()
    code, details = serve_and_call(tmp_path, lambda port: infer(port, request), max_request_bytes=LIMIT)
    assert code == "RESOURCE_EXHAUSTED", details
    assert details == (
        f"ModelInfer: the request is {size} bytes, larger than max {LIMIT} bytes in one message "
        "(server.max_request_bytes); send less in one request, or raise server.max_request_bytes"
    )


def test_a_request_within_the_limit_is_served(tmp_path: Path) -> None:
    request = voice(1024)
    assert request.ByteSize() < LIMIT
    code, details = serve_and_call(tmp_path, lambda port: infer(port, request), max_request_bytes=LIMIT)
    assert (code, details) == ("OK", "")


def test_an_over_large_request_through_a_front_end_names_the_setting(tmp_path: Path) -> None:
    """The front ends' ModelInfer (the fast path) and a relayed call (residency.v1 Pin) alike."""
    request = voice(LIMIT // 2)
    size = request.ByteSize()
    pin = rpb.ModelRequest(name="x" * LIMIT)

    def calls(port: int) -> tuple[tuple[str, str], tuple[str, str]]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpb_grpc.ResidencyStub(channel)  # type: ignore[no-untyped-call]
            try:
                stub.Pin(pin, timeout=60)
                relayed = ("OK", "")
            except grpc.RpcError as e:
                relayed = (e.code().name, e.details() or "")
        return infer(port, request), relayed

    (code, details), (rcode, rdetails) = serve_and_call(tmp_path, calls, max_request_bytes=LIMIT, frontends=1)
    assert code == "RESOURCE_EXHAUSTED", details
    assert details.startswith(f"ModelInfer: the request is {size} bytes, larger than max {LIMIT} bytes")
    assert "(server.max_request_bytes)" in details
    assert rcode == "RESOURCE_EXHAUSTED", rdetails
    assert rdetails.startswith(f"Pin: the request is {pin.ByteSize()} bytes, larger than max {LIMIT}")
    assert "server.max_request_bytes" in rdetails


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_an_over_large_world_stream_message_names_the_setting(tmp_path: Path, frontends: int) -> None:
    """A message of a client stream (a world session's) is checked as a unary request is."""
    big = rpb.WorldInput(start=rpb.WorldStart(model="x" * LIMIT))

    def calls(port: int) -> tuple[str, str]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpb_grpc.WorldSessionStub(channel)  # type: ignore[no-untyped-call]
            try:
                for _ in stub.Run(iter([big]), timeout=60):
                    pass
                return "OK", ""
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""

    code, details = serve_and_call(tmp_path, calls, max_request_bytes=LIMIT, frontends=frontends)
    assert code == "RESOURCE_EXHAUSTED", details
    assert details.startswith(f"Run: the request is {big.ByteSize()} bytes, larger than max {LIMIT}")
    assert "server.max_request_bytes" in details


def test_grpcs_own_limit_stays_past_the_margin(tmp_path: Path) -> None:
    """A message past `front.receive_limit` is refused by gRPC itself, before it is read (its own words)."""
    cap = front.receive_limit(LIMIT)
    assert LIMIT < cap < 2**31
    request = voice(cap // 4 + 16)
    code, details = serve_and_call(tmp_path, lambda port: infer(port, request), max_request_bytes=LIMIT)
    assert code == "RESOURCE_EXHAUSTED", details
    assert "Received message larger than max" in details and f"vs. {cap})" in details, details


def test_the_receive_limit_is_bounded_by_grpcs_largest() -> None:
    assert front.receive_limit(64 * 2**20) == 128 * 2**20
    assert front.receive_limit(2**31 - 1) == 2**31 - 1
    assert front.receive_limit(2**30 + 5) == 2**31 - 1
