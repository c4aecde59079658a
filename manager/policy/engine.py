"""The decision engine: admission, room-making and tier moves, as data (pure Python).

Order of use (the replay simulator and the live manager drive it the same way):
  1. `start(now)`            - pinned models (and whatever the policy preloads) are loaded.
  2. `observe(m, now)`       - a request for `m` arrived: statistics first.
  3. `admit(m, rank, now)`   - hit, load (with the evictions that make room), wait, or reject.
  4. `finish(m, start, busy)`- the request holds the model until start + busy.
  5. `tick(now)`             - keep-alive expiry, elastic leases, policy prewarm; at the times
                               the engine asked for through `wakeups`.
Every state change is returned as an `Action` and appended to `actions` (when logging is on).
The moves themselves (load, promote, demote, drop, lease changes) and their counters are in
`moves.py`; this module decides when they happen.

Admission rules (for every policy): a request never evicts a pinned model, a busy or loading one,
or one of a higher class within its keep-alive (a model past its keep-alive has no claim on its
room: eager policies unload it then, lazy ones when the room is wanted); a class with
`may_evict: false` only takes free room and room held by models whose keep-alive has expired, or
that the policy says give way to it (`Policy.gives_way_at`: `residency`'s learned keep-alives, which
give way to lower classes too);
class reservations and device reserves are never given away; elastic leases shrink before any
weights are evicted (a lease above its minimum is lent free room that any request may take back);
a model that can never fit is rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from manager.policy.moves import TierMoves
from manager.policy.outcomes import Admission, Counters
from manager.policy.state import NEVER, ClusterState, DeviceState, ModelState
from manager.policy.types import DISK, GPU, HOST, Action, Tier
from manager.units import format_size as fmt_bytes

if TYPE_CHECKING:
    from manager.config import Config
    from manager.policy.base import Policy

LoadTimeFn = Callable[[ModelState, str], float]

LEASE_TICK_S = 1.0
"""The live manager ticks the engine every second; a session's lease grows into room that came free
(an eviction, a demote) at its next tick. The replay ticks only at wake-ups, so the engine asks for
one this long after a move that leaves a session's lease room to grow."""


