"""The Open Inference Protocol's view of a world model (17th review: manager/api/oip.py). A world model
generates frames in a world session (`residency.v1.WorldSession/Run`), and ModelInfer refuses it; yet
its ModelMetadata advertised an input (`actions` FP32 [-1, 4]) and an output (`latents`), with the
platform `residency/worldpager-mg2`. A stock client (tritonclient) that reads the metadata and builds
its request from it was refused the request it had been told to send. Now ModelMetadata answers a world
model with no inputs and no outputs and the platform `residency/world-session` (WORLD_PLATFORM), and
the index's reason for an unloaded world model says that a world session loads it (a ModelInfer request
does not: it is refused before admission). ModelReady and RepositoryIndex answer it as any model: the
residency state (READY on its device), the same in both. ModelConfig (served since review 19)
answers it with no tensors. Real components: the service's gRPC server on a free port over
in-process device hosts with the world model (the micro stand-in); `tritonclient` runs in a child
process (its generated `inference` messages and the service's cannot share one protobuf descriptor
pool)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from live_helpers import grpc_service, served_world_config, until

from manager.api.oip import WORLD_PLATFORM
from manager.config import Config
from manager.live import LiveManager
from manager.policy.types import Tier
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

LRU = "policy: {name: lru-keepalive}\n"  # no prewarm


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[int, LiveManager]]:
    """The service's gRPC server on a free port (its port) over in-process device hosts."""
    async with grpc_service(config) as (port, manager, _, _):
        await until(lambda: not manager.live["world"].loads_pending, "the start settled")
        yield port, manager


TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

c = tc.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}")
out = {}
meta = c.get_model_metadata("world")
out["meta"] = [meta.name, list(meta.versions), meta.platform,
               [(t.name, t.datatype, list(t.shape)) for t in meta.inputs],
               [(t.name, t.datatype, list(t.shape)) for t in meta.outputs]]
out["ready"] = c.is_model_ready("world")
out["index"] = [[m.name, m.version, m.state, m.reason] for m in c.get_model_repository_index().models]
try:
    c.get_model_config("world")
    out["config"] = "OK"
except InferenceServerException as e:
    out["config"] = [e.status(), e.message()]
# a stock client: a request built from what the metadata declares (-1: one)
inputs = []
for t in meta.inputs:
    shape = [1 if d == -1 else int(d) for d in t.shape]
    i = tc.InferInput(t.name, shape, t.datatype)
    i.set_data_from_numpy(np.zeros(shape, np.float32))
    inputs.append(i)
outputs = [tc.InferRequestedOutput(t.name) for t in meta.outputs]
try:
    c.infer("world", inputs, outputs=outputs or None)
    out["infer"] = "OK"
except InferenceServerException as e:
    out["infer"] = [e.status(), e.message()]
print(json.dumps(out))
"""


async def triton_client(port: int) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TRITON_CLIENT, str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    got: dict[str, object] = json.loads(stdout)
    return got


class TestAWorldModelsMetadataAdvertisesNothingModelInferRefuses:
    """ModelMetadata of a world model declared `actions` FP32 [-1, 4] and `latents` FP32 [-1, -1],
    platform `residency/worldpager-mg2`; ModelInfer refused the request built from them."""

    def test_the_metadata_has_no_tensors_and_names_the_world_session_platform(self, tmp_path: Path) -> None:
        async def main() -> None:
            async with (
                serving(served_world_config(tmp_path, LRU)) as (port, _),
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            ):
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                for version in ("", "1"):
                    m = await stub.ModelMetadata(
                        pb.ModelMetadataRequest(name="world", version=version), timeout=30
                    )
                    assert (m.name, list(m.versions), m.platform) == ("world", ["1"], WORLD_PLATFORM)
                    assert list(m.inputs) == [] and list(m.outputs) == []
                with pytest.raises(grpc.aio.AioRpcError) as e:  # versions still checked
                    await stub.ModelMetadata(pb.ModelMetadataRequest(name="world", version="2"), timeout=30)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert "model 'world' has no version '2'" in (e.value.details() or "")

        asyncio.run(main())

    def test_tritonclient_building_its_request_from_the_metadata(self, tmp_path: Path) -> None:
        """It sends what the metadata declares (nothing) and is told, by the platform already and by
        ModelInfer's answer, that the model is served through WorldSession; the index, readiness and
        metadata agree."""

        result: dict[str, object] = {}

        async def run() -> None:
            async with serving(served_world_config(tmp_path, LRU)) as (port, manager):
                result.update(await triton_client(port))
                result["serving"] = manager.serving("world")

        asyncio.run(run())
        assert result["meta"] == ["world", ["1"], WORLD_PLATFORM, [], []]
        status, message = result["infer"]  # type: ignore[misc]
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert "'world' is a world model" in message and "residency.v1.WorldSession/Run" in message
        assert result["config"] == "OK"  # (ModelConfig: served since review 19)
        (entry,) = result["index"]  # type: ignore[misc]
        assert entry[:2] == ["world", "1"]
        assert result["ready"] is result["serving"] and (entry[2] == "READY") is result["ready"]


class TestAnUnloadedWorldModelsIndexEntry:
    """UNAVAILABLE "unloaded (in the disk tier; a request loads it)": a ModelInfer request does not
    load a world model (refused before admission); a world session or RepositoryModelLoad does."""

    def test_it_says_a_world_session_loads_it_and_readiness_agrees(self, tmp_path: Path) -> None:
        async def main() -> None:
            async with serving(served_world_config(tmp_path, LRU)) as (port, manager):
                m = manager.engine.models["world"]
                manager.evict("world", "disk")
                await until(lambda: m.tier == Tier.DISK, "world evicted to disk")
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)
                    index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30)
                    (entry,) = index.models
                    assert (entry.name, entry.version, entry.state) == ("world", "1", "UNAVAILABLE")
                    assert entry.reason == (
                        "unloaded (in the disk tier; a world session, residency.v1.WorldSession/Run, "
                        "loads it)"
                    )
                    ready = await stub.ModelReady(pb.ModelReadyRequest(name="world"), timeout=30)
                    assert ready.ready is False
                    await stub.RepositoryModelLoad(
                        pb.RepositoryModelLoadRequest(model_name="world"), timeout=60
                    )
                    index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=30)
                    assert [(e.name, e.state, e.reason) for e in index.models] == [("world", "READY", "")]
                    ready = await stub.ModelReady(pb.ModelReadyRequest(name="world"), timeout=30)
                    assert ready.ready is True

        asyncio.run(main())
