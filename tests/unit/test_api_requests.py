"""Bad Open Inference Protocol requests, checked before any model runs (manager/api/convert.py and
manager/api/oip.py): each is InvalidRequest (INVALID_ARGUMENT) or ModelNotFound (NOT_FOUND) naming
what is wrong, never an exception that would reach the client as INTERNAL; and status details stay
short enough for a client's metadata limit."""

from __future__ import annotations

import asyncio
import struct
import threading
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

import manager.api.oip as oip
from manager.api.convert import MAX_ELEMENTS, decode_input
from manager.api.errors import MAX_DETAILS_BYTES, TRUNCATED, details_of, mapped
from manager.api.oip import InferenceServicer, check_request, check_version
from manager.errors import InvalidRequest, ModelNotFound
from residency_proto.inference import grpc_service_pb2 as pb
from workers.protocol import TensorSpec

C = pb.InferTensorContents
VOICE_IN = [TensorSpec("audio", "FP32", (-1,))]
VOICE_OUT = [TensorSpec("speech_prob", "FP32", (-1,))]
PAIR_IN = [TensorSpec("ids", "INT64", (-1, 4)), TensorSpec("text", "BYTES", (-1,))]


@pytest.mark.parametrize(
    ("datatype", "shape", "raw"),
    [("FP32", [0, 2**40, 2**40], b""), ("FP32", [0, 2**62, 2**62], None), ("BYTES", [0, 2**40], b"")],
)
def test_a_zero_dimension_beside_huge_ones_is_invalid(datatype: str, shape: list[int], raw: Any) -> None:
    with pytest.raises(
        InvalidRequest, match=rf"input 'x': shape .* dimension of \d+; the limit is {MAX_ELEMENTS}"
    ):
        decode_input("x", datatype, shape, raw, C())


@pytest.mark.parametrize(
    ("datatype", "contents", "problem"),
    [
        ("UINT8", C(uint_contents=[1, 300]), "UINT8 contents hold 300, outside UINT8's range 0..255"),
        ("INT8", C(int_contents=[200]), "INT8 contents hold 200, outside INT8's range -128..127"),
        ("INT16", C(int_contents=[70000]), "INT16 contents hold 70000, outside INT16's range -32768..32767"),
        ("UINT16", C(uint_contents=[70000]), "UINT16 contents hold 70000, outside UINT16's range 0..65535"),
        ("FP16", C(fp32_contents=[1e6]), "FP16 contents hold 1000000.0, beyond FP16's range"),
    ],
)
def test_typed_values_outside_the_datatype_are_invalid(datatype: str, contents: Any, problem: str) -> None:
    n = len(contents.ListFields()[0][1])
    with pytest.raises(InvalidRequest, match=rf"input 'x': {problem}"):
        decode_input("x", datatype, [n], None, contents)


def test_typed_values_at_the_ends_of_their_range_decode() -> None:
    assert decode_input("x", "UINT8", [2], None, C(uint_contents=[0, 255])).tolist() == [0, 255]
    assert decode_input("x", "INT8", [2], None, C(int_contents=[-128, 127])).dtype == np.int8
    assert decode_input("x", "UINT64", [1], None, C(uint64_contents=[2**64 - 1])).tolist() == [2**64 - 1]
    assert decode_input("x", "FP16", [2], None, C(fp32_contents=[1.5, float("inf")])).tolist() == [
        1.5,
        np.inf,
    ]


def test_raw_and_typed_contents_for_one_input_are_invalid() -> None:
    with pytest.raises(InvalidRequest, match="input 'x': has both raw_input_contents and typed contents"):
        decode_input("x", "FP32", [1], b"\0\0\0\0", C(fp32_contents=[1.0]))


def test_more_bytes_elements_than_the_raw_data_can_hold_is_refused_up_front() -> None:
    with pytest.raises(
        InvalidRequest, match=r"input 't': 1000 BYTES elements need at least 4000 raw bytes, got 6"
    ):
        decode_input("t", "BYTES", [1000], struct.pack("<I", 2) + b"hi", C())


def test_typed_contents_in_another_field_name_the_field_wanted() -> None:
    with pytest.raises(
        InvalidRequest, match=r"0 elements given in contents.fp32_contents, shape \[1\] needs 1"
    ):
        decode_input("x", "FP32", [1], None, C(int_contents=[1]))


