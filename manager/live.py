"""The live manager: admission → policy → reconciler, on an asyncio loop (never blocking on a worker).

Order of use: `await start()` (pinned models load, the poll loop starts), then `infer(...)`,
`preload`, `evict`, `pin`/`unpin`, `status()`, `subscribe()` from gRPC handlers; `await stop()`.

The decision engine (`manager.policy`) decides with its own bookkeeping of tiers; every decision it
logs becomes one declarative command to the model's device host, submitted through the worker pool.
A request waits for its model's *confirmed* load (the worker's result), with a deadline; the
worker's measured load time and footprint then replace the engine's estimates. A failed load
takes the model off the engine's books (so it stops counting against the budget) and fails the
waiting requests with the worker's reason. All engine calls happen on the event loop's thread.

`LiveManager` is assembled from mixins: what the store keeps across a restart (statistics,
intents, the request log) is in `manager.live_persist`, world sessions in `manager.live_sessions`;
its state, the reconciler loop, decisions -> commands, requests, admin and events are here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from manager.clock import SteadyWallClock
from manager.config import Config
from manager.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InsufficientCapacity,
    InvalidRequest,
    ModelNotFound,
    ResidencyError,
    WorkerUnavailable,
)
from manager.journal import RequestJournal
from manager.live_batch import LocalBatcher
from manager.live_persist import PersistenceMixin, read_outcome
from manager.live_sessions import WorldSessionsMixin, _World, worker_error
from manager.metrics import Metrics
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.outcomes import Admission
from manager.policy.types import TIER_NAMES, Action, ActionKind, Tier
from manager.reload import TunedHold
from manager.replay.trace import keep_alive_json
from manager.store.base import CorruptDocument
from manager.units import format_size as fmt_bytes
from manager.workers_bridge import model_specs
from workers import protocol as P

logger = logging.getLogger(__name__)

POLL_S = 0.005
WAIT_RETRY_S = 0.05
EVENTS_QUEUE = 1000
STOP_WAIT_S = 5.0
"""At a stop, how long the writes on their way to a device host or the store are waited for."""

SAVE_EVERY_S = 60.0
SILENT_RETRY_S = 5.0
"""How soon a statistics save that found the store silent (`_store_silent`) is tried again."""
SILENT_REUSE_S = 2.5
"""At the stop, a probe that found the store silent at most this long ago stands (no second probe):
shorter than SILENT_RETRY_S, so a store back since the reconciler's last probe is not skipped for long."""
LOG_EVERY_S = 1.0
LOG_BATCH = 500
INLINE_INFER_S = 0.0005
"""In-process models whose recent inferences took less than this run on the event loop itself:
handing them to a thread would cost more than the inference."""
INLINE_SLOW_S = 0.01
"""An inline call that held the event loop longer than this sends its model's calls to a thread for
good (`LiveManager._inline_took`)."""
WAIT_WINDOW = 10_000
"""Stats' wait p99 per class is over the last this many requests of the class (a window, not the
whole uptime: a service that runs for months keeps no per-request list)."""
RESYNC_TRIES = 20
RESYNC_RETRY_S = 0.5
"""A device host that does not report its status for a resync (it is still restarting) is asked again
this often, this many times."""
RESYNC_LATER_S = 5.0
"""A device whose resync found no status after those tries is resynced again this often, by the
reconciler, until its host reports one (what it holds meanwhile is unknown to the books)."""
UNREAD = " (its status was unread)"
"""Added to the reason of a resync tried again because the last one could not read a status."""
HOST_CHECK_S = 10.0
"""Each device host's status is read this often, to see whether it restarted (a new boot id) while no
command or request of it said so: a host that died idle and came back empty (Ray restarts it) left
the books counting models it no longer holds (pinned ones too) until their next request paid a load."""
HOST_CHECK_TIMEOUT_S = 2.0
"""How long that read waits for a host's answer (one that does not answer is left to its next command
or request, which tell)."""
HELD_CHECK_S = 2.0
"""While a device host runs a load it abandoned (LOAD_TIMEOUT) whose room the books keep held, its
status is read again (a resync) this often, until it no longer lists that load."""
NO_LOAD_AT_STOP = "it is not loaded (no load starts now)"
"""What a request (or preload) for a model not on its GPU is told once the service is stopping
(`abandon_waits`): its load would start only to be abandoned, evicting what it needs room from."""
NOT_HELD = "not held by its device host (resync)"
"""The reason of the moves by which a resync takes a model its device host no longer holds off the
books (no eviction: nothing was decided, and a reload after it is no thrash)."""
FAIL_LOG_EVERY_S = 600.0
"""A model whose load keeps failing for the same reason (a client retrying every few seconds, a
missing file) is logged once, then again only when the reason changes, after a load of it worked, or
once this long has passed since its last line (saying how many times it failed meanwhile)."""
LOAD_KINDS = (ActionKind.LOAD, ActionKind.PROMOTE, ActionKind.LOAD_HOST)
REFUSED = "_residency_refused"
"""Set (True) on the error that refused a request at admission (no room for it, in time or ever, or
the service stopping before any load of it): such a request is `rejected`; one that failed after
admission (its model's load failed, or did not finish in time) is an `error` (`_outcome_of`)."""


def _outcome_of(e: BaseException) -> str:
    """The requests metric's outcome of a request that `e` ended before it ran: `rejected` when
    admission refused it (InsufficientCapacity: it can never fit, a full queue, no room within its
    class's max_wait; or an error of the wait for room, `LiveManager._room_turn`), else `error`."""
    return "rejected" if isinstance(e, InsufficientCapacity) or getattr(e, REFUSED, False) else "error"


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
    evict_to: str | None = None  # an admin's evict, waiting for the requests in flight to end
    failures: int = 0  # failed commands so far (a request's wait tells a new failure from one it took)
    failure_logged: tuple[str, str] | None = None  # (code, reason) of the load failure last logged
    failure_logged_at: float = 0.0  # when that line was written
    failure_repeats: int = 0  # load failures for that same reason since, not logged


@dataclass(eq=False)
class _RoomWait:
    """A request waiting for room on its model's device (`LiveManager._room_turn`). The waiting
    requests are tried in class order, highest first, and within a class in arrival order (`seq`):
    room that comes free goes to the first of them it is enough for."""

    m: Any
    rank: int
    seq: int
    arrival: float | None  # its request's arrival (None: an admin's preload, no max_wait)
    deadline: float
    tried: bool = False  # a pass tried it once (a request is always tried once, however late)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    admission: Admission | None = None  # its admission, once it is no longer "wait"
    error: Exception | None = None  # what its admission raised


@dataclass(frozen=True)
class Served:
    """One served request's outcome (what goes to the request log)."""

    result: P.InferResult
    wait_s: float
    cold: bool


class EventQueue(asyncio.Queue[dict[str, Any]]):
    """A watcher's events; `dropped`: how many did not fit since the last that did (a slow reader)."""

    dropped = 0

    def gap_note(self, t: float) -> dict[str, Any] | None:
        """The event that says where the events dropped for this watcher were (once: the count is
        reset), or None when none were."""
        if not self.dropped:
            return None
        note = f"{self.dropped} events were dropped here: this watcher read them too slowly"
        self.dropped = 0
        return {"t": t, "kind": "events_dropped", "model": "", "detail": note, "device": ""}


