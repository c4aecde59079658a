"""`residency.v1.Residency`: ps-style status, pin/unpin, preload, evict, stats, and residency events."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc

from manager.api.errors import mapped
from manager.api.runtime import LOAD_WAIT_S, call_wait_s
from manager.config import Config
from manager.errors import DeadlineExceeded, WorkerUnavailable
from manager.live import EventQueue, LiveManager
from manager.policy.types import TIER_NAMES, Tier
from manager.replay.sim import p99
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
PIN_SAVE_WAIT_S = 5.0
"""How long a Pin or Unpin waits for the pin to be saved in the store before it answers (a kill
right after the answer lost it about half the time): within the call's deadline, and at most this
when it has none. A store that does not answer by then holds up no admin: the pin holds at once,
and is saved once the store answers (a kill before that loses it, as the log says)."""


def loading_to_host(manager: LiveManager, name: str) -> bool:
    """Whether `name` is in host RAM on the books but its copy there is not confirmed yet: its device
    host reports it on disk, or a read of it into host RAM, or a demote from the GPU, is on its way
    (sent, not answered: `LiveManager.host_read_pending`). The host's report alone is not enough:
    right after an evict to disk, while the drop is still on its way, the host still reports the
    model on the GPU (or in host RAM, from before): the new read has not even begun there; and during
    a demote it reports the model on the GPU until the copy is made. `ps` says `loading` meanwhile
    (the word it has for a move into a tier not confirmed yet)."""
    if manager.engine.models[name].tier != Tier.HOST:
        return False
    if manager.live[name].tier == "disk":
        return True
    return manager.host_read_pending(name)


def model_status(manager: LiveManager, name: str) -> pb.ModelStatus:
    eng = manager.engine
    m = eng.models[name]
    live = manager.live[name]
    now = manager.clock()
    tier = TIER_NAMES[m.tier]
    # on its way to the GPU, or its read into host RAM is not confirmed yet
    if (m.tier == Tier.GPU and not live.ready.is_set()) or loading_to_host(manager, name):
        tier = "loading"
    if m.pinned:
        left = -1.0
    elif m.tier == Tier.GPU:
        exp = eng.policy.expiry(m, now)
        left = -1.0 if exp == math.inf else max(0.0, exp - now)
    else:
        left = 0.0
    cost = m.cost.as_dict()
    keep_s, keep_from = keep_alive_in_force(manager, name, now)
    return pb.ModelStatus(
        name=name, tier=tier, device=m.device, class_name=manager.config.classes[m.rank].name,
        pinned=m.pinned, bytes=int(m.weights), last_used=live.last_used, keep_alive_left_s=left,
        load_seconds=pb.LoadSeconds(disk=cost.get("disk", 0.0), cached=cost.get("cached", 0.0),
                                    host=cost.get("host", 0.0)),
        lease_bytes=int(m.lease), requests=live.requests, adapter=m.cfg.adapter,
        last_error=live.load_error or "",
        keep_alive_s=-1.0 if keep_s == math.inf else keep_s, keep_alive_from=keep_from,
    )  # fmt: skip


def keep_alive_in_force(manager: LiveManager, name: str, now: float) -> tuple[float, str]:
    """How long after its last use the policy protects `name` on the GPU (inf: forever), and whose
    word that is: "pin", "request" (the last admitted request's own keep-alive), "config" (the
    model's keep_alive, a tuned value included), or "policy" (learned from its reuse intervals, or
    the policy's default: `lru-keepalive` keeps its fixed one whatever the config says, `histogram`
    its own windows)."""
    m = manager.engine.models[name]
    policy = manager.engine.policy
    keep = policy.keep_alive(m, now)
    if m.pinned:
        return keep, "pin"
    if not policy.honours_keep_alive(m):  # (the policy's own: a value that equals one is no source)
        return keep, "policy"
    return keep, "request" if m.keep_alive_req is not None else "config"


def reload_from_file(manager: LiveManager, path: str | None) -> list[str]:
    """Re-read the config file and hot-apply it; InvalidRequest says why it was not applied."""
    return _apply_reload(manager, path, _read_for_reload(path))


RELOAD_READS = 5
"""How many times a reload reads a config file that changes while it is read before it gives up."""


def file_identity(path: str) -> tuple[int, int, int, int]:
    """What tells a changed file (device, inode, size, modification time; zeros when it cannot be
    read): its modification time alone misses a symlink re-pointed (or a file copied in) with the
    same time (`cp -p`, `touch -r`, an unpacked archive)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return (0, 0, 0, 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


async def reload_from_file_on_loop(manager: LiveManager, path: str | None) -> list[str]:
    """`reload_from_file` as the service makes it: the file is read and checked on a thread (a
    config's parse takes milliseconds, a large one seconds: the event loop, and every request, would
    wait for it), the reload applied on the event loop, and only while the file still holds what was
    read: one saved again during the read (another reload of the newer file, or the tuning job's, may
    have been applied meanwhile, and the older text would undo it) is read again."""
    from manager.errors import InvalidRequest

    for _ in range(RELOAD_READS):
        seen, new = await asyncio.to_thread(_read_identified, path)
        # (its stat on a thread too: a config on a mount that hangs must not hold the event loop)
        if path is None or await asyncio.to_thread(file_identity, path) == seen:
            return _apply_reload(manager, path, new)
    raise InvalidRequest(
        f"config not reloaded: {path}: it changed each time it was read ({RELOAD_READS} times); "
        "reload it once it is saved"
    )


def _read_identified(path: str | None) -> tuple[tuple[int, int, int, int], Config]:
    """The file's identity (`file_identity`) before it was read, and what it holds."""
    seen = file_identity(path) if path is not None else (0, 0, 0, 0)
    return seen, _read_for_reload(path)


def _read_for_reload(path: str | None) -> Config:
    from manager.config import ConfigError, load_config
    from manager.errors import InvalidRequest

    if path is None:
        raise InvalidRequest("this server was not started from a config file; nothing to reload")
    try:
        return load_config(path)
    except ConfigError as e:
        raise InvalidRequest(f"config not reloaded: {e}") from None


def _apply_reload(manager: LiveManager, path: str | None, new: Config) -> list[str]:
    from manager.config import ConfigError
    from manager.errors import InvalidRequest
    from manager.reload import RestartNeeded

    try:
        return manager.reload(new)
    except ConfigError as e:  # (pins that do not fit at their measured sizes: the file named, as below)
        raise InvalidRequest(f"config not reloaded: {path}: {e}") from None
    except RestartNeeded as e:
        raise InvalidRequest(f"config not reloaded: {path}: {e}; restart the service to apply it") from None


PRELOAD_TIMEOUT_S = LOAD_WAIT_S
"""How long a Preload waits for its model's confirmed load (as `LiveManager.preload` to the GPU)."""


async def preload_host(manager: LiveManager, name: str, timeout_s: float = PRELOAD_TIMEOUT_S) -> None:
    """Preload `name` into host RAM and wait until its device host confirms it holds it there (or it
    went on to the GPU meanwhile), as a preload to the GPU waits for its confirmed load: the answer
    said `host` while the read was still under way, and OK for a load that then failed; and right after
    an evict to disk (`loading_to_host`), before the drop's result came; and during a demote from the
    GPU (an evict to host RAM, the policy's), before its copy in host RAM existed.
    WorkerUnavailable: the load (or the demote) failed, or the model left host RAM before it was
    confirmed there."""
    events = manager.subscribe()  # before the command: its confirmation cannot be missed
    try:
        failures = manager.live[name].failures if name in manager.live else 0
        await manager.preload(name, "host")
        m, live = manager.engine.models[name], manager.live[name]
        if not await _until_in_host(manager, name, events, timeout_s):
            raise DeadlineExceeded(
                f"model {name!r}: its load into host RAM did not finish within {timeout_s:g} s; "
                "it goes on (see `residency ps`)"
            )
        if m.tier == Tier.DISK:
            failed = live.error if live.failures > failures else None  # (a demote's failure, say)
            why = (
                live.load_error
                or failed
                or "it was dropped again before its load was confirmed (see the events)"
            )
            raise WorkerUnavailable(f"model {name!r} could not be loaded into host RAM: {why}")
    finally:
        manager.unsubscribe(events)


async def _until_in_host(
    manager: LiveManager, name: str, events: asyncio.Queue[dict[str, Any]], timeout_s: float
) -> bool:
    """Wait while `name`'s copy into host RAM is on its way (`loading_to_host`), `timeout_s` at most;
    `events`: a subscription made before that move was asked for (its result cannot be missed).
    False when it is still on its way at the end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loading_to_host(manager, name):
        left = deadline - loop.time()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(events.get(), left)  # any event: the books may have moved
    return True


EVICT_WAIT_S = 20.0
"""How long an Evict(to=host) waits for the demote it starts to be confirmed (under the client's
admin timeout, 30 s), at most until just before the call's own deadline; past it, it answers
`loading` (the demote goes on)."""


async def evict(manager: LiveManager, name: str, to: str, wait_s: float = EVICT_WAIT_S) -> None:
    """An admin's evict (`LiveManager.evict`). One to host RAM that demotes the model now waits, at most
    `wait_s`, for the demote's result (its answer said `host` before the copy there existed); one
    deferred behind requests or a load answers at once, as before (`evict_deferred`)."""
    events = manager.subscribe()  # before the command: its confirmation cannot be missed
    try:
        manager.evict(name, to)
        if to == "host":
            await _until_in_host(manager, name, events, wait_s)
    finally:
        manager.unsubscribe(events)


def _caught_up_gap(q: asyncio.Queue[dict[str, Any]], t: float) -> pb.Event | None:
    """The note on the events dropped for a watcher too slow for them, once it has read all its
    queue holds: the manager puts it in the queue before the next event that fits, which may come
    hours later, and meanwhile the watcher saw a history that ended without a word on its last
    events (often the latest state: the end of a burst). None when nothing was dropped, or the
    queue still holds events (the note then comes in its place, from the manager)."""
    gap = q.gap_note(t) if isinstance(q, EventQueue) and q.empty() else None
    return None if gap is None else pb.Event(**gap)


class AdminServicer(pb_grpc.ResidencyServicer):
    def __init__(
        self, manager: LiveManager, config_path: str | None = None, stopping: asyncio.Event | None = None
    ) -> None:
        self.manager = manager
        self.config_path = config_path
        self.stopping = stopping if stopping is not None else asyncio.Event()
        """Set when the service stops: open Events streams end at once (UNAVAILABLE, saying so), not
        at the end of the stop's grace period, which they held up every time (they never end)."""

    @mapped
    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:
        return pb.ListResponse(models=[model_status(self.manager, n) for n in self.manager.engine.models])

    @mapped
    async def Pin(self, request: pb.ModelRequest, context: Any) -> pb.ModelStatus:
        self.manager.set_pin(request.name, True)
        await self.manager.pins_saved(call_wait_s(context.time_remaining(), PIN_SAVE_WAIT_S))
        return model_status(self.manager, request.name)

    @mapped
    async def Unpin(self, request: pb.ModelRequest, context: Any) -> pb.ModelStatus:
        self.manager.set_pin(request.name, False)
        await self.manager.pins_saved(call_wait_s(context.time_remaining(), PIN_SAVE_WAIT_S))
        return model_status(self.manager, request.name)

    @mapped
    async def Preload(self, request: pb.PreloadRequest, context: Any) -> pb.ModelStatus:
        if request.tier == "host":
            await preload_host(self.manager, request.name, call_wait_s(context.time_remaining()))
        else:
            await self.manager.preload(
                request.name, request.tier or "gpu", call_wait_s(context.time_remaining())
            )
        return model_status(self.manager, request.name)

    @mapped
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.ModelStatus:
        # within the caller's deadline too: past it, its answer (`loading`) would never reach it
        wait_s = min(call_wait_s(context.time_remaining(), EVICT_WAIT_S), EVICT_WAIT_S)
        await evict(self.manager, request.name, request.to or "disk", wait_s)
        return model_status(self.manager, request.name)

    @mapped
    async def ReloadConfig(self, request: pb.ReloadConfigRequest, context: Any) -> pb.ReloadConfigResponse:
        from manager.errors import ResidencyError

        try:
            changes = await reload_from_file_on_loop(self.manager, self.config_path)
        except ResidencyError as e:  # logged and said in an event, as the watcher's refusals are
            if self.config_path:
                logger.warning("%s", e)
                self.manager._publish("config_rejected", "", str(e), "", self.manager.clock())
            raise
        msg = "changed: " + ", ".join(changes) if changes else "no changes"
        if self.manager.reload_warnings:  # (models the file's pins or reservations left no room for)
            msg += "; warning: " + "; ".join(self.manager.reload_warnings)
        path = os.path.abspath(self.config_path) if self.config_path else ""
        digest = await asyncio.to_thread(_sha256_of, path) if path else ""
        return pb.ReloadConfigResponse(changed=bool(changes), message=msg, path=path, sha256=digest)

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
            load_wait_s=m.wait_total_s, errors=m.failed, cancelled=m.cancelled, failed_runs=m.failed_runs,
            wait_p99_s={k: p99(list(v)) for k, v in m.waits.items()}, resident_bytes=resident,
        )  # fmt: skip

    async def Events(self, request: pb.EventsRequest, context: Any) -> AsyncIterator[pb.Event]:
        q = self.manager.subscribe()
        stopping = asyncio.ensure_future(self.stopping.wait())
        get: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                caught_up = _caught_up_gap(q, self.manager.clock())
                if caught_up is not None:
                    yield caught_up
                    continue
                get = asyncio.ensure_future(q.get())
                await asyncio.wait((get, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, "the service is stopping; reconnect to follow its events"
                    )
                ev = get.result()
                yield pb.Event(
                    t=ev["t"], kind=ev["kind"], model=ev["model"], detail=ev["detail"], device=ev["device"]
                )
        finally:
            for f in (get, stopping):
                if f is not None:
                    f.cancel()
            self.manager.unsubscribe(q)


def _sha256_of(path: str) -> str:
    """The hex SHA-256 of the file at `path` ("" when it cannot be read now)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ""
