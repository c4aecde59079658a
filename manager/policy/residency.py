"""`residency`: our policy - cost-aware, class-weighted, histogram keep-alive and prewarm.

What it decides, and from what:
- **Value** of keeping a model on the GPU = class weight x reload cost (from the tier it would
  go to) x P(requested within the horizon). P blends the reuse-interval hazard (given how long the
  model has been idle) with the arrival rate at this hour of week (hour of day in the first week).
- **Victims**: the set of eligible models with the least total value that frees enough bytes
  (all subsets are tried: a home has a handful of models), fewer bytes on ties.
- **Tiers**: an evicted model is demoted to host RAM when the host tier can take it, dropping
  host residents worth less; otherwise it is dropped (the OS page cache may still hold its file).
- **Keep-alive**: an explicit `keep_alive` in the config is the user's word and is honoured
  eagerly (demote to host when it expires; no restore brings it back before it is asked for
  again, or expected right after a request as a learned successor). `auto` (unset) is lazy: the
  model stays while nobody needs its room, and after the histogram's tail (95th percentile of its
  reuse intervals) it becomes available to classes that may not evict (background batches); such
  a request, which cannot take the room itself, and a request of a lower class, get it already once
  the model has been idle `GIVE_WAY_S`, or at once while it is a prewarm that has not served
  (`gives_way_at`: a batch waited hours behind an LLM idle since the evening, image requests hours
  behind speech models past their class's reservation).
- **Prewarm**: (1) at start, models are preloaded into free room by class; within a class in
  the config's order on a first boot, by value after a restart with statistics; (2) after a request
  for A, models that usually follow A within a minute (learned co-occurrence: voice -> LLM ->
  TTS chains) are loaded at once; (3) when a model that displaced others goes idle (its request
  ended), host residents worth `DISPLACE_MARGIN` times more than what they would displace are
  promoted back (e.g. after a world session, the image model it pushed to host RAM); the same
  review runs once an hour (at the first request after each hour boundary, when the hourly rates
  change), so a model left in host RAM by a displacement comes back when its hour comes round
  (e.g. the image model the afternoon after a weekday-evening world session); (4) turn
  taking: when the room left cannot hold two models that are both in use (the LLM and the image
  model during a world session), then as soon as X's request ends, Y is swapped in for X if the
  learned odds that Y is asked for next outweigh, in reload seconds, the odds that it is not.
  A prewarmed model that has not served yet gives way to a request of its class (a guess never
  makes a request wait), see `Policy.prewarm_yields`. No prewarm takes the room of a model whose
  class may not evict (a background batch's) within its keep-alive: its next request could not
  take the room back, and would wait for room, not for its reload.
- **Lease headroom**: in a world session the KV lease grows into free room, but not into the room a
  model taking turns needs to come back (a host resident it would share the room with, with
  P(request within the horizon) >= `FILL_MIN_P`): shrinking a lease first spills KV pages to host
  RAM, which would delay that model's load (a swap in by turn taking included: a prewarm shrinks
  leases before it evicts any weights, as a request does).
- **Rates** by hour are sparse in the first weeks (an hour with no arrival yet says "never"), so
  the hour's rate is shrunk towards the model's mean hourly rate (`RATE_SMOOTH`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from manager.policy.base import Enough, Policy, host_models
from manager.policy.state import ModelState
from manager.policy.stats import EDGES, WEEK_S
from manager.policy.types import DISK, GPU

if TYPE_CHECKING:
    from manager.policy.engine import Engine

HORIZON_S = 1800.0
"""How far ahead the value looks."""
CHAIN_WINDOW_S = 60.0
"""B 'follows' A when B arrives within this long after A."""
CHAIN_MIN_P = 0.4
"""Prewarm B after A when P(B follows A) is at least this."""
FILL_MIN_P = 0.1
"""Restore a displaced host resident only when P(request within the horizon) is at least this."""
DISPLACE_MARGIN = 4.0
"""A prewarm displaces a model only when the prewarmed one is worth this many times more."""
RATE_SMOOTH = 0.3
"""Weight of the model's mean hourly rate in the rate used for prediction (the rest: its hour's)."""
TURN_ACTIVE_S = 45.0
"""A model is "in use" for turn taking when it was asked for within this long."""
TURN_MARGIN = 2.0
"""Swap Y in for X only when P(Y next) x reload(Y) exceeds this times P(not Y) x reload(X)."""
GIVE_WAY_S = 300.0
"""A model kept by a learned keep-alive gives its room to a request of a class that may not evict, or
of a lower class, after this long idle (Ollama's default keep-alive; 15 minutes let batches wait)."""
REVIEW_S = 3600.0
"""Host residents are weighed against the GPU's idle residents at least this often (see (3) above)."""
MAX_SUBSET = 10


class ResidencyPolicy(Policy):
    name = "residency"
    uses_host_tier = True
    prewarm_yields = True

    def __init__(self) -> None:
        self.t0 = math.nan
        self._follow: dict[ModelState, dict[ModelState, int]] = {}
        self._counted: dict[tuple[str, str], float] = {}
        self._weights: list[float] = []
        self._wake_on_idle: set[str] = set()
        self._ka_cache: dict[str, tuple[int, float]] = {}
        # Turn taking: (x, y, y in use) -> [next swappable request was not y, was y], after x.
        self._turns: dict[tuple[str, str, bool], list[int]] = {}
        self._last_turn: ModelState | None = None
        self._turn_checked = -math.inf
        self._swap_out: ModelState | None = None
        self._next_review = -math.inf

    def bind(self, engine: Engine) -> None:
        super().bind(engine)
        n = len(self.engine.state.class_names)
        self._weights = [3.0 ** (n - 1 - r) for r in range(n)]
        self._order = list(self.engine.models.values())

    # ---- prediction ---------------------------------------------------------------------------
    def p_request(self, m: ModelState, now: float) -> float:
        """P(a request for `m` within HORIZON_S of `now`)."""
        h = m.hist
        if h.count == 0:
            return 0.05
        idle = now - m.last_arrival if m.last_arrival > -math.inf else 0.0
        p_hist = h.p_reuse_within(max(0.0, idle), HORIZON_S)
        # The statistics cover this run and, after a restart, what the store kept from before it.
        since = min(self.t0, h.first_t) if self.t0 == self.t0 else h.first_t
        seen = max(0.0, now - since)
        weeks = max(1.0 / 7.0, seen / WEEK_S)
        mean_rate = h.count / max(24.0, seen / 3600.0)
        rate = (1.0 - RATE_SMOOTH) * h.rate_per_hour(now, weeks) + RATE_SMOOTH * mean_rate
        p_rate = 1.0 - math.exp(-rate * HORIZON_S / 3600.0)
        return 0.5 * (p_hist + p_rate)

    def value(self, m: ModelState, now: float) -> float:
        return self._weights[m.rank] * self.engine.reload_s(m) * self.p_request(m, now)

    def gpu_value(self, m: ModelState, now: float) -> float:
        """`value` of keeping `m` on its GPU, weighed against evicting it: for a model whose class may
        not evict, pushed out, its next request cannot take the room back; it waits for room (up to
        GIVE_WAY_S behind a learned keep-alive), not for its reload (a photo batch, cheapest to
        reload, was every interactive load's victim, then waited minutes between its bursts)."""
        cost = self.engine.reload_s(m)
        if not self.engine.state.class_may_evict[m.rank]:
            cost = max(cost, GIVE_WAY_S)
        return self._weights[m.rank] * cost * self.p_request(m, now)

    # ---- hooks ----------------------------------------------------------------------------------
    def is_eager(self, m: ModelState) -> bool:
        return m.keep_alive_cfg is not None and not m.pinned

    def keep_alive(self, m: ModelState, now: float) -> float:
        if m.pinned:
            return math.inf
        if m.keep_alive_cfg is not None:
            return m.keep_alive_cfg
        n = m.hist.intervals
        if n < 5:
            return self.default_keep_alive
        cached = self._ka_cache.get(m.name)
        if cached is None or n - cached[0] > cached[0] // 16:  # recompute as the histogram grows
            # past the histogram's top edge (about 7.5 days) its quantile is inf: a learned
            # keep-alive is never `forever` (a model asked for every 9 days held its room for good,
            # and a class that may not evict never got it), but at most that top edge
            q = min(m.hist.quantile(0.95), EDGES[-1])
            cached = (n, max(self.engine.min_residency, q))
            self._ka_cache[m.name] = cached
        return cached[1]

    def gives_way_at(self, m: ModelState, now: float) -> float:
        """A learned keep-alive (lazy: `auto`) keeps a model while nobody needs its room; a request
        of a class that may not evict (a background batch), which cannot take the room itself, or
        of a lower class, gets it once the model has been idle `GIVE_WAY_S`, rather than waiting out
        the learned keep-alive (its reuse intervals' 95th percentile: hours, or days); at once while
        the model is a prewarm that has not served (a guess never makes a request wait). An
        explicit keep-alive is the user's word: it holds."""
        if m.pinned or m.keep_alive_cfg is not None:
            return math.inf
        if m.prewarmed and m.last_end < m.gpu_since:  # a guess that has not served: a request wins
            return m.gpu_since
        return self.engine.idle_since(m) + GIVE_WAY_S

    def start(self, now: float) -> None:
        self.t0 = now
        if any(m.hist.count for m in self._order):  # a restart with statistics: the likeliest first
            order = sorted(self._order, key=lambda m: (m.rank, -self.value(m, now)))
        else:  # a first boot: nothing is known, the config's order stands
            order = sorted(self._order, key=lambda m: m.rank)
        for m in order:
            if m.prewarm_ok and m.tier != GPU:
                self.engine.prewarm(m, now)
        for m in order:
            if m.prewarm_ok and m.tier == DISK:
                self.engine.load_host(m, now, "boot: warm in host RAM")

    def reloaded(self) -> None:
        self._ka_cache.clear()  # learned keep-alives are floored at min_residency: the new one

    def on_request(self, m: ModelState, now: float) -> None:
        if self.t0 != self.t0:
            self.t0 = now
        if self._swappable(m):
            self._learn_turn(m, now)
        # Learn "m follows a": count each (a arrival, m) pair once.
        counted = self._counted
        for a in self._order:
            if now - a.last_arrival > CHAIN_WINDOW_S or a is m:
                continue
            key = (a.name, m.name)
            if counted.get(key) != a.last_arrival:
                counted[key] = a.last_arrival
                f = self._follow.setdefault(a, {})
                f[m] = f.get(m, 0) + 1

    def after_request(self, m: ModelState, now: float) -> list[ModelState]:
        """m's usual successors; and, at the first request after an hour boundary, the review."""
        out = []
        f = self._follow.get(m)
        if f:
            n = m.hist.count
            out = [s for s, k in f.items() if k / n >= CHAIN_MIN_P and s.tier != GPU and s.prewarm_ok]
        if now >= self._next_review:
            self._next_review = (math.floor(now / REVIEW_S) + 1.0) * REVIEW_S
            out += self._restorable(now)
        return out

    def choose_victims(
        self, m: ModelState, cands: list[ModelState], enough: Enough, now: float
    ) -> list[ModelState] | None:
        if len(cands) > MAX_SUBSET:
            return super().choose_victims(m, cands, enough, now)
        vals = [self.gpu_value(c, now) for c in cands]
        best: tuple[float, int] | None = None
        best_set: list[ModelState] | None = None
        for mask in range(1, 1 << len(cands)):
            subset = [c for i, c in enumerate(cands) if mask >> i & 1]
            key = (sum(v for i, v in enumerate(vals) if mask >> i & 1), sum(c.gpu_bytes for c in subset))
            if (best is None or key < best) and enough(subset):
                best, best_set = key, subset
        if best_set is not None:
            self._wake_on_idle.add(m.name)
        return best_set

    def host_victim(self, incoming: ModelState, now: float) -> ModelState | None:
        hosted = host_models(self.engine)
        if not hosted:
            return None
        v = min(hosted, key=lambda h: self.value(h, now))
        return v if self.value(v, now) < self.value(incoming, now) else None

    @property
    def prewarm_min_residency(self) -> bool:  # type: ignore[override]
        """`min_residency` protects models from prewarms, except the model a turn-taking swap moves
        out: its turn has just ended."""
        return self._swap_out is None

    def may_displace(self, c: ModelState, m: ModelState, now: float) -> bool:
        if self._swap_out is not None:
            return c is self._swap_out  # a turn-taking swap moves out the model whose turn ended
        if not self.engine.state.class_may_evict[c.rank] and not self.expired(c, now):
            # A model of a class that may not evict (a background batch's) would not come back by
            # its own next request: it waits for room, minutes or hours, not its reload time. A
            # guess does not take its room within its keep-alive (a request of a higher class may).
            return False
        return self.gpu_value(c, now) * DISPLACE_MARGIN < self.value(m, now)

    # ---- turn taking ------------------------------------------------------------------------------
    def _swappable(self, m: ModelState) -> bool:
        """Models that trade places for the shared room: their class may evict and holds no
        reservation, and they are neither pinned nor elastic (a session's lease is not swapped)."""
        if m.pinned or m.elastic or not m.prewarm_ok:
            return False
        state = self.engine.state
        return state.class_may_evict[m.rank] and state.devices[m.device].reserves[m.rank] == 0

    def _learn_turn(self, m: ModelState, now: float) -> None:
        """After the previous swappable request (x), was this one for y, given whether y was in use?"""
        x = self._last_turn
        if x is not None:
            for y in self._order:
                if y is x or not self._swappable(y):
                    continue
                c = self._turns.setdefault((x.name, y.name, now - y.last_arrival < TURN_ACTIVE_S), [0, 0])
                c[1 if y is m else 0] += 1
        self._last_turn = m

    def _take_turns(self, now: float) -> None:
        """The last swappable model's request has ended: swap in the host resident most likely to be
        asked for next, when the odds pay for the reload of the one moved out."""
        x = self._last_turn
        if x is None or x.tier != GPU or x.busy_until > now or self._turn_checked == x.last_arrival:
            return
        self._turn_checked = x.last_arrival
        best: tuple[float, ModelState] | None = None
        for y in host_models(self.engine):
            if not self._swappable(y):
                continue
            c = self._turns.get((x.name, y.name, now - y.last_arrival < TURN_ACTIVE_S), [0, 0])
            p = (c[1] + 0.5) / (c[0] + c[1] + 1.0)
            gain = p * self.engine.reload_s(y)
            if gain > TURN_MARGIN * (1.0 - p) * self.engine.reload_s(x) and (best is None or gain > best[0]):
                best = (gain, y)
        if best is not None:
            self._swap_out = x
            try:
                self.engine.prewarm(best[1], now)
            finally:
                self._swap_out = None

    def prewarm(self, now: float) -> list[ModelState]:
        """Turn taking, then promote valuable host residents back when a displacing model went idle."""
        self._take_turns(now)
        if not self._wake_on_idle:
            return []
        busy = [n for n in self._wake_on_idle if self.engine.models[n].busy_until > now]
        self._wake_on_idle = set(busy)
        return self._restorable(now)

    def _restorable(self, now: float) -> list[ModelState]:
        """Host residents likely to be asked for, most valuable first; the engine promotes each only
        where it displaces models worth `DISPLACE_MARGIN` times less (`may_displace`). Not one
        whose explicit keep-alive expired since its last request (`held_off`: the user's word), nor
        one whose last prewarm was wasted (pushed out before it served) within the thrash window:
        restored into room a model freed for a moment (one with `keep_alive: 0` in a batch, unloaded
        after each request), it was pushed out again at that model's next request, all night."""
        window = self.engine.thrash_window
        hosted = [
            h
            for h in host_models(self.engine)
            if h.prewarm_ok and not h.held_off and not now - h.wasted_at < window
        ]
        scored = sorted(((self.value(h, now), h) for h in hosted), key=lambda x: -x[0])
        return [h for v, h in scored if self.p_request(h, now) >= FILL_MIN_P]

    def lease_headroom(self, m: ModelState, now: float) -> int:
        """The most bytes a likely host resident that takes turns would miss to come back, after
        displacing the models that take turns on the GPU now."""
        dev = self.engine.state.devices[m.device]
        on_gpu = [c for c in dev.models if c.tier == GPU and self._swappable(c)]
        need = 0
        for x in host_models(self.engine):
            if x.device != m.device or not self._swappable(x) or self.p_request(x, now) < FILL_MIN_P:
                continue
            freed = sum(c.gpu_bytes for c in on_gpu if c.rank >= x.rank)
            need = max(need, x.weights - freed)
        return need

    def wants_wakeup_after(self, m: ModelState) -> bool:
        return m.name in self._wake_on_idle or self._swappable(m)
