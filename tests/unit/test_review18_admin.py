"""Found in the 18th review (manager/api/admin.py): Preload(tier=host) sent right after an Evict(to=disk)
of the same model answered `host` before its device host confirmed the load into host RAM, and `ps`
said `host` meanwhile, not `loading`: the wait (and `ps`) looked only for the host reporting the model
on disk, and while the drop was still on its way the host still reported it on the GPU (or in host
RAM). Each test failed before its fix. Real components: the service's gRPC server on a free port over
in-process device hosts, a real TorchScript checkpoint; the results of the held model come back late."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import grpc
import pytest
import torch
from live_helpers import until
from test_review13_admin import _HoldingPool, serving

from manager.api.admin import preload_host
from manager.config import Config, load_config
from manager.errors import DeadlineExceeded
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

CONFIG = """
server: {listen: "127.0.0.1:0"}
store: {url: "sqlite:///TMP/state.db", journal: TMP/requests.journal}
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: interactive}]
policy: {name: lru-keepalive}
models:
  - {name: embed, class: interactive, adapter: torchscript, device: cpu0, memory: 1MiB, prewarm: false,
     load_seconds: {disk: 0.1, host: 0.05}, source: {path: TMP/embed.pt}}
"""
"""A CPU device with a real (tiny) TorchScript model; nothing is prewarmed."""


def config(tmp_path: Path) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated in this torch
        torch.jit.script(torch.nn.Linear(4, 2)).save(str(tmp_path / "embed.pt"))  # type: ignore[no-untyped-call]
    (tmp_path / "c.yaml").write_text(CONFIG.replace("TMP", str(tmp_path)))
    return load_config(tmp_path / "c.yaml")


async def tier_of(stub: pb_grpc.ResidencyStub, name: str) -> str:
    listed = await stub.List(pb.ListRequest())
    return next(str(m.tier) for m in listed.models if m.name == name)


async def evict_then_preload_to_host(
    stub: pb_grpc.ResidencyStub, pool: _HoldingPool
) -> asyncio.Future[pb.ModelStatus]:
    """Evict(to=disk) and at once Preload(tier=host), the results of both held back; returns the
    preload's call once its device host has run both commands (their results not yet taken)."""
    pool.hold.add("embed")
    pool.sent.clear()
    await stub.Evict(pb.EvictRequest(name="embed", to="disk"))
    call: asyncio.Future[pb.ModelStatus] = asyncio.ensure_future(
        stub.Preload(pb.PreloadRequest(name="embed", tier="host"))
    )
    await until(
        lambda: pool.sent == [("drop", "embed"), ("load", "embed")], "the drop and the read were sent"
    )
    await until(lambda: pool.real.pending() == 0, "the device host ran both")
    return call


class TestPreloadToHostRightAfterAnEvict:
    def test_from_the_gpu_it_answers_once_the_read_is_confirmed_and_ps_says_loading_meanwhile(
        self, tmp_path: Path
    ) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                assert str(manager.live["embed"].tier) == "gpu"
                call = await evict_then_preload_to_host(stub, pool)
                await asyncio.sleep(0.2)  # (a wrong answer comes at once)
                assert not call.done(), "answered before the read into host RAM was confirmed"
                assert await tier_of(stub, "embed") == "loading"
                pool.hold.clear()
                status = await call
                assert status.tier == "host" and manager.live["embed"].tier == "host"
                assert await tier_of(stub, "embed") == "host"

        asyncio.run(body())

    def test_from_host_ram_it_waits_for_the_new_read_too(self, tmp_path: Path) -> None:
        """The host still reports it in host RAM until the drop's result comes: not the new read's."""

        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="host"))
                assert str(manager.live["embed"].tier) == "host"
                call = await evict_then_preload_to_host(stub, pool)
                await asyncio.sleep(0.2)
                assert not call.done(), "answered before the read into host RAM was confirmed"
                assert await tier_of(stub, "embed") == "loading"
                pool.hold.clear()
                status = await call
                assert status.tier == "host" and manager.live["embed"].tier == "host"

        asyncio.run(body())

    def test_a_read_that_fails_is_unavailable_naming_the_cause(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, _, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                (tmp_path / "embed.pt").unlink()  # the read into host RAM fails
                call = await evict_then_preload_to_host(stub, pool)
                await asyncio.sleep(0.2)
                assert not call.done(), "answered before the read into host RAM was answered"
                pool.hold.clear()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                details = str(e.value.details())
                assert "model 'embed' could not be loaded into host RAM" in details and "embed.pt" in details
                assert await tier_of(stub, "embed") == "disk"

        asyncio.run(body())

    def test_its_deadline_passing_is_said(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                pool.hold.add("embed")
                manager.evict("embed", "disk")
                with pytest.raises(DeadlineExceeded) as e:
                    await preload_host(manager, "embed", timeout_s=0.3)
                assert "model 'embed': its load into host RAM did not finish within 0.3 s" in str(e.value)
                assert await tier_of(stub, "embed") == "loading"
                pool.hold.clear()
                await until(lambda: manager.live["embed"].tier == "host", "the read was confirmed")
                assert await tier_of(stub, "embed") == "host"

        asyncio.run(body())
