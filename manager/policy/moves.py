"""Tier moves and leases: how the engine changes where a model's bytes are (pure Python).

`Engine` (engine.py) decides *whether* something moves: admission, room, expiry, prewarm.
`TierMoves` carries the moves out on the books and counts them:
  load (disk or page cache -> GPU) / promote (host -> GPU), load_host (disk -> host),
  evict (GPU -> host, or drop to disk), drop_host (host -> disk), and an elastic tenant's lease
  growing or shrinking. Each move is logged as an `Action`; the thrash clock, loads by source,
  wasted prewarms and budget checks are counted here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from manager.policy.outcomes import Counters
from manager.policy.state import NEVER, ClusterState, DeviceState, HostState, ModelState
from manager.policy.types import DISK, GPU, HOST, Action, ActionKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from manager.policy.base import Policy


class TierMoves:
    """The moves of `Engine` (a mixin: the engine owns the state these methods change)."""

    state: ClusterState
    host: HostState
    policy: Policy
    counters: Counters
    actions: list[tuple[float, Action]] | None
    thrash_window: float
    load_time: Callable[[ModelState, str], float]
    measures_loads: bool
    gpu_time: dict[str, float]
    wakeups: list[float]
    _on_gpu_at: dict[str, float]
    models: dict[str, ModelState]
    host_leaving: list[ModelState]
    """Host residents already chosen to leave host RAM this moment (`_host_victims`): no policy
    chooses them again (`base.host_models` leaves them out)."""

    # ---- elastic leases ---------------------------------------------------------------------
    def _shrink_leases(
        self,
        dev: DeviceState,
        m: ModelState,
        tenants: list[ModelState],
        need: int,
        now: float,
        reason: str | None = None,
    ) -> None:
        """Shrink `tenants`' leases until `dev.room(m.rank)` reaches `need`: the lowest class's first
        (a lower class's session gives back its lent room before a higher class's loses KV), and a
        higher class's lease only by what its class holds beyond its reservation (bytes given back
        inside that reservation are no room for `m`: spilling them would only delay its load)."""
        for t in sorted(tenants, key=lambda t: -t.rank):
            short = need - dev.room(m.rank)
            if short <= 0:
                return
            spare = t.lease - t.lease_min
            if t.rank < m.rank:
                spare = min(spare, dev.class_used[t.rank] - dev.reserves[t.rank])
            give = min(spare, short)
            if give <= 0:
                continue
            self._set_lease(t, t.lease - give, now, reason=reason or f"room for '{m.name}'")
            # WorldPager spills the KV pages to host RAM at PCIe speed before the bytes are free.
            dev.loader_free_at = max(dev.loader_free_at, now) + give / self._host_link_rate(dev)

    def _host_link_rate(self, dev: DeviceState) -> float:
        """Bytes a second between host RAM and `dev`: the fastest of its models' host loads (weights
        over the host->gpu load time). Not the session's own model's: a small one's load time is
        mostly fixed costs, and its rate made a spill of gigabytes of KV take minutes."""
        rate = 1.0
        for x in self.models.values():
            if x.device == dev.name:
                rate = max(rate, x.weights / max(1e-6, float(x.cost.get("host"))))
        return rate

    def _lease_growth(self, m: ModelState, now: float) -> int:
        """Bytes a session's lease would grow by now: into the free room its device leaves (less the
        policy's headroom), up to its maximum; 0 when none."""
        if m.lease >= m.lease_max:
            return 0
        room = self.state.devices[m.device].room(m.rank) - self.policy.lease_headroom(m, now)
        return max(0, min(m.lease_max - m.lease, room))

    def _refresh_lease(self, m: ModelState, now: float) -> None:
        if m.busy_until > now:  # in session: grow into free room, up to the maximum
            grow = self._lease_growth(m, now)
            if grow > 0:
                self._set_lease(m, m.lease + grow, now, reason="session wants KV")
        elif m.lease > m.lease_min:
            self._set_lease(m, m.lease_min, now, reason="session ended")

    def _set_lease(self, m: ModelState, new: int, now: float, reason: str) -> None:
        dev = self.state.devices[m.device]
        delta = new - m.lease
        dev.add(m, delta)
        m.lease = new
        kind = ActionKind.GROW_LEASE if delta > 0 else ActionKind.SHRINK_LEASE
        if delta > 0:
            self.counters.lease_grows += 1
        else:
            self.counters.lease_shrinks += 1
        self._check_budget(dev)
        self._log(now, Action(kind, m.name, m.device, new, reason))

    # ---- tier moves -------------------------------------------------------------------------
    def load_source(self, m: ModelState) -> str:
        """Where a load of `m` to the GPU reads from now: "host", "cached" (the OS page cache) or
        "disk"."""
        if m.tier == HOST:
            return "host"
        return "cached" if m.file in self.host.cache else "disk"

    def reload_s(self, m: ModelState) -> float:
        """Estimated seconds to bring `m` back to the GPU if it left it now: from host RAM when the
        host tier could take it (or holds it), else from where its file is."""
        host = self.host
        if m.tier == HOST or m.weights <= host.usable - host.used:
            return m.cost.get("host")
        return m.cost.get(self.load_source(m))

    def load(self, m: ModelState, now: float, *, prewarm: bool, reason: str) -> None:
        dev = self.state.devices[m.device]
        host = self.host
        source = self.load_source(m)
        if source == "host":
            kind = ActionKind.PROMOTE
            host.used -= m.weights
        else:
            kind = ActionKind.LOAD
        dur = self.load_time(m, source)
        start = max(now, dev.loader_free_at, m.ready_at if source == "host" else now)
        m.ready_at = m.gpu_since = start + dur
        dev.loader_free_at = m.ready_at
        m.tier = GPU
        m.lease = m.lease_min
        dev.add(m, m.gpu_bytes)
        if source != "host":
            host.cache_touch(m.file, m.weights)
        if self.measures_loads:  # (the replay's: its load times are the truth it was given)
            m.cost.measure(source, dur)
        c = self.counters
        c.loads += 1
        c.loads_by_source[source] += 1
        if now - m.left_gpu_at <= self.thrash_window:
            c.thrash += 1
        if prewarm:
            c.prewarm_loads += 1
            m.prewarmed = True
        m.held_off = False
        self._on_gpu_at[m.name] = now
        self._wake_at_expiry(m, now)
        self._check_budget(dev)
        self._log(now, Action(kind, m.name, m.device, m.gpu_bytes, reason, prewarm))

    def _wake_at_expiry(self, m: ModelState, now: float) -> None:
        """`m` became resident on the GPU (a load for a request, a prewarm, a pin, a restart's
        restore or adoption): if its keep-alive is eager, the engine ticks when it expires, whether
        or not a request ever comes (`Engine.finish` asks again after each request)."""
        pol = self.policy
        if not m.pinned and pol.is_eager(m):
            exp = pol.expiry(m, now)
            if exp < math.inf:
                self.wakeups.append(exp)

    def load_host(self, m: ModelState, now: float, reason: str) -> bool:
        """Read `m`'s checkpoint into the host tier (disk -> host), if host RAM has room."""
        host = self.host
        if m.tier != DISK or host.usable - host.used < m.weights:
            return False
        # A disk -> host read costs what a disk -> GPU load costs less the host -> GPU copy.
        dur = max(0.0, self.load_time(m, self.load_source(m)) - self.load_time(m, "host"))
        if self.measures_loads:
            m.cost.measure("disk_host", dur)
        m.tier = HOST
        m.ready_at = now + dur
        host.used += m.weights
        host.cache_shrink()
        self._check_budget(self.state.devices[m.device])
        self._log(now, Action(ActionKind.LOAD_HOST, m.name, "host", m.weights, reason, prewarm=True))
        return True

    def evict(
        self,
        c: ModelState,
        now: float,
        reason: str,
        *,
        expiry: bool = False,
        failed: bool = False,
        to_host: bool | None = None,
    ) -> None:
        """Take `c` off the GPU: demote to the host tier when the policy wants it (or `to_host` says
        so: an admin's choice, whatever the policy's use of the host tier) and it fits (dropping host
        residents the policy values less), else drop to disk. `failed`: its load failed, so nothing
        was resident: dropped to disk, not counted as an eviction, no thrash clock. The failed load
        was the reload its last departure's thrash is counted on (if within the window), so the
        next load, a retry, is not counted again for that departure."""
        dev = self.state.devices[c.device]
        nbytes = self._leave_gpu(c, now)
        if failed:
            c.prewarmed = False
            c.tier = DISK
            c.left_gpu_at = NEVER
            self._log(now, Action(ActionKind.DROP, c.name, c.device, nbytes, reason, moved=False))
            return
        c.left_gpu_at = now
        cnt = self.counters
        cnt.evictions += 1
        if expiry:
            cnt.expiries += 1
            if self.policy.honours_keep_alive(c):
                c.held_off = True  # the user's keep-alive: no prewarm brings it back unasked
        if c.prewarmed:
            cnt.wasted_loads += 1
            c.prewarmed = False
            c.wasted_at = now
        wanted = self.policy.uses_host_tier if to_host is None else to_host
        to_host = wanted and self._host_make_room(c, now)
        if to_host:
            c.tier = HOST
            self.host.used += c.weights
            self.host.cache_shrink()
            self._check_budget(dev)
            self._log(now, Action(ActionKind.DEMOTE, c.name, c.device, nbytes, reason))
        else:
            c.tier = DISK
            self._log(now, Action(ActionKind.DROP, c.name, c.device, nbytes, reason))

    def _leave_gpu(self, c: ModelState, now: float) -> int:
        """`c`'s bytes off its device's books, its lease ended and its time on the GPU counted (the
        tier is the caller's to set). Returns the bytes it held there."""
        nbytes = c.gpu_bytes
        self.state.devices[c.device].add(c, -nbytes)
        c.lease = 0
        self.gpu_time[c.name] += now - self._on_gpu_at.pop(c.name, now)
        return nbytes

    def unbook(self, m: ModelState, now: float) -> bool:
        """Take `m` off the books to disk without a move: its device host does not hold it in the
        books' tier (it holds it in another, which `adopt` may then book). No action is logged (no
        command follows), nothing is counted (no eviction, no thrash clock). False when the books
        have it on disk already: then nothing changes."""
        if m.tier == GPU:
            self._leave_gpu(m, now)
        elif m.tier == HOST:
            self.host.used -= m.weights
        else:
            return False
        m.prewarmed = False
        m.tier = DISK
        return True

    def _host_make_room(self, c: ModelState, now: float) -> bool:
        """Room in host RAM for `c`, dropping the host residents the policy values less than `c`; or,
        when they are not enough, nothing dropped (False)."""
        host = self.host
        if c.weights > host.usable:
            return False
        victims = self._host_victims(c, c.weights - (host.usable - host.used), now)
        if victims is None:
            return False
        for v in victims:
            self.drop_host(v, now, f"host room for '{c.name}'")
        return True

    def _host_victims(self, incoming: ModelState, short: int, now: float) -> list[ModelState] | None:
        """The host residents whose drop frees `short` bytes of host RAM for `incoming`, the policy's
        choice one at a time (`host_victim`, each weighed as if those before it were gone already);
        None when the policy would rather keep one than make the whole room. Nothing is dropped
        here: a room that cannot be made costs no host resident."""
        host = self.host
        chosen: list[ModelState] = []
        used = host.used
        try:
            self.host_leaving = chosen
            while short > 0:
                v = self.policy.host_victim(incoming, now)
                if v is None or v is incoming:
                    return None
                chosen.append(v)
                short -= v.weights
                host.used -= v.weights  # as if dropped: what the next choice is weighed against
        finally:
            host.used = used
            self.host_leaving = []
        return chosen

    def drop_host(self, v: ModelState, now: float, reason: str) -> None:
        self.host.used -= v.weights
        v.tier = DISK
        self._log(now, Action(ActionKind.DROP, v.name, "host", v.weights, reason))

    # ---- accounting -------------------------------------------------------------------------
    def _check_budget(self, dev: DeviceState) -> None:
        if dev.used > dev.usable or self.host.used > self.host.usable or min(dev.class_used) < 0:
            self.counters.budget_violations += 1

    def _log(self, now: float, a: Action) -> None:
        if self.actions is not None:
            self.actions.append((now, a))
