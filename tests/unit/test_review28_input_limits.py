"""A model's own input limits are checked before the request is admitted (28th session: manager/api/oip.py,
workers/protocol.py TensorSpec). The sentence-transformers adapter takes 1..256 UTF-8 texts a request,
silero-vad a positive multiple of 512 finite samples (at most 60 s). Those checks ran only in the
adapter, after the request was admitted: a request its model would refuse was counted as the model's
demand and loaded it, evicting others to make room, only to be refused on the device host. The limits
now travel with the declared inputs (TensorSpec's `items`, `multiple_of`, `finite`, `utf8`), and the
service refuses such a request INVALID_ARGUMENT before admission, in the adapter's words; the adapter
still checks them (a call that does not come through the service). Real components: the service's gRPC
server on a free port over in-process device hosts with the real silero-vad and MiniLM models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from live_helpers import grpc_service, lru_config, on_port_0, until

from manager.config import Config
from manager.policy.types import Tier
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import protocol as P


def _config(tmp_path: Path) -> Config:
    """local-cpu's pinned voice model and embed (lru-keepalive: nothing preloaded, embed on disk)."""
    base = lru_config(tmp_path)
    cfg = base.model_copy(update={"models": [m for m in base.models if m.name in ("voice", "embed")]})
    return on_port_0(cfg, tmp_path)


def _texts(items: list[bytes]) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="embed")
    t = r.inputs.add(name="text", datatype="BYTES", shape=[len(items)])
    t.contents.bytes_contents.extend(items)
    return r


def _audio(a: np.ndarray) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice")
    r.inputs.add(name="audio", datatype="FP32", shape=list(a.shape))
    r.raw_input_contents.append(a.astype("<f4").tobytes())
    return r


async def _refused(stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ModelInfer(request, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details() or ""


class TestARequestItsModelRefusesIsRefusedBeforeAdmission:
    def test_texts_and_audio_past_the_models_limits(self, tmp_path: Path) -> None:
        async def main() -> None:
            async with (
                grpc_service(_config(tmp_path)) as (port, manager, _, _),
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            ):
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                embed, voice = manager.engine.models["embed"], manager.engine.models["voice"]
                await until(lambda: voice.tier == Tier.GPU and manager.serving("voice"), "the pinned voice")
                voice_seen, embed_seen = voice.last_arrival, embed.last_arrival

                assert "model 'embed': input 'text' has 300 texts; expected 1..256" in await _refused(
                    stub, _texts([b"hi"] * 300)
                )
                assert "input 'text' has 0 texts; expected 1..256" in await _refused(stub, _texts([]))
                details = await _refused(stub, _texts([b"fine", b"caf\xe9"]))
                assert "model 'embed': input 'text'[1] is not UTF-8 text (byte 3: 0xe9)" in details
                details = await _refused(stub, _audio(np.zeros(1000, np.float32)))
                assert (
                    "model 'voice': input 'audio' has 1000 samples; expected a positive multiple of 512, "
                    "at most 960000" in details
                )
                a = np.zeros(1024, np.float32)
                a[[700, 900]] = [np.nan, np.inf]
                details = await _refused(stub, _audio(a))
                assert (
                    "model 'voice': input 'audio' has 2 samples that are not finite (NaN or inf), the first "
                    "at index 700; expected PCM samples in [-1, 1]" in details
                )
                # none was admitted: embed was never loaded nor counted as asked for, voice's demand is
                # as it was
                assert embed.tier == Tier.DISK and embed.last_arrival == embed_seen
                assert manager.live["embed"].loads_pending == 0 and not manager.serving("embed")
                assert voice.last_arrival == voice_seen
                # within the limits, both run
                ok = await stub.ModelInfer(_texts([b"fine", "caf\u00e9".encode()]), timeout=120)
                assert list(ok.outputs[0].shape) == [2, 384]
                ok = await stub.ModelInfer(_audio(np.zeros(1024, np.float32)), timeout=60)
                assert list(ok.outputs[0].shape) == [2]

        asyncio.run(main())


class TestTheLimitsTravelWithTheDeclaredInputs:
    def test_count_problem(self) -> None:
        spec = P.TensorSpec("audio", "FP32", (-1,), items=(1, 2048), multiple_of=512, unit="samples")
        assert spec.count_problem([512]) is None and spec.count_problem([2048]) is None
        assert (
            spec.count_problem([0])
            == "input 'audio' has 0 samples; expected a positive multiple of 512, at most 2048"
        )
        assert spec.count_problem([2560]) is not None and spec.count_problem([513]) is not None
        texts = P.TensorSpec("text", "BYTES", (-1,), items=(1, 4))
        assert texts.count_problem([5]) == "input 'text' has 5 items; expected 1..4"
        assert P.TensorSpec("x", "FP32", (-1, 3)).count_problem([10**9, 3]) is None  # no limit declared

    def test_value_problem(self) -> None:
        spec = P.TensorSpec("x", "FP32", (-1, 3), finite=True)
        a = np.zeros((2, 3), np.float32)
        assert spec.value_problem(a) is None
        a[1, 2] = np.nan
        assert (
            spec.value_problem(a)
            == "input 'x' has 1 values that are not finite (NaN or inf), the first at index [1, 2]"
        )
        assert P.TensorSpec("x", "FP32", (-1, 3)).value_problem(a) is None  # not declared finite
        texts = P.TensorSpec("t", "BYTES", (-1,), utf8=True)
        assert texts.value_problem(np.array([b"ok", "\u00e9".encode()], dtype=object)) is None
        assert (
            texts.value_problem(np.array([b"\xff"], dtype=object))
            == "input 't'[0] is not UTF-8 text (byte 0: 0xff)"
        )
        # fixed-width bytes too (an adapter called directly: numpy's kind S), as objects are
        fixed = np.array([b"ok", b"\xff"])
        assert texts.value_problem(fixed) == "input 't'[1] is not UTF-8 text (byte 0: 0xff)"

    def test_the_adapters_declare_them(self) -> None:
        import torch

        from workers.adapters import ADAPTERS

        def spec(adapter: str) -> P.ModelSpec:
            return P.ModelSpec(name="m", adapter=adapter)

        (audio,) = ADAPTERS["silero-vad"](spec("silero-vad"), torch.device("cpu")).inputs()
        assert (audio.items, audio.multiple_of, audio.finite) == ((1, 960000), 512, True)
        (text,) = ADAPTERS["sentence-transformers"](
            spec("sentence-transformers"), torch.device("cpu")
        ).inputs()
        assert (text.items, text.utf8) == ((1, 256), True)
