"""Discrete-event replay of a request trace through a policy on a simulated home server.

The simulated hardware is the config: device and host budgets with their reserves, load times per
source (`load_seconds.disk`, `.cached` from the OS page cache, `.host` from host RAM), one load at
a time per device (loads queue behind each other), and each model serving one request at a time
(requests queue behind loads and behind busy models). Host RAM not used by the host tier is the
page cache (LRU over checkpoint files), for every policy alike. Demoting (gpu -> host) and
dropping are not charged time; shrinking an elastic lease is (its KV spills at PCIe speed).

Time advances from request to request; between them the engine ticks at the times it asked for
(keep-alive expiries, prewarms, session ends, retries of waiting requests).

A request without room waits, as in the live manager, until its class's `max_wait` (then it is
rejected, never served later); a later request of a higher class for the same model is not held
behind it. A class's `max_queue` counts what the live manager counts (`LiveManager._queue_for`):
the requests of the class that wait for their model's load, for room or behind a load already
under way (not those whose model is loaded and only busy). A request of the class that arrives
while that many wait is rejected, "queue full", unless its model is loaded and ready (it would not
wait). The figures cover the service's start to the trace's end (the last request's end, had it
been served on arrival), the same span for every policy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from manager.config import Config
from manager.policy.base import Policy
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.state import ModelState
from manager.policy.types import GPU, Action, Request

DRAIN_S = 7 * 86400.0
"""How long after the last request pending events are still played out."""
WARMUP_S = 600.0
"""The service starts this long before the first request (pinned models are loaded by then)."""


@dataclass
class ModelFigures:
    requests: int = 0
    """Its requests, counted at arrival as the top level's `requests` (served and rejected)."""
    rejected: int = 0
    cold_starts: int = 0
    load_wait_s: float = 0.0
    resident_fraction: float = 0.0