def _request(*inputs: tuple[str, str, list[int]], outputs: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in inputs:
        r.inputs.add(name=name, datatype=datatype, shape=shape)
    for o in outputs:
        r.outputs.add(name=o)
    return r


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request(("audio", "BYTES", [1])), "model 'm' input 'audio': datatype 'BYTES', expected 'FP32'"),
        (_request(("audio", "INT64", [512])), "datatype 'INT64', expected 'FP32'"),
        (_request(("audio", "fp32", [512])), "datatype 'fp32', expected 'FP32'"),
        (
            _request(("audio", "FP32", [1, 512])),
            r"input 'audio': shape \[1, 512\], expected \[-1\] \(-1: any\)",
        ),
        (
            _request(("audio", "FP32", [512]), ("bogus", "FP32", [1])),
            r"model 'm' has no input 'bogus'; its inputs: audio \(FP32 \[-1\]\)",
        ),
        (_request(("audio", "FP32", [512]), ("audio", "FP32", [3])), "input 'audio' is given more than once"),
        (_request(), r"model 'm': missing input audio \(FP32 \[-1\]\)"),
        (
            _request(("audio", "FP32", [512]), outputs=("speech_prob", "nope")),
            "model 'm' has no output 'nope'; its outputs: speech_prob",
        ),
    ],
)
def test_requests_that_do_not_match_the_declared_tensors_are_invalid(
    request_: pb.ModelInferRequest, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_request(request_, VOICE_IN, VOICE_OUT)


def test_fixed_dimensions_are_checked_and_declared_requests_pass() -> None:
    with pytest.raises(InvalidRequest, match=r"input 'ids': shape \[2, 3\], expected \[-1, 4\]"):
        check_request(_request(("ids", "INT64", [2, 3]), ("text", "BYTES", [2])), PAIR_IN, [])
    with pytest.raises(InvalidRequest, match=r"missing input text \(BYTES \[-1\]\)"):
        check_request(_request(("ids", "INT64", [2, 4])), PAIR_IN, [])
    check_request(_request(("text", "BYTES", [2]), ("ids", "INT64", [2, 4])), PAIR_IN, [])
    check_request(_request(("audio", "FP32", [512]), outputs=("speech_prob",)), VOICE_IN, VOICE_OUT)


def test_only_version_1_of_a_model_exists() -> None:
    check_version("voice", "")
    check_version("voice", "1")
    for v in ("7", "42", "01", " 1"):
        with pytest.raises(ModelNotFound, match=rf"model 'voice' has no version '{v}'; versions: 1"):
            check_version("voice", v)


def test_long_details_are_cut_to_fit_a_clients_metadata_limit() -> None:
    assert details_of(ModelNotFound("unknown model 'x'")) == "unknown model 'x'"
    for name in ("x" * 100_000, "é" * 100_000, "x" + "é" * 100_000):
        cut = details_of(ModelNotFound(f"unknown model {name!r}"))
        assert cut.startswith("unknown model '") and cut.endswith(TRUNCATED)
        assert len(cut.encode()) <= MAX_DETAILS_BYTES + len(TRUNCATED.encode())


def test_a_mapped_method_sends_the_cut_details() -> None:
    """The context is a fake recording what `abort` is given."""

    class FakeContext:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.got = (code, details)
            raise RuntimeError("aborted")

    class Servicer:
        @mapped
        async def Call(self, request: Any, context: Any) -> None:
            raise ModelNotFound(f"unknown model {'x' * 100_000!r}")

    ctx = FakeContext()
    with pytest.raises(RuntimeError, match="aborted"):
        asyncio.run(Servicer().Call(None, ctx))
    assert ctx.got[0] == grpc.StatusCode.NOT_FOUND and ctx.got[1].endswith(TRUNCATED)
    assert len(ctx.got[1].encode()) <= MAX_DETAILS_BYTES + len(TRUNCATED.encode())


def test_a_large_request_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager is a fake (the servicer reads only its classes here); decode_input is wrapped to
    record the thread each input decodes on."""
    threads: dict[str, int] = {}
    real = oip.decode_input

    def recording(name: str, *args: Any) -> np.ndarray:
        threads[name] = threading.get_ident()
        return real(name, *args)

    monkeypatch.setattr(oip, "decode_input", recording)
    fake_manager = SimpleNamespace(config=SimpleNamespace(classes=[]))
    servicer = InferenceServicer(fake_manager, lambda name: (VOICE_IN, VOICE_OUT))  # type: ignore[arg-type]

    def req(name: str, n: int) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="voice")
        r.inputs.add(name=name, datatype="BYTES", shape=[n])
        r.raw_input_contents.append(b"\0\0\0\0" * n)
        return r

    async def main() -> int:
        small = await servicer._decoded(req("small", 16))
        large = await servicer._decoded(req("large", oip.INLINE_DECODE_BYTES // 4 + 1))
        assert small["small"].shape == (16,) and large["large"].shape == (oip.INLINE_DECODE_BYTES // 4 + 1,)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads["small"] == loop_thread
    assert threads["large"] != loop_thread
