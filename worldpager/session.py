"""Session: runs `TinyCausalWan` blocks one by one with tiered retrieval memory (see `Session`).

* `Session` -- generates block by block through the `TransferHandler`, offloads each block's final KV
  and measures the **stall** (the wait for the step's retrieval buffer) in ``prefetch`` or
  ``on_demand`` mode (`Mode`). `Session.resume` reopens a saved session and continues it.
* `SESSION_PRESETS` -- the stand-in's sizes for `worldpager session` (``tiny``: segments big enough
  that a 64 MiB host tier holds 18 of them, so revisits read back from NVMe; ``micro``: the unit tests'
  `TINY`, 36 KiB segments).
* `StepRecord` -- what one step did (numbers only); `CorruptSlot` -- a log slot found corrupt when a
  session was reopened; `stall_stats` -- median / p99 / max of a series of seconds (all three defined
  in `worldpager.session_records`, with the session's bounded event log).

Memory and RSS measurement: see `worldpager.memory` (`RssMeter`, `RSS_SLACK`). Save / resume
(``session.json``, ``window.bin``, `read_saved_state`, `CorruptSlot`): see `worldpager.session_store`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from worldpager import session_store as store
from worldpager.layout import SegmentLayout
from worldpager.memory import RSS_SLACK, RssMeter, malloc_trim
from worldpager.model import TINY, TinyCausalWan, TinyConfig
from worldpager.page_types import Corrupt, Read
from worldpager.pages import PageManager
from worldpager.retrieval import (
    FovOverlapRule,
    Pose,
    RetrievalRule,
    SegmentInfo,
    check_pose,
    outside_window,
    predict_pose,
)
from worldpager.segment_log import INDEX_NAME, LOG_NAME, META_NAME, DiskFullError, LogInUse, is_disk_full
from worldpager.session_records import (
    CorruptSlot,
    EventLog,
    MissingSegment,
    SessionEvent,
    StepRecord,
    stall_stats,
)
from worldpager.session_store import SESSION_FILE, WINDOW_FILE, WindowLostError, read_saved_state
from worldpager.trajectory import block_inputs
from worldpager.transfer import Throttle, TransferHandler, sleep_until

__all__ = [
    "MODES",
    "RSS_SLACK",
    "SESSION_FILE",
    "SESSION_PRESETS",
    "WINDOW_FILE",
    "CorruptSlot",
    "MissingSegment",
    "Mode",
    "Session",
    "SessionEvent",
    "StepRecord",
    "WindowLostError",
    "read_saved_state",
    "stall_stats",
]

logger = logging.getLogger(__name__)

Mode = Literal["prefetch", "on_demand"]
MODES: tuple[Mode, ...] = ("prefetch", "on_demand")

SESSION_PRESETS: dict[str, TinyConfig] = {
    # TINY's structure, deeper and wider: 32 layers x 2 x 108 tokens x 256 dims in bf16 = 3.375 MiB per
    # segment, 18 per 64 MiB; about 0.3 s per block on 2 CPU cores. Tables stay 16 / 40 frames.
    "tiny": dataclasses.replace(
        TINY, layers=32, dim=256, heads=4, ffn_dim=256, latent_h=6, latent_w=6, action_layers=16
    ),
    "micro": TINY,  # the unit tests' stand-in: 36 KiB segments
}


# ---- session ------------------------------------------------------------------------------------------


class Session:
    """Runs `TinyCausalWan` blocks one by one with tiered retrieval memory.

    Step ``n`` (block frames ``[3n, 3n+3)``): ``on_demand`` prepares step n's retrieval buffer now
    (the paper's baseline); ``prefetch`` prepared it during step n-1. Then it waits for the buffer (the
    measured **stall**), prepares step n+1 (``prefetch``: its reads/uploads overlap this step's compute),
    runs `generate_block` with the memories (none when the buffer is empty), releases step n, encodes the
    block's final KV into one payload and registers it (host copy + write-behind to the log).

    Retrieval set of step m, the same in both modes: ``rule.select`` over stored segments that have left
    the rolling window at step m, queried with `predict_pose` of the poses before m, ``retrieval_k``
    segments (0 = retrieval off, the plain model). ``compute_s`` pads each step's compute to at least
    that many seconds (a calibrated compute time). ``keep_outputs`` keeps each block's prediction in
    ``outputs``. ``codec`` defaults to bf16 and ``seed`` to 0 (a resumed session: the saved ones).
    ``resume``: reopen the saved session in ``log_dir`` instead of creating one (see `Session.resume`);
    ``resume_at``: continue at that step at the latest (segments from it on in the log are ignored: the
    caller never received them, so they are generated again and their new copies supersede the old);
    one at or past the step the saved session stopped at continues there, as without it.
    Memory and RSS measurement: see `worldpager.memory`. Not thread-safe; one session per model.
    """

    def __init__(
        self,
        model: TinyCausalWan,
        *,
        codec: str | None = None,
        host_budget_bytes: int,
        gpu_slots: int = 2,
        log_dir: str | Path,
        rule: RetrievalRule | None = None,
        mode: Mode = "prefetch",
        throttle_bps: float | None = None,
        retrieval_k: int = 2,
        log_max_bytes: int | None = None,
        compute_s: float | None = None,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        keep_outputs: bool = False,
        warmup_segments: int | None = None,
        trim_memory: bool = True,
        max_records: int | None = 10_000,
        max_events: int = 1_000,
        metadata: Mapping[str, Any] | None = None,
        resume: bool = False,
        resume_at: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if retrieval_k < 0 or gpu_slots < 1:
            raise ValueError("retrieval_k must be >= 0 and gpu_slots >= 1")
        if warmup_segments is not None and warmup_segments < 0:
            raise ValueError(f"warmup_segments must be >= 0, got {warmup_segments}")
        if resume_at is not None and (not resume or resume_at < 0):
            raise ValueError(f"resume_at needs resume and must be >= 0, got {resume_at}")
        self.log_dir = Path(log_dir)
        saved = read_saved_state(self.log_dir) if resume else None
        if resume and saved is None and (self.log_dir / LOG_NAME).exists():  # (no log: FileNotFoundError)
            raise ValueError(
                f"{self.log_dir / SESSION_FILE}: missing or unreadable, so the saved session's seed, "
                "codec and roll-backs are unknown: cannot resume it"
            )
        codec = self._resolved("codec", codec, saved, "bf16")
        seed = self._resolved("seed", seed, saved, 0)
        if saved is not None and saved.get("config") != store.config_dict(model.cfg):
            raise ValueError(f"{self.log_dir}: the model's config differs from the saved session's")
        self.model, self.cfg, self.mode, self.k, self.seed = model, model.cfg, mode, retrieval_k, seed
        self.compute_s = compute_s
        self.metadata: dict[str, Any] = dict(metadata or (saved or {}).get("metadata") or {})
        self.layout = SegmentLayout.from_config(self.cfg, codec, model.head.weight.dtype)
        self.segment_bytes = self.layout.payload_nbytes
        self.pm = PageManager(
            host_budget_bytes, self.layout.decoded_nbytes, gpu_slots, segment_bytes=self.segment_bytes
        )
        self.rule: RetrievalRule = rule if rule is not None else FovOverlapRule(seed=seed)
        self.max_records = max_records
        self.records: list[StepRecord] = []  # the last `max_records` steps of this run
        self.outputs: list[torch.Tensor] | None = [] if keep_outputs else None  # denoised preds
        self._infos: list[SegmentInfo] = []  # retrieval candidates: every stored segment, id order
        self._poses: dict[int, Pose] = {}  # the last three steps' poses (predict_pose needs two)
        self._prepared: set[int] = set()  # steps prepared, not released (plans: `handler.plan`)
        self._stalls, self._computes = array("d"), array("d")
        self._hits = self._misses = 0
        self._unavailable = 0  # wanted segments a step could not attend to (lost, or no host room)
        self._max_position = -1
        self._events = EventLog(max_events)
        self._trim = malloc_trim() if trim_memory else None
        self._closed = False
        self._failed: tuple[int, BaseException] | None = None  # (step, cause) of a step that raised
        lag = -(-(self.cfg.window_frames - self.cfg.frames_per_block) // self.cfg.frames_per_block)
        auto_warmup = max(2, min(retrieval_k, gpu_slots) + lag + 1)  # until the buffers first fill
        warmup = auto_warmup if warmup_segments is None else warmup_segments
        # RSS bookkeeping; on a CPU run the device tier (the retrieval buffers) is emulated in RAM
        self.meter = RssMeter(warmup, buffers_in_ram=torch.device(device).type == "cpu")
        self._last_read = self._last_written = 0
        self.resume_bytes_read = 0  # log bytes read back while reopening (host copies, rolling window)
        self.window_source: str | None = None  # resumed: "checkpoint" (window.bin) or "log"
        self._rollbacks: list[tuple[int, int]] = []  # (segment, slots) of each roll-back: store.abandoned
        # a new session that runs no step leaves nothing behind (`close`): the folder too, if it made it
        self._fresh = not resume
        self._made_dir = not resume and not self.log_dir.exists() and not self.log_dir.is_symlink()
        try:  # a new session is refused a folder holding a file of its names (nothing of it is made)
            self.log = store.open_log(self.log_dir, self.segment_bytes, log_max_bytes, resume=resume)
        except BaseException:
            if self._made_dir:  # (a create that fails removes what it wrote: the folder is empty)
                with contextlib.suppress(OSError):
                    self.log_dir.rmdir()
            raise
        model.reset_cache()
        self._first = self._next = 0
        try:  # from here on a failure closes the log (and stops the transfer threads, if started)
            if resume and read_saved_state(self.log_dir) != saved:
                # read before the log's lock was taken: another process saved it meanwhile (it closed
                # the session as this one opened it), so what was read is not what is saved
                raise LogInUse(
                    f"{self.log_dir}: its session was saved by another process while this one opened "
                    "it: resume it again"
                )
            self.handler = TransferHandler(
                self.pm, self.log, self.layout, throttle=Throttle(throttle_bps), device=device
            )
            if resume:
                self._restore(saved, resume_at)
            else:
                self._save_state(window=None)
        except BaseException:
            if hasattr(self, "handler"):
                with contextlib.suppress(Exception):
                    self.handler.close()
            with contextlib.suppress(OSError):  # (its index write on a full disk: not the cause)
                self.log.close()
            if not resume:  # never opened: nothing of it is worth resuming
                self._discard()
            raise

    @classmethod
    def resume(cls, log_dir: str | Path, model: TinyCausalWan, **kwargs: Any) -> Session:
        """Reopen the session saved in ``log_dir`` (see `worldpager.session_store`) and continue it at the
        next frame; ``kwargs`` as for the constructor (``codec``/``seed`` default to the saved ones).
        ValueError if ``model`` or the log does not fit the saved session; FileNotFoundError if there
        is no log; `WindowLostError` (a `SegmentLogError`) if the rolling window cannot be restored:
        its ``resume_at`` is the latest step a resume can continue at instead, consistently.

        A full disk does not stop a resume, which reads what is saved and writes nothing it needs:
        a ``session.json`` it cannot rewrite keeps the saved window, which a later resume checks
        against the log as ever. Only a roll-back (``resume_at`` below segments the log holds) must
        be recorded before the log moves on: on a full disk it is refused (`LogFullError` naming
        the folder) and nothing changes. Later writes a full disk refuses: see `close`.

        Segments the session had generated but the log no longer holds (below the step it continues
        at) are reported as `MissingSegment` events; corrupt, truncated and missing slots as
        `CorruptSlot` events."""
        return cls(model, log_dir=log_dir, resume=True, **kwargs)

    @staticmethod
    def _resolved(name: str, given: Any, saved: dict[str, Any] | None, default: Any) -> Any:
        if saved is None or name not in saved:
            return default if given is None else given
        if given is not None and given != saved[name]:
            raise ValueError(f"{name}={given!r} differs from the saved session's {saved[name]!r}")
        return saved[name]

    # ---- properties -----------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """The next step to run (= segments generated so far, restored ones included)."""
        return self._next

    @property
    def steps_run(self) -> int:
        """Steps run by this object (a resumed session starts at 0)."""
        return self._next - self._first

    @property
    def gpu_budget_bytes(self) -> int:
        """The GPU lease in force (both retrieval buffers): the page manager's, however it was set."""
        return self.pm.gpu_budget_bytes

    @property
    def warmup_segments(self) -> int:
        return self.meter.warmup_segments

    @property
    def rss_start(self) -> int:
        return self.meter.rss_start

    @property
    def peak_rss(self) -> int:
        return self.meter.peak_rss

    @property
    def rss_baseline(self) -> int | None:
        return self.meter.rss_baseline

    @property
    def host_peak_bytes(self) -> int:
        return self.meter.host_peak_bytes

    @property
    def events(self) -> list[SessionEvent]:
        """Notable events (all of them, but only the last ``max_events`` `LeaseResized`, and the first
        and the last ``max_events`` `Dropped`) and the last ``max_events`` routine ones."""
        self._drain_events()
        return self._events.events()

    def event_counts(self) -> dict[str, int]:
        self._drain_events()
        return self._events.counts()

    # ---- retrieval ------------------------------------------------------------------------------
    def _window_start(self, step: int) -> int:
        fpb = self.cfg.frames_per_block
        return max(0, step * fpb - (self.cfg.window_frames - fpb))

    def wanted(self, step: int) -> list[int]:
        """Retrieval set for ``step`` (needs the poses of steps < step, known at the start of step-1).
        A segment whose NVMe copy failed its check (a `Corrupt` event: lost) is no candidate: it
        would take a pick that a segment which can still come back should have."""
        if self.k == 0 or step < 1:
            return []
        self._drain_events()  # (a read-back found corrupt since the last step: no longer a candidate)
        fpb = self.cfg.frames_per_block
        now = step * fpb
        cands = outside_window(self._infos, now, self.cfg.window_frames - fpb)
        if not cands:
            return []
        history = [self._poses[i] for i in range(max(0, step - 2), step) if i in self._poses]
        if not history:
            return []
        return self.rule.select(cands, predict_pose(history, 1), now, self.k)

    def _prepare(self, step: int) -> None:
        # the rule's best first: with fewer slots than wanted the best are kept; placed oldest first,
        # so virtual positions keep true-time order (segment id = time order)
        wanted, start = self.wanted(step), self._window_start(step)
        self.handler.prepare(step, wanted, start, place_by_id=True)
        self._prepared.add(step)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, pose: Pose) -> StepRecord:
        """Run the next segment; ValueError (nothing changed) for a pose `check_pose` refuses.

        A step that raises otherwise (a transfer failure, the codec refusing the block's KV, the
        model itself) may have changed the session part-way (its buffers, the model's rolling
        window): the session is then failed, and every later step raises a RuntimeError naming the
        failed step and its cause. `close` still saves it, without its rolling window (which the
        failure may have left half-changed); a resume continues from the log."""
        if self._closed:
            raise RuntimeError("session is closed")
        if self._failed is not None:
            at, cause = self._failed
            raise RuntimeError(
                f"session step {at} failed ({cause!r}): the session cannot go on; close it, and "
                "resume it to continue from what its log holds"
            ) from cause
        check_pose(pose)
        try:
            return self._step(pose)
        except BaseException as e:
            self._failed = (self._next, e)
            raise

    def _step(self, pose: Pose) -> StepRecord:
        n, fpb = self._next, self.cfg.frames_per_block
        self._poses[n] = pose
        self._poses.pop(n - 3, None)
        t0 = time.perf_counter()
        replan_wait = 0.0
        if self.mode == "on_demand" or n == self._first:
            self._prepare(n)
        elif self.pm.needs_replan(n):  # shrunk since the prefetch by `pm.resize` (the handler re-plans)
            replan_wait = self._replan(n)
        stall = replan_wait + self.handler.wait_ready(n)
        if self.mode == "on_demand":
            stall = time.perf_counter() - t0
        if self.mode == "prefetch":
            self._prepare(n + 1)  # its reads and uploads overlap this step's compute
        memory, ids = self.handler.memory(n)
        latent, actions = block_inputs(self.cfg, n, self.seed)
        p = next(self.model.parameters())  # the inputs go where the model is (CUDA when present)
        latent, actions = latent.to(p.device, p.dtype), actions.to(p.device, p.dtype)
        t1 = time.perf_counter()
        pred, kv = self.model.generate_block(latent, actions, n * fpb, memory)
        del memory, latent, actions
        if self.outputs is not None:
            self.outputs.append(pred)
        del pred
        if self.compute_s is not None:
            sleep_until(t1 + self.compute_s)
        compute = time.perf_counter() - t1
        rss_mid = self.meter.rss()  # the step's working set is live here
        plan = self.handler.plan(n)  # (a re-plan's, when a shrink prepared the step again)
        self.handler.release(n)
        self._prepared.discard(n)
        misses = sum(isinstance(j, Read) for j in plan.jobs)
        hits = len(plan.slots) - misses
        self._unavailable += len(plan.unavailable)
        del plan
        info = SegmentInfo(n, n * fpb, (n + 1) * fpb, pose)
        payload = self.layout.encode(kv)
        del kv
        if self.handler.add_segment(info, payload):
            self._infos.append(info)
        del payload
        self._next = n + 1
        self._drain_events()
        if self._trim is not None:
            self._trim()
        rss = self.meter.rss()
        host, pm_host = self.handler.host_bytes, self.pm.host_used_bytes
        buffers = self.handler.buffer_bytes if self.meter.buffers_in_ram else 0
        self.meter.account(self.steps_run, rss_mid, rss, max(host, pm_host), buffers)
        read, written = self.handler.bytes_read, self.handler.bytes_written
        rec = StepRecord(
            n, stall, compute, hits, misses, ids, read - self._last_read, written - self._last_written,
            host, pm_host, rss, (n + 1) * fpb - 1,
        )  # fmt: skip
        self._last_read, self._last_written = read, written
        self._stalls.append(stall)
        self._computes.append(compute)
        self._hits += hits
        self._misses += misses
        self._max_position = rec.max_position
        self.records.append(rec)
        if self.max_records is not None and len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]
        return rec

    def resize_lease(self, host_budget_bytes: int | None = None, gpu_budget_bytes: int | None = None) -> None:
        """Change the host and/or GPU byte budgets while the session runs (the manager's elastic
        lease): see `TransferHandler.resize`. ``gpu_budget_bytes`` then reports the new GPU lease.

        A shrink holds when this returns, for the step already prefetched too: when that step's
        buffer has more slots than the new GPU lease allows, or its protected segments keep the host
        over the new budget (the page manager's `PageManager.needs_replan`), it is released and
        prepared again within the new lease (the rule's best segments are kept; host hits are
        uploaded again, evicted ones read back when room allows): `TransferHandler.resize` does that
        itself, so it holds however the handler was called. A lease shrunk through ``pm.resize``
        alone is caught the same way when the step starts, before it runs; a step is re-planned at
        most once per shrink. RuntimeError after `close`.

        The session re-plans nothing here itself: when the handler's resize returns, a prepared step
        still out of the lease is one already started (its memory handed out by `step`, the model
        computing on it), which keeps its buffer until `step` releases it -- releasing it here
        would free it under the model. Called between steps (the Session is not thread-safe; the
        world worker serialises step, resize and close under one lock per session) no step is
        started then, so the prefetched step is always the handler's to re-plan."""
        if self._closed:
            raise RuntimeError("session is closed: cannot resize its lease")
        self.handler.resize(host_budget_bytes, gpu_budget_bytes)

    def _replan(self, n: int) -> float:
        """Release prefetched step ``n`` (once its transfers are done) and prepare it again within the
        lease in force; the seconds waited for those transfers."""
        waited = self.handler.wait_ready(n)
        self.handler.release(n)
        self._prepared.discard(n)
        self._prepare(n)
        return waited

    def wait_written(self, step: int, timeout: float = 60.0) -> bool:
        """Block until segment ``step`` has been written to the log (not fsynced: it survives the
        process, not the machine); False when it is not in the log (dropped, or the disk is full)."""
        return self.handler.wait_written(step, timeout) is not None

    def flush_index(self) -> None:
        """fsync the log and save its index (a reopen then trusts it instead of scanning the slots);
        `LogFullError` naming the folder when the disk is full (the index is saved by a later flush,
        or rebuilt by the next resume)."""
        try:
            self.log.flush()
        except OSError as e:
            if is_disk_full(e):
                raise self._disk_full(
                    e, "the log's index", "a later flush or the next resume writes it"
                ) from e
            raise

    def run(self, poses: Sequence[Pose]) -> list[StepRecord]:
        return [self.step(p) for p in poses]

    def _drain_events(self) -> None:
        events = self.handler.take_events()
        lost = {e.seg_id for e in events if isinstance(e, Corrupt)}
        if lost:  # never retrieved again (its log copy failed its check and was retired)
            self._infos = [i for i in self._infos if i.segment_id not in lost]
        self._events.extend(events)

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the transfer threads (after outstanding I/O), release a prefetched step, close the log,
        then save the session state (``session.json`` and the rolling window) for `resume`. A new
        session that ran no step (its first pose refused, say) saves nothing: what it wrote at
        creation is removed instead (`discarded`), and its folder when the session made it.

        A transfer thread's failure (`TransferError`: EIO, EFBIG...) raised while waiting for the
        transfers is raised after the session is saved, so a resume continues from the steps run.

        On a full disk: an index the log cannot save is logged (its data is fsynced; the next resume
        scans for it) and the session is still saved; a save the disk refuses raises `LogFullError`
        naming the folder (a `DiskFullError`: an OSError too), with nothing half-written: a resume
        continues from what the folder holds (the saved state where it still matches the log, else
        the log)."""
        if self._closed:
            return
        self._closed = True
        pending: Exception | None = None  # a transfer thread's failure: raised once the session is saved
        try:
            nxt = self._next
            if nxt in self._prepared:
                self.handler.wait_ready(nxt)
                self.handler.release(nxt)
                self._prepared.discard(nxt)
        except Exception as e:  # (EIO, EFBIG...) the steps run so far are saved all the same
            pending = e
        finally:  # also after a transfer thread failed: stop the threads that are left
            try:
                self.handler.close()
            except Exception as e:
                pending = pending or e
        discard = self._fresh and self._next == 0 and self.log.n_slots == 0
        unsaved: OSError | None = None
        if not discard:  # saved while the log is open: its lock held until the session is saved (a
            # process waiting for it would read a session.json from before this run's steps)
            try:
                # a failed step may have changed the model's rolling window part-way (shifted one
                # layer's K but not its V, or not its end index): no checkpoint of it, the resume
                # rebuilds the window from the log
                self._save_state(window=None if self._failed is not None else self._save_window())
            except OSError as e:
                unsaved = e
        try:
            self.log.close()
        except OSError as e:  # (the file is closed all the same)
            if is_disk_full(e):
                logger.warning(
                    "%s: the log's index was not saved (%s): the next resume rebuilds it", self.log_dir, e
                )
            else:
                pending = pending or e
        finally:
            self._drain_events()
        if discard:
            self._discard()  # refused at its first pose, or never stepped: nothing to resume
            if pending is not None:
                raise pending
            return
        if unsaved is not None:
            if pending is not None:  # (the first failure is the one to report)
                logger.warning("%s: the session was not saved either: %s", self.log_dir, unsaved)
                raise pending from pending.__cause__  # (its own cause kept: the OSError)
            if is_disk_full(unsaved):
                raise self._disk_full(
                    unsaved, "the session", "a resume continues from what the folder holds"
                ) from unsaved
            raise unsaved
        if pending is not None:
            raise pending

    @property
    def discarded(self) -> bool:
        """Whether `close` left nothing on disk: a new session that ran no step (nothing to resume)."""
        return self._closed and self._fresh and self._next == 0 and self.log.n_slots == 0

    def _discard(self) -> None:
        """Remove what this new session wrote in ``log_dir`` (its log, the log's index and meta file,
        ``session.json``, ``window.bin``, and their temporary files), ``session.json`` first, and the
        folder itself when this session made it and it is empty now. They are this session's own: a
        new session is refused a folder holding any file of those names (`store.open_log`), and its
        log is created exclusively (O_EXCL, then locked), so only after that is this called. Other
        files are left as they are; a file that cannot be removed is logged (a resume of what is
        left is refused as damaged)."""
        names = (SESSION_FILE, WINDOW_FILE, LOG_NAME, INDEX_NAME, META_NAME)
        temps = (SESSION_FILE, WINDOW_FILE, INDEX_NAME, META_NAME)  # (the log is written in place)
        for name in (*names, *(n + ".tmp" for n in temps)):
            try:
                (self.log_dir / name).unlink(missing_ok=True)
            except OSError as e:
                logger.warning(
                    "%s: cannot remove %s of a session that ran no step: %s", self.log_dir, name, e
                )
        if self._made_dir:
            with contextlib.suppress(OSError):  # (not empty: files of someone else's stay)
                self.log_dir.rmdir()

    def _disk_full(self, e: OSError, what: str, then: str) -> DiskFullError:
        """The `LogFullError` (a `DiskFullError`: an OSError too) for a write of ``what`` the full disk
        refused (``e``), naming the folder (and the file), and ``then``: what happens next, or what
        to do."""
        name = f" ({Path(e.filename).name})" if e.filename else ""
        return DiskFullError(
            f"{self.log_dir}: disk full: cannot save {what}{name}: {e.strerror or e}; {then}", e.errno
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_window(self) -> dict[str, Any]:
        """Write the rolling window's K/V (every layer, exactly as cached) to ``window.bin``, with the
        log slots of the segments it holds (None: not in the log), so a resume can tell whether the
        log still holds those copies."""
        segments = []
        for sid in store.window_segments(self.cfg, self._next):
            slot = self.log.find(sid)
            if slot is not None and store.abandoned(sid, slot, self._rollbacks):
                slot = None  # the new copy never reached the log; the old one is not the window's
            segments.append((sid, slot))
        return store.save_window(self.model, self.log_dir, segments)

    def _save_state(self, window: dict[str, Any] | None) -> None:
        store.save_state(
            self.log_dir, seed=self.seed, codec=self.layout.codec, cfg=self.cfg, next_step=self._next,
            poses=self._poses, window=window, metadata=self.metadata, rollbacks=self._rollbacks,
        )  # fmt: skip

    # ---- resume ---------------------------------------------------------------------------------
    def _restore(self, saved: dict[str, Any] | None, resume_at: int | None) -> None:
        """Reopen the saved session: corrupt slots, stored segments, rolling window, last poses.
        The log bytes read meanwhile (the host copies read back, a window rebuilt from the log) are
        ``resume_bytes_read``: not NVMe reads of this run's steps (``handler.bytes_read``)."""
        read_before = self.log.bytes_read
        for slot, reason in sorted(self.log.corrupt_slots().items()):
            self._events.record(CorruptSlot(slot, reason))
        self._rollbacks = [(at, slots) for at, slots in (saved or {}).get("rollbacks", [])]
        stored = store.stored_segments(self.log, self.layout, self.cfg, self.log_dir, self._rollbacks)
        rolled_back = resume_at is not None and any(sid >= resume_at for sid in stored)
        if rolled_back and resume_at is not None:
            # every copy written so far of a segment from resume_at on is of the abandoned timeline
            self._rollbacks.append((resume_at, self.log.n_slots))
            stored = {sid: v for sid, v in stored.items() if sid < resume_at}
        # first: a slot found corrupt on read-back leaves `stored` (a trusted index did not check it)
        infos, corrupt = store.register_stored(stored, self.log, self.pm, self.handler, self.segment_bytes)
        self._events.extend(corrupt)
        nxt = max(stored, default=-1) + 1
        window = store.checkpoint_window(saved, nxt, self.model, self.log_dir, stored)
        if window is not None and saved is not None:
            if resume_at is None or int(saved["next_step"]) <= resume_at:
                nxt = int(saved["next_step"])  # (at or past where it stopped: it continues there)
            else:  # the checkpoint is past the step to continue at
                window = None
        for sid in range(nxt):  # generated before, but not in the log now: never attended to
            if sid not in stored:
                self._events.record(MissingSegment(sid, "not in the log (lost, corrupt or never written)"))
        self._infos.extend(infos)
        if window is None:
            try:
                window = store.window_from_log(stored, nxt, self.log, self.layout, self.cfg, self.log_dir)
            except WindowLostError as e:  # the slots found corrupt (and retired) meanwhile go with it
                e.events = self._events.events()
                raise
            self.window_source = "log"
        else:
            self.window_source = "checkpoint"
        store.set_window(self.model, window, nxt * self.cfg.frames_per_block * self.cfg.tokens_per_frame)
        self.resume_bytes_read = self.log.bytes_read - read_before  # (the transfer threads were idle)
        saved_poses = (saved or {}).get("poses") or {}
        for i in range(max(0, nxt - 2), nxt):
            if self.window_source == "checkpoint" and str(i) in saved_poses:
                self._poses[i] = Pose(*(float(x) for x in saved_poses[str(i)]))
            elif i in stored:
                self._poses[i] = Pose(*stored[i][1].pose)
        self._first = self._next = nxt
        self._max_position = nxt * self.cfg.frames_per_block - 1
        # The checkpoint is spent: from here the log moves on (after a roll-back it holds other copies
        # of the window's segments), so a crash before close() must rebuild the window from the log.
        try:
            self._save_state(window=None)
        except OSError as e:
            if not is_disk_full(e):
                raise
            if rolled_back:  # unrecorded, a crash would bring the abandoned timeline back
                then = "free some space and resume again (the saved session is unchanged)"
                raise self._disk_full(e, f"the roll-back to step {resume_at}", then) from e
            # Unsaved, session.json keeps the saved window: a later resume uses it only while it
            # matches the log (segments appended from here on, or other copies, make it stale).
            logger.warning(
                "%s: %s not rewritten on resume (%s): saved at close", self.log_dir, SESSION_FILE, e
            )

    # ---- summary --------------------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        """Totals over this run's steps (the `worldpager session` JSON, less the CLI's keys)."""
        fpb = self.cfg.frames_per_block
        return {
            "segments": self.steps_run,
            "latent_frames": self.steps_run * fpb,
            "first_segment": self._first,
            **self.meter.summary(self.steps_run, self.pm.host_budget_bytes),
            "gpu_budget_bytes": self.gpu_budget_bytes,
            "nvme_bytes_written": self.handler.bytes_written,
            "nvme_bytes_read": self.handler.bytes_read,
            "resume_bytes_read": self.resume_bytes_read,
            "positional_table_frames": self.cfg.rope_table_frames,
            "max_position_reached": self._max_position,
            "stall": stall_stats(self._stalls),
            "compute": stall_stats(self._computes),
            "segment_bytes": self.segment_bytes,
            "codec": self.layout.codec,
            "mode": self.mode,
            "nvme_reads": self.handler.reads,
            "host_hits": self._hits,
            "host_misses": self._misses,
            "retrieval_unavailable": self._unavailable,
            "peak_host_bytes": self.host_peak_bytes,
            "events": self.event_counts(),
            "resumed": self.window_source is not None,
            "window_source": self.window_source,
        }