class Engine(TierMoves):
    """Owns the cluster state and applies the policy's choices within the admission rules."""

    def __init__(self, config: Config, policy: Policy, load_time: LoadTimeFn | None = None) -> None:
        self.config = config
        self.state = ClusterState(config)
        self.models = self.state.models
        self.host = self.state.host
        self.hours = self.state.hours
        """The home's wall clock (`policy.timezone`): hour of week of a time, for the statistics."""
        self.thrash_window = config.policy.thrash_window
        self.min_residency = config.policy.min_residency
        self.load_time: LoadTimeFn = load_time or (lambda m, src: m.cost.get(src))
        self.measures_loads = load_time is not None
        """Whether a load's time is learned where the engine decides it (the replay: `load_time` is
        its truth). Without one (the live manager) the estimate it decided by is no measurement: the
        load's result, which its device host timed, is measured (`LiveManager._on_result`); fed back,
        the estimate made half the samples and the estimate learned a real time slowly."""
        self.counters = Counters()
        self.wakeups: list[float] = []
        self.actions: list[tuple[float, Action]] | None = None
        self.gpu_time: dict[str, float] = dict.fromkeys(self.models, 0.0)
        self._on_gpu_at: dict[str, float] = {}
        self.policy = policy
        policy.bind(self)
        self.never_fits: dict[str, str] = {}
        self.incoming: ModelState | None = None
        """The model `make_room` is making room for (not a host-tier victim meanwhile)."""
        self.host_leaving: list[ModelState] = []
        self._elastic = [m for m in self.models.values() if m.elastic]
        self.room_wanted: Callable[[str], bool] = _nothing_waits
        """Whether requests wait for room on a device (the live manager's and the replay's queues):
        no prewarm is made there meanwhile (`prewarm`)."""
        self.recheck_fit()

    # ---- requests ---------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Load the pinned models, then let the policy preload."""
        self.load_pinned(now)
        self.policy.start(now)

    def load_pinned(self, now: float, skip: Collection[str] = ()) -> None:
        """Load the pinned models that are not on their device yet (an adopted one already is), each
        into free room or room held past its keep-alive, as a request that may not evict: nothing
        within its keep-alive is evicted for a pin (as a prewarm, the policy's guesses could). A
        model that can never fit, or is named in `skip`, is left where it is."""
        for m in self.models.values():
            if not m.pinned or m.tier == GPU or m.name in skip or self.never_fits[m.name]:
                continue
            if self.make_room(m, m.rank, now, may_evict=False):
                self.load(m, now, prewarm=False, reason="pinned")

    def adopt(self, m: ModelState, tier: Tier, now: float) -> bool:
        """Put `m` on the books in `tier` without a load: its device host already holds it there
        (a restarted manager reattaching). No action, no load counted. False when the books have no
        room for it within the rules (nothing evicted for it): then nothing changes."""
        if m.tier != DISK or tier == DISK:
            return False
        if tier == HOST:
            if self.host.usable - self.host.used < m.weights:
                return False
            self.host.used += m.weights
            self.host.cache_shrink()
        else:
            dev = self.state.devices[m.device]
            if self.never_fits[m.name] or dev.room(m.rank) < m.weights + m.lease_min:
                return False
            if not m.pinned and self._at_model_cap(dev):
                return False
            m.lease = m.lease_min
            m.gpu_since = now
            dev.add(m, m.gpu_bytes)
            self._on_gpu_at[m.name] = now
        m.tier = tier
        m.ready_at = now
        if tier == GPU:
            self._wake_at_expiry(m, now)
        return True

    def observe(self, m: ModelState, now: float) -> None:
        m.held_off = False  # asked for again: prewarms may bring it back
        m.hist.observe(now)
        self.policy.on_request(m, now)
        m.last_arrival = now

    def request_keep_alive(self, m: ModelState, keep_alive: float | None) -> None:
        """An admitted request's own keep-alive (seconds; inf: forever), or None for the config's: it
        holds for the idle time after this request, until the next request says otherwise (Ollama's
        per-request `keep_alive`). A pin still wins."""
        m.keep_alive_req = keep_alive
        m.keep_alive_cfg = m.keep_alive_conf if keep_alive is None else keep_alive

    def admit(self, m: ModelState, rank: int, now: float) -> Admission:
        if m.tier == GPU:
            if m.prewarmed:
                m.prewarmed = False
            return Admission("hit" if m.ready_at <= now else "load", m.ready_at)
        reason = self.never_fits[m.name]
        if reason:
            return Admission("reject", math.inf, reason)
        if self.make_room(m, rank, now, may_evict=self.state.class_may_evict[rank]):
            self.load(m, now, prewarm=False, reason="request")
            self._wake_for_leases(now)  # its evictions may have freed more than it took
            return Admission("load", m.ready_at)
        return Admission("wait", math.inf, "no room yet")

    def finish(self, m: ModelState, start: float, busy_s: float) -> None:
        end = start + busy_s
        if end > m.busy_until:
            m.busy_until = end
        m.last_end = m.busy_until
        if self.policy.is_eager(m):
            exp = self.policy.expiry(m, start)
            if exp < math.inf:
                self.wakeups.append(max(exp, m.busy_until))
        if m.elastic and end > start:
            # A session's lease grows into free room as it starts (the live manager ticks every
            # second), not at whatever tick comes next; it shrinks back when the session ends.
            self.wakeups.append(start)
        if m.elastic or self.policy.wants_wakeup_after(m):
            self.wakeups.append(m.busy_until)

    # ---- periodic -----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Keep-alive expiry (eager policies), elastic leases, then the policy's prewarm."""
        pol = self.policy
        for m in self.models.values():
            if m.tier != GPU or m.ready_at > now:
                continue
            if not m.pinned and pol.is_eager(m) and m.idle(now) and pol.expiry(m, now) <= now:
                self.evict(m, now, "keep-alive expired", expiry=True)
            elif m.elastic:
                self._refresh_lease(m, now)
        for m in pol.prewarm(now):
            self.prewarm(m, now)
        self._wake_for_leases(now)

    def _wake_for_leases(self, now: float) -> None:
        """A wake-up LEASE_TICK_S from now when a session's lease could grow into free room then
        (the live manager's next tick would grow it), as `_refresh_lease` would judge it now."""
        for m in self._elastic:
            if m.tier == GPU and m.busy_until > now and m.ready_at <= now and self._lease_growth(m, now) > 0:
                self.wakeups.append(now + LEASE_TICK_S)
                return

    def after_request(self, m: ModelState, now: float) -> None:
        """Prewarm what the policy expects right after `m` (e.g. the rest of a voice chain). The
        request just made is fresh demand: a model it is expected to bring is loaded even if its
        explicit keep-alive expired since its own last request (a policy's review of what to
        restore, also run here, leaves such a model out itself)."""
        for s in self.policy.after_request(m, now):
            self.prewarm(s, now, chained=True)
        self._wake_for_leases(now)

    def prewarm(self, m: ModelState, now: float, *, chained: bool = False) -> bool:
        """Load `m` before a predicted request, displacing only what the policy values less.
        A model with `prewarm: false` is never loaded ahead of its request, by any policy; nor is
        one whose explicit keep-alive expired (`ModelState.held_off`: the user's word), before it is
        asked for again - or, `chained`, expected right after a request just made. Nor is one whose
        keep-alive is eager and zero (`keep_alive: 0`): it would be unloaded the moment its load is
        over, a wasted load, and its request's reload would count as thrash. Nor while requests wait
        for room on its device (`room_wanted`): a guess (a tick's, a request's chained successors, a
        turn taken) gives way to them, and a later wake-up tries it again. Nor one never asked for
        whose keep-alive is unbounded (`keep_alive: forever`, not pinned): the guess would hold its
        room for good, above every lower class's requests (one that fits the empty device was never
        served); its first request loads it (the oracle's prewarms are that request's load, moved
        earlier). (Pinned loads are no prewarm: a pin outranks every class.)"""
        if m.tier == GPU or self.never_fits[m.name] or not m.prewarm_ok or (m.held_off and not chained):
            return False
        if self.room_wanted(m.device):
            return False
        pol = self.policy
        if pol.is_eager(m) and pol.keep_alive(m, now) <= 0.0:
            return False
        if m.keep_alive_cfg == math.inf and not m.pinned and not m.hist.count and not pol.prewarm_as_demand:
            return False
        if not self.make_room(m, m.rank, now, may_evict=True, prewarm=True):
            return False
        self.load(m, now, prewarm=True, reason="prewarm")
        return True

    # ---- room -----------------------------------------------------------------------------
    def recheck_fit(self) -> None:
        """Work out again which models can never be loaded. Call it after anything it depends on
        changes: a pin (an admin's or the config's), a class reservation, a measured footprint."""
        self.never_fits = {m.name: self._never_fits_reason(m) for m in self.models.values()}

    def _never_fits_reason(self, m: ModelState) -> str:
        """Why `m` can never be loaded (empty if it can): with every other unpinned model gone,
        the room left is the usable bytes less the pinned models and the higher classes'
        reservations (a pinned model inside its class's reservation counts once)."""
        dev = self.state.devices[m.device]
        pinned_by_class = [0] * len(dev.reserves)
        for o in dev.models:
            if o.pinned and o is not m:
                pinned_by_class[o.rank] += o.weights + o.lease_min
        held = sum(max(r, p) for r, p in zip(dev.reserves[: m.rank], pinned_by_class[: m.rank], strict=True))
        held += sum(pinned_by_class[m.rank :])
        cap = dev.usable - held
        need = m.weights + m.lease_min
        if need > cap:
            return (
                f"model '{m.name}' needs {fmt_bytes(need)} but device '{dev.name}' can never give it "
                f"more than {fmt_bytes(max(cap, 0))} (usable {fmt_bytes(dev.usable)}, less pinned models and "
                f"higher classes' reservations {fmt_bytes(held)})"
            )
        return ""

    def _eligible(
        self, c: ModelState, m: ModelState, rank: int, now: float, may_evict: bool, prewarm: bool
    ) -> bool:
        if c is m or c.tier != GPU or c.pinned or c.ready_at > now or not c.idle(now):
            return False
        if prewarm:
            if c.rank < rank:  # a higher class: only as the request itself could, when it expired
                ok = self.policy.prewarm_as_demand and self.policy.expired(c, now)
            else:
                ok = not (now - c.gpu_since < self.min_residency and self.policy.prewarm_min_residency)
            return ok and self.policy.may_displace(c, m, now)
        expired = self.policy.expired(c, now) or self._gives_way(c, rank, may_evict, now)
        if c.rank < rank:
            # A higher class is never evicted; a model past its keep-alive holds no claim to its
            # room any more (an eager policy would have unloaded it already), whoever needs it.
            return expired
        unserved = c.rank == rank and now - c.gpu_since < self.min_residency and c.last_end < c.gpu_since
        if unserved and not (c.prewarmed and self.policy.prewarm_yields):
            # Loaded for a request (or a prediction) it has not served yet: it keeps its room, unless
            # it was only a guess and the policy lets a real request win over its guesses.
            return False
        return may_evict or expired

    def _gives_way(self, c: ModelState, rank: int, may_evict: bool, now: float) -> bool:
        """Whether `c` gives its room to a request of class `rank` (one that may not evict, or of a
        lower class than `c`'s, which its keep-alive would otherwise hold off): `Policy.gives_way_at`."""
        return (not may_evict or c.rank < rank) and self.policy.gives_way_at(c, now) <= now

    @staticmethod
    def _room_after(dev: DeviceState, rank: int, removed: list[ModelState], shrunk: list[ModelState]) -> int:
        """`dev.room(rank)` once `removed` are evicted and `shrunk` leases are at their minimum."""
        used = dev.used
        cu = list(dev.class_used)
        for c in removed:
            b = c.gpu_bytes
            used -= b
            cu[c.rank] -= b
        for t in shrunk:
            b = t.lease - t.lease_min
            used -= b
            cu[t.rank] -= b
        return dev.room(rank, used, cu)

    def _at_model_cap(self, dev: DeviceState) -> bool:
        """The policy's cap on unpinned models loaded per device is reached on `dev`."""
        cap = self.policy.max_loaded
        return cap is not None and sum(1 for c in dev.models if c.tier == GPU and not c.pinned) >= cap

    def make_room(
        self, m: ModelState, rank: int, now: float, *, may_evict: bool, prewarm: bool = False
    ) -> bool:
        """Make room on `m`'s device for `m` (a request of class `rank`), or change nothing.

        Elastic leases shrink first; weights are evicted only when shrinking every lease to its
        minimum is not enough (and then leases shrink only by what is still missing)."""
        dev = self.state.devices[m.device]
        need = m.weights + m.lease_min
        over_count = not m.pinned and self._at_model_cap(dev)  # a pin is not counted: it always wins
        if not over_count and dev.room(m.rank) >= need:
            return True
        # A lease above its minimum is free room lent to the tenant: any request may take it
        # back (nothing is evicted), a background one included, and so may a prewarm - leases
        # shrink before any weights are evicted, whoever asks for the room. At the policy's cap on
        # models per device one model must go whatever the bytes, but no more weights than the
        # leases cannot make up for (lent room used to count only below the cap).
        tenants = [
            t for t in dev.models if t is not m and t.tier == GPU and t.elastic and t.lease > t.lease_min
        ]
        if not over_count and self._room_after(dev, m.rank, [], tenants) >= need:
            self._shrink_leases(dev, m, tenants, need, now)
            return True
        cands = [c for c in dev.models if self._eligible(c, m, rank, now, may_evict, prewarm)]
        if not cands:
            return False

        def enough(victims: list[ModelState]) -> bool:
            if over_count and not victims:
                return False
            return self._room_after(dev, m.rank, victims, [t for t in tenants if t not in victims]) >= need

        victims = self.policy.choose_victims(m, cands, enough, now)
        if victims is None or not enough(victims):
            return False
        # Why each goes is decided before any goes: an eviction changes host room, and with it
        # what a policy thinks the next victim would cost to bring back (so whether it "expired").
        expired = [self.policy.expired(c, now) for c in victims]
        gave_way = [not prewarm and self._gives_way(c, rank, may_evict, now) for c in victims]
        self.incoming = m
        try:
            for c, gone, gave in zip(victims, expired, gave_way, strict=True):
                if gone:
                    self.evict(c, now, "keep-alive expired", expiry=True)
                elif gave:  # (its keep-alive's hold on this request's class is over)
                    self.evict(c, now, f"gave way to '{m.name}'")
                else:
                    self.evict(c, now, f"room for '{m.name}'")
        finally:
            self.incoming = None
        self._shrink_leases(dev, m, [t for t in tenants if t not in victims], need, now)
        return True

    def measured_footprint(self, m: ModelState, nbytes: int, now: float) -> None:
        """A worker measured `m`'s real footprint: it replaces the estimate (and the accounting)."""
        delta = nbytes - m.weights
        m.weights = nbytes
        if m.tier == GPU:
            dev = self.state.devices[m.device]
            dev.add(m, delta)
            self._fit_back_measured(dev, m, now)
        elif m.tier == HOST:
            self.host.used += delta
            self._fit_back_host(m, now)
            self.host.cache_shrink()
        self.recheck_fit()  # a pinned model's bytes count against every other model's room

    def measured_lease_floor(self, m: ModelState, floor: int, now: float) -> bool:
        """A device host keeps at least `floor` bytes of KV for a session of elastic `m` whatever lease
        it is given (the runtime's floor: three segments; on a GPU, two decoded slots): `m`'s minimum
        lease (and a maximum below it) is raised to it, and a lease below it grows to it (the device
        holds those bytes), room made as for a footprint measured larger (`_fit_back`). True when
        the books changed; a floor within `elastic.min` changes nothing."""
        if not m.elastic or floor <= m.lease_min:
            return False
        m.lease_min = floor
        m.lease_max = max(m.lease_max, floor)
        if m.tier == GPU and m.lease < floor:
            dev = self.state.devices[m.device]
            violations = self.counters.budget_violations  # (the grow's own check: where it ends counts)
            self._set_lease(
                m, floor, now, reason=f"'{m.name}': its device host keeps {floor} bytes of KV at least"
            )
            self.counters.budget_violations = violations
            self._fit_back_measured(dev, m, now)
        self.recheck_fit()
        return True

    def _fit_back_measured(self, dev: DeviceState, m: ModelState, now: float) -> None:
        """`_fit_back` after `m` was found to hold more of `dev` than its books said (a footprint or a
        lease floor measured larger). Each move that fits it back checks the budget while the surplus
        it removes is still there: what counts is where the device ends, checked once."""
        violations = self.counters.budget_violations
        self._fit_back(dev, m, now)
        self.counters.budget_violations = violations
        self._check_budget(dev)

    def honour_reservations(self, now: float, before: dict[str, list[int]]) -> None:
        """Class reservations raised (a config reload; `before`: each device's reserves until then) may
        find lower classes' models in the room they add, which the reserving class's requests could
        not take back (a class that may not evict; a keep-alive that holds): leases there shrink
        first, then idle, unpinned models of the classes below the raised reservation leave, the
        lowest class and the longest idle first, until each class's room is whole again, and never
        more than the raise withholds anew (room the raising class already uses withholds nothing,
        and room a higher class took from a middle one before is not this reload's to give back).
        At start a reservation keeps them out from the first load. What is busy or pinned stays."""

        def held(reserves: list[int], dev: DeviceState, k: int) -> int:
            """The room the classes above `k` withhold from it with `reserves` (unused reservations)."""
            return sum(max(0, r - u) for r, u in zip(reserves[:k], dev.class_used[:k], strict=True))

        for dev in self.state.devices.values():
            old = before.get(dev.name)
            if old is None or len(old) != len(dev.reserves) or old == dev.reserves:
                continue
            why = f"a higher class's reservation on '{dev.name}' (raised by a reload)"
            freed = 0  # (for the whole device: the classes below share what was given back)
            for k in range(len(dev.reserves) - 1, 0, -1):  # room(k) < 0: classes k.. are in the room
                owed = held(dev.reserves, dev, k) - held(old, dev, k) - freed  # of a reservation above
                if owed <= 0 or dev.room(k) >= 0:  # them; only their bytes give it back
                    continue
                for t in dev.models:
                    short = min(-dev.room(k), owed)
                    if short > 0 and t.rank >= k and t.tier == GPU and t.elastic and t.lease > t.lease_min:
                        give = min(t.lease - t.lease_min, short)
                        self._set_lease(t, t.lease - give, now, reason=why)
                        freed += give
                        owed -= give
                idle = [
                    c
                    for c in dev.models
                    if c.rank >= k and c.tier == GPU and not c.pinned and c.ready_at <= now and c.idle(now)
                ]
                idle.sort(key=lambda c: (-c.rank, self.idle_since(c), c.name))
                for c in idle:
                    if dev.room(k) >= 0 or owed <= 0:
                        break
                    freed += c.gpu_bytes
                    owed -= c.gpu_bytes
                    self.evict(c, now, why)

    def _fit_back_host(self, m: ModelState, now: float) -> None:
        """`m`, in the host tier and measured larger than its estimate, left host RAM over its usable
        bytes: other host residents are dropped to disk - the one the policy values least
        (`host_victim`; least recently on the GPU first for a policy without a host tier) - when
        those the policy would rather drop than `m` make its room; if they do not, `m` itself leaves
        host RAM (its file is still on disk) and no other does. Host RAM is never left over budget."""
        host = self.host
        if host.used <= host.usable:
            return
        short = host.used - host.usable
        victims: list[ModelState] | None
        if self.policy.uses_host_tier:
            self.incoming = m  # not a victim of its own fit
            try:
                victims = self._host_victims(m, short, now)
            finally:
                self.incoming = None
        else:
            others = sorted(
                (c for c in self.models.values() if c.tier == HOST and c is not m),
                key=lambda c: (c.left_gpu_at, c.ready_at, c.name),
            )
            victims = []
            for c in others:
                if short <= 0:
                    break
                victims.append(c)
                short -= c.weights
            if short > 0:
                victims = None
        if victims is None:  # the others cannot make its room (or are worth more): it leaves, alone
            self.drop_host(m, now, f"'{m.name}' measured larger than host RAM can hold beside what it holds")
            return
        why = f"host room after '{m.name}' measured larger than its estimate"
        for v in victims:
            self.drop_host(v, now, why)

    def _fit_back(self, dev: DeviceState, m: ModelState, now: float) -> None:
        """`m`, measured larger than its estimate, took more than its room on `dev` (its class's room:
        the usable bytes less the higher classes' unused reservations). What leaves for it is what
        a load of `m` at its measured size could have displaced, within the admission rules: leases
        shrink first, then idle models `m`'s admission may evict go, the longest idle first (never a
        higher class within its keep-alive); then `m` itself, when idle and not pinned (the guess or
        the idle model that does not fit). Only a device still over its usable bytes for real - `m`
        busy or pinned - takes more: other leases at their minimum, then idle higher-class models
        (the budget wins over the class rule: the device holds those bytes already, in its
        emergency reserve). What is busy, loading or pinned stays (the budget counter then says so)."""
        if dev.room(m.rank) >= 0:
            return
        why = f"room after '{m.name}' measured larger than its estimate"
        tenants = [
            t for t in dev.models if t is not m and t.tier == GPU and t.elastic and t.lease > t.lease_min
        ]
        self._shrink_leases(dev, m, tenants, 0, now, reason=why)
        rank, may_evict = m.rank, self.state.class_may_evict[m.rank]
        idle = [c for c in dev.models if c is not m and c.tier == GPU and not c.pinned and c.idle(now)]
        idle.sort(key=lambda c: (self.idle_since(c), c.name))
        eligible = [c for c in idle if self._eligible(c, m, rank, now, may_evict, m.prewarmed)]
        # Why each goes is decided before any goes (as in `make_room`).
        expired = [self.policy.expired(c, now) for c in eligible]
        for c, gone in zip(eligible, expired, strict=True):
            if dev.room(m.rank) >= 0:
                return
            self.evict(c, now, "keep-alive expired" if gone else why, expiry=gone)
        if dev.room(m.rank) >= 0:
            return
        if not m.pinned and m.idle(now):
            self.evict(m, now, f"'{m.name}' measured larger than its room on '{dev.name}'")
            return
        # The device holds more than its usable bytes (into its emergency reserve): the budget wins.
        for t in dev.models:
            over = dev.used - dev.usable
            if over <= 0:
                return
            if t is not m and t.tier == GPU and t.elastic and t.lease > t.lease_min:
                self._set_lease(t, t.lease - min(t.lease - t.lease_min, over), now, reason=why)
        for c in idle:
            if dev.used <= dev.usable:
                return
            if c.tier == GPU and c.ready_at <= now:
                self.evict(c, now, why)

    # ---- accounting -------------------------------------------------------------------------
    def close(self, now: float) -> None:
        """End of replay: account GPU time of what is still resident."""
        for name, since in self._on_gpu_at.items():
            self.gpu_time[name] += now - since
        self._on_gpu_at = {k: now for k in self._on_gpu_at}

    def idle_since(self, m: ModelState) -> float:
        """When `m` last became idle on the GPU (its last request's end, or its load)."""
        return m.last_end if m.last_end > m.gpu_since else m.gpu_since

    def next_change(self, now: float) -> float:
        """Earliest future time at which room could appear (a busy model ends, a load completes,
        an expiry passes): when waiting requests should be retried."""
        t = math.inf
        pol = self.policy
        for m in self.models.values():
            if m.tier != GPU:
                continue
            for x in (
                m.busy_until, m.ready_at, pol.expiry(m, now), m.gpu_since + self.min_residency,
                pol.gives_way_at(m, now),
            ):  # fmt: skip
                if now < x < t:
                    t = x
        return t


__all__ = ["NEVER", "Admission", "Engine"]


def _nothing_waits(device: str) -> bool:
    """`Engine.room_wanted` where no queue is kept: no request ever waits for room."""
    return False
