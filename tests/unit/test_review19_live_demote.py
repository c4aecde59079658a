"""Review 19 (`manager/live.py`, `manager/api/admin.py`): a GPU->host demote on its way (sent to the
device host, its result not come yet) read `host` in `ps`, and a Preload(tier=host) of that model
answered at once, before its copy in host RAM existed. While a demote is under way the model now
reads `loading` (the word `ps` uses for a read into host RAM not confirmed yet), a Preload to host
waits for the demote's result, and an Evict(to=host) answers once the demote is confirmed. Each
test failed before its fix. Real components: the service's gRPC server on a free port over
in-process device hosts, a real TorchScript checkpoint; the results of the held model come back
late (`_HoldingPool`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from live_helpers import until
from test_review13_admin import _HoldingPool, serving
from test_review18_admin import config, tier_of

from manager.policy.types import Tier
from residency_proto.v1 import residency_pb2 as pb


async def _demote_held(manager: object, pool: _HoldingPool) -> None:
    """The demote of `embed` (on the GPU) is sent and run by its device host; its result is held."""
    from manager.live import LiveManager

    assert isinstance(manager, LiveManager)
    pool.hold.add("embed")
    pool.sent.clear()
    manager.evict("embed", "host")
    await until(lambda: pool.sent == [("demote", "embed")], "the demote was sent")
    await until(lambda: pool.real.pending() == 0, "the device host ran it")


class TestADemoteOnItsWay:
    def test_ps_says_loading_until_its_result_comes(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                await _demote_held(manager, pool)
                assert manager.engine.models["embed"].tier == Tier.HOST  # (the books moved at once)
                assert await tier_of(stub, "embed") == "loading", "ps said host before the copy existed"
                pool.hold.clear()
                await until(lambda: manager.live["embed"].tier == "host", "the demote was confirmed")
                assert await tier_of(stub, "embed") == "host"

        asyncio.run(body())

    def test_a_preload_to_host_waits_for_its_result(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                await _demote_held(manager, pool)
                call = asyncio.ensure_future(stub.Preload(pb.PreloadRequest(name="embed", tier="host")))
                await asyncio.sleep(0.2)  # (a wrong answer comes at once)
                assert not call.done(), "answered before the demote's copy in host RAM was confirmed"
                pool.hold.clear()
                status = await asyncio.wait_for(call, 30)
                assert status.tier == "host" and manager.live["embed"].tier == "host"

        asyncio.run(body())

    def test_an_evict_to_host_answers_once_the_demote_is_confirmed(self, tmp_path: Path) -> None:
        """(`residency evict --to host` prints the tier it answers: not `loading` for a demote that
        takes a moment, which it would take for an evict deferred behind requests.)"""

        async def body() -> None:
            async with serving(config(tmp_path)) as (stub, manager, pool):
                await stub.Preload(pb.PreloadRequest(name="embed", tier="gpu"))
                pool.hold.add("embed")
                call = asyncio.ensure_future(stub.Evict(pb.EvictRequest(name="embed", to="host")))
                await until(lambda: ("demote", "embed") in pool.sent, "the demote was sent")
                await asyncio.sleep(0.2)
                assert not call.done(), "answered before the demote was confirmed"
                pool.hold.clear()
                status = await asyncio.wait_for(call, 30)
                assert status.tier == "host" and manager.live["embed"].tier == "host"

        asyncio.run(body())
