"""residency.v1.WorldSession over a real socket (in-process server and hosts), found in the 17th review:
a stream opened whose `start` had not come yet when the server stopped was not ended by the stop (its
first message was read with no regard to it): it held the stop for the whole grace and then ended with
gRPC's own "Cancelling all calls" instead of UNAVAILABLE "the server is stopping". Failed before the fix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from residency_proto.v1 import residency_pb2_grpc as pb_grpc

from .test_review15_world_unread import BOUND_S, serving
from .test_world_stream import world_config


def test_a_stop_ends_a_stream_that_has_not_sent_its_start(tmp_path: Path) -> None:
    config = world_config(tmp_path)

    async def main() -> None:
        async with (
            serving(config) as (target, manager, server),
            grpc.aio.insecure_channel(target) as ch,
        ):
            call = pb_grpc.WorldSessionStub(ch).Run()
            await call.wait_for_connection()
            for _ in range(100):  # until the handler runs (waits for the first message)
                await asyncio.sleep(0.02)
            server.world_stopping.set()  # as `serve` does when it stops ...
            stopping = asyncio.ensure_future(server.stop(grace=BOUND_S))  # ... then the server
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), BOUND_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == "the server is stopping: no world session was opened"
            await stopping
            assert manager.sessions == {}

    asyncio.run(main())
