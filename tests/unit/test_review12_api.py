"""Review of the gRPC surface (manager/api/): what a client sees over a real socket, with the service's
gRPC server in this process on in-process device hosts. One class per bug found; each docstring says
what a client saw before."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import grpc_service, local_config, served_world_config, until

from manager.config import Config
from manager.live import LiveManager
from manager.policy.types import Tier
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[grpc.aio.Channel, LiveManager, grpc.aio.Server]]:
    """The service's gRPC server on a free port, a channel to it, and the server."""
    async with (
        grpc_service(config) as (port, manager, server, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield channel, manager, server


def run(config: Config, body: Callable[[grpc.aio.Channel, LiveManager], Awaitable[None]]) -> None:
    async def main() -> None:
        async with serving(config) as (channel, manager, _):
            await body(channel, manager)

    asyncio.run(main())


def voice_request(**params: Any) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voice", id="req-1")
    r.inputs.add(name="audio", datatype="FP32", shape=[512])
    r.raw_input_contents.append(np.zeros(512, np.float32).tobytes())
    for key, (field, value) in params.items():
        if field is None:
            r.parameters[key].SetInParent()  # present, with no value set
        else:
            setattr(r.parameters[key], field, value)
    return r


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value


class TestModelInferOnAWorldModel:
    """ModelInfer naming a world model (an elastic tenant, served through residency.v1.WorldSession)
    was admitted like any request: the model was loaded onto its device (evicting others there for
    it, on a GPU gigabytes of weights), the call counted as served and as a cold start, and only then
    did the device host refuse it. Now it is refused before admission, and nothing moves."""

    def test_it_is_refused_up_front_and_the_model_stays_where_it_is(self, tmp_path: Path) -> None:
        cfg = served_world_config(tmp_path, "policy: {name: lru-keepalive}\n")  # no prewarm

        async def body(channel: grpc.aio.Channel, manager: LiveManager) -> None:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            m = manager.engine.models["world"]
            await until(lambda: not manager.live["world"].loads_pending, "the start settled")
            manager.evict("world", "disk")
            await until(lambda: m.tier == Tier.DISK, "world evicted to disk")
            events = manager.subscribe()
            r = pb.ModelInferRequest(model_name="world")
            r.inputs.add(name="actions", datatype="FP32", shape=[1, 4])
            r.raw_input_contents.append(np.zeros(4, np.float32).tobytes())
            e = await rpc_error(stub.ModelInfer(r, timeout=30))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            await asyncio.sleep(0.3)  # a load it had started would have shown by now
            kinds = []
            while not events.empty():
                kinds.append(events.get_nowait()["kind"])
            assert "load" not in kinds and m.tier == Tier.DISK
            assert manager.served == 0 and manager.cold_starts == 0
            assert "'world' is a world model" in (e.details() or "")
            assert "WorldSession" in (e.details() or "")

        run(cfg, body)


@pytest.fixture(scope="module")
def voice_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One voice-only server for the tests below: (event loop, channel, manager), on a thread."""
    import threading

    cfg = local_config(tmp_path_factory.mktemp("voice"), ("voice",))
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    channel, manager, _ = loop.run_until_complete(stack.enter_async_context(serving(cfg)))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(make: Callable[[], Awaitable[Any]]) -> Any:
        """Await `make()` on the server's loop (gRPC's aio calls belong to the loop they start on)."""

        async def on_loop() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(60)

    yield call, channel, manager
    asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


class TestResidencyClassOfAnotherType:
    """A `residency_class` parameter sent as an int64, a bool or with no value set was turned into a
    string ("2", "True", "None") and refused as "unknown class '2'" (or, worse, 'None'), never saying
    that the parameter's type was the problem."""

    @pytest.mark.parametrize(
        ("param", "shown"),
        [(("int64_param", 2), "2"), (("bool_param", True), "True"), ((None, None), "None")],
        ids=["int64", "bool", "unset"],
    )
    def test_it_is_invalid_naming_the_type_expected(self, voice_server: Any, param: Any, shown: str) -> None:
        call, channel, _ = voice_server
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        e = call(lambda: rpc_error(stub.ModelInfer(voice_request(residency_class=param), timeout=30)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = e.details() or ""
        assert "parameter 'residency_class' must be a string" in details
        assert f"got {shown}" in details and "realtime, interactive, background" in details

    def test_a_class_name_still_chooses_the_class(self, voice_server: Any) -> None:
        call, channel, _ = voice_server
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        req = voice_request(residency_class=("string_param", "background"))
        resp = call(lambda: stub.ModelInfer(req, timeout=30))
        assert resp.id == "req-1" and [o.name for o in resp.outputs] == ["speech_prob"]


class TestRepositoryLoadParameters:
    """RepositoryModelLoad with Triton's `config` override (tritonclient's `load_model(name,
    config=...)`) or `file:` contents answered OK having ignored them: the client believed the model
    now ran with its new configuration. Now INVALID_ARGUMENT names them and says where configuration
    comes from; a plain load and an unload (tritonclient always sends `unload_dependents`) work."""

    def test_a_config_override_is_refused_by_name(self, voice_server: Any) -> None:
        call, channel, _ = voice_server
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        req = pb.RepositoryModelLoadRequest(model_name="voice")
        req.parameters["config"].string_param = '{"max_batch_size": 8}'
        req.parameters["file:1/model.pt"].bytes_param = b"weights"
        e = call(lambda: rpc_error(stub.RepositoryModelLoad(req, timeout=30)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = e.details() or ""
        assert "parameters are not supported (got 'config', 'file:1/model.pt')" in details
        assert "ReloadConfig" in details

    def test_an_unknown_model_is_not_found_first(self, voice_server: Any) -> None:
        call, channel, _ = voice_server
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        req = pb.RepositoryModelLoadRequest(model_name="nope")
        req.parameters["config"].string_param = "{}"
        e = call(lambda: rpc_error(stub.RepositoryModelLoad(req, timeout=30)))
        assert e.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in (e.details() or "")

    def test_plain_load_and_unload_with_unload_dependents_work(self, voice_server: Any) -> None:
        call, channel, manager = voice_server
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call(lambda: stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="voice"), timeout=30))
        assert manager.serving("voice")
        unload = pb.RepositoryModelUnloadRequest(model_name="voice")
        unload.parameters["unload_dependents"].bool_param = False
        e = call(lambda: rpc_error(stub.RepositoryModelUnload(unload, timeout=30)))
        # voice is pinned in local-cpu.yaml: the unload reaches the manager, which says so; the
        # request is well formed, the service's state forbids it (review 31: INVALID_ARGUMENT before)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "pinned" in (e.details() or "")


class TestResponseOverTheMessageLimit:
    """`server.max_request_bytes` bounds what the server sends too. A small request whose response
    passed it (a batch of texts for the embedding model: 1.5 KiB out per text) was served, then
    failed in gRPC's send: the client got "SERVER: Sent message larger than max (24667 vs. 8192)",
    naming neither the setting nor what to do (and a front end logged a traceback). Now the service
    answers RESOURCE_EXHAUSTED naming `server.max_request_bytes`, and keeps serving."""

    def test_it_names_the_setting_and_smaller_requests_still_work(self, tmp_path: Path) -> None:
        cfg = local_config(tmp_path, ("voice", "embed"), max_request_bytes=8192)

        def texts(n: int) -> pb.ModelInferRequest:
            r = pb.ModelInferRequest(model_name="embed")
            r.inputs.add(name="text", datatype="BYTES", shape=[n])
            r.raw_input_contents.append(b"".join(struct.pack("<I", 2) + b"hi" for _ in range(n)))
            return r

        async def body(channel: grpc.aio.Channel, manager: LiveManager) -> None:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            ok = await stub.ModelInfer(texts(1), timeout=60)
            assert list(ok.outputs[0].shape) == [1, 384]
            e = await rpc_error(stub.ModelInfer(texts(16), timeout=60))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = e.details() or ""
            assert "server.max_request_bytes: 8192" in details and "model 'embed'" in details
            again = await stub.ModelInfer(texts(2), timeout=60)
            assert list(again.outputs[0].shape) == [2, 384]

        run(cfg, body)


class TestAWorldStreamEndsAtOnceWhenTheServerStops:
    """An open world session's stream held the server's stop for its whole grace (5 s), and its
    client then got gRPC's own "Cancelling all calls", not that the server stopped nor how to resume."""

    def test_it_ends_unavailable_naming_the_session_to_resume(self, tmp_path: Path) -> None:
        import time

        from residency_proto.v1 import residency_pb2 as rpb
        from residency_proto.v1 import residency_pb2_grpc as rpb_grpc

        cfg = served_world_config(tmp_path)

        async def main() -> None:
            async with serving(cfg) as (channel, manager, server):
                call = rpb_grpc.WorldSessionStub(channel).Run()
                await call.write(rpb.WorldInput(start=rpb.WorldStart(model="world")))
                opened = await call.read()
                await call.write(rpb.WorldInput(action=rpb.WorldAction(x=1.0)))
                assert (await call.read()).segment == 0
                t0 = time.monotonic()
                server.world_stopping.set()  # as `serve` does when it stops
                e = await rpc_error(call.read())
                # at once, not after the stop's 5 s grace (its session's save, fsyncs included, first)
                assert time.monotonic() - t0 < 4.5
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert "the server is stopping" in (e.details() or "")
                assert f"resume_session_id={opened.session_id!r}) at segment 1" in (e.details() or "")
                assert "once the server is back" in (e.details() or "")
                await until(lambda: not manager.sessions, "the session closed (saved)")

        asyncio.run(main())
