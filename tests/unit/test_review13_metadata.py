"""ModelMetadata (and a request's check against the model's declared inputs) reads what a module
declares by building it on the meta device, which runs the model's factory. A factory that never
returns held the manager's event loop, and so every call of the service (ServerLive included), for
good; each later call started the build again. Now the build runs on a thread of its own, waited for
at most the describer's limit, and a build past its limit is not started again while it runs."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from torch import nn

from manager.api.server import build_server, describer
from manager.config import load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers.st_io import write_safetensors

CONFIG = """
server: {{listen: "127.0.0.1:0"}}
store: {{url: "sqlite:///{tmp}/state.db", journal: "{tmp}/requests.journal"}}
devices: [{{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}]
host: {{memory: 4GiB, reserve: 1GiB}}
classes: [{{name: interactive}}]
models:
  - {{name: stuck, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     prewarm: false, load_seconds: {{disk: 0.05, host: 0.01}},
     source: {{factory: "residency_review13_stuck:mlp", path: "{tmp}/m.safetensors"}}}}
"""

RELEASE = threading.Event()
BUILDS: list[int] = []


def _mlp() -> nn.Module:
    BUILDS.append(1)
    RELEASE.wait(30)  # a factory that hangs (until the test lets it go)
    return nn.Linear(4, 2)


@pytest.fixture
def stuck_factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    mod = types.ModuleType("residency_review13_stuck")
    mod.mlp = _mlp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    RELEASE.clear()
    BUILDS.clear()
    yield
    RELEASE.set()


def test_a_factory_that_hangs_holds_neither_the_service_nor_a_thread_a_call(
    tmp_path: Path, stuck_factory: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.api.server as server_mod

    write_safetensors(nn.Linear(4, 2).state_dict(), tmp_path / "m.safetensors")
    (tmp_path / "c.yaml").write_text(CONFIG.format(tmp=tmp_path))
    cfg = load_config(tmp_path / "c.yaml")
    monkeypatch.setattr(server_mod, "describer", lambda m: describer(m, timeout_s=0.5))

    async def main() -> None:
        pool = create_pool(cfg, in_process=True)
        manager = LiveManager(cfg, pool)
        server, port, _ = await build_server(cfg, manager)
        await server.start()
        await manager.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                meta = asyncio.ensure_future(
                    stub.ModelMetadata(pb.ModelMetadataRequest(name="stuck"), timeout=10)
                )
                live = await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)  # the loop still answers
                assert live.live
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await meta
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "model 'stuck': reading its inputs and outputs" in str(e.value.details())
                assert "more than 0.5 s; its factory may hang" in str(e.value.details())
                with pytest.raises(grpc.aio.AioRpcError) as again:  # refused at once, not built again
                    await stub.ModelMetadata(pb.ModelMetadataRequest(name="stuck"), timeout=0.4)
                assert again.value.code() == grpc.StatusCode.UNAVAILABLE
                assert len(BUILDS) == 1
                RELEASE.set()  # the build ends: its answer is kept
                for _ in range(100):
                    try:
                        ok = await stub.ModelMetadata(pb.ModelMetadataRequest(name="stuck"), timeout=5)
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.05)
                assert [t.name for t in ok.inputs] == ["input"]
                assert len(BUILDS) == 1
        finally:
            await server.stop(None)
            await manager.stop()
            pool.close()

    asyncio.run(main())
