"""Found in the 13th review of the operator's view (manager/api/admin.py, manager/metrics.py, `residency
ps`); each test failed before its fix. Real components: the service's gRPC server on a free port over
in-process device hosts, a real TorchScript checkpoint, prometheus_client's registry."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from live_helpers import until

from manager.api.admin import AdminServicer
from manager.api.server import build_server
from manager.cli import main
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.metrics import Metrics
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc
from workers import protocol as P

CONFIG = """
server: {listen: "127.0.0.1:0"}
store: {url: "sqlite:///TMP/state.db", journal: TMP/requests.journal}
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: interactive}]
policy: {name: lru-keepalive}
models:
  - {name: tiny, class: interactive, adapter: torchscript, device: cpu0, memory: 1MiB, prewarm: false,
     load_seconds: {disk: 0.1, host: 0.05}, source: {path: TMP/tiny.pt}}
  - {name: gone, class: interactive, adapter: torchscript, device: cpu0, memory: 1MiB, prewarm: false,
     load_seconds: {disk: 0.1, host: 0.05}, source: {path: TMP/missing.pt}}
"""
"""A CPU device with a real (tiny) TorchScript model and one whose checkpoint is missing; nothing is
prewarmed, so what is loaded is what the test asks for."""


def config(tmp_path: Path) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated in this torch
        torch.jit.script(torch.nn.Linear(4, 2)).save(str(tmp_path / "tiny.pt"))  # type: ignore[no-untyped-call]
    (tmp_path / "c.yaml").write_text(CONFIG.replace("TMP", str(tmp_path)))
    return load_config(tmp_path / "c.yaml")


class _HoldingPool:
    """Around the in-process pool (unit tests only): the results of the models in `hold` are kept
    back (the host has run the command) until they leave it."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.hold: set[str] = set()
        self.sent: list[tuple[str, str]] = []
        self._held: list[P.CommandResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        self.sent.append((P.command_op(cmd), P.command_model(cmd)))
        op: str = self.real.submit(device, cmd, op_id)
        return op

    def poll(self) -> list[P.CommandResult]:
        results, self._held = self._held + self.real.poll(), []
        out: list[P.CommandResult] = []
        for r in results:
            (self._held if r.model in self.hold else out).append(r)
        return out


@contextlib.asynccontextmanager
async def serving(
    cfg: Config, hold: tuple[str, ...] = (), store: Any = None
) -> AsyncIterator[tuple[pb_grpc.ResidencyStub, LiveManager, _HoldingPool]]:
    """The service's gRPC server on a free port over in-process hosts: a Residency stub, the manager
    and the (holding) pool, holding back the results of the models in `hold` from the start; the
    manager with `store` (None: none)."""
    pool = _HoldingPool(create_pool(cfg, in_process=True))
    pool.hold.update(hold)
    manager = LiveManager(cfg, pool, store=store)
    server, port, _ = await build_server(cfg, manager)
    await server.start()
    await manager.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.ResidencyStub(channel), manager, pool
    finally:
        await server.stop(None)
        await manager.stop()
        pool.real.close()


async def tier_of(stub: pb_grpc.ResidencyStub, name: str) -> str:
    listed = await stub.List(pb.ListRequest())
    return next(str(m.tier) for m in listed.models if m.name == name)


class TestPreloadToHostRam:
    """Preload(tier=host) answered OK with tier `host` as soon as the read was sent to the device
    host: while the read was still under way (`ps` said `host` too), and for a model whose checkpoint
    is missing (the load then failed, and nothing told the caller). A preload to the GPU waits for its
    confirmed load and answers UNAVAILABLE naming the cause."""

    def test_a_load_that_fails_is_unavailable_naming_the_cause(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, _, _):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Preload(pb.PreloadRequest(name="gone", tier="host"))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "missing.pt" in str(e.value.details())
                assert await tier_of(stub, "gone") == "disk"

        asyncio.run(body())

    def test_it_answers_once_the_host_holds_it_and_ps_says_loading_meanwhile(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                pool.hold.add("tiny")
                call = asyncio.ensure_future(stub.Preload(pb.PreloadRequest(name="tiny", tier="host")))
                await until(lambda: ("load", "tiny") in pool.sent, "the read into host RAM was sent")
                await until(lambda: pool.real.pending() == 0, "the device host ran it")
                assert await tier_of(stub, "tiny") == "loading"  # not confirmed: not yet in host RAM
                assert not call.done()
                pool.hold.clear()
                status = await call
                assert status.tier == "host" and manager.live["tiny"].tier == "host"
                assert await tier_of(stub, "tiny") == "host"

        asyncio.run(body())


class TestEventsEndWhenTheServiceStops:
    """An Events stream never ends by itself, so a stop (SIGTERM) with an event watcher attached (a
    dashboard, `grpcurl … Events`) waited the whole grace period (6 s, against 0.05 s without one),
    and the watcher was then cut with "Cancelling all calls"."""

    def test_the_stream_ends_unavailable_saying_so_as_soon_as_the_stop_begins(self, tmp_path: Path) -> None:
        async def body() -> None:
            cfg = config(tmp_path)
            pool = create_pool(cfg, in_process=True)
            manager = LiveManager(cfg, pool)
            admin = AdminServicer(manager)
            server = grpc.aio.server()
            pb_grpc.add_ResidencyServicer_to_server(admin, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await manager.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = pb_grpc.ResidencyStub(channel).Events(pb.EventsRequest())
                    await until(lambda: len(manager._subscribers) == 1, "the watcher subscribed")
                    manager._publish("note", "tiny", "before the stop", "cpu0", 1.0)
                    first = await call.read()
                    assert first.kind == "note"
                    admin.stopping.set()
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await asyncio.wait_for(call.read(), 2.0)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "stopping" in str(e.value.details())
                    await until(lambda: not manager._subscribers, "the watcher unsubscribed")
            finally:
                await server.stop(None)
                await manager.stop()
                pool.close()

        asyncio.run(body())

    def test_the_servers_stop_ends_it(self, tmp_path: Path) -> None:
        """`serve` sets `server.world_stopping` at its stop: the Events streams end with it."""

        async def body() -> None:
            cfg = config(tmp_path)
            pool = create_pool(cfg, in_process=True)
            manager = LiveManager(cfg, pool)
            server, port, _ = await build_server(cfg, manager)
            await server.start()
            await manager.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = pb_grpc.ResidencyStub(channel).Events(pb.EventsRequest())
                    await until(lambda: len(manager._subscribers) == 1, "the watcher subscribed")
                    server.world_stopping.set()
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await asyncio.wait_for(call.read(), 2.0)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "the service is stopping" in str(e.value.details())
            finally:
                await server.stop(None)
                await manager.stop()
                pool.close()

        asyncio.run(body())


def test_a_load_slower_than_30_s_is_not_read_as_30_s() -> None:
    """The load and wait histograms ended at a 30 s bucket: every LLM read from a disk in a minute
    or more fell in +Inf, and histogram_quantile reads that as the last finite bucket (30 s)."""
    m = Metrics()
    m.load_seconds.labels("llm", "disk->gpu").observe(90.0)
    m.wait.labels("interactive").observe(90.0)
    load = {"model": "llm", "transition": "disk->gpu"}
    assert m.registry.get_sample_value("residency_load_seconds_bucket", {**load, "le": "60.0"}) == 0
    assert m.registry.get_sample_value("residency_load_seconds_bucket", {**load, "le": "120.0"}) == 1
    wait = {"cls": "interactive"}
    assert m.registry.get_sample_value("residency_request_wait_seconds_bucket", {**wait, "le": "120.0"}) == 1


class _Refusing(pb_grpc.ResidencyServicer):
    async def List(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin call: missing or wrong bearer token")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--config", "CFG"], "$PS_TOKEN_13 is not set here"),
        ([], "--token-env"),
    ],
)
def test_ps_without_a_token_says_why_none_was_sent(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    says: str,
) -> None:
    """`residency ps` against a server that wants a token, with none to send (the config's variable
    not set in this shell, or --target without --token-env) printed only the server's UNAUTHENTICATED,
    which reads as a wrong token."""
    monkeypatch.delenv("PS_TOKEN_13", raising=False)

    async def serve_and_ps() -> int:
        server = grpc.aio.server()
        pb_grpc.add_ResidencyServicer_to_server(_Refusing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            cfg = tmp_path / "c.yaml"
            cfg.write_text(
                CONFIG.replace("TMP", str(tmp_path)).replace(
                    'server: {listen: "127.0.0.1:0"}',
                    f'server: {{listen: "127.0.0.1:{port}", auth_token_env: PS_TOKEN_13}}',
                )
            )
            argv = ["ps", *(str(cfg) if a == "CFG" else a for a in args)]
            if not args:
                argv += ["--target", f"127.0.0.1:{port}"]
            return await asyncio.to_thread(main, argv)
        finally:
            await server.stop(None)

    assert asyncio.run(serve_and_ps()) == 2
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and says in err


def test_a_watcher_too_slow_for_its_events_is_told_where_some_were_dropped(tmp_path: Path) -> None:
    """A watcher's queue holds 1,000 events; the ones past that were dropped without a word, so a
    dashboard showed a history with a hole it could not see."""
    from manager.live import EVENTS_QUEUE

    async def body() -> None:
        cfg = config(tmp_path)
        pool = create_pool(cfg, in_process=True)
        manager = LiveManager(cfg, pool)
        try:
            q = manager.subscribe()
            for i in range(EVENTS_QUEUE + 5):  # 5 past what fits
                manager._publish("note", "tiny", f"event {i}", "cpu0", float(i))
            read = [q.get_nowait() for _ in range(3)]
            manager._publish("note", "tiny", "after the reader caught up", "cpu0", 9e3)
            rest = [q.get_nowait() for _ in range(q.qsize())]
        finally:
            pool.close()
        details = [e["detail"] for e in read + rest]
        assert details[:EVENTS_QUEUE] == [f"event {i}" for i in range(EVENTS_QUEUE)]
        gap = (read + rest)[EVENTS_QUEUE]
        assert gap["kind"] == "events_dropped" and gap["detail"].startswith("5 events were dropped here")
        assert details[EVENTS_QUEUE + 1 :] == ["after the reader caught up"]

    asyncio.run(body())


class TestPreloadToTheGpuSaysWhatHoldsTheRoom:
    """A Preload to the GPU that found no room said only "no room on cpu0 without breaking the rules":
    not whether the model can never fit there, nor what holds the room."""

    @staticmethod
    def _config(tmp_path: Path, reserve: bool) -> Config:
        config(tmp_path)
        text = (tmp_path / "c.yaml").read_text().replace("memory: 1MiB", "memory: 600MiB")
        if reserve:  # a higher class's model holds 600 MiB of the 896 MiB usable (pinned)
            text = text.replace("classes: [", "classes: [{name: realtime}, ")
            text = text.replace(
                "{name: tiny, class: interactive,", "{name: tiny, class: realtime, pin: true,"
            )
        (tmp_path / "c.yaml").write_text(text)
        return load_config(tmp_path / "c.yaml")

    def test_a_model_that_can_never_fit_says_so(self, tmp_path: Path) -> None:
        async def body() -> None:
            # the pinned model's load held back: measured, it would take next to nothing
            async with serving(self._config(tmp_path, reserve=True), hold=("tiny",)) as (stub, _, pool):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Preload(pb.PreloadRequest(name="gone", tier="gpu"))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = str(e.value.details())
                assert "model 'gone' needs 600MiB but device 'cpu0' can never give it" in details, details
                pool.hold.clear()

        asyncio.run(body())

    def test_a_model_loading_for_another_preload_is_named(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(self._config(tmp_path, reserve=False)) as (stub, _, pool):
                pool.hold.add("tiny")
                first = asyncio.ensure_future(stub.Preload(pb.PreloadRequest(name="tiny", tier="gpu")))
                await until(lambda: ("load", "tiny") in pool.sent, "tiny's load was sent")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Preload(pb.PreloadRequest(name="gone", tier="gpu"))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = str(e.value.details())
                assert "model 'gone': no room on cpu0 for its 600MiB" in details, details
                assert "tiny 600MiB (loading)" in details, details
                pool.hold.clear()
                await first

        asyncio.run(body())


def test_evict_of_a_pinned_model_to_a_wrong_tier_names_the_tier_first(tmp_path: Path) -> None:
    """It said "pinned; unpin it first", and once unpinned, that the tier was wrong."""

    async def body() -> None:
        config(tmp_path)
        pinned = (tmp_path / "c.yaml").read_text().replace("{name: tiny,", "{name: tiny, pin: true,")
        (tmp_path / "c.yaml").write_text(pinned)
        async with serving(load_config(tmp_path / "c.yaml")) as (stub, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Evict(pb.EvictRequest(name="tiny", to="gpu"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "evict to must be disk or host, not 'gpu'" in str(e.value.details())

    asyncio.run(body())
