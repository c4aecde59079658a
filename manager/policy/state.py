"""Mutable bookkeeping of what is where (pure Python): models, devices, host RAM, page cache.

The engine (`engine.py`) owns one `ClusterState` and is the only writer. Sizes are bytes, times
are seconds on the injected clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from manager.policy.stats import HomeHours, LoadCost, ReuseHistogram, home_hours
from manager.policy.types import Tier

if TYPE_CHECKING:
    from manager.config import Config, ModelConfig

NEVER = -math.inf


class ModelState:
    """One model: its tier, bytes, busy/ready times and statistics."""

    __slots__ = (
        "busy_until",
        "cfg",
        "cost",
        "device",
        "elastic",
        "file",
        "gpu_since",
        "held_off",
        "hist",
        "keep_alive_cfg",
        "keep_alive_conf",
        "keep_alive_req",
        "last_arrival",
        "last_end",
        "lease",
        "lease_max",
        "lease_min",
        "left_gpu_at",
        "name",
        "pinned",
        "prewarm_ok",
        "prewarmed",
        "rank",
        "ready_at",
        "tier",
        "waiting",
        "wasted_at",
        "weights",
    )

    def __init__(self, cfg: ModelConfig, rank: int, hours: HomeHours | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.device = cfg.device
        self.rank = rank
        self.pinned = cfg.pin
        self.weights = cfg.memory
        path = cfg.source.get("path") if isinstance(cfg.source, dict) else None
        self.file = f"path:{path}" if isinstance(path, str) and path else f"model:{cfg.name}"
        """What the page cache holds of it: its checkpoint file (two models of one file share it)."""
        self.lease_min = cfg.elastic.min if cfg.elastic else 0
        self.lease_max = cfg.elastic.max if cfg.elastic else 0
        # Has an elastic KV lease (the range is fixed for the process: changing it needs a restart).
        self.elastic = self.lease_max > 0
        self.lease = 0
        self.keep_alive_conf = cfg.keep_alive
        """The config's keep-alive (None: the policy's own)."""
        self.keep_alive_req: float | None = None
        """The keep-alive the last admitted request gave (Ollama's per-request `keep_alive`), or None."""
        self.keep_alive_cfg = cfg.keep_alive
        """The explicit keep-alive in force (the user's word): the last request's own, else the config's."""
        self.prewarm_ok = cfg.prewarm
        self.tier = Tier.DISK
        self.ready_at = NEVER
        self.gpu_since = NEVER
        self.busy_until = NEVER
        self.last_end = NEVER
        self.last_arrival = NEVER
        self.left_gpu_at = NEVER
        self.prewarmed = False
        self.wasted_at = NEVER
        """When a prewarm of it was last wasted (it left the GPU before it served)."""
        self.held_off = False
        """Its explicit keep-alive (the user's word) expired and it left the GPU: no prewarm brings
        it back before its next request."""
        self.waiting = 0
        ls = cfg.load_seconds
        self.cost = LoadCost(ls.disk, ls.cached_s, ls.host)
        self.hist = ReuseHistogram(hours or HomeHours())

    @property
    def gpu_bytes(self) -> int:
        """Bytes this model holds on its device while on the GPU tier (weights + KV lease)."""
        return self.weights + self.lease

    def idle(self, now: float) -> bool:
        return self.busy_until <= now and self.waiting == 0

    def __repr__(self) -> str:
        return f"ModelState({self.name}, tier={self.tier.name}, lease={self.lease})"


class DeviceState:
    """One accelerator: usable bytes (memory minus emergency reserve) and class reservations."""

    __slots__ = ("class_used", "loader_free_at", "models", "name", "reserves", "usable", "used")

    def __init__(self, name: str, usable: int, reserves: list[int]) -> None:
        self.name = name
        self.usable = usable
        self.used = 0
        self.reserves = reserves
        self.class_used = [0] * len(reserves)
        self.loader_free_at = NEVER
        self.models: list[ModelState] = []

    def room(self, rank: int, used: int | None = None, class_used: list[int] | None = None) -> int:
        """Bytes a model of class `rank` may still take: free bytes minus the unused
        reservations of the classes above it (for hypothetical `used`/`class_used` when given)."""
        used = self.used if used is None else used
        class_used = self.class_used if class_used is None else class_used
        held = 0
        for i in range(rank):
            r = self.reserves[i] - class_used[i]
            if r > 0:
                held += r
        return self.usable - used - held

    @property
    def free(self) -> int:
        """Usable bytes not held by any model (class reservations not subtracted)."""
        return self.usable - self.used

    def add(self, m: ModelState, nbytes: int) -> None:
        self.used += nbytes
        self.class_used[m.rank] += nbytes

    def resident(self) -> list[ModelState]:
        return [m for m in self.models if m.tier == Tier.GPU]


class HostState:
    """Host RAM: the host tier (weights kept warm) and, in what it leaves free, the OS page cache
    (an LRU over recently read checkpoint files)."""

    __slots__ = ("cache", "cache_used", "usable", "used")

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self.used = 0
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.cache_used = 0

    def cache_touch(self, name: str, nbytes: int) -> None:
        """A checkpoint file was read: it is now the most recent entry of the page cache."""
        if name in self.cache:
            self.cache.move_to_end(name)
        else:
            self.cache[name] = nbytes
            self.cache_used += nbytes
        self.cache_shrink()

    def cache_shrink(self) -> None:
        cap = self.usable - self.used
        while self.cache_used > cap and self.cache:
            _, b = self.cache.popitem(last=False)
            self.cache_used -= b


class ClusterState:
    """All of it, built from a validated config."""

    def __init__(self, config: Config) -> None:
        self.devices = {
            d.name: DeviceState(d.name, d.usable, config.class_reserves(d.name)) for d in config.devices
        }
        self.host = HostState(config.host.usable)
        self.class_names = [c.name for c in config.classes]
        self.class_may_evict = [c.may_evict for c in config.classes]
        self.class_max_wait = [c.max_wait if c.max_wait is not None else math.inf for c in config.classes]
        self.hours = home_hours(config.policy.timezone)
        """The home's wall clock, which the statistics by hour of week follow."""
        self.models: dict[str, ModelState] = {}
        for mc in config.models:
            m = ModelState(mc, self.class_names.index(mc.class_), self.hours)
            self.models[m.name] = m
            self.devices[m.device].models.append(m)
