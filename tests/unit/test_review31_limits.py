"""Review 31 (what one misbehaving client on the LAN can do): the server ran any number of calls at once,
and one connection could open them all; an idle ModelStreamInfer stream costs about 33 KiB and is never
closed, so one client's 3,000 idle streams took 96 MiB, and more would have taken the manager's
memory. The manager's server now runs at most `MAX_CONCURRENT_RPCS` calls (one more is
RESOURCE_EXHAUSTED at once; admin and health calls are counted, never refused), one client host at
most `MAX_CALLS_PER_CLIENT` of them, and a public listener takes at most
`MAX_STREAMS_PER_CONNECTION` calls per connection. The limits are made small here (the test's own
values) to see them act.

Real components: the service's gRPC server on a free port over in-process device hosts, a client from
the generated stubs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_helpers import grpc_service, local_config

import manager.api.server as server_mod
from manager.api.runtime import MAX_STREAMS_PER_CONNECTION, limit_options
from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from residency_proto.v1 import residency_pb2 as adm
from residency_proto.v1 import residency_pb2_grpc as adm_grpc


async def _nothing() -> AsyncIterator[oip.ModelInferRequest]:
    await asyncio.Event().wait()  # an idle stream: it sends no request
    yield oip.ModelInferRequest()  # (never reached)


@contextlib.asynccontextmanager
async def _oip(tmp_path: Path) -> AsyncIterator[tuple[Any, Any]]:
    """An OIP stub and its channel on the service's gRPC server (a free port, in-process hosts)."""
    async with (
        grpc_service(local_config(tmp_path, ("voice",))) as (port, _, _, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield oip_grpc.GRPCInferenceServiceStub(channel), channel  # type: ignore[no-untyped-call]


async def _refused(stub: Any) -> str:
    """A ServerLive call's refusal (RESOURCE_EXHAUSTED): its details."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ServerLive(oip.ServerLiveRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return e.value.details() or ""


async def _three_idle_streams(stub: Any) -> list[Any]:
    idle = [stub.ModelStreamInfer(_nothing()) for _ in range(3)]
    for call in idle:  # each one open (its headers sent)
        await call.initial_metadata()
    return idle


def test_calls_past_the_servers_limit_are_refused_but_admin_and_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(A review of the first limit, gRPC's `maximum_concurrent_rpcs`: an app's idle streams locked
    out the admin, with the token, and health checks too.)"""
    monkeypatch.setattr(server_mod, "MAX_CONCURRENT_RPCS", 3)

    async def main() -> None:
        async with _oip(tmp_path) as (stub, channel):
            idle = await _three_idle_streams(stub)
            assert "the server runs 3 calls at once, its most" in await _refused(stub)
            admin = adm_grpc.ResidencyStub(channel)  # type: ignore[no-untyped-call]
            assert [m.name for m in (await admin.List(adm.ListRequest(), timeout=10)).models] == ["voice"]
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            idle[0].cancel()  # one ends: a call fits again
            for _ in range(100):
                try:
                    assert (await stub.ServerLive(oip.ServerLiveRequest(), timeout=10)).live
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("no call was taken once one ended")
            for call in idle[1:]:
                call.cancel()

    asyncio.run(main())


def test_one_client_host_may_not_take_them_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "MAX_CALLS_PER_CLIENT", 3)

    async def main() -> None:
        async with _oip(tmp_path) as (stub, _):
            idle = await _three_idle_streams(stub)
            said = await _refused(stub)
            assert "this client (127.0.0.1) runs 3 calls at once, the most one client may" in said
            for call in idle:
                call.cancel()

    asyncio.run(main())


def test_a_public_listener_limits_the_calls_of_one_connection() -> None:
    assert limit_options(public=True) == [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)]
    assert limit_options(public=False) == []  # (a front end's relay carries its clients' calls together)
