"""`residency.v1.Residency`: ps-style status, pin/unpin, preload, evict, stats, and residency events."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from manager.api.errors import mapped
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.replay.sim import p99
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc


def model_status(manager: LiveManager, name: str) -> pb.ModelStatus:
    eng = manager.engine
    m = eng.models[name]
    live = manager.live[name]
    now = manager.clock()
    tier = {Tier.GPU: "gpu", Tier.HOST: "host", Tier.DISK: "disk"}[m.tier]
    if m.tier == Tier.GPU and not live.ready.is_set():
        tier = "loading"
    if m.pinned:
        left = -1.0
    elif m.tier == Tier.GPU:
        exp = eng.policy.expiry(m, now)
        left = -1.0 if exp == math.inf else max(0.0, exp - now)
    else:
        left = 0.0
    cost = m.cost.as_dict()
    return pb.ModelStatus(
        name=name, tier=tier, device=m.device, class_name=manager.config.classes[m.rank].name,
        pinned=m.pinned, bytes=int(m.weights), last_used=live.last_used, keep_alive_left_s=left,
        load_seconds=pb.LoadSeconds(disk=cost.get("disk", 0.0), cached=cost.get("cached", 0.0),
                                    host=cost.get("host", 0.0)),
        lease_bytes=int(m.lease), requests=live.requests, adapter=m.cfg.adapter,
        last_error=live.load_error or "",
    )  # fmt: skip


def reload_from_file(manager: LiveManager, path: str | None) -> list[str]:
    """Re-read the config file and hot-apply it; InvalidRequest says why it was not applied."""
    from manager.config import ConfigError, load_config
    from manager.errors import InvalidRequest
    from manager.reload import RestartNeeded

    if path is None:
        raise InvalidRequest("this server was not started from a config file; nothing to reload")
    try:
        return manager.reload(load_config(path))
    except ConfigError as e:
        raise InvalidRequest(f"config not reloaded: {e}") from None
    except RestartNeeded as e:
        raise InvalidRequest(f"config not reloaded: {e}; restart the service to apply it") from None


class AdminServicer(pb_grpc.ResidencyServicer):
    def __init__(self, manager: LiveManager, config_path: str | None = None) -> None:
        self.manager = manager
        self.config_path = config_path

    @mapped
    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:
        return pb.ListResponse(models=[model_status(self.manager, n) for n in self.manager.engine.models])

    @mapped
    async def Pin(self, request: pb.ModelRequest, context: Any) -> pb.ModelStatus:
        self.manager.set_pin(request.name, True)
        return model_status(self.manager, request.name)

    @mapped
    async def Unpin(self, request: pb.ModelRequest, context: Any) -> pb.ModelStatus:
        self.manager.set_pin(request.name, False)
        return model_status(self.manager, request.name)

    @mapped
    async def Preload(self, request: pb.PreloadRequest, context: Any) -> pb.ModelStatus:
        await self.manager.preload(request.name, request.tier or "gpu")
        return model_status(self.manager, request.name)

    @mapped
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.ModelStatus:
        self.manager.evict(request.name, request.to or "disk")
        return model_status(self.manager, request.name)

    @mapped
    async def ReloadConfig(self, request: pb.ReloadConfigRequest, context: Any) -> pb.ReloadConfigResponse:
        changes = reload_from_file(self.manager, self.config_path)
        msg = "changed: " + ", ".join(changes) if changes else "no changes"
        return pb.ReloadConfigResponse(changed=bool(changes), message=msg)

    @mapped
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        m = self.manager
        c = m.engine.counters
        resident: dict[str, int] = {}
        for d in m.engine.state.devices.values():
            resident[d.name] = int(d.used)
        return pb.StatsResponse(
            requests=m.served, evictions=c.evictions, thrash=c.thrash, rejected=m.rejected,
            budget_violations=c.budget_violations, cold_starts=m.cold_starts,
            load_wait_s=m.wait_total_s,
            wait_p99_s={k: p99(list(v)) for k, v in m.waits.items()}, resident_bytes=resident,
        )  # fmt: skip

    async def Events(self, request: pb.EventsRequest, context: Any) -> AsyncIterator[pb.Event]:
        q = self.manager.subscribe()
        try:
            while True:
                ev: dict[str, Any] = await q.get()
                yield pb.Event(
                    t=ev["t"], kind=ev["kind"], model=ev["model"], detail=ev["detail"], device=ev["device"]
                )
        except asyncio.CancelledError:
            raise
        finally:
            self.manager.unsubscribe(q)
