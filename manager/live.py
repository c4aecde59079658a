"""The live manager: admission → policy → reconciler, on an asyncio loop (never blocking on a worker).

Order of use: `await start()` (pinned models load, the poll loop starts), then `infer(...)`,
`preload`, `evict`, `pin`/`unpin`, `status()`, `subscribe()` from gRPC handlers; `await stop()`.

The decision engine (`manager.policy`) decides with its own bookkeeping of tiers; every decision it
logs becomes one declarative command to the model's device host, submitted through the worker pool.
A request waits for its model's *confirmed* load (the worker's result), with a deadline; the
worker's measured load time and footprint then replace the engine's estimates. A failed load
takes the model off the engine's books (so it stops counting against the budget) and fails the
waiting requests with the worker's reason. All engine calls happen on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from manager.config import Config
from manager.errors import (
    DeadlineExceeded,
    InsufficientCapacity,
    InvalidRequest,
    ModelNotFound,
    WorkerUnavailable,
)
from manager.journal import RequestJournal
from manager.metrics import Metrics
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.types import Action, ActionKind, Tier
from manager.workers_bridge import model_specs
from workers import protocol as P

logger = logging.getLogger(__name__)

POLL_S = 0.005
WAIT_RETRY_S = 0.05
EVENTS_QUEUE = 1000
SAVE_EVERY_S = 60.0
LOG_EVERY_S = 1.0
LOG_BATCH = 500
LOG_KEEP = 100_000
LEASE_WAIT_S = 10.0
"""A grown lease waits at most this long for the commands that free its room to finish."""
SESSION_RECOVER_S = 60.0
"""A world session whose device host died has this long to be reopened (model reload included)."""
INLINE_INFER_S = 0.0005
"""In-process models whose recent inferences took less than this run on the event loop itself:
handing them to a thread would cost more than the inference."""


def worker_error(code: str | None, message: str) -> Exception:
    """The domain error for a worker's error code: what the caller sent is wrong (bad input, or a
    call the model does not offer) or the worker could not do it."""
    if code in (P.BAD_INPUT, P.NOT_AVAILABLE):
        return InvalidRequest(message)
    return WorkerUnavailable(message)


def _merge_hist(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two `ReuseHistogram.capture()`s added up (ValueError if their shapes differ)."""

    def add(x: list[Any], y: list[Any]) -> list[Any]:
        return [add(p, q) if isinstance(p, list) else int(p) + int(q) for p, q in zip(x, y, strict=True)]

    firsts = [t for t in (a.get("first_t"), b.get("first_t")) if t is not None]
    lasts = [t for t in (a.get("last_t"), b.get("last_t")) if t is not None]
    out = {k: add(a[k], b[k]) for k in ("bins", "how_bins", "arrivals_how", "arrivals_hod")}
    return {**out, "count": int(a["count"]) + int(b["count"]),
            "first_t": min(firsts, default=None), "last_t": max(lasts, default=None)}  # fmt: skip


@dataclass
class _World:
    """An open world session, as the manager tracks it to reopen it after its device host restarted."""

    codec: str
    next_segment: int = 0  # segments the client has been sent
    resumes: int = 0


_SESSION_ID = re.compile(r"[0-9a-f]{12}")


@dataclass
class _Live:
    """What the workers have confirmed for one model."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tier: P.TierName = "disk"
    error: str | None = None
    error_code: str | None = None
    load_error: str | None = None  # the last failed load's error, until a load succeeds (ps shows it)
    loads_pending: int = 0
    requests: int = 0
    last_used: float = 0.0
    inflight: int = 0


@dataclass(frozen=True)
class Served:
    """One served request's outcome (what goes to the request log)."""

    result: P.InferResult
    wait_s: float
    cold: bool


