"""The gRPC server in-process on a real socket (grpc.aio, port 0): admin calls need the bearer token,
inference does not; listening beyond loopback without a token is refused; TLS with a generated cert."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.api.runtime import ServeError, event_loop_factory
from manager.api.server import auth_token
from manager.config import Config, load_config
from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from residency_proto.v1 import residency_pb2 as adm
from residency_proto.v1 import residency_pb2_grpc as adm_grpc

from .grpc_server import serving

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TOKEN = "s3cret-token-for-tests"


def config(**server: Any) -> Config:
    base = load_config(CONFIG)
    return base.model_copy(update={"server": base.server.model_copy(update=server)})


def with_server(cfg: Config, body: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        async with serving(cfg) as (target, _):
            await body(target)

    asyncio.run(main())


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_admin_calls_need_the_token_and_inference_does_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, frontends: int
) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RESIDENCY_TEST_TOKEN", TOKEN)
    cfg = config(listen="127.0.0.1:0", auth_token_env="RESIDENCY_TEST_TOKEN", frontends=frontends)

    async def body(target: str) -> None:
        async with grpc.aio.insecure_channel(target) as ch:
            admin = adm_grpc.ResidencyStub(ch)
            for meta in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await admin.List(adm.ListRequest(), metadata=meta)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in (e.value.details() or "")
                assert TOKEN not in (e.value.details() or "")
            ok = await admin.List(adm.ListRequest(), metadata=[("authorization", f"Bearer {TOKEN}")])
            assert {m.name for m in ok.models} == {"voice", "world", "embed"}
            infer = oip_grpc.GRPCInferenceServiceStub(ch)
            assert (await infer.ServerLive(oip.ServerLiveRequest())).live  # data plane: no token needed
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await infer.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="embed"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    with_server(cfg, body)
    assert TOKEN not in caplog.text  # no secret is logged, whatever happened


def test_beyond_loopback_without_a_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESIDENCY_TEST_TOKEN", raising=False)
    with pytest.raises(ServeError, match="beyond loopback"):
        auth_token(config(listen="0.0.0.0:50051", auth_token_env="RESIDENCY_TEST_TOKEN"))
    assert auth_token(config(listen="127.0.0.1:50051")) is None
    monkeypatch.setenv("RESIDENCY_TEST_TOKEN", TOKEN)
    assert auth_token(config(listen="0.0.0.0:50051", auth_token_env="RESIDENCY_TEST_TOKEN")) == TOKEN


def test_the_server_runs_on_uvloop_unless_asyncio_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    monkeypatch.delenv("RESIDENCY_EVENT_LOOP", raising=False)
    factory = event_loop_factory()
    assert factory is uvloop.new_event_loop
    monkeypatch.setenv("RESIDENCY_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
    monkeypatch.setenv("RESIDENCY_EVENT_LOOP", "tokio")
    with pytest.raises(ServeError, match="RESIDENCY_EVENT_LOOP='tokio'"):
        event_loop_factory()

    async def body() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with (
            serving(config(listen="127.0.0.1:0")) as (target, _),
            grpc.aio.insecure_channel(target) as ch,
        ):
            stub = oip_grpc.GRPCInferenceServiceStub(ch)
            assert (await stub.ServerLive(oip.ServerLiveRequest(), timeout=30)).live
            index = await stub.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=30)
            assert {m.name for m in index.models} == {"voice", "world", "embed"}

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(body())


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_tls_with_a_generated_certificate(tls_pair: tuple[Path, Path], frontends: int) -> None:
    cert, key = tls_pair
    cfg = config(listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key), frontends=frontends)

    async def body(target: str) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(target, creds) as ch:
            resp = await oip_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(oip.ServerMetadataRequest())
            assert resp.name == "residency"
        async with grpc.aio.insecure_channel(target) as ch:  # plaintext to a TLS port fails
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await oip_grpc.GRPCInferenceServiceStub(ch).ServerLive(oip.ServerLiveRequest(), timeout=5)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    with_server(cfg, body)


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_requests_over_the_size_limit_are_refused(frontends: int) -> None:
    cfg = config(listen="127.0.0.1:0", max_request_bytes=2**20, frontends=frontends)

    async def body(target: str) -> None:
        async with grpc.aio.insecure_channel(
            target, options=[("grpc.max_send_message_length", 8 * 2**20)]
        ) as ch:
            stub = oip_grpc.GRPCInferenceServiceStub(ch)
            req = oip.ModelInferRequest(model_name="voice", raw_input_contents=[b"\0" * (2 * 2**20)])
            req.inputs.add(name="audio", datatype="FP32", shape=[512 * 1024])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfer(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    with_server(cfg, body)


def test_the_token_compare_sees_only_fixed_length_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time: whatever is presented (empty, a prefix of the token, longer, all but the last
    byte right), compare_digest gets two 32-byte digests, so neither the shared prefix nor the length
    can change its time (bench/auth_timing.py measures it over gRPC)."""
    import hmac

    from manager.api.server import AuthInterceptor

    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    auth = AuthInterceptor("s3cret-token")
    for right in ("Bearer s3cret-token", "bearer s3cret-token", "BEARER s3cret-token"):  # RFC 6750
        assert auth.allows(right), right
    for wrong in ("", "Bearer ", "Bearer s3cret-toke", "Bearer s3cret-tokeX", "Bearer s3cret-token-and-more",
                  "s3cret-token", "bearer  s3cret-token", "Basic s3cret-token"):  # fmt: skip
        assert not auth.allows(wrong), wrong
    assert seen == [(32, 32)] * 11


@pytest.mark.parametrize(("first", "second"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_a_second_server_on_a_port_in_use_is_refused_not_sharing_it(first: int, second: int) -> None:
    """grpc turns SO_REUSEPORT on by default, and the front ends set it: a second `serve` on the same
    port started and split the connections with the first, two managers each believing they had the
    whole GPU (found in review, 2026-12-01). Now it is a ServeError naming the address."""

    async def body(target: str) -> None:
        from manager.api.server import Frontends, build_server
        from manager.live import LiveManager
        from manager.workers_bridge import create_pool

        cfg2 = config(listen=target, frontends=second)
        pool = create_pool(cfg2, in_process=True)
        try:
            manager = LiveManager(cfg2, pool)
            with pytest.raises(ServeError, match=f"cannot listen on '{target}'"):
                if second:
                    fronts = Frontends(cfg2, manager)
                    server, _, _ = await build_server(cfg2, manager, listen=fronts.backend)
                    try:
                        await fronts.start()
                    finally:
                        await fronts.stop()
                        await server.stop(None)
                else:
                    server, _, _ = await build_server(cfg2, manager)
                    await server.stop(None)
        finally:
            pool.close()

    with_server(config(listen="127.0.0.1:0", frontends=first), body)
