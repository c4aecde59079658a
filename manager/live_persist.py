"""What the live manager keeps in the store so that a restart loses nothing: the statistics (reuse
histograms, load costs, footprints, request counts), each model's intended tier (and the adoption
of what reattached device hosts hold, and the loads that bring the recorded intents back), and
the request log (buffered, written in batches, kept while the store is down).

`PersistenceMixin` is one of `manager.live.LiveManager`'s bases; it holds no state of its own
(`LiveManager.__init__` sets the attributes it declares), but for four with class defaults: when this
run started, whether the request log's records of an earlier run are in the statistics yet, the
saved statistics of models not configured now, and when the request log is next trimmed to its
retention (`store.request_log_retention`).
"""

from __future__ import annotations

import asyncio
import copy
import heapq
import json
import logging
import math
import time
import uuid
from bisect import bisect_right
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from manager.journal import RequestJournal
from manager.metrics import Metrics
from manager.policy.engine import Engine
from manager.policy.stats import EDGES, HOW_EDGES, LoadCost, ReuseHistogram, hours_between
from manager.policy.types import Action, ActionKind, Tier
from manager.replay.trace import keep_alive_json
from manager.store.base import (
    NEVER_RAN,
    CorruptDocument,
    CorruptRow,
    StoreError,
    normalize_record,
    record_keep_alive,
)
from manager.units import format_duration, parse_keep_alive
from workers import protocol as P

if TYPE_CHECKING:
    from collections.abc import Iterator

    from manager.config_schema import Config, ModelConfig
    from manager.live import _Live

logger = logging.getLogger("manager.live")  # the live manager's one logger (operators' log config)

LOG_KEEP = 100_000
TRIM_EVERY_S = 3600.0
"""How often (at most) the request log's records older than `store.request_log_retention` are deleted
from the store: at the first statistics save of a run, then at the first save an hour later, and so on."""


def _join_hist(a: ReuseHistogram, b: ReuseHistogram) -> ReuseHistogram:
    """`a`'s arrivals followed by `b`'s, as one histogram observing them all in time order would have
    them: both added up, and the interval between `a`'s last arrival and `b`'s first counted too
    (ValueError if their shapes differ). `b`'s arrivals must come after `a`'s; when they do not (a
    clock stepped back), that one interval is left out."""

    def add(x: list[Any], y: list[Any]) -> list[Any]:
        return [add(p, q) if isinstance(p, list) else int(p) + int(q) for p, q in zip(x, y, strict=True)]

    if not b.count or not a.count:
        return _read_hist((b if b.count else a).capture(), b.hours)
    x: dict[str, Any] = a.capture()
    y: dict[str, Any] = b.capture()
    out: dict[str, Any] = {k: add(x[k], y[k]) for k in ("bins", "how_bins", "arrivals_how", "arrivals_hod")}
    gap = b.first_t - a.last_t
    if gap >= 0.0:  # the interval between the two runs of arrivals (hour of week of the first one)
        out["bins"][bisect_right(EDGES, gap)] += 1
        out["how_bins"][b.hours(a.last_t)][bisect_right(HOW_EDGES, gap)] += 1
    out.update(count=a.count + b.count, first_t=min(a.first_t, b.first_t), last_t=max(a.last_t, b.last_t))
    return _read_hist(out, b.hours)


T = TypeVar("T")


def read_outcome(task: asyncio.Future[Any]) -> None:
    """A done callback: `task`'s exception marked read. A task no caller awaits any more (its caller
    was cancelled; a stop left it) would otherwise have asyncio log "Task exception was never
    retrieved", with a traceback, when it is collected; whoever still awaits it gets the exception all
    the same."""
    if not task.cancelled():
        task.exception()


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread. Cancelled, the caller waits for it to end before the cancellation
    goes on: a store write is never left running behind a later one."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    work.add_done_callback(read_outcome)  # (a cancelled caller no longer reads it)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        raise


_Steps = Generator[tuple[Callable[..., Any], tuple[Any, ...]], Any, Any]
"""Work whose store calls are yielded as (function, arguments), each call's result sent back
(`PersistenceMixin._save_steps`, `_restore_steps`): the caller chooses the thread they are made on."""


def _run_steps(steps: _Steps) -> Any:
    """`steps` run to their end, each store call made here; what they return."""
    result = None
    try:
        while True:
            fn, args = steps.send(result)
            result = fn(*args)
    except StopIteration as done:
        return done.value


async def _run_steps_async(steps: _Steps, call: Callable[..., Awaitable[Any]]) -> Any:
    """`steps` run to their end on the event loop, each store call made by `call` (on a thread)."""
    result = None
    try:
        while True:
            fn, args = steps.send(result)
            result = await call(fn, *args)
    except StopIteration as done:
        return done.value


MAX_COUNT = 2**53
"""The largest count a saved entry may hold (a request count, a histogram bin, a footprint in bytes):
every count up to it is exact as a float, which the policy's arithmetic makes of it. A larger one
(a damaged or hand-edited document) would fail that arithmetic at every decision."""


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT


def _shaped(x: Any, like: Any) -> bool:
    """`x` has the nested-list shape of `like`, with a count (`_is_count`) at each leaf."""
    if isinstance(like, list):
        return isinstance(x, list) and len(x) == len(like) and all(map(_shaped, x, like))
    return _is_count(x)