class LiveManager:
    def __init__(
        self,
        config: Config,
        pool: Any,
        *,
        store: Any = None,
        clock: Callable[[], float] = time.time,
        poll_s: float = POLL_S,
        journal: str | Path | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.store = store
        self.clock = clock
        self.poll_s = poll_s
        self.engine = Engine(config, create_policy(config.policy.name))
        self.engine.actions = []
        self._seen_actions = 0
        self.specs = model_specs(config)
        self.class_rank = {c.name: i for i, c in enumerate(config.classes)}
        self.live = {name: _Live() for name in self.engine.models}
        self._ops: dict[str, tuple[str, ActionKind]] = {}
        self._subscribers: list[asyncio.Queue[dict[str, Any]]] = []
        self._task: asyncio.Task[None] | None = None
        self.started = False
        self.waits: dict[str, list[float]] = {c.name: [] for c in config.classes}
        self.rejected = 0
        self.served = 0
        self._next_save = 0.0
        self.metrics = Metrics()
        self.sessions: dict[str, tuple[str, float, int]] = {}  # id -> (model, opened at, class rank)
        self.session_dir = Path(config.store.sessions).resolve()  # one saved-state directory per session
        self._world: dict[str, _World] = {}  # open session -> what a reopen needs
        # The request log is written in batches off the event loop (once a second, or sooner when
        # LOG_BATCH records wait), and at stop: a per-request write would cost more than the request.
        self._log_buf: list[dict[str, Any]] = []
        self.journal = RequestJournal(Path(journal)) if journal is not None and store is not None else None
        self._next_flush = 0.0
        # The store failed: the next log write is tried once a LOG_EVERY_S, after a ping (not on
        # every poll with the whole buffer re-encoded); intents are rewritten and the statistics
        # saved at start-up are merged in (not overwritten) once it answers again.
        self._log_failing = False
        self._intents_stale = False
        self._stats_unread = False
        self._infer_s: dict[str, float] = {}
        self.queued: dict[str, int] = {}  # requests of each class waiting for their model
        self._background: set[asyncio.Task[Any]] = set()
        self._lease_chain: dict[str, asyncio.Task[Any]] = {}  # device -> its last ordered lease step
        self._thrash_seen = 0
        self.pin_overrides: dict[str, bool] = {}  # admin pin/unpin over the config's `pin`
        self._flush_lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------
    # ---- statistics that survive a restart ---------------------------------------------------
    def save_stats(self) -> None:
        """Reuse histograms, measured load costs and footprints → the store (doc "stats"). After the
        store was down: first the intents it missed, and the statistics it held at start-up merged in
        (saving without them would overwrite the earlier runs' history)."""
        if self.store is None:
            return
        if self._intents_stale:
            self._rewrite_intents()
        if self._stats_unread:
            try:
                saved = self.store.get_doc("stats") or {}
            except Exception:
                logger.warning("the store is still down: statistics not saved")
                return
            self._stats_unread = False
            self._merge_stats(saved)
        doc = {
            name: {"hist": m.hist.capture(), "cost": m.cost.capture(), "weights": m.weights,
                   "requests": self.live[name].requests, "last_used": self.live[name].last_used}
            for name, m in self.engine.models.items()
        }  # fmt: skip
        try:
            self.store.put_doc("stats", doc)
        except Exception:
            logger.exception("could not save statistics to the store")

    def restore_stats(self) -> int:
        """Statistics saved by an earlier run, for the models still configured; returns how many."""
        if self.store is None:
            return 0
        try:
            doc = self.store.get_doc("stats") or {}
        except Exception:  # the store is down at start: serve anyway, with fresh statistics
            logger.exception("could not read saved statistics from the store; starting fresh")
            self._stats_unread = True  # merged in when the store is back (save_stats)
            return 0
        restored = 0
        for name, d in doc.items():
            m = self.engine.models.get(name)
            if m is None or not isinstance(d, dict):
                continue
            try:
                m.hist.restore(d["hist"])
                m.cost.restore(d["cost"])
                m.weights = int(d.get("weights", m.weights))
                self.live[name].requests = int(d.get("requests", 0))
                self.live[name].last_used = float(d.get("last_used", 0.0))
                restored += 1
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("statistics of %s in the store are unreadable (%s); starting fresh", name, e)
        return restored

    def _merge_stats(self, doc: dict[str, Any]) -> None:
        """Statistics saved by an earlier run, read late (the store was down at start), added to what
        this run has seen: reuse histograms and request counts add up, saved load times join the
        measured ones. Footprints stay as this run has them (the engine's books count them)."""
        for name, d in doc.items():
            m = self.engine.models.get(name)
            if m is None or not isinstance(d, dict):
                continue
            try:
                m.hist.restore(_merge_hist(d["hist"], m.hist.capture()))
                m.cost.restore(d["cost"])
                self.live[name].requests += int(d.get("requests", 0))
                self.live[name].last_used = max(self.live[name].last_used, float(d.get("last_used", 0.0)))
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("statistics of %s in the store are unreadable (%s); not merged", name, e)

    def _rewrite_intents(self) -> None:
        """Every model's intended tier (the engine's books), after writes were lost to a store outage."""
        tiers = {Tier.GPU: "gpu", Tier.HOST: "host"}
        try:
            for name, m in self.engine.models.items():
                self.store.set_intent(name, tiers.get(m.tier, "disk"))
            self._intents_stale = False
        except Exception:
            logger.warning("the store is still down: intents not rewritten")

    def _catch_up_stats(self) -> int:
        """Requests that arrived after the saved statistics were taken (a killed manager saves none
        at its end) are in the request log (the journal has just put the last ones there): each
        model's reuse histogram, request count and last use take them in, so a kill loses no
        statistics. Each model's histogram says up to when it is complete (its last arrival); the
        only ones not recovered are requests in flight at that snapshot. Returns how many."""
        lasts = {n: m.hist.last_t if m.hist.count else None for n, m in self.engine.models.items()}
        known = [t for t in lasts.values() if t is not None]
        n = 0
        try:
            for rec in self.store.requests(min(known, default=0.0)):
                name, t = rec["model"], rec["t"]
                last = lasts.get(name, math.inf)
                if last is not None and t <= last:
                    continue  # in the snapshot already (or a model no longer configured)
                self.engine.models[name].hist.observe(t)
                live = self.live[name]
                live.requests += 1
                live.last_used = max(live.last_used, t + rec.get("wait_s", 0.0) + rec["busy_s"])
                n += 1
        except Exception:  # the store failed between the two reads: the snapshot alone, as before
            logger.exception("could not read the request log to bring the statistics up to date")
        if n:
            logger.info("statistics brought up to date with %d requests from the request log", n)
        return n

    async def adopt(self) -> list[str]:
        """Reattached device hosts may already hold models (a manager restart): put what they hold on
        the engine's books as it is, with no command and no load (the first request is a hit), and
        drop what no longer is configured there or does not fit the books. Returns the models
        adopted."""
        now = self.clock()
        adopted: list[str] = []
        for device in self.pool.devices():
            try:
                st = await asyncio.to_thread(self.pool.status, device, 10.0)
            except Exception:  # a host that does not answer is reconciled by its next command
                logger.warning("device %s did not report its status at start", device)
                continue
            for name, ms in st.models.items():
                m = self.engine.models.get(name)
                tier = {"gpu": Tier.GPU, "host": Tier.HOST}.get(ms.tier)
                if m is None or m.device != device or tier is None:
                    logger.info("device %s holds %s, which is not configured there: dropped", device, name)
                    self.pool.submit(device, P.Drop(name))
                    continue
                if tier == Tier.GPU and ms.device_bytes > 0:
                    m.weights = int(ms.device_bytes)  # the host's measure, before the books count it
                    self.engine.never_fits[name] = self.engine._never_fits_reason(m)
                if not self.engine.adopt(m, tier, now):
                    logger.warning("device %s holds %s, which does not fit the books: dropped", device, name)
                    self.pool.submit(device, P.Drop(name))
                    continue
                live = self.live[name]
                live.tier = ms.tier
                if tier == Tier.GPU:
                    live.ready.set()
                self._set_intent(name, ms.tier)
                adopted.append(name)
        self._gauge_resident()
        return adopted

    def restore_intent(self, now: float) -> list[str]:
        """At start, after adoption: the models whose recorded intent is the gpu or host tier but that
        no device host holds (the host died with the manager, or lost them) are loaded back, higher
        classes first, within the admission rules: only into free room (nothing evicted for them),
        never a model with `prewarm: false` (it loads at its first request) or one that can never
        fit. Intents of models no longer configured are ignored. Returns "model (tier)" per load."""
        if self.store is None:
            return []
        try:
            intents = self.store.intents()
        except Exception:  # the store is down: the policy's start-up decides alone
            logger.warning("could not read the recorded intents at start; not restored")
            return []
        restored: list[str] = []
        models = self.engine.models
        for name in sorted(intents, key=lambda n: (models[n].rank if n in models else 0, n)):
            tier, m = intents[name], models.get(name)
            if m is None:
                logger.info("recorded intent %s for %s ignored: the model is not configured", tier, name)
                continue
            if tier not in ("gpu", "host") or m.tier == Tier.GPU or (tier == "host" and m.tier == Tier.HOST):
                continue  # held as intended, held on the gpu tier already, or intended on disk
            if not m.prewarm_ok or self.engine.never_fits[name]:
                why = "prewarm: false" if not m.prewarm_ok else "it can never fit"
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

    async def start(self) -> None:
        if self.journal is not None:  # requests served before a crash, not yet in the store
            self._log_buf = self.journal.read() + self._log_buf
            await self.flush_log()
        if self.restore_stats():
            self._catch_up_stats()
        self._restore_pins()
        adopted = await self.adopt()
        if adopted:
            self._publish("reattached", "", f"adopted {', '.join(adopted)}", "", self.clock())
        now = self.clock()
        self.engine.load_pinned(now)  # pinned models first: intents take what room is left
        restored = self.restore_intent(now)
        if restored:
            self._publish("intent_restored", "", f"loading {', '.join(restored)}", "", now)
        self.engine.start(now)
        self._flush()
        self._task = asyncio.create_task(self._loop(), name="residency-reconciler")
        self.started = True

    def _log(self, rec: dict[str, Any]) -> None:
        self._log_buf.append(rec)
        if self.journal is not None:
            self.journal.append(rec)

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
        batch, self._log_buf = self._log_buf, []
        try:
            # shielded: a cancelled caller (the reconciler at stop) must not leave a written batch
            # in the journal, or the next start would log it twice
            await asyncio.shield(self._write_batch(batch))
        except Exception:  # the store is down: keep the records (bounded) and try again later
            logger.warning("could not write %d requests to the store; kept for a retry", len(batch))
            self._log_failing = True
            self._keep_log(batch)
            return
        self.metrics.log_buffered.set(len(self._log_buf))
        self._log_failing = False
        if self._intents_stale or self._stats_unread:  # the store answers again: what else it missed
            self.save_stats()

    async def _store_answers(self) -> bool:
        try:
            return bool(await asyncio.to_thread(self.store.ping))
        except Exception:
            return False

    def _keep_log(self, batch: list[dict[str, Any]]) -> None:
        """Put an unwritten batch back in front of the buffer, keeping at most LOG_KEEP (the oldest
        go, counted)."""
        kept = batch + self._log_buf
        if len(kept) > LOG_KEEP:
            self.metrics.log_dropped.inc(len(kept) - LOG_KEEP)
            kept = kept[-LOG_KEEP:]
        self._log_buf = kept
        self.metrics.log_buffered.set(len(self._log_buf))

    async def _write_batch(self, batch: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self.store.append_requests, batch)
        if self.journal is not None:
            self.journal.rewrite(self._log_buf)  # what the store has leaves the journal

    async def stop(self) -> None:
        self.started = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush_log()
        self.save_stats()
        if self.journal is not None:
            self.journal.close()

    async def _loop(self) -> None:
        next_tick = 0.0
        while True:
            try:
                for r in self.pool.poll():
                    self._on_result(r)
                now = self.clock()
                wake = [t for t in self.engine.wakeups if t <= now]
                if wake or now >= next_tick:
                    self.engine.wakeups = [t for t in self.engine.wakeups if t > now]
                    self.engine.tick(now)
                    self._flush()
                    next_tick = now + 1.0
                full = len(self._log_buf) >= LOG_BATCH and not self._log_failing
                if self._log_buf and (now >= self._next_flush or full):
                    await self.flush_log()
                    self._next_flush = now + LOG_EVERY_S
                if now >= self._next_save:
                    self.save_stats()
                    self._next_save = now + SAVE_EVERY_S
            except Exception:  # the reconciler must outlive any one bad result
                logger.exception("reconciler step failed")
            await asyncio.sleep(self.poll_s)

    # ---- decisions -> commands ----------------------------------------------------------------
    def _flush(self) -> None:
        actions = self.engine.actions
        assert actions is not None
        new, self._seen_actions = actions[self._seen_actions :], len(actions)
        for t, a in new:
            self._apply(t, a)
        if len(actions) > 10_000:  # keep memory bounded on a long-running service
            del actions[: self._seen_actions]
            self._seen_actions = 0

    def _apply(self, t: float, a: Action) -> None:
        spec = self.specs[a.model]
        device = self.engine.models[a.model].device
        live = self.live[a.model]
        cmd: P.Command | None
        if a.kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            cmd = P.Load(spec, "gpu")
            live.ready.clear()
            live.error = None
            live.loads_pending += 1
        elif a.kind == ActionKind.LOAD_HOST:
            cmd = P.Load(spec, "host")
        elif a.kind == ActionKind.DEMOTE:
            cmd = P.Demote(a.model)
            live.ready.clear()
        elif a.kind == ActionKind.DROP:
            cmd = P.Drop(a.model)
            live.ready.clear()
        else:  # lease changes: the model's open world sessions follow the new lease, in order
            cmd = None
            for sid, (name, _, _) in self.sessions.items():
                if name == a.model:
                    grow = a.kind == ActionKind.GROW_LEASE
                    self._in_order(device, self._resize_session(device, sid, a.bytes), after_ops=grow)
        self._count_action(a)
        self._record_intent(a)
        if cmd is not None:
            op = uuid.uuid4().hex
            self._ops[op] = (a.model, a.kind)
            if device in self._lease_chain:  # behind a lease change still being applied
                self._in_order(device, self._submit(device, cmd, op))
            else:
                self.pool.submit(device, cmd, op)
        self._publish(a.kind.value, a.model, a.reason, device, t, bytes=a.bytes, prewarm=a.prewarm)

    def _record_intent(self, a: Action) -> None:
        """The tier the manager wants each model in, kept in the store (what a restarted manager
        reconciles the device hosts against)."""
        tier = {ActionKind.LOAD: "gpu", ActionKind.PROMOTE: "gpu", ActionKind.LOAD_HOST: "host",
                ActionKind.DEMOTE: "host", ActionKind.DROP: "disk"}.get(a.kind)  # fmt: skip
        if tier is not None:
            self._set_intent(a.model, tier, a.kind.value)

    def _set_intent(self, model: str, tier: str, why: str = "adopted") -> None:
        if self.store is None:
            return
        try:
            self.store.set_intent(model, tier)
        except Exception:  # serving goes on; all intents are rewritten once the store is back
            self._intents_stale = True
            logger.warning("could not record the intent for %s (%s -> %s)", model, why, tier)

    def _count_action(self, a: Action) -> None:
        mt = self.metrics
        if a.kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            mt.loads.labels(a.model, "gpu", "host" if a.kind == ActionKind.PROMOTE else "disk").inc()
        elif a.kind == ActionKind.LOAD_HOST:
            mt.loads.labels(a.model, "host", "disk").inc()
        elif a.kind in (ActionKind.DEMOTE, ActionKind.DROP) and a.device != "host":
            mt.evictions.labels(a.model, "host" if a.kind == ActionKind.DEMOTE else "disk").inc()
        elif a.kind in (ActionKind.SHRINK_LEASE, ActionKind.GROW_LEASE):
            mt.lease.labels(a.model).set(a.bytes)
        thrash = self.engine.counters.thrash
        if thrash > self._thrash_seen:
            mt.thrash.inc(thrash - self._thrash_seen)
            self._thrash_seen = thrash
        self._gauge_resident()

    def _gauge_resident(self) -> None:
        host = 0
        for d in self.engine.state.devices.values():
            self.metrics.resident.labels(d.name, "gpu").set(d.used)
        for m in self.engine.models.values():
            if m.tier == Tier.HOST:
                host += m.weights
        self.metrics.resident.labels("host", "host").set(host)

    def _on_result(self, r: P.CommandResult) -> None:
        model, kind = self._ops.pop(r.op_id, (r.model, None))
        live = self.live.get(model)
        if live is None:
            return
        now = self.clock()
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            live.loads_pending -= 1
        if r.ok:
            if not r.noop:
                self.metrics.load_seconds.labels(model, r.transition).observe(r.timing.total_s)
            live.tier = r.to_tier
            m = self.engine.models[model]
            if live.load_error is not None and kind in (
                ActionKind.LOAD,
                ActionKind.PROMOTE,
                ActionKind.LOAD_HOST,
            ):
                live.load_error = None
                m.prewarm_ok = m.cfg.prewarm
            if r.to_tier == "gpu" and not r.noop:
                src = "host" if r.from_tier == "host" else (r.source or "disk")
                m.cost.measure(src, max(r.timing.total_s, 1e-4))
                if r.footprint.device_bytes > 0:
                    self.engine.measured_footprint(m, r.footprint.device_bytes, now)
                m.ready_at = min(m.ready_at, now)
            if r.to_tier == "gpu" and live.loads_pending == 0 and m.tier == Tier.GPU:
                live.ready.set()
            self._publish(
                "confirmed", model, f"{r.op} {r.transition} in {r.timing.total_s:.3f} s", r.device, now
            )
            return
        live.error, live.error_code = r.error, r.error_code
        self.metrics.failures.labels(model, r.error_code or "unknown").inc()
        self._publish("failed", model, r.error or "", r.device, now)
        m = self.engine.models[model]
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE, ActionKind.LOAD_HOST):
            # a model that cannot load is not prewarmed again (no retry loop on a missing file);
            # a request still tries, so a fixed cause is picked up, and a success re-enables it
            m.prewarm_ok = False
            live.load_error = r.error or r.error_code or "load failed"
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE) and m.tier == Tier.GPU and live.loads_pending == 0:
            self.engine.evict(m, now, f"load failed: {r.error}", failed=True)
            self._flush()
            live.ready.set()  # wake the waiters: they see the error
        elif kind == ActionKind.LOAD_HOST and m.tier == Tier.HOST:
            self.engine.drop_host(m, now, f"load to host RAM failed: {r.error}")
            self._flush()

    # ---- requests -------------------------------------------------------------------------------
    def _model(self, name: str) -> Any:
        m = self.engine.models.get(name)
        if m is None:
            known = ", ".join(sorted(self.engine.models))
            raise ModelNotFound(f"unknown model {name!r}; this server has: {known}")
        return m

    def rank_of(self, m: Any, cls: str | None) -> int:
        if cls is None:
            return int(m.rank)
        if cls not in self.class_rank:
            raise InvalidRequest(f"unknown class {cls!r}; classes: {', '.join(self.class_rank)}")
        return self.class_rank[cls]

    async def _admit(self, m: Any, rank: int, deadline: float, *, observe: bool = True) -> float:
        """Admit; return when the request may start (waiting for room if its class must)."""
        arrival = self.clock()
        if observe:  # (not again for a request retried after its device host lost the model)
            self.engine.observe(m, arrival)
        while True:
            now = self.clock()
            adm = self.engine.admit(m, rank, now)
            self._flush()
            if adm.status == "reject":
                self.rejected += 1
                raise InsufficientCapacity(f"model {m.name!r} cannot be served: {adm.reason}")
            if adm.status != "wait":
                return arrival
            max_wait = self.engine.state.class_max_wait[rank]
            if now - arrival > max_wait:
                self.rejected += 1
                raise InsufficientCapacity(
                    f"model {m.name!r}: no room within its class's max_wait ({max_wait} s)"
                )
            if now >= deadline:
                raise DeadlineExceeded(f"model {m.name!r}: no room became free before the deadline")
            await asyncio.sleep(WAIT_RETRY_S)

    async def _ready(self, m: Any, deadline: float) -> None:
        """Wait for `m`'s confirmed load. A device host that died under the load (Ray restarts it,
        empty) costs one more load, within the deadline; past it the caller gets UNAVAILABLE."""
        live = self.live[m.name]
        died = ""
        while not live.ready.is_set() or live.loads_pending:
            left = deadline - self.clock()
            if left <= 0 and died:
                raise WorkerUnavailable(
                    f"model {m.name!r}: its device host died during the load ({died}); "
                    "the reload did not finish before the deadline"
                )
            if left <= 0:
                raise DeadlineExceeded(f"model {m.name!r} did not finish loading before the deadline")
            with contextlib.suppress(TimeoutError):
                # at least once a second: a model taken off its device meanwhile is admitted again
                await asyncio.wait_for(live.ready.wait(), timeout=min(left, 1.0))
            if live.error and m.tier != Tier.GPU and live.error_code == P.WORKER_DIED and not died:
                died = live.error
                why = f"died during the load, loading again: {died}"
                self._publish("lost", m.name, why, m.device, self.clock())
            elif live.error and m.tier != Tier.GPU:
                raise WorkerUnavailable(f"model {m.name!r} could not be loaded: {live.error}")
            if m.tier != Tier.GPU:  # evicted again while waiting (rare): admit once more
                adm = self.engine.admit(m, m.rank, self.clock())
                self._flush()
                if adm.status == "reject":
                    raise InsufficientCapacity(f"model {m.name!r} cannot be served: {adm.reason}")

    async def infer(
        self, model: str, inputs: dict[str, np.ndarray], *, cls: str | None = None, timeout_s: float = 30.0
    ) -> Served:
        """Serve one request. If the device host lost the model under it (the host died or restarted),
        the model is taken off the books and the request is retried once, within its deadline."""
        m = self._model(model)
        rank = self.rank_of(m, cls)
        deadline = self.clock() + timeout_s
        live = self.live[model]
        cls_name = self.config.classes[rank].name
        arrival, cold = await self._queue_for(m, rank, cls_name, deadline)
        retry_failed = ""
        for attempt in range(2):
            start = self.clock()
            m.busy_until = math.inf  # busy while it runs: never evicted under a request
            live.inflight += 1
            try:
                result = await self._run_infer(m.device, model, inputs, max(deadline - start, 0.1))
            finally:
                live.inflight -= 1
                end = self.clock()
                m.busy_until = end if live.inflight == 0 else m.busy_until
                self.engine.finish(m, start, end - start)
                self.engine.after_request(m, end)
                self._flush()
            lost = not result.ok and result.error_code in (P.WORKER_DIED, P.BAD_TRANSITION)
            if not lost or attempt == 1 or self.clock() > deadline - 0.1:
                break
            self._lost(m, result.error or "the device host lost the model")
            try:
                _, again = await self._queue_for(m, rank, cls_name, deadline, retry=True)
            except (DeadlineExceeded, InsufficientCapacity, WorkerUnavailable) as e:
                retry_failed = str(e)  # the request ends with its first attempt's error, logged
                break
            cold = cold or again
        wait = start - arrival
        self.waits[cls_name].append(wait)
        self.metrics.child("wait", cls_name).observe(wait)
        self.metrics.child("requests", model, cls_name, "ok" if result.ok else "error").inc()
        live.requests += 1
        live.last_used = end
        self.served += 1
        self._log_request(arrival, model, end - start, cls, wait, result)
        if retry_failed:
            raise WorkerUnavailable(f"{result.error}; retried once: {retry_failed}")
        if not result.ok:
            self._raise_infer_error(result)
        return Served(result, wait, cold)

    async def _queue_for(
        self, m: Any, rank: int, cls_name: str, deadline: float, *, retry: bool = False
    ) -> tuple[float, bool]:
        """Admission and the wait for the model's confirmed load, under the class's queue limit (a
        `retry` of an accepted request skips the limit, is not observed again nor counted rejected)."""
        limit = None if retry else self.config.classes[rank].max_queue
        if limit is not None and self.queued.get(cls_name, 0) >= limit:
            self.rejected += 1
            self.metrics.child("requests", m.name, cls_name, "rejected").inc()
            raise InsufficientCapacity(
                f"class {cls_name!r}: queue full ({limit} requests waiting); retry later"
            )
        self.queued[cls_name] = self.queued.get(cls_name, 0) + 1
        queue = self.metrics.child("queue", m.name)
        queue.inc()
        m.waiting += 1  # the engine neither expires nor evicts a model that requests wait for
        try:
            arrival = await self._admit(m, rank, deadline, observe=not retry)
            cold = not self.live[m.name].ready.is_set()
            await self._ready(m, deadline)
            return arrival, cold
        except Exception:
            if not retry:
                self.metrics.child("requests", m.name, cls_name, "rejected").inc()
            raise
        finally:
            m.waiting -= 1
            queue.dec()
            self.queued[cls_name] -= 1

    def _lost(self, m: Any, why: str) -> None:
        """The device host no longer holds `m` (it died, or restarted empty): off the books, so the
        next admission loads it again."""
        now = self.clock()
        self._publish("lost", m.name, why, m.device, now)
        self.live[m.name].ready.clear()
        if m.tier == Tier.GPU:
            self.engine.evict(m, now, f"lost by its device host: {why}")
        if m.tier == Tier.HOST:
            self.engine.drop_host(m, now, "lost by its device host")
        self._flush()

    async def _run_infer(
        self, device: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float
    ) -> P.InferResult:
        """The data path: awaited directly on Ray (no thread per request); in process, inline for
        models that take microseconds, else on a thread."""
        infer_async = getattr(self.pool, "infer_async", None)
        if infer_async is not None:
            result: P.InferResult = await infer_async(device, model, inputs, timeout_s)
        elif self._infer_s.get(model, 1.0) < INLINE_INFER_S:
            result = self.pool.infer(device, model, inputs, timeout_s)
        else:
            result = await asyncio.to_thread(self.pool.infer, device, model, inputs, timeout_s)
        if result.ok:  # by the time the call holds a thread (the wall time on a busy thread pool
            # grows with GIL contention, which would keep a microsecond model off the loop for good)
            prev, took = self._infer_s.get(model), result.hold_seconds
            self._infer_s[model] = took if prev is None else 0.8 * prev + 0.2 * took
        return result

    def _raise_infer_error(self, r: P.InferResult) -> None:
        raise worker_error(r.error_code, r.error or "inference failed")

    def _log_request(
        self, t: float, model: str, busy: float, cls: str | None, wait: float, r: P.InferResult
    ) -> None:
        if self.store is None:
            return
        rec: dict[str, Any] = {"t": t, "model": model, "busy_s": round(busy, 6), "wait_s": round(wait, 6)}
        rec["outcome"] = "ok" if r.ok else "error"
        if cls is not None:
            rec["class"] = cls
        self._log(rec)

    # ---- world sessions -------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _in_order(self, device: str, coro: Any, *, after_ops: bool = False) -> None:
        """Run `coro` (a session resize, or a command submission deferred behind one) after what was
        decided before it on `device`: a shrunk lease is applied before the load that takes its room
        is submitted, and a grown one (`after_ops`) only once the commands that freed the room (a
        drop, a demote) have finished. Never more than the device really holds."""
        prev = self._lease_chain.get(device)
        on_device = {n for n, m in self.engine.models.items() if m.device == device}
        before = [op for op, (name, _) in self._ops.items() if name in on_device] if after_ops else []

        async def run() -> None:
            if prev is not None:
                with contextlib.suppress(Exception):
                    await prev
            until = self.clock() + LEASE_WAIT_S
            while any(op in self._ops for op in before) and self.clock() < until:
                await asyncio.sleep(self.poll_s)
            await coro

        task = asyncio.get_running_loop().create_task(run())
        self._lease_chain[device] = task
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if self._lease_chain.get(device) is t:
                del self._lease_chain[device]

        task.add_done_callback(done)

    async def _submit(self, device: str, cmd: P.Command, op: str) -> None:
        self.pool.submit(device, cmd, op)

    def _prune_sessions(self, keep: set[str]) -> list[str]:
        """Delete saved sessions (not open, not in `keep`), least recently written first, until the
        others fit in `store.sessions_keep`. Returns the ids deleted."""
        if not self.session_dir.is_dir():
            return []
        saved = []
        for d in self.session_dir.iterdir():
            if not d.is_dir() or not _SESSION_ID.fullmatch(d.name):
                continue  # only what looks like a session of ours
            files = [f for f in d.rglob("*") if f.is_file()]
            size = sum(f.stat().st_size for f in files)
            last = max((f.stat().st_mtime for f in files), default=d.stat().st_mtime)
            saved.append((last, d.name, size, d))
        total = sum(size for _, _, size, _ in saved)
        gone = []
        for _, name, size, d in sorted(saved):
            if total <= self.config.store.sessions_keep:
                break
            if name in keep:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            gone.append(name)
        if gone:
            logger.info("deleted saved world sessions %s (store.sessions_keep)", ", ".join(gone))
        return gone

    async def _resize_session(self, device: str, sid: str, lease: int) -> None:
        reply = await asyncio.to_thread(self.pool.session, device, "resize", sid, lease)
        model = self.sessions.get(sid, ("", 0.0, 0))[0]
        detail = (
            f"session {sid}: lease {reply.data.get('lease_bytes')} bytes" if reply.ok else (reply.error or "")
        )
        self._publish("lease_applied" if reply.ok else "lease_failed", model, detail, device, self.clock())

    async def open_session(
        self,
        model: str,
        *,
        cls: str | None = None,
        timeout_s: float = 60.0,
        codec: str = "bf16",
        resume_id: str | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Admit a world session like a long request, then open it on the model's device host with the
        model's current lease. The model stays busy (never evicted) until `close_session`.
        ``resume_id``: reopen that session from its saved state instead (it continues at its next
        segment; ``codec`` empty: the saved one); NOT_FOUND when nothing is saved under that id."""
        m = self._model(model)
        if m.cfg.elastic is None:
            raise InvalidRequest(f"model {model!r} has no elastic KV lease: it is not a world model")
        if resume_id is not None and not _SESSION_ID.fullmatch(resume_id):
            raise InvalidRequest(f"resume_session_id {resume_id!r} is not a session id (12 hex digits)")
        if resume_id is not None and resume_id in self.sessions:
            raise InvalidRequest(f"world session {resume_id!r} is open: end its stream first")
        rank = self.rank_of(m, cls)
        deadline = self.clock() + timeout_s
        arrival = await self._admit(m, rank, deadline)
        await self._ready(m, deadline)
        live = self.live[model]
        m.busy_until = math.inf
        live.inflight += 1
        sid = resume_id or uuid.uuid4().hex[:12]
        resume = resume_id is not None
        await asyncio.to_thread(self._prune_sessions, keep={*self.sessions, sid})
        for attempt in range(2):  # a host that lost the model (it restarted) loads it again, in time
            reply = await asyncio.to_thread(
                self.pool.session, m.device, "open", model, sid, int(m.lease or m.lease_min),
                (codec or None) if resume else codec, str(self.session_dir / sid), resume,
            )  # fmt: skip
            lost = reply.error_code in (P.WORKER_DIED, P.BAD_TRANSITION)
            if reply.ok or not lost or attempt == 1 or self.clock() >= deadline:
                break
            if not await self._host_holds(m):
                self._lost(m, reply.error or "the device host lost the model")
            with contextlib.suppress(DeadlineExceeded, InsufficientCapacity, WorkerUnavailable):
                await self._queue_for(m, rank, self.config.classes[rank].name, deadline, retry=True)
            m.busy_until = math.inf
        if not reply.ok:
            self._end_busy(m, arrival)
            if reply.error_code == P.NO_SESSION:
                raise ModelNotFound(f"no saved world session {sid!r} to resume")
            raise worker_error(reply.error_code, f"world session on {model!r} could not open: {reply.error}")
        data = dict(reply.data)
        self.sessions[sid] = (model, arrival, rank)
        self._world[sid] = _World(str(data.get("codec", codec)), int(data.get("next_segment", 0)))
        kind = "session_resumed" if resume_id is not None else "session_opened"
        self._publish(kind, model, f"session {sid}", m.device, self.clock(), lease=m.lease)
        return sid, data

    async def _reopen_session(self, sid: str, why: str, deadline: float) -> dict[str, Any]:
        """The device host lost session `sid` (it died, or restarted empty): load the model again if the
        host lost it too, then reopen the session from its saved state at the next segment the client
        has not been sent. WorkerUnavailable (saying it can be resumed) when that fails or runs late."""
        model, _, rank = self.sessions[sid]
        m, w, live = self.engine.models[model], self._world[sid], self.live[model]
        self._publish("session_lost", model, f"session {sid}: {why}", m.device, self.clock())

        def unavailable(detail: str) -> WorkerUnavailable:
            return self._resumable(sid, why, detail)

        if live.ready.is_set() and not live.loads_pending and not await self._host_holds(m):
            self._lost(m, why)
        try:
            await self._queue_for(m, rank, self.config.classes[rank].name, deadline, retry=True)
        except (DeadlineExceeded, InsufficientCapacity, WorkerUnavailable) as e:
            raise unavailable(str(e)) from e
        m.busy_until = math.inf
        reply = await asyncio.to_thread(
            self.pool.session, m.device, "open", model, sid, int(m.lease or m.lease_min), w.codec,
            str(self.session_dir / sid), True, w.next_segment,
        )  # fmt: skip
        if not reply.ok:
            raise unavailable(reply.error or "the reopen failed")
        w.resumes += 1
        data = dict(reply.data)
        detail = f"session {sid}: reopened at segment {data.get('next_segment')}"
        self._publish("session_resumed", model, detail, m.device, self.clock(), lease=m.lease)
        return data

    def _resumable(self, sid: str, why: str, detail: str) -> WorkerUnavailable:
        return WorkerUnavailable(
            f"world session {sid}: its device host lost it ({why}) and it could not be reopened: "
            f"{detail}; its state is saved: resume it with a new stream (start.resume_session_id="
            f"{sid!r}) at segment {self._world[sid].next_segment}"
        )

    async def _host_holds(self, m: Any) -> bool:
        """Whether `m`'s device host holds it in the gpu tier now (False when the host does not answer)."""
        try:
            st = await asyncio.to_thread(self.pool.status, m.device)
        except Exception:
            return False
        ms = st.models.get(m.name)
        return ms is not None and ms.tier == "gpu"

    def _end_busy(self, m: Any, start: float) -> None:
        live = self.live[m.name]
        live.inflight -= 1
        end = self.clock()
        if live.inflight == 0:
            m.busy_until = end
        self.engine.finish(m, start, end - start)
        self._flush()

    async def step_session(
        self,
        sid: str,
        pose: tuple[float, float, float, float, float],
        *,
        recover_s: float = SESSION_RECOVER_S,
    ) -> dict[str, Any]:
        """One segment. A device host that died (or restarted) under the session costs a reopen from
        the session's saved state within `recover_s` (the model reloaded if need be), then the same
        pose again: the reply then carries ``resumed`` and what the reopen found unusable."""
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model = self.sessions[sid][0]
        m = self.engine.models[model]
        w = self._world[sid]
        deadline = self.clock() + recover_s
        reopened: dict[str, Any] | None = None
        for attempt in range(3):  # a host that dies again during a reopen gets another go, in time
            reply = await asyncio.to_thread(self.pool.session, m.device, "step", sid, pose)
            if reply.ok or reply.error_code not in (P.WORKER_DIED, P.NO_SESSION):
                break
            why = reply.error or "the device host lost it"
            if attempt == 2 or self.clock() >= deadline:
                raise self._resumable(sid, why, "no time left to reopen it")
            reopened = await self._reopen_session(sid, why, deadline)
        if not reply.ok:
            raise worker_error(reply.error_code, f"world session {sid}: {reply.error}")
        self.live[model].last_used = self.clock()
        data = dict(reply.data)
        data["manager_lease_bytes"] = int(m.lease)
        data["resumed"] = reopened is not None
        if reopened is not None:
            data["corrupt_slots"] = reopened.get("corrupt_slots", {})
            data["missing_segments"] = reopened.get("missing_segments", [])
        w.next_segment = int(data["step"]) + 1
        return data

    async def close_session(self, sid: str) -> dict[str, Any]:
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model, opened, rank = self.sessions.pop(sid)
        self._world.pop(sid, None)
        m = self.engine.models[model]
        reply = await asyncio.to_thread(self.pool.session, m.device, "close", sid)
        self._end_busy(m, opened)
        live = self.live[model]
        live.requests += 1
        self.served += 1
        if self.store is not None:
            rec = {"t": opened, "model": model, "busy_s": round(self.clock() - opened, 6), "kind": "session",
                   "class": self.config.classes[rank].name}  # fmt: skip
            self._log(rec)
        self._publish("session_closed", model, f"session {sid}", m.device, self.clock())
        return dict(reply.data)

    # ---- admin --------------------------------------------------------------------------------
    async def preload(self, model: str, tier: str = "gpu", timeout_s: float = 120.0) -> None:
        m = self._model(model)
        now = self.clock()
        if tier == "host":
            self.engine.load_host(m, now, "preload")
            self._flush()
            return
        if tier != "gpu":
            raise InvalidRequest(f"preload tier must be gpu or host, not {tier!r}")
        if m.tier != Tier.GPU:
            if not self.engine.make_room(m, m.rank, now, may_evict=True):
                raise InsufficientCapacity(
                    f"model {model!r}: no room on {m.device} without breaking the rules"
                )
            self.engine.load(m, now, prewarm=False, reason="preload")
            self._flush()
        await self._ready(m, now + timeout_s)

    def evict(self, model: str, to: str = "disk") -> None:
        m = self._model(model)
        if m.pinned:
            raise InvalidRequest(f"model {model!r} is pinned; unpin it first")
        if to not in ("disk", "host"):
            raise InvalidRequest(f"evict to must be disk or host, not {to!r}")
        if m.tier == Tier.GPU:
            self.engine.evict(m, self.clock(), "admin evict")
            if to == "disk" and m.tier == Tier.HOST:
                self.engine.drop_host(m, self.clock(), "admin evict")
        elif m.tier == Tier.HOST and to == "disk":
            self.engine.drop_host(m, self.clock(), "admin evict")
        self._flush()

    def reload(self, new: Config) -> list[str]:
        """Take a changed config, dropping nothing in flight (RestartNeeded: structural changes)."""
        from manager.reload import apply_reload, plan_reload

        changes = plan_reload(self.config, new)
        apply_reload(self.engine, new)
        self.config = new
        self._apply_pins()  # an admin's pin or unpin outlives a reload of the file
        self._publish("config_reloaded", "", ", ".join(changes) or "no changes", "", self.clock())
        return changes

    def set_pin(self, model: str, pinned: bool) -> None:
        """An admin's pin or unpin: it overrides the config's `pin` until the opposite call, across
        hot reloads and restarts (kept in the store's "pins" document)."""
        m = self._model(model)
        m.pinned = pinned
        if pinned == m.cfg.pin:
            self.pin_overrides.pop(model, None)
        else:
            self.pin_overrides[model] = pinned
        if self.store is not None:
            try:
                self.store.put_doc("pins", dict(self.pin_overrides))
            except Exception:  # the store is down: the pin holds now; saved with the next call
                logger.warning("the store is down: the pin of %s is not saved across a restart", model)

    def _apply_pins(self) -> None:
        for name, pinned in self.pin_overrides.items():
            self.engine.models[name].pinned = pinned

    def _restore_pins(self) -> None:
        if self.store is None:
            return
        try:
            doc = self.store.get_doc("pins") or {}
        except Exception:
            logger.warning("could not read the admin pins from the store; the config's pins hold")
            return
        for name, pinned in doc.items():
            if name not in self.engine.models or not isinstance(pinned, bool):
                logger.info("admin pin of %s ignored: the model is not configured", name)
                continue
            if pinned != self.engine.models[name].cfg.pin:
                self.pin_overrides[name] = pinned
        self._apply_pins()

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(EVENTS_QUEUE)
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(q)

    def _publish(self, kind: str, model: str, detail: str, device: str, t: float, **extra: Any) -> None:
        ev = {"t": t, "kind": kind, "model": model, "detail": detail, "device": device, **extra}
        for q in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(ev)
