"""Review 20, a walkthrough of the Open Inference Protocol front with tritonclient (the service's gRPC
server on a free port over in-process device hosts, configs/local-cpu.yaml), each failing before its
fix:

- A request with no deadline (no `timeout` parameter, or 0, and none on its call: tritonclient's
  default) was given one of 60 s by the server: a slow forward, or a cold load of minutes, was cut
  off DEADLINE_EXCEEDED, blamed on a deadline the client never set. Triton has none: now a day.
- `repository_name` in RepositoryIndex / RepositoryModelLoad / RepositoryModelUnload was ignored (a
  load of "other"'s model loaded the service's): Triton answers UNIMPLEMENTED, and so does this now.
- Right after an unload the repository index said the model was "in the gpu tier" (the drop under
  way): it now says the tier it goes to.
- (In test_review15_stop_hang: an inference abandoned at the stop, which may still run to its end,
  is answered INTERNAL, not UNAVAILABLE, which clients retry.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from live_helpers import CONFIG, grpc_service, on_port_0, run, until

from manager.api.oip import MAX_TIMEOUT_S, InferenceServicer
from manager.config import load_config
from manager.live import LiveManager
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("own", [None, 0])
def test_a_request_with_no_deadline_gets_none_of_the_servers(own: int | None) -> None:
    request = pb.ModelInferRequest(model_name="embed")
    if own is not None:
        request.parameters["timeout"].int64_param = own
    servicer = InferenceServicer.__new__(InferenceServicer)
    assert servicer._timeout(request, None) == MAX_TIMEOUT_S
    assert servicer._timeout(request, 5.0) == pytest.approx(4.95)  # the call's deadline still holds
    request.parameters["timeout"].int64_param = 2_000_000
    assert servicer._timeout(request, None) == 2.0


def test_a_repository_name_is_unimplemented_and_an_unload_says_where_the_model_goes(tmp_path: Path) -> None:
    config = on_port_0(load_config(ROOT / "configs" / "local-cpu.yaml"), tmp_path)

    async def main() -> None:
        async with (
            grpc_service(config) as (port, manager, _, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            other = {"repository_name": "other"}
            for call in (
                stub.RepositoryIndex(pb.RepositoryIndexRequest(**other)),
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="embed", **other)),
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="embed", **other)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "'repository_name' specification is not supported" in (e.value.details() or "")

            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="embed"))
            assert manager.serving("embed")
            await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="embed"))
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())  # (the drop under way)
            (embed,) = [m for m in index.models if m.name == "embed"]
            assert embed.state == "UNAVAILABLE"
            assert embed.reason == "unloaded (in the disk tier; a request loads it)", embed.reason

    asyncio.run(main())


def test_a_model_whose_abandoned_load_is_held_reads_as_loading() -> None:
    """(Read-through: once the index named the tier the books hold a model in, a model whose abandoned
    load is held on its host, booked on the GPU so nothing else takes that room, read "unloaded (in
    the gpu tier; a request loads it)", though a request is refused while that load runs.)"""

    async def body(lm: LiveManager) -> None:
        await until(lambda: lm.serving("embed"), "embed to load")
        lm.evict("embed", "disk")
        m = lm.engine.models["embed"]
        await until(lambda: lm.live["embed"].tier == "disk", "embed to go to disk")
        # as a restarted manager's resync does when its host's status lists the load as abandoned
        assert lm._hold_abandoned(m, "its load did not finish within 15 minutes (load_timeout)")
        try:
            index = await InferenceServicer(lm, None).RepositoryIndex(pb.RepositoryIndexRequest(), None)
            (embed,) = [e for e in index.models if e.name == "embed"]
            assert (embed.state, embed.reason) == ("LOADING", ""), embed
        finally:
            lm._held_loads.clear()

    run(load_config(CONFIG), body)