async def _within(
    call: Coroutine[Any, Any, P.InferResult], timeout_s: float, device: str, model: str
) -> P.InferResult:
    """`call`'s result, or DEADLINE when it has none within `timeout_s` (as the Ray pool answers): a
    forward that hangs on an in-process host held its request past the request's own deadline, for
    good. `call` is cancelled then: a request still queued in its batch is not sent; a thread that
    runs it goes on (a thread cannot be stopped), its late result dropped."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        return _no_answer(device, model, timeout_s)


def _busy(r: P.InferResult, wall_s: float) -> float:
    """How long request `r` kept its model busy, as its request-log record (and a replay of it) says:
    its part of the call that served it (a batch's time shared by rows) where its device host
    measured that call, at most the wall time its attempt took; the wall time otherwise (a failure).
    The wall time alone counted, for each request of a batch, the whole batch and the wait for the
    batch before it: a replay, which runs a model's requests one after another, had 64 requests
    batched in 0.2 s keep the model busy for 13 s."""
    wall_s = max(0.0, wall_s)
    if r.ok and r.seconds > 0:
        return min(wall_s, r.seconds * r.share)
    return wall_s


def _no_answer(device: str, model: str, timeout_s: float) -> P.InferResult:
    """DEADLINE: `model` on `device` gave no answer within `timeout_s` (as the Ray pool answers)."""
    return P.InferResult(
        model, False, error_code=P.DEADLINE,
        error=f"model {model!r}: no answer from device {device!r} within {timeout_s:.3g} s",
    )  # fmt: skip


class LiveManager(PersistenceMixin, WorldSessionsMixin):
    def __init__(
        self,
        config: Config,
        pool: Any,
        *,
        store: Any = None,
        clock: Callable[[], float] | None = None,
        poll_s: float = POLL_S,
        journal: str | Path | RequestJournal | None = None,
    ) -> None:
        self.config = config
        self.started_config = config
        """The config the service started with: what its settings read only at start hold."""
        self.server_overrides: dict[str, Any] = {}
        """`server` fields given on the command line (`serve --listen`): a reload of the file keeps them."""
        self.tuning_overrides: TunedHold = {}
        """The scheduled tuning's settings the config file could not take (read-only): a reload of
        the file keeps each while the file holds that field as it did (`reload`, `over_file`)."""
        self.pool = pool
        self.store = store
        self.clock: Callable[[], float] = SteadyWallClock() if clock is None else clock
        """Unix seconds that never go back within a run (`manager.clock`); tests give their own."""
        self.poll_s = poll_s
        self.engine = Engine(config, create_policy(config.policy.name))
        self.engine.room_wanted = self._room_wanted
        self.engine.actions = []
        self._seen_actions = 0
        self.specs = model_specs(config)
        self.class_rank = {c.name: i for i, c in enumerate(config.classes)}
        self.live = {name: _Live() for name in self.engine.models}
        self._ops: dict[str, tuple[str, ActionKind]] = {}
        self._drop_retries: set[str] = set()  # op ids of drops sent again after a failed one
        self._last_drops: set[str] = set()  # op ids of drops neither retried nor resynced if they fail
        self._drops_refused: set[str] = set()  # models resynced after a refused drop, until a success
        self._subscribers: list[EventQueue] = []
        self._task: asyncio.Task[None] | None = None
        self.started = False
        self._started = asyncio.Event()  # set once `start` is done: requests that came before it wait
        self._stopping = asyncio.Event()  # set at stop: requests still waiting for a load give up
        self._stop_answer: asyncio.Future[None] | None = None  # done at the stop's grace (`abandon_waits`)
        self.waits: dict[str, deque[float]] = {c.name: deque(maxlen=WAIT_WINDOW) for c in config.classes}
        self.wait_total_s = 0.0  # every served request's wait, summed since start
        self.rejected = 0  # requests admission refused (no room, a full queue): never run
        self.failed = 0  # requests that failed before they ran (their model's load failed, ...)
        self.cancelled = 0  # requests whose client went away (hung up) before they were answered
        self.reload_warnings: list[str] = []  # the last reload's: models it left unservable
        self.failed_runs = 0  # of `served`, those that ran and failed (the model's code raised)
        self.served = 0
        self.cold_starts = 0  # served requests and session opens that found their model off the GPU
        self._next_save = 0.0
        self.metrics = Metrics()
        self.sessions: dict[str, tuple[str, float, int]] = {}  # id -> (model, opened at, class rank)
        self.session_dir = Path(config.store.sessions).resolve()  # one saved-state directory per session
        self._world: dict[str, _World] = {}  # open session -> what a reopen needs
        self._world_opening: set[str] = set()  # world models whose session is being opened
        self._opening_ids: set[str] = set()  # ids of the sessions being opened
        self._left_ids: set[str] = set()  # ids of sessions whose client hung up mid-open, until closed
        self._reopening: dict[str, asyncio.Task[Any]] = {}  # session id -> its reopen on the host
        # The request log is written in batches off the event loop (once a second, or sooner when
        # LOG_BATCH records wait), and at stop: a per-request write would cost more than the request.
        self._log_buf: list[dict[str, Any]] = []
        self.keep_alive_said: set[str] = set()
        """Models an admitted request of this run gave its word on the keep-alive (its own, or none:
        the config's): an earlier run's, read late (the store down at start), does not override it."""
        self._log_sending: list[dict[str, Any]] = []  # the batch a flush is writing to the store
        if isinstance(journal, (str, Path)):
            journal = RequestJournal(Path(journal)) if store is not None else None
        self.journal = journal if store is not None else None
        """Request-log records not yet in the store (given open, `serve` opened it before Ray's start: a
        second service on the same file is refused before it starts anything)."""
        self._next_flush = 0.0
        self._persisting: asyncio.Task[None] | None = None  # the reconciler's store work under way
        # The store failed: the next log write is tried once a LOG_EVERY_S, after a ping (not on
        # every poll with the whole buffer re-encoded); intents are rewritten and the statistics
        # saved at start-up are merged in (not overwritten) once it answers again.
        self._log_failing = False
        self._intents_stale = False
        self._intents_damaged: list[object] = []
        self._intents_pending = {}
        self._stats_unread = False
        self._measured: set[str] = set()  # models whose footprint a device host measured
        self._infer_s: dict[str, float] = {}
        self._slow_inline: set[str] = set()  # models one of whose inline calls was slow (`_inline_took`)
        self._batchers: dict[str, LocalBatcher | None] = {}
        self.queued: dict[str, int] = {}  # requests of each class waiting for their model
        self._background: set[asyncio.Task[Any]] = set()
        self._lease_chain: dict[str, asyncio.Task[Any]] = {}  # device -> its last ordered lease step
        self._thrash_seen = 0
        self.pin_overrides: dict[str, bool] = {}  # admin pin/unpin over the config's `pin`
        self._pins_set: set[str] = set()  # pinned or unpinned by an admin since this start
        self._pins_unread = False  # the store was down at start: its pins are still to be read
        self._pins_why = "no answer"  # why they could not be read (the store's error)
        self._flush_lock = asyncio.Lock()
        self._save_lock = asyncio.Lock()
        self._intent_gen = 0
        self._boots: dict[str, str] = {}  # device -> the boot id of its host process, as last read
        self._resyncing: dict[str, asyncio.Task[None]] = {}  # device -> its resync under way
        self._resync_again: dict[str, str] = {}  # device -> why another resync follows the one under way
        self._unsynced: dict[str, tuple[float, str]] = {}  # device -> (next resync at, why): status unread
        self._next_host_check = time.monotonic() + HOST_CHECK_S
        self._host_check: asyncio.Task[Any] | None = None  # the hosts' status read under way
        self._results: dict[str, int] = {}  # model -> how many command results were taken for it
        self._held_loads: dict[str, str] = {}
        """Models whose load or promote their device host abandoned (LOAD_TIMEOUT) but still runs, with
        the error that said so: their bytes stay booked on their device (`_hold_abandoned`)."""
        self._held_check: dict[str, float] = {}  # device -> when its abandoned loads are checked again
        self._room_waits: list[_RoomWait] = []  # requests waiting for room (`_room_turn`)
        self._room_seq = 0  # arrival order of the requests that waited for room
        self._room_task: asyncio.Task[None] | None = None  # tries them again while any wait
        self._room_changed = asyncio.Event()  # set when room may have come free: a pass follows at once
        self._pins_write: asyncio.Task[None] | None = None  # the last write of the pins, on a thread
        self._pins_dirty = False  # the pins changed since the store last took them (it failed)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _claim_journal(self) -> None:
        """The journal as this store's (its records go to their own store only: `RequestJournal.claim`),
        by the store's own id; a store that does not say it (down at start) takes them as before."""
        assert self.journal is not None
        get_id = getattr(self.store, "store_id", None)
        if self._down_at_start is not None or not callable(get_id):
            self.journal.disown()
            return
        try:
            sid = await asyncio.to_thread(get_id)
        except Exception as e:  # (StoreError: down, or its id document damaged)
            logger.warning(
                "%s: cannot read the store's id (%s): the journal's records are taken as this store's",
                self.journal.path, e,
            )  # fmt: skip
            self.journal.disown()
            return
        await asyncio.to_thread(self.journal.claim, sid)

    async def start(self) -> None:
        self._stopping.clear()
        self._stop_answer = None
        hours = self.engine.hours
        logger.info(
            "statistics by hour of week on the %s wall clock (policy.timezone: %s)",
            hours.name, self.engine.config.policy.timezone or "null, this machine's zone",
        )  # fmt: skip
        # the store did not answer a first probe (`serve`'s `refused`, within 2 s): the start tries
        # none of its store reads or writes, each of which would wait for its own timeout
        silent = self.store is not None and getattr(self.store, "answered", None) is False
        self._down_at_start = (
            "not tried: the store did not answer its first call at start" if silent else None
        )
        if self.journal is not None:  # requests served before a crash, not yet in the store
            await self._claim_journal()
            left = self.journal.read()
            if left:
                logger.info(
                    "%s: %d request(s) an earlier run served are not in the store yet: sent to it now",
                    self.journal.path, len(left),
                )  # fmt: skip
            self._log_buf = left + self._log_buf
            if self._down_at_start is None:
                await self.flush_log()
        # the store's reads on a thread (a store that hangs held the event loop: health checks, stop
        # signals); once the statistics' read fails, the others are not tried (`_down_at_start`)
        await self.restore_stats_async()
        if self._down_at_start is not None:  # the first flush probes it first (`_store_answers`)
            self._log_failing = True
        await self._restore_pins_at_start()
        adopted = await self.adopt()
        if adopted:
            logger.info("the device hosts still hold (kept as they are): %s", ", ".join(adopted))
            self._publish("reattached", "", f"adopted {', '.join(adopted)}", "", self.clock())
        intents = await asyncio.to_thread(self._read_intents) if self.store is not None else {}
        now = self.clock()
        self.engine.load_pinned(now)  # pinned models first: intents take what room is left
        restored = self.restore_intent(now, intents)
        if restored:
            logger.info("loading back what the last run had resident: %s", ", ".join(restored))
            self._publish("intent_restored", "", f"loading {', '.join(restored)}", "", now)
        self.engine.start(now)
        self._flush()
        self._task = asyncio.create_task(self._loop(), name="residency-reconciler")
        self.started = True
        self._started.set()

    def abandon_waits(self) -> None:
        """The service is stopping: the requests (and preloads, session opens) that wait for a model's
        load, or for room, are answered UNAVAILABLE now, saying so, and those that come next as well
        (for a model not loaded, at once: no load starts, nothing is evicted, for a request that
        could not wait for it). Their loads are abandoned, not cancelled: a device host may still
        finish one, whose result nobody takes (the process exits; a restarted manager adopts what
        its hosts hold). Requests already running on their device host are not affected."""
        self._stopping.set()
        for w in self._room_waits:  # (those waiting for room: now, not at their next poll)
            w.done.set()
        if self._stop_answer is not None and not self._stop_answer.done():
            self._stop_answer.set_result(None)  # (the forwards on Ray's device hosts: answered now)

    async def stop(self) -> None:
        """Stop: what still waits for a load is answered at once (`abandon_waits`), the reconciler
        ends, the request log is flushed and the statistics saved."""
        self.abandon_waits()
        self.started = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._persisting is not None:  # its store writes end first (they are shielded)
            self._persisting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._persisting
        if self._intent_writer is not None:  # the intents recorded last are written before the stop's
            await asyncio.wait({self._intent_writer}, timeout=STOP_WAIT_S)  # save (which may rewrite them)
        if self._room_task is not None:  # (the requests it tried are answered: `abandon_waits`)
            self._room_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._room_task
            self._room_task = None
        if self._background:  # session closes and lease changes on their way to a host (5 s at most)
            await asyncio.wait(set(self._background), timeout=STOP_WAIT_S)
        # (without a journal the buffered requests are lost if the flush is left: a fresh probe)
        if await self._store_silent(seen_within=SILENT_REUSE_S if self.journal is not None else 0.0):
            # each write would wait for its timeout (15 s a call with a stopped Redis): what a kill
            # leaves is left, and taken back as after one (the journal's requests, written at the
            # next start; the statistics caught up from them)
            kept = (
                "in the journal for the next start" if self.journal is not None else "unwritten (no journal)"
            )
            logger.warning(
                "the store does not answer: the stop leaves %d request(s) %s, and does not save the "
                "statistics (caught up from the request log at the next start)%s",
                len(self._log_buf),
                kept,
                f"; the admin pins not saved: {self.pin_overrides}" if self._pins_dirty else "",
            )
        else:
            await self._save_pins_at_stop()
            await self.flush_log()
            await self.save_stats_async()
        if self.journal is not None:
            self._journal_catch_up(force=True)  # what the store does not have, in it for the next start
            self.journal.close()

    async def pins_saved(self, timeout_s: float) -> bool:
        """Wait, `timeout_s` at most, for the pins' last write to the store (an admin's Pin or Unpin
        is answered once it is saved, so a kill right after the answer does not lose it). True when
        it is saved (or there is no store); False when the write failed or is still waiting (a store
        down or hanging): the pin holds, and is saved once the store answers."""
        task = self._pins_write
        if self.store is None:
            return True
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
            if not task.done():
                return False
        return not self._pins_dirty

    async def _save_pins_at_stop(self) -> None:
        """The admin pins whose last write failed (or that waited for the store's saved pins to be
        read) are written once more at the stop, STOP_WAIT_S at most: the reconciler's retry, at its
        next save, will not come, and the pin would be lost across the restart."""
        writing = self._pins_write is not None and not self._pins_write.done()
        if self.store is None or not self._pins_dirty or writing:
            return
        self._save_pins()
        task = self._pins_write
        if task is not None:
            await asyncio.wait({task}, timeout=STOP_WAIT_S)
        if self._pins_dirty:
            logger.warning(
                "the admin pins could not be saved in the store at the stop: %s", self.pin_overrides
            )

    async def _loop(self) -> None:
        next_tick = 0.0
        while True:
            try:
                for r in self.pool.poll():
                    try:
                        self._on_result(r)
                    except Exception:  # the batch's other results are taken already: not lost
                        logger.exception("handling the result of %s %s failed", r.op, r.model)
                now = self.clock()
                wake = [t for t in self.engine.wakeups if t <= now]
                if wake or now >= next_tick:
                    self.engine.wakeups = [t for t in self.engine.wakeups if t > now]
                    self.engine.tick(now)
                    self._load_pins(now)
                    self._flush()
                    self._resync_unsynced(now)
                    self._check_hosts()
                    self._check_abandoned(now)
                    self._journal_catch_up()  # (records a full disk kept from it: once it has room)
                    next_tick = now + 1.0
                full = len(self._log_buf) >= LOG_BATCH and not self._log_failing
                flush = bool(self._log_buf) and (now >= self._next_flush or full)
                save = now >= self._next_save
                if (flush or save) and (self._persisting is None or self._persisting.done()):
                    # on a task of its own: a store that hangs (a stopped Redis: 15 s a call) held
                    # the reconciler, so no load's result was taken, and the first request after a
                    # start waited a minute for a model its host had loaded in a second
                    self._persisting = asyncio.ensure_future(self._persist(now, flush, save))
            except Exception:  # the reconciler must outlive any one bad result
                logger.exception("reconciler step failed")
            await asyncio.sleep(self.poll_s)

    async def _persist(self, now: float, flush: bool, save: bool) -> None:
        """The reconciler's store work, beside it: the request log's flush, the admin pins read or
        written again, the statistics' save."""
        try:
            if flush:
                await self.flush_log()
                self._next_flush = now + LOG_EVERY_S
            if save and await self._store_silent():  # (tried again in a moment, a probe first)
                self._next_save = now + SILENT_RETRY_S
                return
            if save:
                if self._pins_unread:
                    await self._restore_pins_off_loop()
                writing = self._pins_write is not None and not self._pins_write.done()
                if self._pins_dirty and not self._pins_unread and not writing:
                    self._save_pins()  # a pin whose write failed: written once the store answers
                await self.save_stats_async()
                self._next_save = now + SAVE_EVERY_S
        except asyncio.CancelledError:
            raise
        except Exception:  # (tried again at the next flush or save)
            logger.exception("saving to the store failed")

    def _load_pins(self, now: float) -> None:
        """A pinned model that found no room when it was pinned (or at start) loads as soon as there is
        room for it (free, or held past its keep-alive), as the reconciler ticks; not one whose last
        load failed (no load retried every second: a request, a reload or a resync still tries it)."""
        failed = {name for name, live in self.live.items() if live.load_error is not None}
        self.engine.load_pinned(now, skip=failed)

    # ---- decisions -> commands ----------------------------------------------------------------
    def _flush(self) -> None:
        actions = self.engine.actions
        assert actions is not None
        new, self._seen_actions = actions[self._seen_actions :], len(actions)
        for t, a in new:
            self._apply(t, a)
        if new:  # (an eviction, a demote, a lease shrunk: room the requests waiting for it may take)
            self._room_freed()
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
            m = self.engine.models[a.model]
            if m.tier == Tier.GPU:
                # loading until its device host answers for it (`_confirmed`), not until the
                # engine's estimate: past that estimate the engine would count it loaded and could
                # evict it (room for another model) while the load still fills that room on the
                # device; and if the host then abandoned the load (LOAD_TIMEOUT, still running there)
                # that room would be booked twice
                m.ready_at = math.inf
        elif a.kind == ActionKind.LOAD_HOST:
            cmd = P.Load(spec, "host")
        elif a.kind == ActionKind.DEMOTE:
            cmd = P.Demote(a.model)
            live.ready.clear()
            m = self.engine.models[a.model]
            if m.ready_at == math.inf:  # (never one still loading: not the estimate of its promote)
                m.ready_at = t
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

    def _count_action(self, a: Action) -> None:
        mt = self.metrics
        if not a.moved:  # the books catch up (a failed load, a model its host had lost already)
            self._gauge_resident()
            return
        # (a load is counted when its device host confirms it, `_confirmed`: not when it is sent)
        if a.kind in (ActionKind.DEMOTE, ActionKind.DROP) and a.device != "host":
            mt.evictions.labels(a.model, "host" if a.kind == ActionKind.DEMOTE else "disk").inc()
        thrash = self.engine.counters.thrash
        if thrash > self._thrash_seen:
            mt.thrash.inc(thrash - self._thrash_seen)
            self._thrash_seen = thrash
        self._gauge_resident()

    def _gauge_resident(self) -> None:
        """Resident bytes per device and in host RAM, and each elastic model's lease, as the books
        have them (a lease also goes to 0 when its model leaves the GPU, and to its minimum when it
        loads: moves with no lease action of their own)."""
        host = 0
        for d in self.engine.state.devices.values():
            self.metrics.resident.labels(d.name, "gpu").set(d.used)
        for m in self.engine.models.values():
            if m.tier == Tier.HOST:
                host += m.weights
            if m.elastic:
                self.metrics.lease.labels(m.name).set(m.lease)
        self.metrics.resident.labels("host", "host").set(host)

    def _on_result(self, r: P.CommandResult) -> None:
        model, kind = self._ops.pop(r.op_id, (r.model, None))
        retried = r.op_id in self._drop_retries
        self._drop_retries.discard(r.op_id)
        last_try = r.op_id in self._last_drops
        self._last_drops.discard(r.op_id)
        self._results[model] = self._results.get(model, 0) + 1
        known = self.engine.models.get(model)
        device = r.device or (known.device if known is not None else "")
        news = self._host_news(r, device, kind)
        if news is not None:  # the host restarted, or lost models: its other models are checked too
            self._resync_soon(device, news)
        live = self.live.get(model)
        if live is None:
            return
        now = self.clock()
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            live.loads_pending -= 1
        if r.ok:
            self._confirmed(r, model, kind, live, now)
        else:
            self._failed(r, model, kind, live, now, retried=retried, last_try=last_try)
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            # an admin's evict that waited for this load goes now: as usual after a success; after a
            # failure the model is off its device on the books already, or held for a load its host
            # abandoned (its room comes free when that ends, `_release_abandoned`: nothing more to do)
            self._deferred_evict(self.engine.models[model])
        self._room_freed()  # (a load confirmed is evictable now; a failed one left its room)

    def _confirmed(
        self, r: P.CommandResult, model: str, kind: ActionKind | None, live: _Live, now: float
    ) -> None:
        """A command's success (`r`): the books take its measures, waiters of its load wake."""
        self._drops_refused.discard(model)
        if kind in LOAD_KINDS:
            # (its host starts no load of it while an abandoned one runs: that one ended; not a
            # drop's, say the admin's evict's: it finds nothing of the model, the load still runs)
            self._held_loads.pop(model, None)
        if not r.noop:
            self.metrics.load_seconds.labels(model, r.transition).observe(r.timing.total_s)
        if kind in LOAD_KINDS:
            if not r.noop:  # a load that happened (a failed one is counted in the failures metric)
                # where the bytes came from, as the engine's load costs have it (the OS page cache's
                # loads were counted `disk`, while the books priced them `cached`)
                source = "host" if r.from_tier == "host" else (r.source or "disk")
                self.metrics.loads.labels(model, r.to_tier, source).inc()
            self._load_worked(model, r.device or self.engine.models[model].device)
        live.tier = r.to_tier
        m = self.engine.models[model]
        if live.load_error is not None and kind in (
            ActionKind.LOAD,
            ActionKind.PROMOTE,
            ActionKind.LOAD_HOST,
        ):
            live.load_error = None
            m.prewarm_ok = m.cfg.prewarm
        if (
            r.to_tier == "gpu"
            and live.loads_pending == 0
            and m.tier == Tier.GPU
            and model not in self._held_loads
        ):
            # loaded (a no-op one too): resident from now on, evictable as any (`_apply` kept it
            # loading until now); first, so a measure that finds it too big may move it on
            m.ready_at = min(m.ready_at, now)
        if r.to_tier == "gpu" and not r.noop:
            src = "host" if r.from_tier == "host" else (r.source or "disk")
            m.cost.measure(src, max(r.timing.total_s, 1e-4))
            if r.footprint.device_bytes > 0:
                self.engine.measured_footprint(m, r.footprint.device_bytes, now)
                self._measured.add(model)
                self._flush()  # measured larger: what made room for it leaves now
                self._gauge_resident()  # the books count the measured bytes now (no action said so)
        if r.to_tier == "host" and r.from_tier == "disk" and not r.noop:  # (timed by its host)
            m.cost.measure("disk_host", max(r.timing.total_s, 1e-4))
        if (
            r.to_tier == "host"
            and not r.noop
            and r.footprint.host_bytes > m.weights
            and m.tier == Tier.HOST
            and model not in self._measured
        ):
            # read into host RAM, larger than its estimate, and never measured on the device yet: it
            # is booked at the bytes it holds there (two models of 256 MiB estimated at 1 MiB each were
            # booked as 2 MiB of host RAM). Never smaller than the estimate: that is the device's
            # figure (`measure` writes what the device took, its runtime's memory included), and
            # one size serves both tiers' books; a device load's measure replaces it
            self.engine.measured_footprint(m, r.footprint.host_bytes, now)
            self._flush()  # measured larger than host RAM holds beside the others: one leaves now
            self._gauge_resident()  # the books count the measured bytes now (no action said so)
        if r.to_tier == "gpu" and live.loads_pending == 0 and m.tier == Tier.GPU:
            live.ready.set()
        self._publish("confirmed", model, f"{r.op} {r.transition} in {r.timing.total_s:.3f} s", r.device, now)

    def _failed(
        self,
        r: P.CommandResult,
        model: str,
        kind: ActionKind | None,
        live: _Live,
        now: float,
        *,
        retried: bool,
        last_try: bool,
    ) -> None:
        """A command's failure (`r`): said, and the books follow what its device host still holds."""
        live.error, live.error_code = r.error, r.error_code
        live.failures += 1
        self.metrics.failures.labels(model, r.error_code or "unknown").inc()
        self._publish("failed", model, r.error or "", r.device, now)
        m = self.engine.models[model]
        if kind in LOAD_KINDS:
            self._say_load_failed(r, model, kind, live, r.device or m.device, now)
        if kind in LOAD_KINDS:
            # a model that cannot load is not prewarmed again (no retry loop on a missing file);
            # a request still tries, so a fixed cause is picked up, and a success re-enables it
            m.prewarm_ok = False
            live.load_error = r.error or r.error_code or "load failed"
        if kind in (ActionKind.LOAD, ActionKind.PROMOTE) and m.tier == Tier.GPU and live.loads_pending == 0:
            if r.error_code == P.LOAD_TIMEOUT:  # it still runs there: its room is not free
                self._hold_abandoned(m, r.error or f"its {r.op} did not finish in time")
            else:
                self.engine.evict(m, now, f"load failed: {r.error}", failed=True)
                self._flush()
                live.ready.set()  # wake the waiters: they see the error
        elif (
            kind in (ActionKind.LOAD, ActionKind.PROMOTE)
            and r.error_code == P.LOAD_TIMEOUT
            and m.tier == Tier.DISK
            and live.loads_pending == 0
        ):
            # the books took it off its device during the load (neither an admin's evict, which
            # waits for the load, `evict`, nor the engine, for which it is loading until its host
            # answers, `_apply`, does now: a safety net), but the load still runs there and fills
            # that room: booked and held again (as a resync would), until its host's status no
            # longer lists it; unless the room went to another model meanwhile (said:
            # `_hold_abandoned` cannot book it then)
            self._hold_abandoned(m, r.error or f"its {r.op} did not finish in time")
        elif kind == ActionKind.LOAD_HOST and m.tier == Tier.HOST:
            self.engine.drop_host(m, now, f"load to host RAM failed: {r.error}")
            self._flush()
        elif kind == ActionKind.DEMOTE and r.to_tier != "host" and m.tier == Tier.HOST:
            # the host kept it on the device (its copy out failed), and the books gave that room
            # away: it is dropped there, so the room is really free (the books: on disk); or the
            # host does not hold it at all (its load failed, or the host restarted empty): the
            # books do not keep host RAM for it either
            self.engine.drop_host(m, now, f"demote failed: {r.error}")
            self._flush()
        elif kind == ActionKind.DROP and r.to_tier != "disk":
            self._drop_refused(r, m, retried=retried, last_try=last_try)

    def _say_load_failed(
        self, r: P.CommandResult, model: str, kind: ActionKind, live: _Live, device: str, now: float
    ) -> None:
        """A failed load or promote (`r`) is logged at WARNING: the model, the device, the error code
        and the reason. Once per cause: the same model failing again with the same code and reason
        is counted, not logged, until the reason changes, a load of it works (`_load_worked`), or
        FAIL_LOG_EVERY_S passed since its last line (which then says how many times it failed)."""
        code, reason = r.error_code or "unknown", r.error or "no reason given"
        what = {
            ActionKind.LOAD: "load (disk->gpu)",
            ActionKind.PROMOTE: "promote (host->gpu)",
            ActionKind.LOAD_HOST: "load to host RAM (disk->host)",
        }[kind]
        if live.failure_logged == (code, reason):
            live.failure_repeats += 1
            if now - live.failure_logged_at < FAIL_LOG_EVERY_S:
                return
            logger.warning(
                "model %r: its %s on device %s failed again (%s): %s (%d more times with this reason "
                "in the last %.0f s)",
                model,
                what,
                device,
                code,
                reason,
                live.failure_repeats,
                now - live.failure_logged_at,
            )
        else:
            logger.warning("model %r: its %s on device %s failed (%s): %s", model, what, device, code, reason)
        live.failure_logged, live.failure_logged_at, live.failure_repeats = (code, reason), now, 0

    def _load_worked(self, model: str, device: str) -> None:
        """A load of `model` worked: a failure of it logged before is said to be over, and the next
        failure is logged whatever its reason (`_say_load_failed`)."""
        live = self.live[model]
        if live.failure_logged is None:
            return
        logger.info(
            "model %r: loaded on device %s; its earlier load failure (%s) is over",
            model,
            device,
            live.failure_logged[0],
        )
        live.failure_logged, live.failure_repeats = None, 0

    def _drop_refused(self, r: P.CommandResult, m: Any, *, retried: bool, last_try: bool) -> None:
        """The host still holds `m` after a Drop (`r`; a session's close failed, say), which the books
        count on disk: the drop is sent once more; refused again, a resync puts the model back on the
        books if it fits them, or drops it once more (`last_try`) if not. Once per model until one of
        its commands works (no loop of drops and resyncs with a host that refuses every drop)."""
        device = r.device or m.device
        if not retried and not last_try:
            self._drop_on_host(device, m.name, retry=True)
        elif not last_try and m.name not in self._drops_refused:
            self._drops_refused.add(m.name)
            self._resync_soon(device, f"the device host refused a drop of {m.name} twice ({r.error})")
        else:
            logger.warning(
                "device %s: the device host refused a drop of %s again (%s): it still holds it in the "
                "%s tier, which the books do not count",
                device,
                m.name,
                r.error,
                r.to_tier,
            )

    def _host_news(self, r: P.CommandResult, device: str, kind: ActionKind | None) -> str | None:
        """Why result `r` (of a command on `device`) says that device's host may no longer hold what
        the books count there (it restarted empty, or it lost a model), or None."""
        if r.boot_id and device:
            known = self._boots.setdefault(device, r.boot_id)
            if known != r.boot_id:
                return f"the device host restarted (a {r.op} of {r.model} ran on a new host process)"
        if r.error_code == P.WORKER_DIED:
            return f"worker_died under a {r.op} of {r.model}: {r.error}"
        if r.error_code == P.BAD_TRANSITION and kind in (ActionKind.DEMOTE, ActionKind.PROMOTE):
            return f"bad_transition on a {r.op} of {r.model}: {r.error}"
        if r.ok and kind == ActionKind.PROMOTE and r.from_tier == "disk":
            return f"the device host no longer held {r.model} in host RAM (it loaded it from disk)"
        return None

    def _resync_soon(self, device: str, why: str) -> None:
        """Read `device`'s status again and bring the books in step with what its host holds (a
        resync, as adoption does at start): off the books what it no longer holds, on the books (or
        dropped there) what it holds beyond them; once the result or request that said why is handled;
        one at a time per device (one asked for meanwhile follows it)."""
        if not self.started or device not in self.engine.state.devices:
            return
        task = self._resyncing.get(device)
        if task is not None and not task.done():
            self._resync_again[device] = why
            return
        self._resyncing[device] = self._in_background(self._resync(device, why))

    async def _resync(self, device: str, why: str | None) -> None:
        while why is not None and self.started:
            try:
                await self._resync_once(device, why)
            except Exception:
                logger.exception("device %s: the resync after %s failed", device, why)
            why = self._resync_again.pop(device, None)

    async def _resync_once(self, device: str, why: str) -> list[str]:
        """One resync of `device` (see `_resync_soon`): a model on its books whose commands and
        requests are all over, but that its host does not hold at all, leaves the books (`_off_books`,
        said with `why`); pinned models then load again. One its host holds in the other tier (on the
        GPU while the books have it in host RAM, or the other way round) is booked where the host
        holds it, without a command, when it fits, else dropped there (`_held_elsewhere`). A model the
        books have on disk but that its host holds (on the GPU or in host RAM: a load whose result said
        it failed, a drop it refused) is put on the books if it fits them, else dropped there
        (`_held_beyond_books`); one it holds that is not configured there is dropped. A model with a
        command on its way, a request or session in flight, or a result taken while the status was
        read is left to those (their results tell). A model whose abandoned load still runs there
        (`WorkerStatus.abandoned`) stays held, or is held, on the books; its hold ends once the status no
        longer lists it (`_resync_abandoned`). Returns the models taken off."""
        on_device = [m for m in self.engine.models.values() if m.device == device]
        busy = {name for name, _ in self._ops.values()}
        seen = {m.name: self._results.get(m.name, 0) for m in on_device}
        st: P.WorkerStatus | None = None
        for attempt in range(RESYNC_TRIES):
            try:
                st = await asyncio.to_thread(self.pool.status, device, 10.0)
                break
            except Exception as e:  # still restarting: asked again in a moment
                if attempt == 0 and not why.endswith(UNREAD):  # (a later try of an unread one: quiet)
                    logger.info(
                        "device %s did not report its status for a resync (%s); asking again", device, e
                    )
                if not self.started:
                    return []
                await asyncio.sleep(RESYNC_RETRY_S)
        if st is None:
            # warned once; the later tries of a host that stays away only at debug level
            logger.log(
                logging.DEBUG if why.endswith(UNREAD) else logging.WARNING,
                "device %s did not report its status for a resync after %s; tried again in %s s",
                device,
                why,
                RESYNC_LATER_S,
            )
            self._unsynced[device] = (self.clock() + RESYNC_LATER_S, why)
            return []
        self._unsynced.pop(device, None)
        if st.boot_id:
            if self._boots.get(device, st.boot_id) != st.boot_id:  # a new host process, counted once
                self.metrics.host_restarts.labels(device).inc()
            self._boots[device] = st.boot_id
        busy |= {name for name, _ in self._ops.values()}
        lost = []
        beyond: list[str] = []
        repin = False  # a model held in another tier than the books' was dropped (it did not fit)
        for m in on_device:
            if m.name in busy or self.live[m.name].inflight > 0:
                continue
            if self._results.get(m.name, 0) != seen[m.name] or self._resync_abandoned(m, st, why, beyond):
                continue
            want = None if m.tier == Tier.DISK else TIER_NAMES[m.tier]
            held = st.models.get(m.name)
            if want is None:
                if held is not None and held.tier in ("gpu", "host"):
                    beyond.append(self._held_beyond_books(m, held, why))
                continue
            if held is not None and held.tier == want:
                continue
            if held is not None and held.tier in ("gpu", "host"):  # in the other tier: the books follow
                beyond.append(self._held_elsewhere(m, held, why))
                repin = repin or m.tier == Tier.DISK
                continue
            tier = "" if held is None else f" in the {want} tier (it holds it in the {held.tier} tier)"
            logger.warning(
                "device %s: the device host no longer holds %s%s (%s): taken off the books",
                device,
                m.name,
                tier,
                why,
            )
            self._off_books(m, f"{why}; the device host no longer holds it{tier}")
            lost.append(m.name)
        configured = {m.name for m in on_device}
        for name in st.models.keys() - configured - busy:
            logger.warning(
                "device %s holds %s, which is not configured there (%s): dropped", device, name, why
            )
            self._drop_on_host(device, name, last_try=True)
            beyond.append(f"{name} dropped on the host (not configured there)")
        if lost or beyond:
            now = self.clock()
            said = [f"off the books: {', '.join(lost)}"] if lost else []
            self._publish("resynced", "", f"{'; '.join(said + beyond)} ({why})", device, now)
        if lost or repin:
            self.engine.load_pinned(self.clock())  # a pinned model lost goes back at once
            self._flush()
        return lost

    def _resync_abandoned(self, m: Any, st: P.WorkerStatus, why: str, done: list[str]) -> bool:
        """A resync's part for a model whose abandoned load the books hold, or that `st` lists as
        abandoned (what was done goes to `done`): the hold ends when `st` no longer lists it
        (`_release_abandoned`; the rest of the resync then goes on for it as for any model); one the
        books have on disk (a restarted manager's books) or on the GPU is held (`_hold_abandoned`).
        True when the rest of the resync leaves it alone: its load still runs there, so its host holds
        nothing of it to book yet."""
        running = st.abandoned.get(m.name)
        if m.name in self._held_loads:
            if running is None:
                done.append(self._release_abandoned(m, why))
                return False
            return True
        if running is None:
            return False
        op, secs = running
        if m.tier != Tier.HOST and self._hold_abandoned(
            m, f"{why}; its abandoned {op} has run {secs:.0f} s on {m.device}"
        ):
            done.append(f"{m.name} held (its abandoned {op} still runs)")
        return True

    def _hold_abandoned(self, m: Any, why: str) -> bool:
        """`m`'s device host abandoned its load or promote (LOAD_TIMEOUT, `why`) but that still runs
        there (a thread cannot be killed): what it allocates stays allocated until it ends. So its
        bytes stay booked on its device: the model stays on the books as loading, for good (never
        served, never evicted, its room never given to another model) until a status of its host no
        longer lists that load (`WorkerStatus.abandoned`; a resync reads one every HELD_CHECK_S
        meanwhile, `_release_abandoned`). It is not resident: its requests are refused meanwhile,
        saying why (`_refuse_held`), and a load of it is tried again once the hold ends. A model the
        books have on disk (a restarted manager's) is booked so when it fits; False when not."""
        now = self.clock()
        if m.tier == Tier.DISK and not self.engine.adopt(m, Tier.GPU, now):
            logger.warning(
                "device %s: %s (%s), and its room does not fit the books: it is not held there",
                m.device,
                m.name,
                why,
            )
            return False
        if m.tier != Tier.GPU:  # (the books moved it meanwhile: nothing of it is booked there)
            return False
        self._held_loads[m.name] = why
        m.ready_at = math.inf  # loading for good: no hit, no eviction, no keep-alive running out
        live = self.live[m.name]
        live.tier = "disk"
        live.ready.set()  # its waiters wake and find it held (`_refuse_held`)...
        live.ready.clear()  # ...and it is not ready: not resident
        self._set_intent(m.name, "disk", "abandoned load")
        self._held_check.setdefault(m.device, now + HELD_CHECK_S)
        self._gauge_resident()
        held = f"{fmt_bytes(m.gpu_bytes)} on {m.device}"
        logger.warning("device %s: %s; its %s stay booked until that load ends", m.device, why, held)
        self._publish("held", m.name, f"{why}; its {held} stay booked until that load ends", m.device, now)
        return True

    def _release_abandoned(self, m: Any, why: str) -> str:
        """A status of `m`'s device host no longer lists its abandoned load (it ended, or the host
        restarted): the room held for it is free on the books (no command: the host holds nothing of
        it from that load). Returns what was done."""
        now = self.clock()
        self._held_loads.pop(m.name, None)
        if m.tier == Tier.GPU:
            m.ready_at = now
            self.engine.unbook(m, now)
            self._gauge_resident()
            self._room_freed()
        detail = f"{why}; its abandoned load no longer runs: the room held for it is free"
        logger.info("device %s: %s: %s", m.device, m.name, detail)
        self._publish("released", m.name, detail, m.device, now)
        return f"{m.name} released (its abandoned load ended)"

    def _check_abandoned(self, now: float) -> None:
        """The reconciler's check of the abandoned loads whose room the books hold: their device's
        status is read again (a resync) every HELD_CHECK_S, until it no longer lists them."""
        devices: dict[str, list[str]] = {}
        for name in self._held_loads:
            devices.setdefault(self.engine.models[name].device, []).append(name)
        for device in self._held_check.keys() - devices.keys():
            del self._held_check[device]
        for device, names in devices.items():
            if now >= self._held_check.get(device, now):
                self._held_check[device] = now + HELD_CHECK_S
                self._resync_soon(device, f"checking whether the abandoned load of {', '.join(names)} ended")

    def _refuse_held(self, m: Any) -> None:
        """WorkerUnavailable when `m`'s abandoned load still runs on its device host (`_hold_abandoned`):
        no other load of it starts until that one ends."""
        why = self._held_loads.get(m.name)
        if why is not None:
            raise WorkerUnavailable(
                f"model {m.name!r} could not be loaded: {why}; that load is still running on its device "
                f"host, which holds its memory on {m.device} until it ends: retry later"
            )

    def _held_note(self, device: str) -> str:
        """What the abandoned loads still running on `device` hold there ("" when none)."""
        held = [
            f"{fmt_bytes(m.gpu_bytes)} by the abandoned load of {name!r}"
            for name in self._held_loads
            if (m := self.engine.models[name]).device == device and m.tier == Tier.GPU
        ]
        return f" ({', '.join(held)} held on {device}: still running on its device host)" if held else ""

    def _resync_unsynced(self, now: float) -> None:
        """The reconciler's light check: a device whose last resync could not read its host's status
        is resynced again (its host may hold what the books do not count, or no longer hold what they
        do, and no later result need say so: a host that answers again under the same boot id)."""
        for device, (at, why) in list(self._unsynced.items()):
            if at <= now:
                del self._unsynced[device]
                # (said once: the reason of each later try is the same, not one note longer each time)
                self._resync_soon(device, why if why.endswith(UNREAD) else f"{why}{UNREAD}")

    def _check_hosts(self) -> None:
        """Every HOST_CHECK_S (the monotonic clock's), read each device host's status in the background
        (`_look_at_hosts`), one read at a time."""
        now = time.monotonic()
        if now < self._next_host_check or self._stopping.is_set():
            return
        if self._host_check is not None and not self._host_check.done():
            return
        self._next_host_check = now + HOST_CHECK_S
        self._host_check = self._in_background(self._look_at_hosts())

    async def _look_at_hosts(self) -> None:
        """A device whose host answers with another boot id than the books last saw is resynced (it
        restarted: what it held is gone, and the books follow). A device being resynced, or whose
        status could not be read for its last resync (retried by `_resync_unsynced`), is left alone."""
        for device in list(self.engine.state.devices):
            task = self._resyncing.get(device)
            if device in self._unsynced or (task is not None and not task.done()):
                continue
            if self._stopping.is_set() or not self.started:
                return
            try:
                st = await asyncio.to_thread(self.pool.status, device, HOST_CHECK_TIMEOUT_S)
            except Exception as e:  # (its next command or request tells what happened to it)
                logger.debug("device %s: no status for the periodic check (%s)", device, e)
                continue
            if not st.boot_id:  # (an older host: its commands' results tell)
                continue
            known = self._boots.setdefault(device, st.boot_id)
            if known != st.boot_id:
                self._resync_soon(device, "the device host restarted (its status names a new host process)")

    def _held_elsewhere(self, m: Any, held: P.ModelStatus, why: str) -> str:
        """A resync found `m`'s device host holding it in `held.tier` (the GPU or host RAM) while the
        books have it in the other one: the books follow the host. Off the books without a command
        (a Drop would throw away a model the host holds where it can be used), then on them in the
        host's tier when it fits, else dropped there (`_held_beyond_books`). Returns what was done."""
        booked = "gpu" if m.tier == Tier.GPU else "host"
        now = self.clock()
        self.engine.unbook(m, now)
        live = self.live[m.name]
        live.ready.clear()
        live.tier = "disk"
        done = self._held_beyond_books(m, held, why, booked=booked)
        if m.tier == Tier.DISK:  # dropped there: the books, the gauges and the intent say so
            self._set_intent(m.name, "disk", "resync")
            self._gauge_resident()
        return done

    def _held_beyond_books(self, m: Any, held: P.ModelStatus, why: str, *, booked: str = "disk") -> str:
        """A resync found `m`'s device host holding it in `held.tier` (the GPU or host RAM) while the
        books have it on disk (`booked`: had it in that other tier, taken off by `_held_elsewhere`):
        the books would give its room away and the next load there could overrun the device. It is
        put on the books as it is (as adoption at start does: no command, no load) when it fits them;
        dropped on the host when it does not, or when it was loaded with another spec than the
        config's. Said (a log line, an event); returns what was done."""
        now, device = self.clock(), m.device
        on_books = "on disk" if booked == "disk" else f"in the {booked} tier"
        tier = Tier.GPU if held.tier == "gpu" else Tier.HOST
        other = held.spec is not None and held.spec != self.specs.get(m.name)
        if not other and tier == Tier.GPU and held.device_bytes > 0:
            m.weights = int(held.device_bytes)  # the host's measure, before the books count it
            self._measured.add(m.name)
            self.engine.recheck_fit()
        if other or not self.engine.adopt(m, tier, now):
            because = (
                "it was loaded with another adapter, source or budget than the config's"
                if other
                else "it does not fit the books"
            )
            logger.warning(
                "device %s: the device host holds %s in the %s tier, which the books had %s (%s), "
                "and %s: dropped there",
                device,
                m.name,
                held.tier,
                on_books,
                why,
                because,
            )
            where = "beyond the books" if booked == "disk" else f"while the books had it {on_books}"
            detail = f"{why}; held in the {held.tier} tier {where}, and {because}: dropped there"
            self._publish("held_dropped", m.name, detail, device, now)
            self._drop_on_host(device, m.name, last_try=True)
            return f"{m.name} dropped on the host ({because})"
        live = self.live[m.name]
        live.tier = held.tier
        live.error = live.error_code = None
        if live.load_error is not None:  # it did load, after all
            live.load_error = None
            m.prewarm_ok = m.cfg.prewarm
        self._load_worked(m.name, device)
        if tier == Tier.GPU:
            live.ready.set()
        self._set_intent(m.name, held.tier)
        self._gauge_resident()
        logger.warning(
            "device %s: the device host holds %s in the %s tier, which the books had %s (%s): "
            "put on the books",
            device,
            m.name,
            held.tier,
            on_books,
            why,
        )
        had = "" if booked == "disk" else f" (the books had it {on_books})"
        detail = f"{why}; held in the {held.tier} tier{had}: put on the books"
        self._publish("adopted", m.name, detail, device, now)
        return f"{m.name} put on the books ({held.tier})"

    # ---- requests -------------------------------------------------------------------------------
    def serving(self, name: str) -> bool:
        """Whether `name` is ready to serve at once: its load on the GPU confirmed, none pending. A
        failed load also wakes its waiters (the ready event) but leaves the model on disk: not ready."""
        live = self.live[name]
        return (
            live.ready.is_set()
            and not live.loads_pending
            and self.engine.models[name].tier == Tier.GPU
            and name not in self._held_loads
        )

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

    async def _admit(
        self, m: Any, rank: int, deadline: float, *, observe: bool = True, seen: list[float] | None = None
    ) -> float:
        """Admit; return when the request may start (waiting for room if its class must). `seen`: gets
        the time it was observed (`_queue_for`)."""
        arrival = self.clock()
        if observe:  # (not again for a request retried after its device host lost the model)
            self.engine.observe(m, arrival)
            if seen is not None:
                seen.append(arrival)
        await self._room_turn(m, rank, arrival, deadline)
        return arrival

    async def _room_turn(
        self, m: Any, rank: int, arrival: float | None, deadline: float, *, again: bool = False
    ) -> None:
        """`_take_room_turn`; what it raises refused the request at admission (`REFUSED`): no room for
        it in time (or ever), or the service stopping before any load of it."""
        try:
            await self._take_room_turn(m, rank, arrival, deadline, again=again)
        except ResidencyError as e:
            setattr(e, REFUSED, True)
            raise

    async def _take_room_turn(
        self, m: Any, rank: int, arrival: float | None, deadline: float, *, again: bool = False
    ) -> None:
        """Admit `m` for a request of class `rank` (the engine loads it, making room as the class may):
        at once when it is on its GPU or there is room, else once room comes free. The requests that
        wait for room are tried in class order, highest first, and within a class in arrival order
        (`_room_pass`: at each arrival, and by the `_room_passes` task alone meanwhile, at once when
        room may have come free, `_room_freed`, else every WAIT_RETRY_S): room that comes free goes
        to the first one it is enough for, not to whichever asks first. A waiting request does not
        poll: it wakes when a pass admits or refuses it, at its deadline or its class's max_wait, or
        at a stop; meanwhile no prewarm takes room on its device (`Engine.room_wanted`).
        InsufficientCapacity when the engine rejects it, or no room came within its class's max_wait
        from `arrival` (None: none, an admin's preload); DeadlineExceeded at `deadline` (`again`: its
        model was taken off its device while it waited for the load it was admitted for);
        WorkerUnavailable once the service stops."""
        if m.tier == Tier.GPU:  # loaded or loading: no room needed
            adm = self.engine.admit(m, rank, self.clock())
            self._flush()
            if adm.status == "reject":
                raise InsufficientCapacity(f"model {m.name!r} cannot be served: {adm.reason}")
            return
        self._if_stopping(m, NO_LOAD_AT_STOP)  # at a stop, nothing is loaded (nor evicted) for it
        self._room_seq += 1
        w = _RoomWait(m, rank, self._room_seq, arrival, deadline)
        self._room_waits.append(w)
        try:
            self._room_pass()  # in order with those already waiting (it may be first)
            while True:
                if w.error is not None:
                    raise w.error
                if w.admission is not None:
                    if w.admission.status == "reject":
                        raise InsufficientCapacity(f"model {m.name!r} cannot be served: {w.admission.reason}")
                    return
                now = self.clock()
                max_wait = self.engine.state.class_max_wait[rank] if arrival is not None else math.inf
                if arrival is not None and now - arrival > max_wait:
                    raise InsufficientCapacity(
                        f"model {m.name!r}: no room within its class's max_wait ({max_wait} s)"
                        + self._held_note(m.device)
                    )
                if now >= deadline and again:
                    raise DeadlineExceeded(
                        f"model {m.name!r} was taken off its device while the request waited for its load, "
                        f"and no room became free again before the deadline{self._held_note(m.device)}"
                    )
                if now >= deadline:
                    held = self._held_note(m.device)
                    raise DeadlineExceeded(f"model {m.name!r}: no room became free before the deadline{held}")
                self._if_stopping(m, "no room became free for it in time")
                if self._room_task is None or self._room_task.done():  # (the one that serves it)
                    self._room_task = asyncio.get_running_loop().create_task(self._room_passes())
                # no poll: its own timer is for its deadline and max_wait only (on the loop's clock: a
                # pass also wakes it once either has passed on the manager's, `_room_pass`)
                wake = max(deadline - now, 0.0)
                if arrival is not None:
                    wake = min(wake, max(arrival + max_wait - now, 0.0) + 1e-3)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.done.wait(), None if wake == math.inf else wake)
                w.done.clear()  # (woken with no admission: past its time, or the service stops)
        finally:
            self._room_waits.remove(w)

    def _room_pass(self) -> None:
        """Try the requests waiting for room again, in class order (highest first: the config lists
        the classes so, `class_rank` 0 first), within a class in arrival order; each one the engine
        admits (or rejects) is woken. One that finds no room leaves what room there is to the next
        ones (a smaller model may fit it). Not one whose model is off its GPU once the service stops,
        nor one past its deadline or its class's max_wait once it was tried (its own timer may not
        have run yet: it is woken to fail, not given a load, and an eviction, it would not wait for;
        each is tried once however late, as a request put back to wait for room is)."""
        if not self._room_waits:
            return
        now = self.clock()
        stopping = self._stopping.is_set()
        for w in sorted(self._room_waits, key=lambda w: (w.rank, w.seq)):
            if w.admission is not None or w.error is not None or (stopping and w.m.tier != Tier.GPU):
                continue
            max_wait = self.engine.state.class_max_wait[w.rank] if w.arrival is not None else math.inf
            late = now >= w.deadline or (w.arrival is not None and now - w.arrival > max_wait)
            if late and w.tried:
                w.done.set()
                continue
            w.tried = True
            try:
                adm = self.engine.admit(w.m, w.rank, now)
                self._flush()
            except Exception as e:  # (that request's error, not the others')
                w.error = e
                w.done.set()
                continue
            if adm.status != "wait":
                w.admission = adm
                w.done.set()

    async def _room_passes(self) -> None:
        """The one server of the requests that wait for room (they do not poll): `_room_pass` at once
        when room may have come free (`_room_freed`: a move of the books, a command's result, a
        request's or a wait's end), and every WAIT_RETRY_S besides, while any wait (room also comes
        free with time alone: a keep-alive or a min_residency that runs out)."""
        while self._room_waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room_changed.wait(), WAIT_RETRY_S)
            self._room_changed.clear()
            try:
                self._room_pass()
            except Exception:  # (the waiting requests still time out by themselves)
                logger.exception("trying the requests that wait for room failed")

    def _room_freed(self) -> None:
        """Room may have come free (or a model become evictable): the requests waiting for room are
        tried again at once, by the `_room_passes` task (not here: in the caller's step, the books may
        be half-way through a change)."""
        if self._room_waits:
            self._room_changed.set()

    def _room_wanted(self, device: str) -> bool:
        """Whether requests (or admin preloads) still wait for room on `device`: a prewarm there gives
        way to them (`Engine.prewarm`)."""
        return any(w.m.device == device and w.admission is None and w.error is None for w in self._room_waits)

    async def _ready(
        self, m: Any, deadline: float, rank: int | None = None, *, arrival: float | None = None
    ) -> None:
        """Wait for `m`'s confirmed load. A device host that died under the load (Ray restarts it,
        empty) costs one more load, within the deadline; past it the caller gets UNAVAILABLE. A model
        taken off its device meanwhile is admitted again under the request's class `rank` (the
        model's own class when None: an admin's preload), so a background request never evicts; it
        waits for room in turn with the others (`_room_turn`), at most its class's max_wait from the
        request's `arrival` (None: an admin's preload, which waits until its deadline)."""
        live = self.live[m.name]
        died = ""
        taken = -1  # `live.failures` when the death was taken (its error is no new failure after)
        # (its tier too: a failed load sets `ready` to wake its waiters, the model on disk)
        while not live.ready.is_set() or live.loads_pending or m.tier != Tier.GPU:
            self._refuse_held(m)
            self._if_stopping(m)
            left = deadline - self.clock()
            if left <= 0 and died:
                raise WorkerUnavailable(
                    f"model {m.name!r}: its device host died during the load ({died}); "
                    "the reload did not finish before the deadline"
                )
            if left <= 0:
                raise DeadlineExceeded(f"model {m.name!r} did not finish loading before the deadline")
            # at least once a second: a model taken off its device meanwhile is admitted again
            await self._wait_ready(live, min(left, 1.0))
            self._refuse_held(m)
            if live.error and m.tier != Tier.GPU and live.error_code == P.WORKER_DIED and not died:
                died, taken = live.error, live.failures
                why = f"died during the load, loading again: {died}"
                self._publish("lost", m.name, why, m.device, self.clock())
            elif live.error and m.tier != Tier.GPU and live.failures != taken:
                raise WorkerUnavailable(f"model {m.name!r} could not be loaded: {live.error}")
            if not live.ready.is_set() or live.loads_pending or m.tier != Tier.GPU:
                self._if_stopping(m)  # (not admitted, nor loaded, again at a stop)
            if m.tier != Tier.GPU:  # evicted again while waiting (rare): admit once more
                if not live.loads_pending:  # (a failed load set `ready` only to wake its waiters)
                    live.ready.clear()
                await self._room_turn(m, m.rank if rank is None else rank, arrival, deadline, again=True)

    async def _until_started(self, m: Any, deadline: float) -> None:
        """A request that came while the service starts (its gRPC server takes calls before the start
        has read the store and adopted what the device hosts hold) waits for the start's end, within
        its deadline: observed meanwhile, its arrival was lost when the restored statistics replaced
        the books' (and the start's reads, on threads, let it in between them)."""
        await self._until_set(self._started, max(0.0, deadline - self.clock()))
        self._if_stopping(m, "it had not started")
        if not self.started:
            raise DeadlineExceeded(f"model {m.name!r}: the service was still starting at the deadline")

    def _if_stopping(self, m: Any, what: str = "its load did not finish in time") -> None:
        """WorkerUnavailable when the service is stopping (`abandon_waits`), saying `what` `m` waited
        for: the load (or room) it waits for is abandoned (its device host may still finish a load)."""
        if self._stopping.is_set():
            raise WorkerUnavailable(
                f"model {m.name!r}: the service is stopping and {what}; retry when it is back"
            )

    async def _wait_ready(self, live: _Live, timeout: float) -> None:
        """Wait until `live.ready` is set, the service stops (`abandon_waits`), or `timeout` passes."""
        await self._until_set(live.ready, timeout)

    async def _until_set(self, event: asyncio.Event, timeout: float) -> None:
        """Wait until `event` is set, the service stops (`abandon_waits`), or `timeout` passes."""
        if self._stopping.is_set():
            return
        waits = (asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stopping.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        cls: str | None = None,
        timeout_s: float = 30.0,
        keep_alive: float | None = None,
    ) -> Served:
        """Serve one request. If the device host lost the model under it (the host died or restarted),
        the model is taken off the books and the request is retried once, within its deadline.
        `keep_alive`: the request's own (seconds, inf: forever), as Ollama's; once it is admitted, it
        holds for the idle time after it, until the next admitted request says otherwise (None: the
        config's). A request refused before it is admitted leaves the model's keep-alive as it was."""
        m = self._model(model)
        rank = self.rank_of(m, cls)
        deadline = self.clock() + timeout_s
        live = self.live[model]
        cls_name = self.config.classes[rank].name
        seen: list[float] = []  # when the engine observed it (its demand), if it did
        try:
            arrival, cold = await self._queue_for(m, rank, cls_name, deadline, seen=seen)
        except BaseException as e:  # never ran: its demand goes to the request log all the same
            if seen:  # (as the statistics took it: one refused while the service started, never)
                self._log_unserved(seen[0], model, cls, e, keep_alive)
            raise
        self.keep_alive_said.add(model)  # (admitted: its word on the keep-alive is this run's)
        if keep_alive is not None or m.keep_alive_req is not None:
            self.engine.request_keep_alive(m, keep_alive)
        ran = functools.partial(self._ran_for_nobody, model, cls, arrival, keep_alive)
        try:
            result, start, end, cold, unavailable = await self._attempts(
                m, rank, cls_name, inputs, deadline, cold, ran
            )
        except asyncio.CancelledError:  # the client hung up after admission (counted once: its
            self._count_cancelled(m, cls_name)  # retry's wait for a reload counts nothing itself)
            raise
        finally:
            self._deferred_evict(m)  # an admin's evict waits for the request's end, its retry included
        wait = self._count_wait(cls_name, arrival, start)
        self.metrics.child("requests", model, cls_name, "ok" if result.ok else "error").inc()
        live.requests += 1
        live.last_used = end
        self.served += 1
        self.failed_runs += not result.ok
        self.cold_starts += cold
        outcome = "ok" if result.ok else "error"
        self._log_request(arrival, model, _busy(result, end - start), cls, wait, outcome, keep_alive)
        if unavailable:
            raise WorkerUnavailable(unavailable)
        if not result.ok:
            self._raise_infer_error(result)
        return Served(result, wait, cold)

    async def _attempts(
        self,
        m: Any,
        rank: int,
        cls_name: str,
        inputs: dict[str, np.ndarray],
        deadline: float,
        cold: bool,
        ran: Callable[[float, float], None] | None = None,
    ) -> tuple[P.InferResult, float, float, bool, str]:
        """Run an admitted request on its device host, once more if the host lost the model under it
        (result, start and end of the last attempt, cold, and where the retry could not be sent, the
        request's UNAVAILABLE message). `ran(start, end)`: told when an attempt whose caller gave up
        while it ran really ends on its device host."""
        live = self.live[m.name]
        unavailable = first_error = ""
        for attempt in range(2):
            start = self.clock()
            seen = self._results.get(m.name, 0)
            m.busy_until = math.inf  # busy while it runs: never evicted under a request
            live.inflight += 1
            if attempt == 0:
                # what the policy expects right after it (a voice chain's next model), as it starts,
                # busy (the replay has it there, its run booked first; a session at its open), so
                # the weekly tuning replays the prewarms this service makes. At its end, a prewarm
                # came a request's run later than the replay's; before it was busy, a review could
                # take its own room for a model it valued more, just before its forward
                self.engine.after_request(m, start)
                self._flush()
            late: list[asyncio.Future[Any]] = []  # its forward, when it outlives the request
            call = asyncio.ensure_future(
                self._run_infer(m.device, m.name, inputs, max(deadline - start, 0.1), late)
            )
            try:
                result = await asyncio.shield(call)
            except asyncio.CancelledError:
                # the caller gave up (a client that hung up) but the device host still runs it: the
                # model stays busy, never evicted under it, until the call really ends
                self._ended_when_done(m, start, call, late, ran)
                raise
            except BaseException:
                self._call_ended(m, start)
                raise
            if late:  # answered at its deadline, its forward still running on its thread: the model
                # stays busy (an evict waits for it, as for a request in flight) until it ends
                self._ended_when_done(m, start, call, late)
                end = self.clock()
            else:
                end = self._call_ended(m, start)
            lost = not result.ok and result.error_code in (P.WORKER_DIED, P.BAD_TRANSITION)
            if lost or result.error_code == P.DEADLINE:  # the host died or restarted (its other models
                # too: their requests in flight: no), or was silent (hung, or a slow model): looked at
                self._resync_soon(
                    m.device, f"{result.error_code} under a request of {m.name}: {result.error}"
                )
            if attempt == 1 and not result.ok:  # the retry failed too: its error (its status: a
                # retry that was sent and got no answer in time may still run, so DEADLINE_EXCEEDED,
                # never UNAVAILABLE, which clients retry), saying what the first attempt met
                said = f"{first_error}; retried once: {result.error or result.error_code}"
                result = replace(result, error=said)
                break
            if not lost or attempt == 1 or self.clock() > deadline - 0.1:
                break
            first_error = result.error or str(result.error_code)
            if self._results.get(m.name, 0) == seen and not live.loads_pending:
                self._lost(m, result.error or "the device host lost the model")
            # else the books moved meanwhile (another request that lost it loads it again, or has
            # loaded it on the new host already): that load is waited for, not thrown away
            try:
                _, again = await self._queue_for(m, rank, cls_name, deadline, retry=True)
            except (DeadlineExceeded, InsufficientCapacity, WorkerUnavailable) as e:
                # the request ends with its first attempt's error, logged
                unavailable = f"{first_error}; retried once: {e}"
                break
            cold = cold or again
            if self.clock() > deadline - 0.1:  # reloaded, with no time left to run it: not sent
                unavailable = (
                    f"{first_error}; retried once: model {m.name!r} was loaded again on "
                    f"{m.device!r} too late to run before the deadline"
                )
                break
        return result, start, end, cold, unavailable

    def _ended_when_done(
        self,
        m: Any,
        start: float,
        call: asyncio.Future[Any],
        late: list[asyncio.Future[Any]],
        then: Callable[[float, float], None] | None = None,
    ) -> None:
        """`_call_ended` for a request nobody waits for any more (`call`, its `_run_infer`, done or
        not), once its forward really ends: `late`'s thread when it outlived its deadline. `then(start,
        end)` after it."""
        if not call.done():
            call.add_done_callback(lambda c: self._ended_when_done(m, start, c, late, then))
        elif late:  # (its DEADLINE answer was given; an admin's evict deferred behind it goes then)
            late[0].add_done_callback(lambda _: self._then(then, start, self._call_ended(m, start, call)))
        else:
            self._then(then, start, self._call_ended(m, start, call))

    @staticmethod
    def _then(then: Callable[[float, float], None] | None, start: float, end: float) -> None:
        if then is not None:
            then(start, end)

    def _ran_for_nobody(
        self, model: str, cls: str | None, arrival: float, keep_alive: float | None, start: float, end: float
    ) -> None:
        """A request whose client hung up while it ran, now ended on its device host: it goes to the
        request log (it ran: its demand and its busy time are the replay's, whoever read the answer),
        `outcome` `cancelled`. Stats' waits and cold starts stay those of the requests it served (it
        is counted `cancelled` there)."""
        wait = max(0.0, start - arrival)  # (the wall clock may step back between the two)
        self._log_request(arrival, model, end - start, cls, wait, "cancelled", keep_alive)

    def _call_ended(self, m: Any, start: float, abandoned: asyncio.Future[Any] | None = None) -> float:
        """A request's call on its device host ended (started at `start`): the model is idle again when
        no other is in flight. `abandoned`: the call of a request whose caller gave up meanwhile (its
        admin evict, deferred, goes now). Returns the end time."""
        if abandoned is not None and not abandoned.cancelled():
            abandoned.exception()  # retrieved: nobody waits for it
        live = self.live[m.name]
        live.inflight -= 1
        end = self.clock()
        m.busy_until = end if live.inflight == 0 else m.busy_until
        self.engine.finish(m, start, end - start)
        self._flush()
        if abandoned is not None:
            self._deferred_evict(m)
        self._room_freed()  # (idle now: evictable, within the rules)
        return end

    async def _queue_for(
        self,
        m: Any,
        rank: int,
        cls_name: str,
        deadline: float,
        *,
        retry: bool = False,
        seen: list[float] | None = None,
    ) -> tuple[float, bool]:
        """Admission and the wait for the model's confirmed load, under the class's queue limit: at
        most `max_queue` requests of the class wait for their model's load (or for room) at once; one
        more that would wait is refused, one whose model is loaded and ready is not (a `retry` of an
        accepted request skips the limit, is not observed again nor counted rejected). `seen` gets the
        time the engine observed the request (its demand), if it did: what its record in the request
        log says, should it never run."""
        if not self.started:
            try:
                await self._until_started(m, deadline)
            except Exception as e:  # still starting at its deadline, or stopped: never admitted
                setattr(e, REFUSED, True)
                if not retry:  # (not observed, nor logged: the statistics are not restored yet)
                    self._count_unserved(m, cls_name, "rejected")
                raise
            except asyncio.CancelledError:  # its client hung up while the service started
                if not retry:
                    self._count_cancelled(m, cls_name)
                raise
        limit = None if retry else self.config.classes[rank].max_queue
        # A request for a model loaded and ready waits for no load and no room: never "queue full".
        # (`ready` alone is not enough: a failed load sets it to wake its waiters, the model on disk.)
        live = self.live[m.name]
        waits = not (live.ready.is_set() and m.tier == Tier.GPU and live.loads_pending == 0)
        if limit is not None and waits and self.queued.get(cls_name, 0) >= limit:
            # still asked for: the statistics learn the demand (as the replay's do), none is served
            now = self.clock()
            self.engine.observe(m, now)
            if seen is not None:
                seen.append(now)
            self._count_unserved(m, cls_name, "rejected")
            raise InsufficientCapacity(
                f"class {cls_name!r}: queue full ({limit} requests waiting); retry later"
            )
        self.queued[cls_name] = self.queued.get(cls_name, 0) + 1
        queue = self.metrics.child("queue", m.name)
        queue.inc()
        m.waiting += 1  # the engine neither expires nor evicts a model that requests wait for
        served = False
        try:
            arrival = await self._admit(m, rank, deadline, observe=not retry, seen=seen)
            cold = not self.live[m.name].ready.is_set()
            await self._ready(m, deadline, rank, arrival=arrival)
            served = True
            return arrival, cold
        except Exception as e:  # never served (Stats' counts are the metric's: a retry is counted served)
            if not retry:
                self._count_unserved(m, cls_name, _outcome_of(e))
            raise
        except asyncio.CancelledError:  # its client hung up while it waited (a retry's: in `infer`)
            if not retry:
                self._count_cancelled(m, cls_name)
            raise
        finally:
            m.waiting -= 1
            queue.dec()
            self.queued[cls_name] -= 1
            if not served:  # an admin's evict that waited for this request goes now if it was the last
                self._deferred_evict(m)
            self._room_freed()  # (no request waits for it now: evictable, within the rules)

    def _count_wait(self, cls_name: str, arrival: float, start: float) -> float:
        """A served request's wait (a world session's, at its open), from `arrival` to `start`, counted
        in Stats (its class's recent waits, the total) and the wait metric; the wait."""
        wait = max(0.0, start - arrival)  # the wall clock may step back (NTP) between the two
        self.waits[cls_name].append(wait)
        self.wait_total_s += wait
        self.metrics.child("wait", cls_name).observe(wait)
        return wait

    def _count_unserved(self, m: Any, cls_name: str, outcome: str) -> None:
        """A request that never ran, in Stats and the requests metric: `rejected` (admission refused
        it: no room, a full queue) or `error` (it failed after admission: its model's load failed or
        did not finish before its deadline; a world session's open failed on its host). Its caller
        puts it in the request log (`_log_unserved`: demand that never ran)."""
        if outcome == "rejected":
            self.rejected += 1
        else:
            self.failed += 1
        self.metrics.child("requests", m.name, cls_name, outcome).inc()

    def _count_cancelled(self, m: Any, cls_name: str) -> None:
        """A request whose client went away (hung up, or its RPC was cancelled) before it was answered,
        waiting or running, in Stats (`cancelled`) and the requests metric (outcome `cancelled`)."""
        self.cancelled += 1
        self.metrics.child("requests", m.name, cls_name, "cancelled").inc()

    def _lost(self, m: Any, why: str) -> None:
        """The device host no longer holds `m` (it died, or restarted empty): off the books, so the
        next admission loads it again; as a resync takes it off (no eviction, no demote of what is not
        there, and its reload is no thrash)."""
        self._off_books(m, f"lost by its device host: {why}")

    def _off_books(self, m: Any, why: str) -> None:
        """A resync found that `m`'s device host does not hold it (in the books' tier): off the books,
        its bytes free, to disk (nothing to demote; a Drop makes sure of it), so the next admission
        loads it again. Not an eviction (nothing was decided), and its reload is no thrash."""
        now = self.clock()
        self._publish("lost", m.name, why, m.device, now)
        self.metrics.lost.labels(m.name).inc()
        live = self.live[m.name]
        live.ready.clear()
        live.tier = "disk"
        if m.tier == Tier.GPU:
            self.engine.evict(m, now, f"{NOT_HELD}: {why}", failed=True)
        elif m.tier == Tier.HOST:
            self.engine.drop_host(m, now, f"{NOT_HELD}: {why}")
        self._flush()

    async def _run_infer(
        self,
        device: str,
        model: str,
        inputs: dict[str, np.ndarray],
        timeout_s: float,
        late: list[asyncio.Future[Any]] | None = None,
    ) -> P.InferResult:
        """The data path: awaited directly on Ray (no thread per request); in process, inline for
        models that take microseconds (until one call of theirs does not: `_slow_inline`), else on a
        thread. A thread's forward that outlives `timeout_s` is answered DEADLINE then, and its future
        put in `late` (it runs on: a thread cannot be stopped)."""
        infer_async = getattr(self.pool, "infer_async", None)
        batcher = None if infer_async is not None else self._batcher(device, model)
        if infer_async is not None and self._stopping.is_set():
            result: P.InferResult = await infer_async(device, model, inputs, timeout_s)
        elif infer_async is not None:
            result = await self._infer_on_host(infer_async, device, model, inputs, timeout_s, late)
        elif batcher is not None:
            result = await _within(batcher.submit(inputs, late), timeout_s, device, model)
        elif self._infer_s.get(model, 1.0) < INLINE_INFER_S and model not in self._slow_inline:
            # a turn of the loop first: a request served from memory awaits nothing that suspends,
            # so a caller serving in a loop would hold the loop (and threads' results) to itself
            await asyncio.sleep(0)
            began = time.perf_counter()
            result = self.pool.infer(device, model, inputs, timeout_s)
            self._inline_took(model, time.perf_counter() - began)
        else:  # (the in-process host takes no deadline: the request is answered at its own)
            # (as asyncio.to_thread hands it over: the stop knows a model's call by that form)
            call = functools.partial(
                contextvars.copy_context().run, self.pool.infer, device, model, inputs, timeout_s
            )
            forward = asyncio.get_running_loop().run_in_executor(None, call)
            try:
                done, _ = await asyncio.wait({forward}, timeout=timeout_s)
            except asyncio.CancelledError:
                forward.add_done_callback(read_outcome)  # (it runs on; nobody reads it now)
                raise
            if done:
                result = forward.result()
            else:
                if late is not None:
                    late.append(forward)
                else:
                    forward.add_done_callback(read_outcome)
                result = _no_answer(device, model, timeout_s)
        if result.ok:  # by the time the call holds a thread (the wall time on a busy thread pool
            # grows with GIL contention, which would keep a microsecond model off the loop for good)
            prev, took = self._infer_s.get(model), result.hold_seconds
            self._infer_s[model] = took if prev is None else 0.8 * prev + 0.2 * took
        return result

    async def _infer_on_host(
        self,
        infer_async: Callable[..., Awaitable[P.InferResult]],
        device: str,
        model: str,
        inputs: dict[str, np.ndarray],
        timeout_s: float,
        late: list[asyncio.Future[Any]] | None,
    ) -> P.InferResult:
        """A forward on a device host of its own (Ray), answered at the stop's grace if it has not
        ended (`abandon_waits`) as an in-process one is: INTERNAL, it may still run to its end (the
        stop cancelled the call before: gRPC's UNAVAILABLE "Cancelling all calls", which clients
        retry, and no record in the request log). The call itself goes on, in `late`."""
        if self._stop_answer is None or self._stop_answer.get_loop() is not asyncio.get_running_loop():
            self._stop_answer = asyncio.get_running_loop().create_future()
        work: asyncio.Future[Any] = asyncio.ensure_future(
            infer_async(device, model, inputs, timeout_s, late=late)
        )
        try:
            await asyncio.wait({work, self._stop_answer}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # (as when the call was awaited directly: it is cancelled too)
            work.cancel()
            work.add_done_callback(read_outcome)
            raise
        if work.done():
            result: P.InferResult = work.result()
            return result
        if late is not None:
            late.append(work)
        else:
            work.add_done_callback(read_outcome)
        return P.InferResult(
            model, False, error_code=P.INTERNAL,
            error=f"model {model!r}: the server is stopping, and its inference on {device} had not ended "
            "by the stop's grace; it was abandoned, its device host left to run it, so it may still have "
            "run to its end",
        )  # fmt: skip

    def _inline_took(self, model: str, wall_s: float) -> None:
        """An inline call of `model` held the event loop `wall_s`: past INLINE_SLOW_S (a forward
        that slept, waited on I/O or a lock, or took long on this input) the model's calls run on a
        thread from now on, whatever its average says: the loop serves every other request, the
        admin API and world sessions, and an inline call cannot be cut at its deadline."""
        if wall_s > INLINE_SLOW_S and model not in self._slow_inline:
            self._slow_inline.add(model)
            logger.warning(
                "model %r: a call run on the event loop took %s (its calls so far took microseconds): "
                "its calls run on a thread from now on", model, f"{wall_s * 1000:.1f} ms",
            )  # fmt: skip

    def _batcher(self, device: str, model: str) -> LocalBatcher | None:
        """In process, the dynamic batcher of a model with `max_batch` > 1 (None for the others);
        decided once per model (max_batch changes need a restart), not on every request."""
        if model in self._batchers:
            return self._batchers[model]
        cfg = self.config.model(model)
        b = None
        if cfg.max_batch > 1 and hasattr(self.pool, "infer_many"):

            def quick(n: int, model: str = model) -> bool:
                return self._infer_s.get(model, 1.0) * n < INLINE_INFER_S

            b = LocalBatcher(self.pool, device, model, cfg.max_batch, quick)
        self._batchers[model] = b
        return b

    def _raise_infer_error(self, r: P.InferResult) -> None:
        # INTERNAL: it ran and failed, or may have run: ModelFailed, not UNAVAILABLE (retried)
        raise worker_error(r.error_code, r.error or "inference failed")

    def _log_unserved(
        self,
        t: float,
        model: str,
        cls: str | None,
        e: BaseException | str,
        keep_alive: float | None = None,
        kind: str | None = None,
    ) -> None:
        """A request asked for at `t` that never ran (`e` ended it first, or its outcome) in the
        request log, `busy_s` 0 and `wait_s` until now: its demand is the statistics' catch-up's (the
        engine observed it at `t`: a kill must not lose it); `trace export`, and so the replay and
        the weekly tuning, leave it out. `outcome` `rejected` when admission refused it, else `unserved`
        (`manager.store.base.NEVER_RAN`). Nothing for an error that is no request's (a bug)."""
        if not isinstance(e, str | Exception | asyncio.CancelledError):
            return
        outcome = e if isinstance(e, str) else "rejected" if _outcome_of(e) == "rejected" else "unserved"
        self._log_request(t, model, 0.0, cls, max(0.0, self.clock() - t), outcome, keep_alive, kind)

    def _log_request(
        self,
        t: float,
        model: str,
        busy: float,
        cls: str | None,
        wait: float,
        outcome: str,
        keep_alive: float | None = None,
        kind: str | None = None,
    ) -> None:
        """A request's record in the request log (`outcome`: `manager.store.base.OUTCOMES`; `kind`:
        None for an inference, `session` for a world session): every record is made here."""
        if self.store is None:
            return
        rec: dict[str, Any] = {"t": t, "model": model, "busy_s": round(busy, 6), "wait_s": round(wait, 6)}
        rec["outcome"] = outcome
        if cls is not None:
            rec["class"] = cls
        if kind is not None:
            rec["kind"] = kind
        if keep_alive is not None:  # (a trace line's form: JSON has no infinity)
            rec["keep_alive"] = keep_alive_json(keep_alive)
        self._log(rec)

    # ---- admin --------------------------------------------------------------------------------
    async def preload(self, model: str, tier: str = "gpu", timeout_s: float = 120.0) -> None:
        m = self._model(model)
        self._refuse_held(m)
        now = self.clock()
        if tier == "host":
            if m.tier == Tier.DISK:
                self._if_stopping(m, NO_LOAD_AT_STOP)
            if m.tier == Tier.DISK and not self.engine.load_host(m, now, "preload"):
                host = self.engine.host
                raise InsufficientCapacity(
                    f"model {model!r}: no room in host RAM ({max(host.usable - host.used, 0)} bytes free, "
                    f"it needs {m.weights}); nothing is evicted for a preload to host RAM"
                )
            self._flush()
            return
        if tier != "gpu":
            raise InvalidRequest(f"preload tier must be gpu or host, not {tier!r}")
        self.live[model].evict_to = None  # the admin wants it on the GPU after all
        if m.tier != Tier.GPU:
            self._if_stopping(m, NO_LOAD_AT_STOP)
            if not self.engine.make_room(m, m.rank, now, may_evict=True):
                raise InsufficientCapacity(self._no_room(m, now))
            self.engine.load(m, now, prewarm=False, reason="preload")
            self._flush()
        m.waiting += 1  # as a request's wait: not expired (nor evicted) before its load is confirmed
        try:
            await self._ready(m, now + timeout_s)
        finally:
            m.waiting -= 1
            self._deferred_evict(m)  # an admin's evict made during the preload's wait
            self._room_freed()

    def _no_room(self, m: Any, now: float) -> str:
        """Why a preload of `m` to its GPU found no room: it can never fit there, or what holds the
        room now (said as "no room without breaking the rules", an admin could not tell what to do)."""
        if self.engine.never_fits[m.name]:
            return self.engine.never_fits[m.name]
        dev = self.engine.state.devices[m.device]
        names = self.engine.state.class_names
        held = []
        for c in dev.models:
            if c is m or c.tier != Tier.GPU or self.engine._eligible(c, m, m.rank, now, True, False):
                continue
            why = (
                "pinned" if c.pinned
                else "its abandoned load still runs on its device host" if c.name in self._held_loads
                else "loading" if c.ready_at > now
                else "in use" if not c.idle(now)
                else f"class {names[c.rank]}, above {names[m.rank]}" if c.rank < m.rank
                else "loaded for a request it has not served yet"
            )  # fmt: skip
            held.append(f"{c.name} {fmt_bytes(c.gpu_bytes)} ({why})")
        return (
            f"model {m.name!r}: no room on {m.device} for its {fmt_bytes(m.weights + m.lease_min)}: "
            f"{fmt_bytes(max(dev.room(m.rank), 0))} free to class {names[m.rank]}, and what holds the rest "
            f"may not be evicted for it now: {', '.join(held) or 'reserved for higher classes'}"
        )

    def evict(self, model: str, to: str = "disk") -> None:
        """An admin's evict to host RAM or disk. A model serving requests (or a world session), or
        loading for requests that wait for it, goes when the last of them ends, as Triton's unload
        and Ollama's stop do: taken off under a request, the request would fail or load it again. One
        whose load (or promote) is still on its way goes once its device host answers for it
        (`_on_result`): until then that load fills its room on the device (up to the host's load
        timeout), so the books keep it booked, and no other model is loaded into it. Either way the
        call answers at once; the `evict_deferred` event (and the log) says what it waits for."""
        m = self._model(model)
        if to not in ("disk", "host"):  # (first: unpinning would not make it right)
            raise InvalidRequest(f"evict to must be disk or host, not {to!r}")
        if m.pinned:
            raise FailedPrecondition(f"model {model!r} is pinned; unpin it first")
        live = self.live[model]
        waiting = m.waiting if m.tier == Tier.GPU else 0  # on the GPU (loading) for waiting requests
        loading = self._loading(m)
        if live.inflight > 0 or waiting > 0 or loading:
            live.evict_to = to
            if live.inflight > 0 or waiting > 0:
                detail = f"to {to} when its {live.inflight + waiting} request(s) in flight or waiting end"
                detail += " and its load on its device host ends" if loading else ""
            else:
                detail = (
                    f"to {to} when its load on {m.device} ends (its device host still runs it: its "
                    f"{fmt_bytes(m.gpu_bytes)} stay booked until then)"
                )
            logger.info("admin evict of %s deferred: %s", model, detail)
            self._publish("evict_deferred", model, detail, m.device, self.clock())
            return
        self._evict_now(m, to)

    def _loading(self, m: Any) -> bool:
        """Whether `m`'s load or promote to its GPU is on its way: the books have it there, its
        device host has not answered for it yet."""
        return bool(m.tier == Tier.GPU and self.live[m.name].loads_pending > 0)

    def _deferred_evict(self, m: Any) -> None:
        """Carry out an admin's evict that waited for `m`'s requests in flight (or waiting for its
        load), and for its load's result, once none is left (unless the model was pinned or
        preloaded since: then it stays)."""
        live = self.live[m.name]
        if live.evict_to is None or live.inflight > 0 or m.waiting > 0 or self._loading(m):
            return
        to, live.evict_to = live.evict_to, None
        if not m.pinned:
            self._evict_now(m, to)

    def _evict_now(self, m: Any, to: str) -> None:
        """To disk: dropped at once (demoted on the way, it could push other models out of host RAM
        for a copy dropped next). To host: demoted when host RAM has room (or the policy makes it
        some), whatever the policy's own use of the host tier; else dropped. Not a model whose
        abandoned load still runs (`_hold_abandoned`): it is not resident, and the room held for that
        load is not the books' to free."""
        if m.name in self._held_loads:
            return
        if m.tier == Tier.GPU:
            self.engine.evict(m, self.clock(), "admin evict", to_host=to == "host")
        elif m.tier == Tier.HOST and to == "disk":
            self.engine.drop_host(m, self.clock(), "admin evict")
        self._flush()

    def live_sizes(self) -> dict[str, tuple[int, bool]]:
        """Each model's weights as measured (the config's estimate until a load measured them) and
        whether it is pinned, admin pins included: what the tuning checks its candidates' fit with."""
        return {n: (m.weights, m.pinned) for n, m in self.engine.models.items()}

    def measured(self) -> dict[str, tuple[int, dict[str, float]]]:
        """Each model's weights and load seconds by source as the engine decides by them (measured,
        or the config's estimates until a load measured them): what the tuning's replays take."""
        return {n: (m.weights, m.cost.as_dict()) for n, m in self.engine.models.items()}

    def check_reload(self, new: Config) -> list[str]:
        """What `reload(new)` would apply (its list of changes), or the error it would raise
        (RestartNeeded, PinsDoNotFit), changing nothing: every check the reload makes, the pinned
        models at the footprints their device hosts measured included, and none of its effects (the
        engine, the device hosts, the events and the metrics are as they were). On the event loop's
        thread, as `reload`: what it reads is the loop's to change."""
        return self._checked(new)[1]

    def _checked(self, new: Config, hold: TunedHold | None = None) -> tuple[Config, list[str], TunedHold]:
        """The checks of a reload to `new` (`check_reload` and `reload` both make them, so they cannot
        say different things): `new` as the reload takes it (the command line's `server` fields over
        the file's, the tuned settings the file could not take over its unchanged fields) and its
        changes and the tuned settings it keeps, or what refuses it."""
        from manager.reload import check_measured_fit, over_file, plan_reload

        new, kept = over_file(new, self.tuning_overrides if hold is None else hold)
        if self.server_overrides:
            new = new.model_copy(update={"server": new.server.model_copy(update=self.server_overrides)})
        changes = plan_reload(self.config, new, self.started_config)
        for name, pinned in self.pin_overrides.items():  # an admin's pin or unpin holds over the
            if f"models.{name}.pin" in changes:  # file's `pin` (`_apply_pins`): said, not applied
                i = changes.index(f"models.{name}.pin")
                changes[i] += f" (an admin's {'pin' if pinned else 'unpin'} holds)"
        pins = {m.name: self.pin_overrides.get(m.name, m.pin) for m in new.models}  # an admin's hold
        check_measured_fit(self.engine, new, pins, self._measured)
        return new, changes, kept

    def reload(self, new: Config, hold: TunedHold | None = None) -> list[str]:
        """Take a changed config, dropping nothing in flight (RestartNeeded: structural changes;
        PinsDoNotFit: its pinned models do not fit a device together at their measured footprints;
        both found by `check_reload`'s checks before anything changes). The command line's `server`
        fields (`server_overrides`) hold over the file's, as at start, and so do the tuned settings
        the file could not take (`tuning_overrides`) over the fields the file holds as it did.
        `hold`: the scheduled tuning's reload to settings its file could not take (all of them, in
        place of `tuning_overrides`)."""
        from manager.reload import apply_reload

        new, changes, kept = self._checked(new, hold)
        kept = kept if hold is None else hold  # (`new` holds the tuned values already, not the file's)
        servable = {n for n, why in self.engine.never_fits.items() if not why}
        reserves = {name: list(d.reserves) for name, d in self.engine.state.devices.items()}
        apply_reload(self.engine, new, self.clock())
        self.config = new
        gone = sorted(".".join(k) for k in self.tuning_overrides if k not in kept)
        if gone and hold is None:  # a person's edit of the field (or the tuning's own write) won
            logger.info(
                "tuned value(s) the config file could not take dropped: %s (the file sets the field now, "
                "or the value no longer fits the file's other settings)",
                ", ".join(gone),
            )
        if kept:
            logger.info(
                "tuned settings the config file could not take are kept: %s (a restart reverts them)",
                ", ".join(sorted(".".join(k) for k in kept)),
            )
        self.tuning_overrides = kept
        for name, live in self.live.items():  # a model that failed to load is still not prewarmed
            if live.load_error is not None:  # (until a load of it works), whatever the file says
                self.engine.models[name].prewarm_ok = False
        self._apply_pins()  # an admin's pin or unpin outlives a reload of the file
        if self.started:  # (while it starts, its own `load_pinned` follows adoption: a load sent now
            # would find the model adopted on its host, and adoption drop it there)
            # a reservation raised gets its room back from lower classes' idle models (their
            # requests could not take it back: a class that may not evict, a keep-alive that holds)
            self.engine.honour_reservations(self.clock(), reserves)
            self.engine.load_pinned(self.clock())  # a model pinned now is loaded into free room
            self._flush()
            self._room_freed()  # (reservations, sizes, keep-alives and pins may have changed)
        self._publish("config_reloaded", "", ", ".join(changes) or "no changes", "", self.clock())
        self.reload_warnings = [
            f"model {n!r} can never be served now: {self.engine.never_fits[n]}"
            for n in sorted(servable)
            if self.engine.never_fits.get(n)
        ]
        for warning in self.reload_warnings:  # (the file's pins or reservations took its room for good)
            logger.warning("config reload: %s", warning)
            self._publish("config_warning", warning.split("'")[1], warning, "", self.clock())
        return changes

    def host_read_pending(self, model: str) -> bool:
        """Is a copy of `model` into host RAM sent to its device host and not answered yet: a load into
        host RAM, or a demote (GPU -> host RAM: the books count it in host RAM at once, its copy
        there exists once the host's result says so)?"""
        copies = ((model, ActionKind.LOAD_HOST), (model, ActionKind.DEMOTE))
        return any(op in copies for op in self._ops.values())

    def set_pin(self, model: str, pinned: bool) -> None:
        """An admin's pin or unpin: it overrides the config's `pin` until the opposite call, across
        hot reloads and restarts (kept in the store's "pins" document). A pinned model is loaded as
        soon as there is free room for it (as the config's pins are at start) and never evicted.
        InvalidRequest: the pinned models would no longer fit their device together."""
        m = self._model(model)
        was = m.pinned
        m.pinned = pinned
        self.engine.recheck_fit()  # a pinned model's bytes are no one else's room, and vice versa
        if pinned and not was:
            crowded = [
                f"{o.name}: {self.engine.never_fits[o.name]}"
                for o in self.engine.models.values()
                if o.pinned and o.device == m.device and self.engine.never_fits[o.name]
            ]
            if crowded:
                m.pinned = was
                self.engine.recheck_fit()
                raise InvalidRequest(
                    f"cannot pin {model!r}: the pinned models would no longer fit {m.device!r} together "
                    f"({'; '.join(crowded)})"
                )
        if pinned and m.tier != Tier.GPU and self.started:  # (at start: once adoption is done)
            self.engine.load_pinned(self.clock())  # into free room (or room past its keep-alive)
            self._flush()
        if not pinned:
            self._room_freed()  # (unpinned: evictable, within the rules)
        if pinned == m.cfg.pin:
            self.pin_overrides.pop(model, None)
        else:
            self.pin_overrides[model] = pinned
        self._pins_set.add(model)
        self._save_pins(model)

    def _save_pins(self, model: str | None = None) -> None:
        """The admin pins as they are now -> the store's "pins" document, after `model`'s pin or unpin
        (None: the reconciler's retry after a failed write). The write is made on a thread, after the
        writes asked for before it (the last call's word is the one the store keeps): a store that
        hangs held the event loop, and every request, for its timeout. Pins saved before a start
        with the store down, still unread, are read first (on that thread too) and merged: the
        admin's pins set since the start win for their models, the saved ones hold for the others
        (writing without them would lose them). A write that fails, or that waits for a store still
        down, is logged; the pins hold meanwhile, and are written at the reconciler's next save once
        the store answers (`_pins_dirty`). Without a running event loop (a tool, a test), all on the
        caller's thread."""
        if self.store is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._pins_unread:
                self._restore_pins(late=True)
            if self._pins_unread:
                self._pins_still_unread(model)
                return
            self._pins_dirty = not self._write_pins(dict(self.pin_overrides), model)
            return
        # the document as it is now; unread saved pins: as it is once they are read and merged
        doc = None if self._pins_unread else dict(self.pin_overrides)
        prev = self._pins_write

        async def write() -> None:
            if prev is not None and not prev.done():
                await asyncio.wait({prev})  # (in order: an older document never lands after a newer)
            out = doc
            if out is None:
                if self._pins_unread:  # (an earlier write, or the reconciler, may have read them)
                    await self._restore_pins_off_loop()
                if self._pins_unread:
                    self._pins_still_unread(model)
                    return
                out = dict(self.pin_overrides)
            self._pins_dirty = not await asyncio.to_thread(self._write_pins, out, model)

        self._pins_write = self._in_background(write())

    def _pins_still_unread(self, model: str | None) -> None:
        """The pins saved in the store could not be read (it is down): none are written (that would
        lose them); they are, with the saved ones, once it answers (the reconciler's next save)."""
        self._pins_dirty = True
        if model is not None:
            logger.warning(
                "the store is down: the pin of %r is not saved across a restart yet (it holds now; "
                "saved once the store answers)",
                model,
            )

    def _write_pins(self, doc: dict[str, bool], model: str | None) -> bool:
        """`doc` -> the store's "pins" document; whether it was written (a failure is logged: at
        warning level for an admin's pin or unpin, `model`, at debug for a retry). Any thread."""
        try:
            self.store.put_doc("pins", doc)
        except Exception as e:
            why = str(e) or type(e).__name__
            if model is None:
                logger.debug("the store is still down: the admin pins are not saved yet (%s)", why)
            else:
                logger.warning(
                    "could not save the pin of %r in the store (%s): it holds now, but is not saved "
                    "across a restart until the store answers (tried again at the next save)",
                    model,
                    why,
                )
            return False
        if model is None:
            logger.info("admin pins saved in the store: %s", doc or "none")
        return True

    def _apply_pins(self) -> None:
        for name, pinned in self.pin_overrides.items():
            self.engine.models[name].pinned = pinned
        self.engine.recheck_fit()

    def _restore_pins(self, *, late: bool = False) -> None:
        """The admin pins saved in the store, over the config's. `late`: the store was down at start
        and answers now; a pin an admin set since the start holds over the saved one."""
        if self.store is None:
            return
        self._take_pins(self._read_pins(), late=late)

    async def _restore_pins_at_start(self) -> None:
        """`_restore_pins()` as the start makes it: the store's read on a thread."""
        if self.store is None:
            return
        if self._down_at_start is not None:  # not asked: said as a store that does not answer is
            self._pins_why = self._down_at_start
            self._take_pins(None, late=False)
            return
        self._take_pins(await asyncio.to_thread(self._read_pins), late=False)

    async def _restore_pins_off_loop(self) -> None:
        """`_restore_pins(late=True)` as the reconciler and an admin's pin (`_save_pins`) make it: the
        store's call on a thread (a store that hangs held the event loop, and every request, for its
        timeout at each try)."""
        if self.store is None:
            return
        doc = await asyncio.to_thread(self._read_pins)
        if self._pins_unread:  # (an admin's pin may have read them meanwhile)
            self._take_pins(doc, late=True)

    def _read_pins(self) -> dict[str, Any] | None:
        """The "pins" document ({} when none, or unreadable); None when the store is down. Any thread."""
        try:
            return self.store.get_doc("pins") or {}
        except CorruptDocument as e:  # it answers, but cannot read it: replaced at the next pin
            logger.error("the admin pins saved in the store are unreadable (%s); the config's pins hold", e)
            return {}
        except Exception as e:
            self._pins_why = str(e) or type(e).__name__  # (said by `_take_pins`)
            return None

    def _take_pins(self, doc: dict[str, Any] | None, *, late: bool) -> None:
        """The pins `_read_pins` read (None: the store is down, said once) over the config's."""
        if doc is None:
            if not self._pins_unread:
                logger.warning(
                    "could not read the admin pins from the store (%s); the config's pins hold until "
                    "it answers",
                    self._pins_why,
                )
            self._pins_unread = True
            return
        self._pins_unread = False
        for name, pinned in doc.items():
            if name not in self.engine.models or not isinstance(pinned, bool):
                logger.info("admin pin of %s ignored: the model is not configured", name)
                continue
            if name in self._pins_set:
                continue
            if pinned != self.engine.models[name].cfg.pin:
                self.pin_overrides[name] = pinned
        self._apply_pins()
        if late:
            logger.info("admin pins read from the store: %s", dict(self.pin_overrides) or "none")
            self.engine.load_pinned(self.clock())
            self._flush()
        elif self.pin_overrides:  # (the restart's log says what it took back)
            logger.info("admin pins restored from the store: %s", dict(self.pin_overrides))

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self) -> EventQueue:
        q = EventQueue(EVENTS_QUEUE)
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers = [s for s in self._subscribers if s is not q]

    def _publish(self, kind: str, model: str, detail: str, device: str, t: float, **extra: Any) -> None:
        ev = {"t": t, "kind": kind, "model": model, "detail": detail, "device": device, **extra}
        for q in self._subscribers:
            if q.qsize() + (2 if q.dropped else 1) > q.maxsize:  # a watcher reading too slowly
                q.dropped += 1
                continue
            gap = q.gap_note(t)  # where the gap is, once there is room: it is said, not silent
            if gap is not None:
                q.put_nowait(gap)
            q.put_nowait(ev)
