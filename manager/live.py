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
import time
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
INLINE_INFER_S = 0.0005
"""In-process models whose recent inferences took less than this run on the event loop itself:
handing them to a thread would cost more than the inference."""


def worker_error(code: str | None, message: str) -> Exception:
    """The domain error for a worker's error code: what the caller sent is wrong (bad input, or a
    call the model does not offer) or the worker could not do it."""
    if code in (P.BAD_INPUT, P.NOT_AVAILABLE):
        return InvalidRequest(message)
    return WorkerUnavailable(message)


@dataclass
class _Live:
    """What the workers have confirmed for one model."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tier: P.TierName = "disk"
    error: str | None = None
    error_code: str | None = None
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
        # The request log is written in batches off the event loop (once a second, or sooner when
        # LOG_BATCH records wait), and at stop: a per-request write would cost more than the request.
        self._log_buf: list[dict[str, Any]] = []
        self.journal = RequestJournal(Path(journal)) if journal is not None and store is not None else None
        self._next_flush = 0.0
        self._infer_s: dict[str, float] = {}
        self.queued: dict[str, int] = {}  # requests of each class waiting for their model
        self._background: set[asyncio.Task[Any]] = set()
        self._thrash_seen = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    # ---- statistics that survive a restart ---------------------------------------------------
    def save_stats(self) -> None:
        """Reuse histograms, measured load costs and footprints → the store (doc "stats")."""
        if self.store is None:
            return
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

    async def adopt(self) -> list[str]:
        """Reattached device hosts may already hold models (a manager restart): put them on the
        engine's books (the engine's load turns into a declarative command the host answers as a
        no-op), and drop what no longer is configured. Returns the models adopted."""
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
                if m is None:
                    self.pool.submit(device, P.Drop(name))
                elif ms.tier == "gpu" and self.engine.make_room(m, m.rank, now, may_evict=False):
                    self.engine.load(m, now, prewarm=False, reason="reattached: already on its device")
                    adopted.append(name)
                elif ms.tier == "host" and self.engine.load_host(m, now, "reattached: already in host RAM"):
                    adopted.append(name)
        return adopted

    async def start(self) -> None:
        if self.journal is not None:  # requests served before a crash, not yet in the store
            self._log_buf = self.journal.read() + self._log_buf
            await self.flush_log()
        self.restore_stats()
        adopted = await self.adopt()
        if adopted:
            self._publish("reattached", "", f"adopted {', '.join(adopted)}", "", self.clock())
        self.engine.start(self.clock())
        self._flush()
        self._task = asyncio.create_task(self._loop(), name="residency-reconciler")
        self.started = True

    def _log(self, rec: dict[str, Any]) -> None:
        self._log_buf.append(rec)
        if self.journal is not None:
            self.journal.append(rec)

    async def flush_log(self) -> None:
        """Write the buffered request log to the store (kept for the next try if the store fails)."""
        if self.store is None or not self._log_buf:
            return
        batch, self._log_buf = self._log_buf, []
        try:
            # shielded: a cancelled caller (the reconciler at stop) must not leave a written batch
            # in the journal, or the next start would log it twice
            await asyncio.shield(self._write_batch(batch))
        except Exception:  # the store is down: keep the records (bounded) and try again later
            logger.warning("could not write %d requests to the store; kept for a retry", len(batch))
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
                if self._log_buf and (now >= self._next_flush or len(self._log_buf) >= LOG_BATCH):
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
        else:  # lease changes: the model's open world sessions follow the new lease
            cmd = None
            for sid, (name, _, _) in self.sessions.items():
                if name == a.model:
                    self._spawn(self._resize_session(device, sid, a.bytes))
        self._count_action(a)
        self._record_intent(a)
        if cmd is not None:
            op = self.pool.submit(device, cmd)
            self._ops[op] = (a.model, a.kind)
        self._publish(a.kind.value, a.model, a.reason, device, t, bytes=a.bytes, prewarm=a.prewarm)

    def _record_intent(self, a: Action) -> None:
        """The tier the manager wants each model in, kept in the store (what a restarted manager
        reconciles the device hosts against)."""
        tier = {ActionKind.LOAD: "gpu", ActionKind.PROMOTE: "gpu", ActionKind.LOAD_HOST: "host",
                ActionKind.DEMOTE: "host", ActionKind.DROP: "disk"}.get(a.kind)  # fmt: skip
        if tier is None or self.store is None:
            return
        try:
            self.store.set_intent(a.model, tier)
        except Exception:  # serving goes on; the next decision writes it again
            logger.exception("could not record the intent for %s", a.model)

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
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE) and m.tier == Tier.GPU and live.loads_pending == 0:
            self.engine.evict(m, now, f"load failed: {r.error}")
            self._flush()
            live.ready.set()  # wake the waiters: they see the error

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

    async def _admit(self, m: Any, rank: int, deadline: float) -> float:
        """Admit; return when the request may start (waiting for room if its class must)."""
        arrival = self.clock()
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
        live = self.live[m.name]
        while not live.ready.is_set() or live.loads_pending:
            left = deadline - self.clock()
            if left <= 0:
                raise DeadlineExceeded(f"model {m.name!r} did not finish loading before the deadline")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.ready.wait(), timeout=left)
            if live.error and m.tier != Tier.GPU:
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
            _, again = await self._queue_for(m, rank, cls_name, deadline)
            cold = cold or again
        wait = start - arrival
        self.waits[cls_name].append(wait)
        self.metrics.child("wait", cls_name).observe(wait)
        self.metrics.child("requests", model, cls_name, "ok" if result.ok else "error").inc()
        live.requests += 1
        live.last_used = end
        self.served += 1
        self._log_request(arrival, model, end - start, cls, wait, result)
        if not result.ok:
            self._raise_infer_error(result)
        return Served(result, wait, cold)

    async def _queue_for(self, m: Any, rank: int, cls_name: str, deadline: float) -> tuple[float, bool]:
        """Admission and the wait for the model's confirmed load, under the class's queue limit."""
        limit = self.config.classes[rank].max_queue
        if limit is not None and self.queued.get(cls_name, 0) >= limit:
            self.rejected += 1
            self.metrics.child("requests", m.name, cls_name, "rejected").inc()
            raise InsufficientCapacity(
                f"class {cls_name!r}: queue full ({limit} requests waiting); retry later"
            )
        self.queued[cls_name] = self.queued.get(cls_name, 0) + 1
        queue = self.metrics.child("queue", m.name)
        queue.inc()
        try:
            arrival = await self._admit(m, rank, deadline)
            cold = not self.live[m.name].ready.is_set()
            await self._ready(m, deadline)
            return arrival, cold
        except Exception:
            self.metrics.child("requests", m.name, cls_name, "rejected").inc()
            raise
        finally:
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
        if result.ok:
            prev = self._infer_s.get(model)
            self._infer_s[model] = result.seconds if prev is None else 0.8 * prev + 0.2 * result.seconds
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

    async def _resize_session(self, device: str, sid: str, lease: int) -> None:
        reply = await asyncio.to_thread(self.pool.session, device, "resize", sid, lease)
        model = self.sessions.get(sid, ("", 0.0, 0))[0]
        detail = (
            f"session {sid}: lease {reply.data.get('lease_bytes')} bytes" if reply.ok else (reply.error or "")
        )
        self._publish("lease_applied" if reply.ok else "lease_failed", model, detail, device, self.clock())

    async def open_session(
        self, model: str, *, cls: str | None = None, timeout_s: float = 60.0, codec: str = "bf16"
    ) -> tuple[str, dict[str, Any]]:
        """Admit a world session like a long request, then open it on the model's device host with the
        model's current lease. The model stays busy (never evicted) until `close_session`."""
        import uuid

        m = self._model(model)
        if m.cfg.elastic is None:
            raise InvalidRequest(f"model {model!r} has no elastic KV lease: it is not a world model")
        rank = self.rank_of(m, cls)
        deadline = self.clock() + timeout_s
        arrival = await self._admit(m, rank, deadline)
        await self._ready(m, deadline)
        live = self.live[model]
        m.busy_until = math.inf
        live.inflight += 1
        sid = uuid.uuid4().hex[:12]
        reply = await asyncio.to_thread(
            self.pool.session, m.device, "open", model, sid, int(m.lease or m.lease_min), codec
        )
        if not reply.ok:
            self._end_busy(m, arrival)
            raise worker_error(reply.error_code, f"world session on {model!r} could not open: {reply.error}")
        self.sessions[sid] = (model, arrival, rank)
        self._publish("session_opened", model, f"session {sid}", m.device, self.clock(), lease=m.lease)
        return sid, reply.data

    def _end_busy(self, m: Any, start: float) -> None:
        live = self.live[m.name]
        live.inflight -= 1
        end = self.clock()
        if live.inflight == 0:
            m.busy_until = end
        self.engine.finish(m, start, end - start)
        self._flush()

    async def step_session(self, sid: str, pose: tuple[float, float, float, float, float]) -> dict[str, Any]:
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model = self.sessions[sid][0]
        m = self.engine.models[model]
        reply = await asyncio.to_thread(self.pool.session, m.device, "step", sid, pose)
        if not reply.ok:
            raise worker_error(reply.error_code, f"world session {sid}: {reply.error}")
        self.live[model].last_used = self.clock()
        data = dict(reply.data)
        data["manager_lease_bytes"] = int(m.lease)
        return data

    async def close_session(self, sid: str) -> dict[str, Any]:
        if sid not in self.sessions:
            raise InvalidRequest(f"no open world session {sid!r}")
        model, opened, rank = self.sessions.pop(sid)
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
        self._publish("config_reloaded", "", ", ".join(changes) or "no changes", "", self.clock())
        return changes

    def set_pin(self, model: str, pinned: bool) -> None:
        self._model(model).pinned = pinned

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