@dataclass
class ReplayResult:
    """The ▶ replay JSON fields, plus a few extra figures under their own names."""

    policy: str
    requests: int = 0
    served: int = 0
    rejected: int = 0
    cold_starts: int = 0
    load_wait_s: float = 0.0
    wait_p99_s: dict[str, float] = field(default_factory=dict)
    evictions: int = 0
    thrash: int = 0
    budget_violations: int = 0
    prewarm_loads: int = 0
    wasted_loads: int = 0
    models: dict[str, ModelFigures] = field(default_factory=dict)
    expiries: int = 0
    loads: int = 0
    lease_shrinks: int = 0
    lease_grows: int = 0
    loads_by_source: dict[str, int] = field(default_factory=dict)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    bad_lines: int = 0
    actions: list[tuple[float, Action]] | None = None
    served_log: list[tuple[float, str, bool, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "served": self.served,
            "rejected": self.rejected,
            "cold_starts": self.cold_starts,
            "load_wait_s": round(self.load_wait_s, 3),
            "wait_p99_s": {k: round(v, 3) for k, v in self.wait_p99_s.items()},
            "evictions": self.evictions,
            "thrash": self.thrash,
            "budget_violations": self.budget_violations,
            "prewarm_loads": self.prewarm_loads,
            "wasted_loads": self.wasted_loads,
            "models": {
                k: {
                    "requests": v.requests,
                    "rejected": v.rejected,
                    "cold_starts": v.cold_starts,
                    "load_wait_s": round(v.load_wait_s, 3),
                    "resident_fraction": round(v.resident_fraction, 4),
                }
                for k, v in self.models.items()
            },
            "expiries": self.expiries,
            "loads": self.loads,
            "lease_shrinks": self.lease_shrinks,
            "lease_grows": self.lease_grows,
            "loads_by_source": self.loads_by_source,
            "reject_reasons": self.reject_reasons,
            "bad_lines": self.bad_lines,
        }


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


class _Waiting:
    __slots__ = ("arrival", "deadline", "m", "rank", "req")

    def __init__(self, req: Request, m: ModelState, rank: int, arrival: float, deadline: float) -> None:
        self.req, self.m, self.rank, self.arrival = req, m, rank, arrival
        self.deadline = deadline
        """`arrival` + its class's `max_wait`: still no room then, it is rejected (never served later)."""


class Simulator:
    """One replay: `Simulator(config, requests, policy).run()`; `policy` is a name of the policy
    family, or a fresh `Policy` object (e.g. a variant built for an analysis)."""

    def __init__(
        self,
        config: Config,
        requests: Sequence[Request],
        policy: str | Policy,
        *,
        record: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.requests = requests
        truth = {
            m.name: (m.load_seconds.disk, m.load_seconds.cached_s, m.load_seconds.host) for m in config.models
        }
        idx = {"disk": 0, "cached": 1, "host": 2}
        if isinstance(policy, Policy):
            pol = policy
        elif policy == "oracle":
            # Its future is the requests the engine will see: one refused before that (an unknown
            # class for a known model) stayed its next use of that model for the rest of the run.
            models, classes = {m.name for m in config.models}, {c.name for c in config.classes}
            pol = create_policy(
                policy, [r for r in requests if r.model in models and (r.cls is None or r.cls in classes)]
            )
        else:
            pol = create_policy(policy, requests)
        self.engine = Engine(config, pol, lambda m, src: truth[m.name][idx[src]])
        if record:
            self.engine.actions = []
        self.res = ReplayResult(policy=pol.name)
        self.res.served_log = [] if record else None
        self.progress = progress
        self.class_names = self.engine.state.class_names
        self.class_rank = {c: i for i, c in enumerate(self.class_names)}
        self.waits: dict[str, list[float]] = {c: [] for c in self.class_names}
        self.figs = {name: ModelFigures() for name in self.engine.models}
        self.waiting: deque[_Waiting] = deque()
        self.engine.room_wanted = self._room_wanted  # (no prewarm takes room requests wait for)
        # Per class rank: `max_queue`; how many of `waiting` are of that class; for a class with a
        # `max_queue`, when the loads its served requests still wait for end (a heap, so the count
        # at each arrival is amortized O(log n), not a scan).
        self.queue_limit: list[int | None] = [c.max_queue for c in config.classes]
        self.waiting_n: list[int] = [0] * len(self.class_names)
        self.loading: list[list[float]] = [[] for _ in self.class_names]
        self.heap: list[float] = []
        self._seen = -math.inf  # the latest time the engine was given (`_drain`)
        self._retry_at = math.nan

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> ReplayResult:
        reqs = self.requests
        eng = self.engine
        t_start = (reqs[0].t if reqs else 0.0) - WARMUP_S
        eng.start(t_start)
        self._push_wakeups()
        models = eng.models
        limits = self.queue_limit
        n = len(reqs)
        for i, r in enumerate(reqs):
            now = r.t
            if self.heap and self.heap[0] <= now:
                self._drain(now)
            self._seen = max(self._seen, now)
            self.res.requests += 1
            m = models.get(r.model)
            rank = m.rank if m is not None and r.cls is None else self.class_rank.get(r.cls or "", -1)
            if m is None or rank < 0:
                what = f"unknown model '{r.model}'" if m is None else f"unknown class '{r.cls}'"
                self._reject(what)
                continue
            eng.observe(m, now)
            self.figs[m.name].requests += 1  # (at arrival, as the top level's: served or rejected)
            limit = limits[rank]
            if limit is not None and self._queued(rank, now) >= limit and not self._ready(m, now):
                # The live manager's words (manager/live.py `_queue_for`), checked at arrival.
                self._reject(f"class '{self.class_names[rank]}': queue full ({limit} requests waiting)", m)
                self._push_wakeups()  # (those its arrival asked for: the oracle's, say)
                continue
            # Behind an earlier request for its model of its class or a higher one, or no room yet.
            if self._behind(m, rank) or not self._handle(r, m, rank, now, now):
                self._arrive_waiting(r, m, rank, now)
            elif self.waiting:  # what this request moved (an eviction) may have made room for them
                self._retry(now)
            if eng.wakeups:
                self._push_wakeups()
            if self.progress is not None and i % 2000 == 0:
                self.progress(i, n)
        # The span the figures cover ends where the trace does - the last request's end had it been
        # served on arrival - the same for every policy (a policy's late loads or its wake-ups after
        # the trace do not stretch it): residency is counted up to there, not beyond.
        t_end = max(max((r.t + r.busy_s for r in reqs), default=t_start), t_start + 1.0)
        self._drain(t_end)
        eng.close(t_end)
        gpu_time = dict(eng.gpu_time)
        # After that, pending events (expiries, retries of waiting requests) play out, for at most
        # DRAIN_S: a policy that keeps asking for wake-ups cannot run forever.
        horizon = t_end + DRAIN_S
        last = t_end
        while self.heap or self.waiting:
            if not self.heap or self.heap[0] > horizon:
                for w in self.waiting:
                    self._reject("no room became free before the end of the trace", w.m)
                self.waiting.clear()
                self.waiting_n = [0] * len(self.class_names)
                break
            last = self.heap[0]
            self._drain(last)
        eng.close(last)
        return self._finish(t_start, t_end, gpu_time)

    def _drain(self, upto: float) -> None:
        heap = self.heap
        while heap and heap[0] <= upto:
            t = heapq.heappop(heap)
            while heap and heap[0] <= t:
                heapq.heappop(heap)
            # a wake-up for a time the engine has passed is made now: time never goes back (a request
            # served before it arrived, a lease grown before its session began)
            t = max(t, self._seen)
            self._seen = t
            self.engine.tick(t)
            if self.waiting:
                self._retry(t)
            self._push_wakeups()

    def _push_wakeups(self) -> None:
        for t in self.engine.wakeups:
            heapq.heappush(self.heap, t)
        self.engine.wakeups.clear()

    # ---- one request ------------------------------------------------------------------------------
    def _handle(self, req: Request, m: ModelState, rank: int, arrival: float, now: float) -> bool:
        """Serve `req` (arrived at `arrival`) now if the engine admits it; False if it must wait (the
        caller queues it)."""
        eng = self.engine
        adm = eng.admit(m, rank, now)
        if adm.status == "reject":
            self._reject(adm.reason, m)
            return True
        if adm.status == "wait":
            return False
        ready = adm.ready_at
        if ready > now and self.queue_limit[rank] is not None:
            heapq.heappush(self.loading[rank], ready)  # waits for its model's load until then
        start = max(now, ready, m.busy_until)
        cold = ready > arrival
        lw = ready - arrival if cold else 0.0
        res, fig = self.res, self.figs[m.name]
        res.served += 1
        if cold:
            res.cold_starts += 1
            res.load_wait_s += lw
            fig.cold_starts += 1
            fig.load_wait_s += lw
        self.waits[self.class_names[rank]].append(start - arrival)
        if res.served_log is not None:
            res.served_log.append((arrival, m.name, cold, lw))
        if req.keep_alive is not None or m.keep_alive_req is not None:  # (served: as the live manager)
            eng.request_keep_alive(m, req.keep_alive)
        eng.finish(m, start, req.busy_s)
        eng.after_request(m, now)
        return True

    def _behind(self, m: ModelState, rank: int) -> bool:
        """Does an earlier request for `m`, of class `rank` or a higher one, wait for room? (A request
        of a higher class is tried at once: it may take room the earlier ones may not.)"""
        return m.waiting > 0 and any(w.m is m and w.rank <= rank for w in self.waiting)

    @staticmethod
    def _ready(m: ModelState, now: float) -> bool:
        """Is `m` loaded on its device and ready at `now`? (A request for it waits for no load and no
        room, so a full queue does not refuse it.)"""
        return m.tier == GPU and m.ready_at <= now

    def _queued(self, rank: int, now: float) -> int:
        """How many requests of class `rank` wait for their model at `now`, as the live manager
        counts them (`queued`): for room, or for a load under way (one that ends at `now` is over)."""
        loading = self.loading[rank]
        while loading and loading[0] <= now:
            heapq.heappop(loading)
        return self.waiting_n[rank] + len(loading)

    def _room_wanted(self, device: str) -> bool:
        """Whether requests wait for room on `device`: a prewarm there gives way to them, as in the
        live manager (`Engine.room_wanted`)."""
        return any(w.m.device == device for w in self.waiting) if self.waiting else False

    def _arrive_waiting(self, req: Request, m: ModelState, rank: int, now: float) -> None:
        """A request that just arrived (within its class's `max_queue`) must wait for room: at most
        until its `max_wait`."""
        max_wait = self.engine.state.class_max_wait[rank]
        w = _Waiting(req, m, rank, now, now + max_wait)
        if now < w.deadline < math.inf:
            heapq.heappush(self.heap, w.deadline)  # wake up then: served by then, or rejected
        self._wait(w, now)

    def _wait(self, w: _Waiting, now: float, *, schedule: bool = True) -> bool:
        """`w` waits (True), or is rejected past its class's max_wait (False); `schedule`: once it
        waits, the retry is scheduled (`_retry` leaves it out while nothing changed since the last
        one: the same time again)."""
        if now >= w.deadline:
            # The live manager's words (manager/live.py `_admit`).
            max_wait = self.engine.state.class_max_wait[w.rank]
            self._reject(f"model '{w.m.name}': no room within its class's max_wait ({max_wait} s)", w.m)
            return False
        self.waiting.append(w)
        w.m.waiting += 1
        self.waiting_n[w.rank] += 1
        if schedule:
            self._schedule_retry(now)
        return True

    def _schedule_retry(self, now: float) -> None:
        t = self.engine.next_change(now)
        if t < math.inf and t != self._retry_at:
            self._retry_at = t
            heapq.heappush(self.heap, t)

    def _retry(self, now: float) -> None:
        """Try the waiting requests again in class order (the highest first), within a class first
        come first served, as the live manager does (`manager/live.py` `_room_pass`); passes repeat
        while one serves something, since what a served request moves (its evictions) may make room
        for one tried before it in the same pass. A request still without room keeps the later
        requests for its model of its class or a lower one behind it; a later one of a higher class
        is tried, and so is one for another model (a smaller one may fit the room there is)."""
        progress = True
        while progress and self.waiting:
            progress = False
            pending, self.waiting = self.waiting, deque()
            blocked: dict[str, int] = {}  # model -> the highest class (lowest rank) left waiting
            # A request put back schedules the retry (`Engine.next_change`, a look at every model)
            # only when the engine may have changed since the last one did: the same time again is
            # no new retry, and thousands of requests waiting made each pass cost thousands of looks.
            # (Their own count, `m.waiting`, is not in `next_change`.)
            changed = True
            # (`waiting` is in arrival order within each class, and a stable sort keeps it so)
            for w in sorted(pending, key=_rank_of):
                w.m.waiting -= 1
                self.waiting_n[w.rank] -= 1
                if w.rank >= blocked.get(w.m.name, len(self.class_names)):
                    # behind an earlier request for its model
                    if self._wait(w, now, schedule=changed):
                        changed = False
                elif self._handle(w.req, w.m, w.rank, w.arrival, now):
                    progress = changed = True
                else:  # still no room (its admission may have moved something: scheduled)
                    changed = not self._wait(w, now)
                    blocked[w.m.name] = w.rank

    def _reject(self, reason: str, m: ModelState | None = None) -> None:
        self.res.rejected += 1
        if m is not None:  # (None: a request for a model or class the config does not have)
            self.figs[m.name].rejected += 1
        self.res.reject_reasons[reason] = self.res.reject_reasons.get(reason, 0) + 1

    def _finish(self, t_start: float, t_end: float, gpu_time: dict[str, float]) -> ReplayResult:
        """The figures; `gpu_time` is each model's time on the GPU from `t_start` to `t_end`."""
        res, c = self.res, self.engine.counters
        span = t_end - t_start  # 0 only where t is so large that adding a second changes nothing
        for name, fig in self.figs.items():
            fig.resident_fraction = min(1.0, gpu_time[name] / span) if span > 0 else 0.0
        res.models = self.figs
        res.wait_p99_s = {k: p99(v) for k, v in self.waits.items()}
        res.evictions, res.thrash, res.expiries = c.evictions, c.thrash, c.expiries
        res.budget_violations, res.prewarm_loads, res.wasted_loads = (
            c.budget_violations,
            c.prewarm_loads,
            c.wasted_loads,
        )
        # A prewarmed model never used before the end of the trace was a wasted load too.
        res.wasted_loads += sum(1 for m in self.engine.models.values() if m.prewarmed)
        res.loads, res.loads_by_source = c.loads, dict(c.loads_by_source)
        res.lease_shrinks, res.lease_grows = c.lease_shrinks, c.lease_grows
        res.actions = self.engine.actions
        return res


def _rank_of(w: _Waiting) -> int:
    return w.rank


def replay(
    config: Config,
    requests: Sequence[Request],
    policy: str | Policy,
    *,
    record: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay `requests` through `policy` (a name, or a fresh `Policy` object) on the server
    described by `config`."""
    return Simulator(config, requests, policy, record=record, progress=progress).run()
