"""Review 31 (what one app on the LAN can do without the token): a request's class came from its
`priority` or `residency_class` whoever sent it, so any app could name the top class for its own
model and evict the voice models (pinned ones excepted), request after request. Now, while the
service has an admin token, a class above the model's own needs that token (PERMISSION_DENIED
otherwise), directly, through a front end (the fast path carries the call's header to the manager)
and for a world session's `class_name`; lowering the class, or asking the model's own, needs nothing.
Without a token (a loopback service) every request may ask any class, as before.

Real components: the gRPC server in-process on a real socket, the example CPU home's models
(`configs/local-cpu.yaml`: voice realtime, world interactive, embed background), front-end processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.config import Config, load_config
from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from residency_proto.v1 import residency_pb2 as rpb
from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

from .grpc_server import serving

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TOKEN = "class-claims-test-token"
ENV = "RESIDENCY_TEST_CLAIMS_TOKEN"
BEARER = [("authorization", f"Bearer {TOKEN}")]


def config(tmp_path: Path, **server: Any) -> Config:
    base = load_config(CONFIG)
    return base.model_copy(
        update={
            "server": base.server.model_copy(update={"listen": "127.0.0.1:0", **server}),
            "store": base.store.model_copy(update={"sessions": str(tmp_path / "sessions")}),
        }
    )


def embed_request(**params: Any) -> oip.ModelInferRequest:
    r = oip.ModelInferRequest(model_name="embed")
    r.inputs.add(
        name="text", datatype="BYTES", shape=[1], contents=oip.InferTensorContents(bytes_contents=[b"hi"])
    )
    for key, (kind, value) in params.items():
        setattr(r.parameters[key], kind, value)
    return r


async def _once(msg: Any) -> AsyncIterator[Any]:
    yield msg


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_a_class_above_the_models_own_needs_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frontends: int
) -> None:
    monkeypatch.setenv(ENV, TOKEN)
    cfg = config(tmp_path, auth_token_env=ENV, frontends=frontends)

    async def main() -> None:
        async with serving(cfg) as (target, _), grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            raised = (
                embed_request(priority=("uint64_param", 1)),
                embed_request(residency_class=("string_param", "realtime")),
            )
            for request in raised:
                for meta in (None, [("authorization", "Bearer wrong")]):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.ModelInfer(request, metadata=meta, timeout=60)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert (e.value.details() or "").startswith(
                        "model 'embed': class 'realtime' is above its own ('background'); a request asks "
                        "a higher class only with the admin token"
                    )
                    assert TOKEN not in (e.value.details() or "")
                ok = await stub.ModelInfer(request, metadata=BEARER, timeout=60)  # with the token: served
                assert [o.name for o in ok.outputs] == ["embedding"]
            # its own class, a lower one, or none: no token needed
            for request in (
                embed_request(),
                embed_request(residency_class=("string_param", "background")),
                embed_request(priority=("uint64_param", 3)),
            ):
                assert [o.name for o in (await stub.ModelInfer(request, timeout=60)).outputs] == ["embedding"]
            # ModelStreamInfer (relayed to the manager's own server through a front end): the same
            answers = [a async for a in stub.ModelStreamInfer(_once(raised[0]), timeout=60)]
            assert "class 'realtime' is above its own" in answers[0].error_message
            answers = [a async for a in stub.ModelStreamInfer(_once(raised[0]), metadata=BEARER, timeout=60)]
            assert not answers[0].error_message
            # a world session's class_name (world is interactive)
            world = rpb_grpc.WorldSessionStub(channel)  # type: ignore[no-untyped-call]
            start = rpb.WorldInput(start=rpb.WorldStart(model="world", class_name="realtime"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in world.Run(_once(start), timeout=60):
                    pass
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "session asks a higher class only with the admin token" in (e.value.details() or "")

    asyncio.run(main())


def test_without_a_token_any_request_may_ask_any_class(tmp_path: Path) -> None:
    async def main() -> None:
        async with serving(config(tmp_path)) as (target, _), grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            ok = await stub.ModelInfer(embed_request(priority=("uint64_param", 1)), timeout=60)
            assert [o.name for o in ok.outputs] == ["embedding"]

    asyncio.run(main())