def _finite(x: Any) -> bool:
    """`x` is a JSON number a float can hold (not NaN or infinite, nor an integer too large for one)."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # a huge JSON integer
        return False


def _time_or_none(x: Any) -> bool:
    return x is None or _finite(x)


def _read_hist(doc: Any, hours: Callable[[float], int]) -> ReuseHistogram:
    """A saved `ReuseHistogram.capture()` as a new histogram on the home's clock `hours` (ValueError
    unless it has its shape: a restored list of the wrong length would fail every later request's
    `observe`)."""
    if not isinstance(doc, dict):
        raise ValueError("reuse histogram: not an object")
    fresh = ReuseHistogram().capture()
    for k in ("bins", "how_bins", "arrivals_how", "arrivals_hod", "count"):
        if not _shaped(doc.get(k), fresh[k]):
            raise ValueError(f"reuse histogram: {k} of the wrong shape")
    # Each arrival but the first adds at most one interval (`_join_hist` leaves out one across a clock
    # stepped back): more intervals than that would make the policy's hazard divide by zero.
    intervals = max(doc["count"] - 1, 0)
    if sum(doc["bins"]) > intervals or sum(map(sum, doc["how_bins"])) > intervals:
        raise ValueError(f"reuse histogram: more intervals in its bins than its {doc['count']} arrivals make")
    if not (_time_or_none(doc.get("first_t")) and _time_or_none(doc.get("last_t"))):
        raise ValueError("reuse histogram: first_t/last_t not a time")
    if doc["count"] and not (_finite(doc.get("first_t")) and _finite(doc.get("last_t"))):
        # (restored as -inf/inf: a later merge, `_join_hist`, took the hour of week of -inf, a
        # ValueError out of every save and flush of the run; a first_t after last_t is not refused:
        # a wall clock stepped back between two arrivals leaves one, and every use takes it as is)
        raise ValueError(f"reuse histogram: {doc['count']} arrivals, but no first_t/last_t time")
    h = ReuseHistogram(hours)
    h.restore(doc)
    return h


def spec_key(config: Config, cfg: ModelConfig) -> str:
    """What a model's measured footprint and load times belong to: its adapter, source and device
    (and the device's kind). Another checkpoint under the same name is measured afresh."""
    kind = {d.name: d.kind for d in config.devices}.get(cfg.device)
    return json.dumps([cfg.adapter, cfg.source, cfg.device, kind], sort_keys=True, default=str)


def saved_measurements(config: Config, doc: Any) -> dict[str, tuple[int, dict[str, float]]]:
    """From the store's saved "stats" document `doc`: each configured model's footprint and load
    seconds by source as the service decides by them (`LiveManager.measured`: measured, or the
    config's estimates where nothing was measured), for `residency tune --from-store`'s replays, as
    the service's own tuning takes them. A model with no entry, one saved for another adapter, source
    or device, or one unreadable, is left out (its config's estimates stand)."""
    out: dict[str, tuple[int, dict[str, float]]] = {}
    if not isinstance(doc, dict):
        return out
    for m in config.models:
        d = doc.get(m.name)
        if not isinstance(d, dict) or d.get("spec", spec_key(config, m)) != spec_key(config, m):
            continue
        ls = m.load_seconds
        try:
            cost = _read_cost(LoadCost(ls.disk, ls.cached_s, ls.host), d["cost"])
            weights = _count(d.get("weights", m.memory)) if d.get("measured", True) is True else m.memory
        except (KeyError, TypeError, ValueError):
            continue
        if weights > 0:
            out[m.name] = (weights, cost.as_dict())
    return out


def _read_cost(cost: LoadCost, doc: Any) -> LoadCost:
    """`cost` (left as it is) with the saved samples `doc` folded in, as a new object."""
    if not isinstance(doc, dict) or not all(
        # (NaN and infinities are floats, which `LoadCost.measure` leaves out; an integer too large
        # for a float would fail it)
        isinstance(v, list) and all(isinstance(x, float) or _finite(x) for x in v)
        for v in doc.values()
    ):
        raise ValueError("load costs: not lists of seconds by source")
    out = copy.deepcopy(cost)
    out.restore(doc)
    return out


def _same(rec: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What tells one canonical request record from another (two equal ones: one request written
    twice, or two requests in the same instant alike in everything)."""
    return tuple(sorted(rec.items()))


JOURNAL_COMPARE = (
    "left out while the request journal's records were compared with the store (a journal record it "
    "may have been is written again); repair or delete it to read that time range"
)
CATCH_UP = (
    "left out of the statistics' catch-up for good (they go on without that request; `trace export` "
    "and the tuning leave the row out too, until it is repaired or deleted)"
)
"""What `_skip_corrupt` says of a damaged row, by the read that left it out (the catch-up's stopped
whole, and the next save's mark then put the requests it had not read out of reach)."""


def _skip_corrupt(e: StoreError, said: set[str], what: str) -> None:
    """Say (once: `said` holds what was) a corrupt stored row that a read leaves out, and `what` of it."""
    if e.reason in said:
        return
    said.add(e.reason)
    logger.warning("%s; %s", e, what)


def _why(e: Exception) -> str:
    """What is wrong with a saved entry, from the error reading it (a KeyError names only the key)."""
    return f"it has no {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e)


def _count(x: Any) -> int:
    if _is_count(x):
        return int(x)
    raise ValueError(f"{x!r} is not a count")


def _keep_alive_req(x: Any) -> float | None:
    """A saved request's keep-alive (`keep_alive_json`'s form; None: the config's holds). ValueError
    if it is not one."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float | str):
        raise ValueError(f"keep_alive_req is not a keep-alive but {type(x).__name__}")
    return parse_keep_alive(x, bounded=False)


def _when(x: Any) -> float:
    if x is not None and _time_or_none(x):
        return float(x)
    raise ValueError(f"{x!r} is not a time")


def _complete_until(d: dict[str, Any], hist: ReuseHistogram) -> float | None:
    """Up to when a model's saved entry `d` (its histogram `hist`) has every arrival: the time of the
    save that wrote it (`seen_until`: arrivals are observed as they come, so none before it is left
    out) or its last arrival, whichever is later; None when it says neither (an older document's
    entry of a model never asked for)."""
    seen = d.get("seen_until")
    times = [float(seen)] if seen is not None and _time_or_none(seen) else []
    if hist.count:
        times.append(hist.last_t)
    return max(times, default=None)


def _saved_until(doc: dict[str, Any]) -> float | None:
    """The time of the newest save in `doc` (None when no entry says): a model configured then has an
    entry, so one without has no arrival before it (as far as this document knows)."""
    seen = [d.get("seen_until") for d in doc.values() if isinstance(d, dict)]
    return max((float(t) for t in seen if t is not None and _time_or_none(t)), default=None)


_Taken = tuple[dict[str, ReuseHistogram], dict[str, tuple[int, float, float | None]]]
"""What `_take_missed` read of the request log: each model's histogram that took its records, and per
model how many, when its last one ended and the last one's own keep-alive (None: it had none)."""


@dataclass(frozen=True)
class _MergePlan:
    """Statistics saved by an earlier run, read late (`_merge_plan`): per model its saved entry, its
    saved histogram or a fresh one, up to when it is complete, and from when the log's records are
    this run's."""

    saved: dict[str, tuple[ReuseHistogram, Any, int, float, float | None]]
    """Per model: its saved histogram, load costs (as saved: joined with the measured ones at the
    apply; None when another model was saved under its name), request count, last use and the last
    request's own keep-alive (None: it had none)."""
    before: dict[str, ReuseHistogram]
    since: dict[str, float | None]
    until: dict[str, float]


def _wanted(since: dict[str, float | None], until: dict[str, float]) -> Callable[[dict[str, Any]], bool]:
    """Whether a request record is one the statistics' catch-up takes: a configured model's (those in
    `since`), after its `since` (any when None), before its `until`."""

    def wanted(rec: dict[str, Any]) -> bool:
        name, t = rec["model"], rec["t"]
        if name not in since or t >= until[name]:
            return False  # a model no longer configured, or a request this run has seen
        after = since[name]
        return after is None or t > after  # (else in the snapshot already)

    return wanted


class PersistenceMixin:
    """Statistics, intents and the request log of `LiveManager` (see the module's docstring)."""

    config: Config
    store: Any
    pool: Any
    clock: Callable[[], float]
    engine: Engine
    live: dict[str, _Live]
    keep_alive_said: set[str]
    specs: dict[str, Any]
    metrics: Metrics
    journal: RequestJournal | None
    _log_buf: list[dict[str, Any]]
    _log_sending: list[dict[str, Any]]
    _log_failing: bool
    _intents_stale: bool
    _intents_damaged: list[object]
    """The keys of the damaged intent rows read at start (`_read_intents`), until a save replaces them."""
    _intents_pending: dict[str, tuple[str, str]]
    """Intents recorded on the event loop and not yet written (`_set_intent`): model -> (tier, why)."""
    _intent_writer: asyncio.Task[None] | None = None
    _stats_unread: bool
    _retry_len: int = 0
    """The request log's first records that are a batch the store failed: sent again alone, as they
    were (`_flush_log`)."""
    _silent_at: float = -math.inf  # (monotonic) when a probe last found the store silent
    _pins_unread: bool  # (LiveManager's: the store was down at start, its admin pins still to be read)
    _down_at_start: str | None = None
    """Why the store did not answer at start (`serve`'s first probe, `RedisStore.refused`, or the
    statistics' read), if it did not: the start's other reads (the admin pins, the intents) are not
    tried (a store that hangs, a stopped Redis, takes 15 s a call, and the start waited for each in
    turn); the pins are read once the store answers, the intents rewritten from the books. (A failed
    journal flush does not count: a store may refuse writes, a Redis at its maxmemory, and still
    answer reads.)"""
    _stats_until: float = math.inf
    """This run's start: the request log's records before it are an earlier run's (caught up)."""
    _stats_caught_up: bool = False
    """The request log's records an earlier run left out of its statistics are taken in."""
    _stats_others: dict[str, Any] | None = None
    """The saved statistics of models not configured now, as read: saved again as they are."""
    _next_trim: float = -math.inf
    """When the request log is next trimmed to `store.request_log_retention` (`_trim_log`)."""
    _flush_lock: asyncio.Lock
    _save_lock: asyncio.Lock  # one statistics save at a time (`save_stats_async`)
    _intent_gen: int  # intents decided so far: a rewrite taken before one more is not the books
    _drop_retries: set[str]  # op ids of drops sent a second time (a refusal then: a resync)
    _measured: set[str]  # models whose `weights` a device host measured (not the config's estimate)
    sessions: dict[str, tuple[str, float, int]]
    _boots: dict[str, str]  # device -> the boot id of its host process, as last read
    _ops: dict[str, tuple[str, ActionKind]]  # op id -> the model and kind of a command on its way
    _last_drops: set[str]  # op ids of drops neither retried nor resynced if they fail
    _unsynced: dict[str, tuple[float, str]]  # device -> (next resync at, why): its status unread

    if TYPE_CHECKING:  # LiveManager's

        def _gauge_resident(self) -> None: ...
        async def _restore_pins_off_loop(self) -> None: ...
        def _hold_abandoned(self, m: Any, why: str) -> bool: ...
        def _publish(
            self, kind: str, model: str, detail: str, device: str, t: float, **extra: Any
        ) -> None: ...

    # ---- statistics that survive a restart ---------------------------------------------------
    def _save_steps(self) -> _Steps:
        """The steps of a statistics save, each store call yielded as (function, arguments) for the
        caller to make (here: `save_stats`; on a thread: `save_stats_async`) and its result sent back.
        After the store was down: first the intents it missed, and the statistics it held at start-up
        merged in (saving without them would overwrite the earlier runs' history). Returns whether the
        statistics were saved (not while the store is still down)."""
        if self._intents_stale:
            gen, tiers, damaged = self._intent_gen, self._intent_tiers(), list(self._intents_damaged)
            written = yield self._write_intents, (tiers, damaged)
            if written:
                self._intents_damaged = [k for k in self._intents_damaged if k not in damaged]
            if written and self._intent_gen == gen:  # (else decided meanwhile: rewritten next time)
                self._intents_stale = False
        if self._stats_unread:
            saved = yield self._read_saved_stats, ()
            if saved is None:
                return False
            plan = self._merge_plan(saved)
            taken = yield self._take_missed, self._missed_args(plan.before, plan.since, plan.until)
            self._merge_apply(plan, taken)
            self._stats_unread = False
        yield self._put_stats, (self._stats_doc(),)
        return True

    def save_stats(self) -> None:
        """Reuse histograms, measured load costs and footprints → the store (doc "stats"), as
        `_save_steps` says. The store's calls are made here, on the caller's thread: the service
        saves with `save_stats_async`."""
        if self.store is None:
            return
        _run_steps(self._save_steps())

    async def save_stats_async(self) -> None:
        """`save_stats` as the service makes it: what is saved is taken on the event loop, the store's
        calls are made on a thread. A store that hangs (a stopped Redis, a network that drops its
        packets, a SQLite file another program holds locked) held the event loop, and every request,
        for its timeout at each save (15 s a minute with Redis). One save at a time; a cancelled
        caller (the stop) waits for a write under way, so an older one never lands after a newer.
        Then, once the statistics are saved, the request log's old records are trimmed."""
        if self.store is None:
            return
        async with self._save_lock:
            writer = self._intent_writer
            if self._intents_stale and writer is not None and not writer.done():
                # its write under way ends first (it stops at its failure): an intent it wrote late
                # would stand over the rewrite from the books below, for good
                await asyncio.wait({writer})
            if not await _run_steps_async(self._save_steps(), _off_loop):
                return
            await self._trim_log()

    async def _trim_log(self) -> None:
        """The request log's records older than `store.request_log_retention` (as the config is now:
        a reload's applies at the next trim) deleted from the store, on a thread, at most once every
        TRIM_EVERY_S; the number that went is logged. Null: nothing deleted. Only after the records of
        an earlier run are in the statistics (`save_stats_async` returns before, while they are
        unread): the statistics' catch-up reads them from the log."""
        keep = self.config.store.request_log_retention
        now = self.clock()
        if keep is None or now < self._next_trim:
            return
        self._next_trim = now + TRIM_EVERY_S  # (a failure too: tried again in an hour, not each minute)
        gone = await _off_loop(self._trim_requests, now - keep)
        if gone:
            logger.info(
                "request log: %d record(s) older than %s (store.request_log_retention) deleted",
                gone,
                format_duration(keep),
            )

    def _trim_requests(self, before: float) -> int:
        """`store.trim_requests(before)`; a failure is logged (one line, not a traceback for a
        StoreError) and counts as none deleted. Any thread."""
        try:
            return int(self.store.trim_requests(before))
        except StoreError as e:
            logger.warning("could not trim the request log in the store (%s); tried again in an hour", e)
        except Exception:
            logger.exception("could not trim the request log in the store; tried again in an hour")
        return 0

    def _intent_tiers(self) -> dict[str, str]:
        tiers = {Tier.GPU: "gpu", Tier.HOST: "host"}
        return {name: tiers.get(m.tier, "disk") for name, m in self.engine.models.items()}

    def _write_intents(self, tiers: dict[str, str], damaged: Sequence[object] = ()) -> bool:
        """Every model's intended tier, as `tiers` has it (the engine's books, after writes were lost
        to a store outage, or a damaged row read at start); the `damaged` rows' keys that name no
        model of `tiers` removed (a model no longer configured: no rewrite would replace them, and
        every start said them again). Whether all was written. Any thread."""
        try:
            for name, tier in tiers.items():
                self.store.set_intent(name, tier)
            for key in damaged:
                # (Redis gives its keys as bytes: one naming a configured model was just rewritten)
                named = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
                if not (isinstance(named, str) and named in tiers):
                    self.store.drop_intent(key)
            return True
        except Exception as e:
            logger.warning("the store is still down: intents not rewritten (%s)", str(e) or type(e).__name__)
            return False

    def _read_saved_stats(self) -> dict[str, Any] | None:
        """The statistics the store held at start (read late: it was down then), {} when it cannot
        read them (replaced at this save), None when it is still down. Any thread."""
        try:
            saved: dict[str, Any] = self.store.get_doc("stats") or {}
            return saved
        except CorruptDocument as e:  # it answers, but cannot read it: kept aside, replaced
            logger.error("the statistics saved in the store are unreadable (%s); %s", e, self._stats_aside())
            return {}
        except Exception:
            logger.warning("the store is still down: statistics not saved")
            return None

    def _stats_aside(self) -> str:
        """Move the unreadable "stats" document aside (`Store.set_aside_doc`), so the next save does
        not overwrite it; says where it went, for the log line (or that it could not be kept)."""
        try:
            aside = self.store.set_aside_doc("stats")
        except Exception as e:  # (a full disk, the store gone again): said, not raised
            return f"could not keep it aside ({e}); starting fresh, overwritten at the next save"
        return f"kept as document {aside!r}; starting fresh" if aside else "starting fresh"

    def _stats_doc(self) -> dict[str, Any]:
        """The "stats" document: each model's statistics now, and the saved ones of models not
        configured now (kept as they were). On the event loop: it reads the engine's books."""
        doc = dict(self._stats_others or {})
        now = self.clock()  # every arrival before it is in the histograms (`_complete_until`)
        hours = self.engine.hours  # (the clock the counts by hour of week are on: turned if it changes)
        clock, offset = hours.name, hours.offset(now)
        doc.update({
            name: {"hist": m.hist.capture(), "cost": m.cost.capture(), "weights": m.weights,
                   "measured": name in self._measured, "spec": self._spec_of(name),
                   "requests": self.live[name].requests, "last_used": self.live[name].last_used,
                   "keep_alive_req": None if m.keep_alive_req is None else keep_alive_json(m.keep_alive_req),
                   "clock": clock, "clock_offset_s": offset, "seen_until": now}
            for name, m in self.engine.models.items()
        })  # fmt: skip
        return doc

    def _put_stats(self, doc: dict[str, Any]) -> None:
        """`doc` to the store; a failure is logged (one line each time, not a traceback). Any thread."""
        try:
            self.store.put_doc("stats", doc)
        except StoreError as e:  # (a full disk, a lock)
            logger.error("could not save statistics to the store: %s", e)
        except Exception:
            logger.exception("could not save statistics to the store")

    def _spec_of(self, name: str) -> str:
        """What a model's measured footprint and load times belong to (`spec_key`)."""
        return spec_key(self.engine.config, self.engine.models[name].cfg)

    def _same_spec(self, name: str, d: dict[str, Any]) -> bool:
        """Whether the saved entry `d` was measured with `name`'s configured spec (an older document,
        which does not say, counts as the same); when not, says so."""
        if d.get("spec", self._spec_of(name)) == self._spec_of(name):
            return True
        logger.info(
            "statistics of %s: its adapter, source or device changed since they were saved; its "
            "measured footprint and load times start again from the config's estimates",
            name,
        )
        return False

    def restore_stats(self) -> int:
        """Statistics saved by an earlier run, for the models still configured, brought up to date with
        the request log (`_catch_up_stats`); returns how many models' were restored. The store down:
        fresh statistics now, the saved ones (and the log's) taken in once it answers (`save_stats`).
        The entries of models not configured now are kept as they are (saved with this run's). The
        store's calls are made here, on the caller's thread: the service's start makes them on a
        thread (`restore_stats_async`)."""
        if self.store is None:
            return 0
        return int(_run_steps(self._restore_steps()))

    async def restore_stats_async(self) -> int:
        """`restore_stats` as the service's start makes it: the store's calls (the statistics' read, the
        request log's catch-up) on a thread, the books changed on the event loop. Made there, a store
        that hangs held the loop (health checks, stop signals) for its timeout; a long catch-up too."""
        if self.store is None:
            return 0
        # (reads: a stop signal during the start does not wait for one to end, as a write's caller
        # does, `_off_loop`; a store that hangs would hold it for its timeout)
        return int(await _run_steps_async(self._restore_steps(), asyncio.to_thread))

    def _read_stats_doc(self) -> dict[str, Any] | BaseException:
        """The saved "stats" document ({} when none, or unreadable: said); the store's error when it
        does not answer. Any thread."""
        try:
            return self.store.get_doc("stats") or {}
        except CorruptDocument as e:  # it answers, but cannot read it: kept aside, fresh
            logger.error("the statistics saved in the store are unreadable (%s); %s", e, self._stats_aside())
            return {}
        except Exception as e:
            return e

    def _restore_steps(self) -> _Steps:
        """The steps of `restore_stats`, each store call yielded as (function, arguments) for the caller
        to make and its result sent back (as `_save_steps`)."""
        self._stats_until = min(self._stats_until, self.clock())  # what the log has before: caught up
        # What is this run's in the request log: its arrivals from its first on (none yet, at start).
        # Not the clock: one set back between the runs (NTP) would leave the last run's latest
        # requests out of the statistics, as this run's own.
        until = {n: m.hist.first_t if m.hist.count else math.inf for n, m in self.engine.models.items()}
        if self._down_at_start is not None:
            logger.warning(
                "could not read saved statistics from the store (%s); starting fresh", self._down_at_start
            )
            self._stats_unread = True  # merged in when the store is back (save_stats)
            return 0
        doc = yield self._read_stats_doc, ()
        if isinstance(doc, BaseException):  # the store is down at start: serve anyway, fresh statistics
            if isinstance(doc, StoreError):  # supported (said, without a traceback)
                logger.warning("could not read saved statistics from the store (%s); starting fresh", doc)
            else:
                logger.error(
                    "could not read saved statistics from the store; starting fresh",
                    exc_info=(type(doc), doc, doc.__traceback__),
                )
            self._stats_unread = True  # merged in when the store is back (save_stats)
            self._down_at_start = "not tried: the store failed the statistics' read at start"
            return 0
        self._stats_others = {n: d for n, d in doc.items() if n not in self.engine.models}
        since: dict[str, float | None] = dict.fromkeys(self.engine.models, _saved_until(doc))
        restored = 0
        for name, d in doc.items():
            m = self.engine.models.get(name)
            if m is None:
                continue
            try:  # all of a model's entry is read before any of it is taken (none, if unreadable)
                if not isinstance(d, dict):
                    raise ValueError(f"an entry that is not an object but {type(d).__name__}")
                hist, cost = self._saved_hist(d), _read_cost(m.cost, d["cost"])
                requests, last_used = _count(d.get("requests", 0)), _when(d.get("last_used", 0.0))
                keep_alive = _keep_alive_req(d.get("keep_alive_req"))  # (older documents: none)
                measured = d.get("measured", True)  # (older documents do not say)
                if not self._same_spec(name, d):  # another model under this name: its use, not its size
                    cost, measured = m.cost, False
                weights = _count(d.get("weights", m.weights)) if measured is True else None
                if weights == 0:
                    raise ValueError("a footprint of 0 bytes")
            except (KeyError, TypeError, ValueError) as e:
                logger.warning(
                    "statistics of %s in the store are unreadable (%s); rebuilt from the request log",
                    name,
                    _why(e),
                )
                since[name] = None  # its whole history is in the log: the catch-up takes all of it
                continue
            m.hist, m.cost = hist, cost
            since[name] = _complete_until(d, hist)
            # How long it has been idle counts from its last arrival, before the restart too.
            m.last_arrival = max(m.last_arrival, m.hist.last_t)
            if weights is not None:  # a measured footprint; an estimate gives way to the config's
                m.weights = weights
                self._measured.add(name)
            self.live[name].requests = requests
            self.live[name].last_used = last_used
            if "keep_alive_req" not in d and hist.count:  # an earlier release's: its last record says it
                keep_alive = yield self._logged_keep_alive, (name, hist.last_t)
            if keep_alive is not None:  # the last request's own keep-alive holds across the restart
                self.engine.request_keep_alive(m, keep_alive)
            restored += 1
        self.engine.recheck_fit()  # restored footprints change what can ever fit
        # the request log's catch-up, also with no snapshot (a run killed before its first save)
        yield from self._catch_up_steps(since, until)
        return restored

    def _logged_keep_alive(self, name: str, t: float) -> float | None:
        """The own keep-alive of `name`'s request logged at `t` (its last arrival), None when it had
        none or the log cannot say (any thread): statistics an earlier release saved do not keep it."""
        try:
            found = [
                r
                for r in self.store.requests(t, math.nextafter(t, math.inf), on_corrupt=lambda e: None)
                if r["model"] == name and r.get("outcome") not in NEVER_RAN
            ]
        except Exception as e:  # (the store failed between two reads: the config's keep-alive holds)
            logger.warning("could not read %s's last request's keep-alive from the request log: %s", name, e)
            return None
        return record_keep_alive(found[-1]) if found else None

    def _saved_hist(self, d: dict[str, Any]) -> ReuseHistogram:
        """A saved entry's histogram on the home's clock: counted on another (the zone changed since,
        or an older release counted on UTC's, saying none), its counts by hour of week are turned by
        the clocks' difference, so a habit keeps its hour (ValueError: not one)."""
        hours = self.engine.hours
        hist = _read_hist(d["hist"], hours)
        clock, offset = d.get("clock"), d.get("clock_offset_s", 0.0)
        if not isinstance(clock, str) or not isinstance(offset, int | float) or not math.isfinite(offset):
            clock, offset = None, 0.0
        turn = hours_between(clock, float(offset), hours, self.clock())
        if turn:
            hist.turn(turn)
            logger.info(
                "statistics counted on %s's clock turned %+d h to the home's, %s's",
                clock or "UTC (an earlier release)", turn, hours.name,
            )  # fmt: skip
        return hist

    def _merge_plan(self, doc: dict[str, Any]) -> _MergePlan:
        """Statistics saved by an earlier run, read late (the store was down at start): each model's
        saved entry, and up to when it is complete. Then (`_save_steps`) the request log's records
        after that are read on a thread (`_take_missed`: a killed earlier run's, from its journal),
        and `_merge_apply` adds what this run has seen after them, in time order: reuse histograms
        and request counts add up, saved load times join the measured ones. Footprints stay as this
        run has them (the engine's books count them)."""
        saved: dict[str, tuple[ReuseHistogram, Any, int, float, float | None]] = {}
        self._stats_others = {n: d for n, d in doc.items() if n not in self.engine.models}
        since: dict[str, float | None] = dict.fromkeys(self.engine.models, _saved_until(doc))
        for name, d in doc.items():
            m = self.engine.models.get(name)
            if m is None:
                continue
            try:  # all of a model's entry is read before any of it is merged (none, if unreadable)
                if not isinstance(d, dict):
                    raise ValueError(f"an entry that is not an object but {type(d).__name__}")
                hist, cost = self._saved_hist(d), d["cost"]
                _read_cost(m.cost, cost)  # (read: all of the entry or none; joined at the apply)
                requests, last_used = _count(d.get("requests", 0)), _when(d.get("last_used", 0.0))
                keep_alive = _keep_alive_req(d.get("keep_alive_req"))
                if not self._same_spec(name, d):
                    cost = None
            except (KeyError, TypeError, ValueError) as e:
                logger.warning(
                    "statistics of %s in the store are unreadable (%s); rebuilt from the request log",
                    name,
                    _why(e),
                )
                since[name] = None  # (as restore_stats does)
                continue
            saved[name] = (hist, cost, requests, last_used, keep_alive)
            since[name] = _complete_until(d, hist)
        hours = self.engine.hours
        before = {n: saved[n][0] if n in saved else ReuseHistogram(hours) for n in self.engine.models}
        # this run's first arrival of each model bounds what is an earlier run's (a clock step aside)
        until = {n: min(self._stats_until, m.hist.first_t) for n, m in self.engine.models.items()}
        return _MergePlan(saved, before, since, until)

    def _merge_apply(self, plan: _MergePlan, taken: _Taken | None) -> None:
        """`plan`'s saved statistics, the request log's records after them (`taken`; None: unread)
        and what this run has seen (on the books now), joined in time order."""
        before = dict(plan.before)
        caught: dict[str, tuple[int, float, float | None]] = {}
        if taken is not None:
            work, caught = taken
            before.update(work)
        for name, m in self.engine.models.items():
            live = self.live[name]
            # the earlier run's last request's own keep-alive, where this run has seen none of its own
            earlier: float | None = None
            if name in plan.saved:
                _, cost, requests, last_used, earlier = plan.saved[name]
                if cost is not None:  # the saved samples, then this run's (the newest are kept)
                    mine = m.cost.capture()  # (taken now: a load measured while the log was read too)
                    m.cost = _read_cost(m.cost.fresh(), cost)
                    m.cost.restore(mine)
                live.requests += requests
                live.last_used = max(live.last_used, last_used)
            m.hist = _join_hist(before[name], m.hist)
            m.last_arrival = max(m.last_arrival, m.hist.last_t)
            if name in caught:
                live.requests += caught[name][0]
                live.last_used = max(live.last_used, caught[name][1])
                earlier = caught[name][2]  # (the log's last record says it, or that it had none)
            if name not in self.keep_alive_said and earlier is not None:  # (a request of this run
                self.engine.request_keep_alive(m, earlier)  # refused before admission said nothing)

    def _missed_args(
        self, hists: dict[str, ReuseHistogram], since: dict[str, float | None], until: dict[str, float]
    ) -> tuple[Any, ...]:
        """The arguments of `_take_missed`, taken on the event loop: copies of `hists` (the thread
        that reads the log adds to them; the books' own take requests meanwhile) and the request
        records still waiting for the store that it wants. The catch-up is made once per run."""
        self._stats_caught_up = True
        copies = {n: copy.deepcopy(h) for n, h in hists.items()}
        wanted = _wanted(since, until)
        waiting = []
        for rec in self._log_buf:
            try:
                rec = normalize_record(rec)
            except ValueError:
                continue  # (dropped, and said, when the store refuses it)
            if wanted(rec):
                waiting.append(rec)
        waiting.sort(key=lambda r: r["t"])  # (stable: equal times keep the buffer's order)
        return copies, since, until, waiting

    def _take_missed(
        self,
        hists: dict[str, ReuseHistogram],
        since: dict[str, float | None],
        until: dict[str, float],
        waiting: list[dict[str, Any]],
    ) -> _Taken | None:
        """Each of `hists` (a model's statistics, complete up to its `since`: copies, `_missed_args`)
        observes the requests the log has after that, before its `until` (`_missed_requests`), in
        time order. Returns them and, per model, how many it took, when its last one ended and that
        one's own keep-alive; None when the log is unreadable (said). Any thread."""
        out: dict[str, tuple[int, float, float | None]] = {}
        try:
            for rec in self._missed_requests(since, until, waiting):
                name, t = rec["model"], rec["t"]
                hists[name].observe(t)  # (asked for: demand, as the engine observed it at arrival)
                if rec.get("outcome") in NEVER_RAN:  # no use: neither a request served nor a keep-alive
                    continue
                n, end, _ = out.get(name, (0, 0.0, None))
                end = max(end, t + rec.get("wait_s", 0.0) + rec["busy_s"])
                out[name] = (n + 1, end, record_keep_alive(rec))
        except Exception as e:  # the store failed between the two reads: the snapshot alone
            if isinstance(e, StoreError):  # (said in one line: the store names what failed)
                logger.error("could not read the request log to bring the statistics up to date: %s", e)
            else:
                logger.exception("could not read the request log to bring the statistics up to date")
            return None
        taken = sum(n for n, _, _ in out.values())
        if taken:
            logger.info("statistics brought up to date with %d requests from the request log", taken)
        return hists, out

    def _missed_requests(
        self, since: dict[str, float | None], until: dict[str, float], waiting: list[dict[str, Any]]
    ) -> Iterator[dict[str, Any]]:
        """The request records of the models in `since` after each one's `since` (all of them when
        None) and before its `until` (this run's own are seen already), in time order (equal times
        in the log's order): those the store has, and those still waiting for it (`waiting`: the
        journal's, read at start while the store was down; in time order), each once: a waiting
        record the store has already (a batch it took just before a kill, which the journal still
        had) is taken from the store alone. Streamed: a log of millions read since a model's last use
        months ago is never held whole, only the waiting records are."""
        wanted = _wanted(since, until)
        lo = min((0.0 if t is None else t for t in since.values()), default=0.0)
        ends = [t for t in until.values() if math.isfinite(t)]
        hi = max(ends) if len(ends) == len(until) and ends else None
        keys = Counter(map(_same, waiting))
        held: Counter[tuple[tuple[str, Any], ...]] = Counter()
        said: set[str] = set()  # a damaged row is named once and left out: the rest is caught up on
        log = self.store.requests(max(lo, 0.0), hi, on_corrupt=lambda e: _skip_corrupt(e, said, CATCH_UP))
        stored = ((rec, True) for rec in log if wanted(rec))
        # merged by time, the store's first at equal times: its copy of a waiting record comes before it
        for rec, in_store in heapq.merge(stored, ((rec, False) for rec in waiting), key=lambda x: x[0]["t"]):
            if keys:
                same = _same(rec)
                if in_store and same in keys:
                    held[same] += 1
                elif not in_store and held[same] > 0:  # one for one: the store's copy stands for it
                    held[same] -= 1
                    continue
            yield rec

    def _catch_up_stats(
        self, since: dict[str, float | None] | None = None, until: dict[str, float] | None = None
    ) -> int:
        """Requests that arrived after the saved statistics were taken (a killed manager saves none
        at its end) are in the request log (the journal has just put the last ones there): each
        model's reuse histogram, request count and last use take them in, so a kill loses no
        statistics. Each model's histogram says up to when it is complete (its last arrival); the
        only ones not recovered are requests in flight at that snapshot. Once per run (at start, by
        `restore_stats`; later, with the store down at start, by the save's merge). `since` and
        `until`: per model, up to when its statistics are complete and from when the log's records
        are this run's (`_take_missed`; by default its last arrival and now). The log is read here,
        on the caller's thread. Returns how many."""
        if self.store is None:
            return 0
        return int(_run_steps(self._catch_up_steps(since, until)))

    def _catch_up_steps(
        self, since: dict[str, float | None] | None = None, until: dict[str, float] | None = None
    ) -> _Steps:
        """The steps of `_catch_up_stats` (its read of the log yielded, as `_save_steps`); how many."""
        if self._stats_caught_up:
            return 0
        hists = {n: m.hist for n, m in self.engine.models.items()}
        if since is None:
            since = {n: h.last_t if h.count else None for n, h in hists.items()}
        if until is None:
            until = {n: min(self._stats_until, self.clock()) for n in hists}
        taken = yield self._take_missed, self._missed_args(hists, since, until)
        return self._apply_caught(taken)

    def _apply_caught(self, taken: _Taken | None) -> int:
        """The request log's records taken by `_take_missed` on the books: each model's histogram (a
        copy that took them), request count, last use and idle time. Returns how many."""
        if taken is None:
            return 0
        hists, caught = taken
        for name, m in self.engine.models.items():
            m.hist = hists[name]
        for name, (n, end, keep_alive) in caught.items():
            m, live = self.engine.models[name], self.live[name]
            # the log's last record is the latest request (none of this run's came after it): its own
            # keep-alive holds, or, if it had none, the config's
            latest = m.last_arrival <= m.hist.last_t
            if latest and (keep_alive is not None or m.keep_alive_req is not None):
                self.engine.request_keep_alive(m, keep_alive)
            m.last_arrival = max(m.last_arrival, m.hist.last_t)  # as `restore_stats` has it: idle since
            live.requests += n
            live.last_used = max(live.last_used, end)
        return sum(n for n, _, _ in caught.values())

    # ---- intents ----------------------------------------------------------------------------
    async def adopt(self) -> list[str]:
        """Reattached device hosts may already hold models (a manager restart): put what they hold on
        the engine's books as it is, with no command and no load (the first request is a hit), and
        drop what no longer is configured there or does not fit the books; close the world sessions
        left open there by an earlier run (`_close_orphans`). Returns the models adopted."""
        now = self.clock()
        adopted: list[str] = []
        for device in self.pool.devices():
            try:
                st = await asyncio.to_thread(self.pool.status, device, 10.0)
            except Exception as e:  # (still starting): resynced by the reconciler once it answers
                logger.warning(
                    "device %s did not report its status at start (%s); what it holds is read again "
                    "once it answers",
                    device,
                    e,
                )
                # its first result would only record its boot id: without a resync, what it holds
                # stayed off the books for good, its room given to other models
                self._unsynced[device] = (now, f"the start could not read its status ({e})")
                continue
            if st.boot_id:
                self._boots[device] = st.boot_id
            await self._close_orphans(device, st)
            for name, ms in st.models.items():
                m = self.engine.models.get(name)
                tier = {"gpu": Tier.GPU, "host": Tier.HOST}.get(ms.tier)
                if m is None or m.device != device or tier is None:
                    logger.info("device %s holds %s, which is not configured there: dropped", device, name)
                    self._drop_on_host(device, name)
                    continue
                if ms.spec is not None and ms.spec != self.specs.get(name):
                    logger.info(
                        "device %s holds %s loaded with another adapter, source or budget than the "
                        "config's: dropped (it loads again from the configured source)",
                        device,
                        name,
                    )
                    self._drop_on_host(device, name)
                    continue
                if tier == Tier.GPU and ms.device_bytes > 0:
                    m.weights = int(ms.device_bytes)  # the host's measure, before the books count it
                    self._measured.add(name)
                    self.engine.recheck_fit()
                elif tier == Tier.HOST and ms.host_bytes > m.weights and name not in self._measured:
                    # held in host RAM, larger than its estimate and never measured on the device: the
                    # bytes it holds there, as a read into host RAM is booked (`_confirmed`); it was
                    # adopted at its estimate (two models of 256 MiB estimated at 1 MiB: 2 MiB booked)
                    m.weights = int(ms.host_bytes)
                    self.engine.recheck_fit()
                if not self.engine.adopt(m, tier, now):
                    logger.warning("device %s holds %s, which does not fit the books: dropped", device, name)
                    self._drop_on_host(device, name)
                    continue
                live = self.live[name]
                live.tier = ms.tier
                if tier == Tier.GPU:
                    live.ready.set()
                self._set_intent(name, ms.tier)
                adopted.append(name)
            for name, (op, secs) in getattr(st, "abandoned", {}).items():  # (an older host: none)
                m = self.engine.models.get(name)
                if m is not None and m.device == device and m.tier == Tier.DISK:  # an earlier run's
                    self._hold_abandoned(m, f"at start: its abandoned {op} has run {secs:.0f} s on {device}")
        self._gauge_resident()
        return adopted

    def _drop_on_host(self, device: str, name: str, *, last_try: bool = False, retry: bool = False) -> None:
        """Drop `name` on `device`, which holds it beyond the books (nothing on the books changes). Its
        result is taken as the engine's drops' are (a command on its way: no resync touches the model
        meanwhile): refused, it is sent once more (`retry`: this is that second one), then a resync
        follows; `last_try`: a refusal is only said (a resync's own drop: no loop of drops and
        resyncs)."""
        op = uuid.uuid4().hex
        self._ops[op] = (name, ActionKind.DROP)
        if last_try:
            self._last_drops.add(op)
        if retry:
            self._drop_retries.add(op)
        self.pool.submit(device, P.Drop(name), op)

    async def _close_orphans(self, device: str, st: P.WorkerStatus) -> list[str]:
        """Close on `device` every world session its status lists that this manager has no record of:
        one an earlier run of the manager left open there when it was killed (device hosts outlive it
        on a cluster), holding its KV memory and its world model, which nobody would ever close. Its
        state is saved on close, so its client can still resume it. Returns the ids closed. (A session
        left open after this, by a manager killed mid-open, is closed when the host refuses an open
        because of it: `manager.live_sessions`' `_orphan`.)"""
        closed = []
        for s in st.sessions:
            if s.session_id in self.sessions:
                continue
            try:
                reply = await asyncio.to_thread(self.pool.session, device, "close", s.session_id)
            except Exception as e:
                reply = P.SessionReply(False, error=repr(e))
            if not reply.ok:
                logger.warning(
                    "device %s: world session %s, left open by an earlier run of the manager, could not "
                    "be closed at adoption: %s",
                    device,
                    s.session_id,
                    reply.error,
                )
                continue
            logger.warning(
                "device %s: world session %s of %s was left open by an earlier run of the manager: closed "
                "at adoption (its state is saved: its client can resume it)",
                device,
                s.session_id,
                s.model,
            )
            detail = (
                f"session {s.session_id}: left open on the device host by an earlier run of the manager; "
                "closed at adoption (resumable)"
            )
            self._publish("session_closed", s.model, detail, device, self.clock())
            closed.append(s.session_id)
        return closed

    def _read_intents(self) -> dict[str, str]:
        """The recorded intents, for `restore_intent` ({} when the store does not answer: said; every
        intent is then rewritten from the books at the next save). Any thread."""

        def corrupt(e: StoreError) -> None:  # one damaged row: the others are restored, it is replaced
            logger.warning("%s; left out at start (replaced, or removed, at the next save)", e)
            if isinstance(e, CorruptRow):  # (a model not configured now: removed, not rewritten)
                self._intents_damaged.append(e.key)
            self._intents_stale = True

        try:
            if self._down_at_start is not None:
                raise StoreError(self.store.url, self._down_at_start)
            return dict(self.store.intents(on_corrupt=corrupt))
        except Exception as e:  # the store is down
            if isinstance(e, StoreError):  # (it names what failed: said in one line)
                logger.warning("could not read the recorded intents at start (%s); not restored", e)
            else:
                logger.exception("could not read the recorded intents at start; not restored")
            # the policy's start-up decides alone; every intent is rewritten from its books at the
            # next save (a damaged one replaced, else every later start would read none either)
            self._intents_stale = True
            return {}

    def restore_intent(self, now: float, intents: dict[str, str] | None = None) -> list[str]:
        """At start, after adoption: the models whose recorded intent is the gpu or host tier but that
        no device host holds (the host died with the manager, or lost them) are loaded back, higher
        classes first, within the admission rules: only into free room (nothing evicted for them),
        never a model with `prewarm: false` (it loads at its first request) or one that can never
        fit. Intents of models no longer configured are ignored. `intents`: as `_read_intents` read
        them (the service's start, on a thread); by default read here. Returns "model (tier)" per load."""
        if self.store is None:
            return []
        if intents is None:
            intents = self._read_intents()
        restored: list[str] = []
        models = self.engine.models
        for name in sorted(intents, key=lambda n: (models[n].rank if n in models else 0, n)):
            tier, m = intents[name], models.get(name)
            if m is None:
                if tier != "disk":  # (a disk intent has nothing to restore: not said at every start)
                    logger.info("recorded intent %s for %s ignored: the model is not configured", tier, name)
                continue
            if tier not in ("gpu", "host") or m.tier == Tier.GPU or (tier == "host" and m.tier == Tier.HOST):
                continue  # held as intended, held on the gpu tier already, or intended on disk
            if not m.prewarm_ok or self.engine.never_fits[name]:
                # (one that can never fit its device would be held in host RAM for requests it
                # refuses: its reason says which room it can never have)
                never = self.engine.never_fits[name]
                why = "prewarm: false" if not m.prewarm_ok else f"it can never fit ({never})"
                logger.info("recorded intent %s for %s not restored: %s", tier, name, why)
                continue
            reason = f"restart: recorded intent {tier}"
            if tier == "host":
                ok = self.engine.load_host(m, now, reason)
            else:
                ok = self.engine.make_room(m, m.rank, now, may_evict=False, prewarm=True)
                if ok:
                    self.engine.load(m, now, prewarm=False, reason=reason)
            if ok:
                restored.append(f"{name} ({tier})")
            else:
                logger.info("recorded intent %s for %s not restored: no free room for it", tier, name)
        return restored

    def _record_intent(self, a: Action) -> None:
        """The tier the manager wants each model in, kept in the store (what a restarted manager
        reconciles the device hosts against)."""
        tier = {ActionKind.LOAD: "gpu", ActionKind.PROMOTE: "gpu", ActionKind.LOAD_HOST: "host",
                ActionKind.DEMOTE: "host", ActionKind.DROP: "disk"}.get(a.kind)  # fmt: skip
        if tier is not None:
            self._set_intent(a.model, tier, a.kind.value)

    def _set_intent(self, model: str, tier: str, why: str = "adopted") -> None:
        """Record `model`'s intended tier. On the event loop the write goes to a thread, in order
        (`_write_pending_intents`): made there, a store that hangs held the loop, and every request,
        for its timeout (15 s with Redis) at the first write. Once a write has failed the next ones
        are not tried; every intent is rewritten from the engine's books once the store answers
        (`save_stats_async`). Without a running loop (a test's direct call), written at once."""
        self._intent_gen += 1
        if self.store is None or self._intents_stale:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._write_intent_batch({model: (tier, why)})
            return
        self._intents_pending[model] = (tier, why)  # (a later intent of the model replaces it)
        if self._intent_writer is None or self._intent_writer.done():
            self._intent_writer = asyncio.ensure_future(self._write_pending_intents())
            self._intent_writer.add_done_callback(read_outcome)

    async def _write_pending_intents(self) -> None:
        while self._intents_pending and not self._intents_stale:
            batch, self._intents_pending = self._intents_pending, {}
            await _off_loop(self._write_intent_batch, batch)
        self._intents_pending = {}  # (the store failed: all are rewritten once it answers)

    def _write_intent_batch(self, batch: dict[str, tuple[str, str]]) -> None:
        """Write `batch` (model: (tier, why)) in order; a failure marks every intent for a rewrite.
        Any thread."""
        for model, (tier, why) in batch.items():
            try:
                self.store.set_intent(model, tier)
            except Exception:  # serving goes on; all intents are rewritten once the store is back
                self._intents_stale = True
                logger.warning("could not record the intent for %s (%s -> %s)", model, why, tier)
                return

    # ---- request-log buffering and flushing ---------------------------------------------------
    def _log(self, rec: dict[str, Any]) -> None:
        self._log_buf.append(rec)
        self.metrics.log_buffered.set(len(self._log_buf))  # (between flushes too: it read low)
        if self.journal is None:
            return
        if not self._journal_catch_up():
            self.journal.append(rec)

    def _journal_catch_up(self, *, force: bool = False) -> bool:
        """When the journal failed appends (a full disk), write it anew with every record the store
        does not have (the buffer, and the batch a flush is sending, which the store may yet refuse),
        at most once a second unless `force`; True when done. Asked at each request, at each tick of
        the reconciler (a quiet hour after a burst must not leave them in memory only) and at the
        stop."""
        if self.journal is None or not self.journal.behind:
            return False
        return self.journal.catch_up(self._log_sending + self._log_buf, time.monotonic(), force=force)

    async def flush_log(self) -> None:
        """Write the buffered request log to the store (kept for the next try if the store fails).
        One flush at a time: when it returns, what was buffered at the call is written (or kept),
        also if the reconciler's own flush was writing a part of it meanwhile."""
        async with self._flush_lock:
            await self._flush_log()

    async def _flush_log(self) -> None:
        if self.store is None or not self._log_buf:
            return
        if self._log_failing and not await self._store_answers():
            self._keep_log([])  # still down: a ping, not the whole batch encoded and sent again
            return
        # a batch the store failed goes again as it was (its records alone, the newer ones after it):
        # a Redis that hangs may run the first copy once it answers, and the same batch is written once
        retried, n = self._retry_len > 0, self._retry_len or len(self._log_buf)
        batch, self._log_buf = self._log_buf[:n], self._log_buf[n:]
        self._log_sending = batch
        # shielded: a cancelled caller (the reconciler at stop) must not leave a written batch in the
        # journal, or the next start would log it twice; and the write's outcome is still handled
        # here, under the flush lock (a batch the store fails is kept), before the cancel goes on
        write = asyncio.ensure_future(self._write_batch(batch))
        cancelled = False
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            cancelled = True
            await asyncio.wait({write})
        except Exception:
            pass  # handled below, from the write itself
        error = asyncio.CancelledError() if write.cancelled() else write.exception()
        self._log_sending = []
        if error is not None:
            self._write_failed(batch, error)
        else:
            self._write_done()
        if cancelled:
            raise asyncio.CancelledError
        if error is None and retried and self._log_buf:  # then the newer records, in this flush too
            await self._flush_log()
            return
        if error is None and (self._intents_stale or self._stats_unread):  # the store answers again:
            await self.save_stats_async()  # what else it missed
        if error is None and self._pins_unread:  # (its admin pins: not at the next save, a minute on)
            await self._restore_pins_off_loop()

    def _write_failed(self, batch: list[dict[str, Any]], e: BaseException) -> None:
        if isinstance(e, ValueError):  # records the store refuses (it answers): those go, the rest stay
            good = self._valid_records(batch)
            if len(good) < len(batch):
                self._keep_log(good)  # written at the next flush; the journal loses the bad ones then
                self._retry_len = 0
                return
        # the store is down: keep the records (bounded) and try again later
        why = str(e) or type(e).__name__
        logger.warning("could not write %d requests to the store (%s); kept for a retry", len(batch), why)
        self._log_failing = True
        # it may come back without what it held (a Redis restarted without its data): every intent
        # is rewritten from the books once it answers, not only those that changed meanwhile
        self._intents_stale = True
        self._keep_log(batch)
        self._retry_len = len(batch) if self._log_buf[: len(batch)] == batch else 0

    def _write_done(self) -> None:
        self.metrics.log_buffered.set(len(self._log_buf))
        self._log_failing = False
        self._retry_len = 0
        self._silent_at = -math.inf  # (it answers)

    def _valid_records(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records of `batch` the store can take; each other one is dropped, said and counted (a
        record it refuses would otherwise hold back every later one, retried for good)."""
        good = []
        for rec in batch:
            try:
                normalize_record(rec)
            except ValueError as e:
                logger.warning("request record %.200r dropped: the store cannot take it (%s)", rec, e)
                self.metrics.log_dropped.inc()
                continue
            good.append(rec)
        return good

    async def _store_answers(self) -> bool:
        """The store's `ping`, on a thread (a Redis store's: one PING within 2 s, not retried)."""
        try:
            return bool(await asyncio.to_thread(self.store.ping))
        except Exception:
            return False

    async def _store_silent(self, *, seen_within: float = 0.0) -> bool:
        """Whether the store, which failed a call lately (a write, the start's reads), does not answer
        a short probe now (`_store_answers`): its calls would each wait for their timeout (15 s with
        a Redis that hangs). Not asked when nothing failed, nor when a probe found it silent less than
        `seen_within` seconds ago (the stop: the reconciler's last probe stands)."""
        failed = self._log_failing or self._stats_unread or self._intents_stale or self._pins_unread
        if self.store is None or not failed:
            return False
        if time.monotonic() - self._silent_at <= seen_within:
            return True
        silent = not await self._store_answers()
        self._silent_at = time.monotonic() if silent else -math.inf
        return silent

    def _keep_log(self, batch: list[dict[str, Any]]) -> None:
        """Put an unwritten batch back in front of the buffer, keeping at most LOG_KEEP (the oldest
        go, counted): the records of requests that never ran first (`NEVER_RAN`: a client retrying a
        refusal in a loop must not push out the requests that ran, which the replay needs)."""
        kept = batch + self._log_buf
        if len(kept) > LOG_KEEP:
            over = len(kept) - LOG_KEEP
            self.metrics.log_dropped.inc(over)
            unrun = [i for i, rec in enumerate(kept) if rec.get("outcome") in NEVER_RAN][:over]
            if unrun:
                gone = set(unrun)
                kept = [rec for i, rec in enumerate(kept) if i not in gone]
            kept = kept[-LOG_KEEP:]
        self._log_buf = kept
        self.metrics.log_buffered.set(len(self._log_buf))
        if self.journal is not None and self.journal.lines > 2 * LOG_KEEP:
            # a long outage: the journal keeps what the buffer keeps, not every request since
            self.journal.rewrite(self._log_buf)

    async def _write_batch(self, batch: list[dict[str, Any]]) -> None:
        if self.journal is not None and self.journal.replayed:  # an earlier run's: the store may have some
            batch = await asyncio.to_thread(self._not_stored, batch, self.journal.replayed)
        await asyncio.to_thread(self.store.append_requests, batch)
        if self.journal is not None:
            self.journal.replayed = []  # (all that are left were in the batch: the store has them now)
            self.journal.rewrite(self._log_buf)  # what the store has leaves the journal

    def _not_stored(
        self, batch: list[dict[str, Any]], replayed: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """`batch` without those of the journal's records read at start (`replayed`) that the store
        holds already: a batch it took just before the earlier run was killed, before the journal let
        it go. Sent again, it would be in the request log twice, and counted twice by the statistics'
        catch-up. One for one: two equal records in the journal are two requests. A corrupt stored
        row in the window is named (once) and left out of the comparison: a journal record it may
        have been is written again, rather than every record of the journal held back for good."""
        mine = {id(rec) for rec in replayed}
        times = [rec["t"] for rec in batch if id(rec) in mine]
        if not times:
            return batch
        said = self.journal.corrupt_said if self.journal is not None else set()
        window = self.store.requests(
            min(times),
            math.nextafter(max(times), math.inf),
            on_corrupt=lambda e: _skip_corrupt(e, said, JOURNAL_COMPARE),
        )
        held = Counter(map(_same, window))
        out = []
        for rec in batch:
            if id(rec) in mine and held[_same(rec)] > 0:
                held[_same(rec)] -= 1
                continue
            out.append(rec)
        if len(out) < len(batch):
            logger.info(
                "%d request(s) of the journal were in the store already (written just before the last "
                "run ended): not logged again",
                len(batch) - len(out),
            )
        return out
