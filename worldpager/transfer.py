"""Transfers: runs a `PageManager`'s jobs with real bytes (the PageManager is the bookkeeping side).

* `Throttle` -- paces NVMe reads to a given bandwidth (a serial disk: each read of ``n`` bytes holds the
  disk for ``n / bytes_per_s`` seconds, starting when the previous read's time is up), so a benchmark
  can emulate a slow disk on any machine. The real read happens inside that time.
* `TransferHandler` -- runs a `PageManager`'s jobs with real bytes. An I/O worker thread takes jobs in
  the PageManager's `io_queue()` order (prefetch reads > spills > write-backs, re-read at every pick so
  a write-back that became a spill moves up): `SegmentLog` reads through the `Throttle` into host
  copies, write-backs of host copies into the log. An upload stage (a thread; on CUDA it also works on
  a side stream with pinned host copies and records an event per upload) performs `Upload` jobs:
  decode the codec, re-rotate the keys' temporal dims from their true frames to virtual positions just
  before the rolling window (`rope.rerotate_time` / `rope.virtual_positions`), place the result in the
  step's retrieval buffer. Every PageManager call is made under one lock; completions go back through
  `PageManager.complete`, and a per-step `threading.Event` says the step's buffer is ready. A lease
  shrink (`resize`) re-plans the prepared steps it left out of the lease before it returns, except
  a step already started (its memory handed out by `memory`), which keeps its buffer until released.
* `Dropped` / `RuntimeEvent` -- what the handler records besides the PageManager's events.

Failure handling: a read that fails with an OS error (EIO, EINTR, EAGAIN: a disk or controller hiccup)
is retried, up to ``TransferHandler.read_retries`` more times with a short, doubling pause
(``read_retry_delay_s``), each failure logged as a warning; one that still fails then is treated as
corrupt (below), its slot left as it is (not retired: the data may be readable later, by a resume).
A write to the log (a write-back, or a write-through) that fails with an OS error other than a full
disk is retried the same way (``write_retries``, ``write_retry_delay_s``: a failed append leaves the
log as it was), each failure logged; one that still fails then stops the I/O thread: the handler
fails (its error raised by every later call), so the session fails loudly rather than go on without
the segments it can no longer write.
A corrupt slot (checksum) is reported as ``Failure.CORRUPT`` -> the PageManager takes
the segment out of every step (a `Corrupt` event, with the slot and the reason added here) and it is
never uploaded, so never attended to; the slot is retired in the log (`SegmentLog.mark_corrupt`: its
space given back, never reported again by a resume); a full log (`LogFullError`) is reported as
``Failure.DISK_FULL`` -> host-only mode (a `DiskFull` event), the session goes on. A new segment that
finds no host room a spill could make (every host byte is protected by the next step's retrieval set,
or reserved for reads) is written straight to the log by the caller's thread (a `WrittenThrough`
event) and registered as NVMe-only: no segment is lost while the log is usable. Only in host-only
mode is such a segment dropped (a `Dropped` event): it is never retrievable, generation continues.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from worldpager import rope
from worldpager.layout import SegmentLayout
from worldpager.model import KV
from worldpager.page_types import (
    Corrupt,
    DiskFull,
    Event,
    Evicted,
    Failure,
    IoJob,
    Job,
    Read,
    Spilled,
    StepPlan,
    Upload,
    WriteBack,
)
from worldpager.pages import PageManager
from worldpager.retrieval import SegmentInfo
from worldpager.segment_header import SegmentHeader
from worldpager.segment_log import (
    HEADER_SIZE,
    CorruptSlotError,
    LogFullError,
    SegmentLog,
    SegmentLogError,
)

__all__ = [
    "Dropped",
    "RuntimeEvent",
    "Throttle",
    "TransferError",
    "TransferHandler",
    "WrittenThrough",
    "sleep_until",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)


# ---- throttle -------------------------------------------------------------------------------------


class TransferError(SegmentLogError, RuntimeError):
    """A transfer thread failed on an error of the system's (EIO, EFBIG over a file-size limit, EROFS):
    named with the log file, one line (``__cause__``: the OSError). A SegmentLogError, so callers
    that report the log's failures (the CLI's one-line error) report it; a RuntimeError, as every
    transfer thread failure was before."""


class Throttle:
    """Paces reads to ``bytes_per_s`` (None: no pacing). Thread-safe; readers queue like on one disk."""

    def __init__(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
            raise ValueError(f"bytes_per_s must be a positive finite number or None, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T], nbytes: int) -> T:
        """Call ``fn`` (the real read of ``nbytes``) and return when the paced transfer is done."""
        if self.bytes_per_s is None:
            return fn()
        with self._lock:
            start = max(time.perf_counter(), self._busy_until)
            end = self._busy_until = start + nbytes / self.bytes_per_s
        sleep_until(start)
        result = fn()
        sleep_until(end)
        return result


def sleep_until(t: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``t``."""
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


# ---- transfer handler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dropped:
    """Host-only mode and no host room: the new segment was not kept (never retrievable)."""

    seg_id: int
    nbytes: int


@dataclass(frozen=True)
class WrittenThrough:
    """No host room could be made for a new segment: it went straight to the log (NVMe only, read
    back when wanted), never through the host tier."""

    seg_id: int
    nbytes: int


RuntimeEvent = Event | Dropped | WrittenThrough


@dataclass
class _StepBuf:
    plan: StepPlan  # the plan in force (a re-plan's after `TransferHandler.resize` re-planned it)
    wanted: tuple[int, ...]  # prepare()'s arguments, to prepare the step again after a shrink
    window_start_frame: int
    place_by_id: bool
    slot_seg: dict[int, int]  # slot -> segment
    targets: dict[int, int]  # slot -> virtual start frame
    kv: dict[int, bool] = field(default_factory=dict)  # slot -> True once uploaded (its K/V in `store`)
    store: list[KV] | None = None  # per layer (K, V) of every placed slot, one after the other
    packed: int | None = None  # slots `memory` closed up (its first call): the first ones of `store`
    ready: threading.Event = field(default_factory=threading.Event)
    cuda_events: list[torch.cuda.Event] = field(default_factory=list)
    started: bool = False  # its memory was handed out (`memory`): it runs on it until released


class TransferHandler:
    """Executes a `PageManager`'s jobs with real bytes (see the module docstring).

    ``log`` is shared, not owned (``close()`` leaves it open). ``host_bytes`` is what the host copies
    take; it follows the PageManager's accounting (copies leave on `Evicted`/`Spilled`).
    A read that fails with an OS error is tried again ``read_retries`` times, after
    ``read_retry_delay_s`` seconds and then twice as long each time, before its segment is given up;
    a write (a write-back or a write-through) ``write_retries`` times, after ``write_retry_delay_s``
    seconds and then twice as long each time, before the handler fails.
    """

    read_retries = 3
    read_retry_delay_s = 0.05
    write_retries = 3
    write_retry_delay_s = 0.05

    def __init__(
        self,
        pm: PageManager,
        log: SegmentLog,
        layout: SegmentLayout,
        *,
        throttle: Throttle | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.pm, self.log, self.layout = pm, log, layout
        self.throttle = throttle or Throttle(None)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:
            if self.device.index is None:
                # "cuda" means the device current here and now; named, since each thread resolves an
                # index-less device to its own current device (the upload thread's is cuda:0)
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._cond = threading.Condition()  # serialises every PageManager call
        self._host: dict[int, bytes] = {}
        self._info: dict[int, SegmentInfo] = {}
        self._slot_of: dict[int, int] = {}  # segment -> log slot
        self._io_pending: dict[int, IoJob] = {}  # handed to the worker, not started
        self._outstanding: set[int] = set()  # I/O jobs handed out, not completed
        self._writing: dict[int, int] = {}  # write-back job -> segment, until it completes or is cancelled
        self._read_failures: dict[int, tuple[int | None, str]] = {}  # segment -> (slot, reason), briefly
        self._uploads: queue.Queue[Upload | None] = queue.Queue()
        self._steps: dict[int, _StepBuf] = {}
        self._closing = False  # the threads stop once their work is done (set after close's drain)
        self._closed = False  # close() has begun: no resize or prepare is accepted from then on
        self.events: list[RuntimeEvent] = []
        self.bytes_read = 0  # NVMe bytes read (header + payload)
        self.bytes_written = 0
        self.reads = 0
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._guard(self._io_loop), name="wp-io", daemon=True),
            threading.Thread(target=self._guard(self._upload_loop), name="wp-upload", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the runtime's calls ----------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        with self._cond:
            return sum(len(p) for p in self._host.values())

    @property
    def buffer_bytes(self) -> int:
        """Bytes the retrieval buffers of prepared, unreleased steps take (on ``device``): each is
        allocated, for all its placed slots, at its first upload."""
        with self._cond:
            stores = [buf.store for buf in self._steps.values() if buf.store is not None]
        return sum(t.numel() * t.element_size() for st in stores for pair in st for t in pair)

    @staticmethod
    def staging_bytes(layout: SegmentLayout, *, cuda: bool) -> int:
        """Host bytes one upload stages outside the host tier: one page at a time, copied out of the
        host copy (and, on CUDA, into pinned memory for the copy to the device)."""
        return (2 if cuda else 1) * layout.page_nbytes

    def take_events(self) -> list[RuntimeEvent]:
        """Drain the events recorded so far (``events`` then starts empty), atomically with respect to
        the transfer threads: a long-running owner keeps memory bounded by draining them."""
        with self._cond:
            events, self.events = self.events, []
            return events

    def log_slot(self, seg_id: int) -> int | None:
        with self._cond:
            return self._slot_of.get(seg_id)

    def wait_written(self, seg_id: int, timeout: float = 60.0) -> int | None:
        """Block until no write-back of ``seg_id`` is outstanding; its log slot, or None when it is not
        in the log (dropped, or the disk is full). TimeoutError after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: seg_id not in self._writing.values() or self.error is not None, timeout
            ):
                raise TimeoutError(f"segment {seg_id}: write-back still outstanding after {timeout} s")
            self._raise_error()
            return self._slot_of.get(seg_id)

    def add_segment(self, info: SegmentInfo, payload: bytes, *, on_disk_slot: int | None = None) -> bool:
        """Register a finished segment (host copy + write-behind). ``on_disk_slot``: it is already in
        the log there (no write). Waits for spills under backpressure. When no spill can make host room
        (every host byte protected or reading) the segment is written straight to the log from this
        thread and registered NVMe-only (a `WrittenThrough` event; with ``on_disk_slot`` it is only
        registered). False if it was dropped: only in host-only mode (the log full)."""
        sid = info.segment_id
        while True:
            with self._cond:
                while True:
                    self._raise_error()
                    # (once close has begun: a write-back queued now would never run)
                    self._refuse_if_closed(f"add segment {sid}")
                    res = self.pm.add_segment(sid, len(payload))
                    self._drain_events()
                    if isinstance(res, list):
                        self._host[sid], self._info[sid] = payload, info
                        if on_disk_slot is None:
                            self._submit(res)
                        else:
                            self._slot_of[sid] = on_disk_slot
                            for job in res:
                                self._submit(self.pm.complete(job.job_id, True))
                            self._drain_events()
                        return True
                    if res.spills:
                        self._wait_jobs({j.job_id for j in res.spills})
                        continue
                    if on_disk_slot is not None:  # already in the log: NVMe-only, nothing to write
                        self.pm.add_on_nvme(sid, len(payload))
                        self._slot_of[sid], self._info[sid] = on_disk_slot, info
                        return True
                    if not self.pm.nvme_enabled:
                        self.events.append(Dropped(sid, len(payload)))
                        return False
                    break  # write it through, without the lock (the transfer threads go on)
            slot = self._append(info, payload)  # the log serialises appends with the I/O thread's
            with self._cond:
                if slot is not None:
                    self.pm.add_on_nvme(sid, len(payload))
                    self._slot_of[sid], self._info[sid] = slot, info
                    self.bytes_written += HEADER_SIZE + len(payload)
                    self.events.append(WrittenThrough(sid, len(payload)))
                    return True
                self.pm.disk_full(sid)  # host-only mode from here: once more for host room, or dropped
                self._drain_events()

    def resize(self, host_budget_bytes: int | None = None, gpu_budget_bytes: int | None = None) -> None:
        """The elastic lease, at run time. Growing is immediate. Shrinking the host tier evicts clean
        segments and spills dirty ones to NVMe first (their write-backs jump the queue); this waits
        until the spills have landed, so no segment is lost and the new budget then holds. A GPU
        shrink applies to steps prepared from now on, and to those already prepared but not started
        (their memory not yet handed out by `memory`): each one the shrink left out of the lease
        (`PageManager.needs_replan`: more slots than a buffer now has, or its protected segments
        holding the host over the new budget) is re-planned here before this returns -- once its
        transfers are done it is released (its uploads leave the retrieval buffer) and prepared
        again with the same arguments within the new lease -- so the room the shrink gives back is
        free when this returns (its new transfers may still be running: `wait_ready`). A started
        step keeps its buffer until it is released. A budget below one segment: ValueError.
        After `close` has begun: RuntimeError (nothing changed). A close that begins while this
        waits on a step's transfers abandons the re-plans not made yet (those steps keep their
        plans; the budgets are in force); a re-plan made before it has its transfers finished by
        close's drain.
        Size a host lease to hold the retrieval sets of the running and the next step plus the
        incoming segment: with less, a new segment can find every host slot protected and goes
        straight to the log (a `WrittenThrough` event; dropped only in host-only mode) rather than
        let the budget be exceeded, and a retrieved segment may find no room to be read back."""
        with self._cond:
            self._refuse_if_closed("resize")
            self._raise_error()
            spills = {j.job_id for j in self.pm.resize(host_budget_bytes, gpu_budget_bytes)}
            self._drain_events()
            self._cond.notify_all()
            while spills & self._outstanding and self.error is None:
                self._wait_jobs(spills)
            self._raise_error()
            for step in sorted(self._steps):
                self._replan_if_outdated(step)

    def _replan_if_outdated(self, step: int) -> None:
        """Under the lock: re-plan prepared ``step`` if a shrink left it out of the lease and it has
        not started. Waits for its transfers first (the lock is released while waiting, so the copy
        threads -- and other callers -- go on); what changed meanwhile is checked again after."""
        buf = self._steps.get(step)
        if self._closed or buf is None or buf.started or not self.pm.needs_replan(step):
            return

        def settled() -> bool:  # done waiting: transfers over, or the step is no longer ours to re-plan
            return (
                self._steps.get(step) is not buf
                or buf.started
                or self.pm.buffer_ready(step)
                or self.error is not None
                or self._closed
            )

        while not self._cond.wait_for(settled, 5.0):
            pass
        self._raise_error()
        if self._closed or self._steps.get(step) is not buf or buf.started:
            return  # closing, released (or prepared again) or started meanwhile: not re-planned here
        # (release and prepare below run under the lock held since the check: a close waits for them,
        # then drains their reads, so every Upload they lead to is queued before the stop marker)
        if not self.pm.needs_replan(step):
            return  # (a grow meanwhile: its plan fits again)
        self.release(step)
        self.prepare(step, buf.wanted, buf.window_start_frame, place_by_id=buf.place_by_id)

    def _wait_jobs(self, ids: set[int]) -> None:
        self._cond.wait_for(lambda: not ids & self._outstanding or self.error is not None, 5.0)

    def prepare(
        self, step: int, wanted: Iterable[int], window_start_frame: int, *, place_by_id: bool = False
    ) -> StepPlan:
        """Plan ``step``'s retrieval buffer and start its transfers; memory lands at virtual frames just
        before ``window_start_frame`` (slot order = oldest-to-newest placement: ``wanted`` order, or id
        order with ``place_by_id``; ``wanted`` is best first: see `PageManager.prepare_step`).
        RuntimeError once `close` has begun (its transfers would never run)."""
        wanted = tuple(wanted)  # (kept: a shrink may have to prepare the step again, see `resize`)
        with self._cond:
            self._refuse_if_closed(f"prepare step {step}")
            self._raise_error()
            plan = self.pm.prepare_step(step, wanted, place_by_id=place_by_id)
            starts = rope.virtual_positions(window_start_frame, len(plan.slots), self.layout.frames)
            slot_seg = {slot: sid for sid, slot in plan.slots.items()}
            targets = {slot: starts[slot] for slot in slot_seg}
            self._steps[step] = _StepBuf(plan, wanted, window_start_frame, place_by_id, slot_seg, targets)
            self._drain_events()
            self._submit(plan.jobs)
            self._check_ready()
            return plan

    def wait_ready(self, step: int, timeout: float = 120.0) -> float:
        """Block until ``step``'s buffer is ready; the seconds blocked (the stall)."""
        with self._cond:
            buf = self._steps[step]
        t0 = time.perf_counter()
        if not buf.ready.wait(timeout):
            raise TimeoutError(f"step {step}: retrieval buffer not ready after {timeout} s")
        if self._cuda:
            for ev in buf.cuda_events:
                torch.cuda.current_stream(self.device).wait_event(ev)
        stall = time.perf_counter() - t0
        self._raise_error()
        return stall

    def plan(self, step: int) -> StepPlan:
        """The plan in force for prepared ``step``: `prepare`'s, or the re-plan's when a shrink
        (`resize`) prepared it again. KeyError if it is not prepared."""
        with self._cond:
            if step not in self._steps:
                raise KeyError(f"step {step} is not prepared")
            return self._steps[step].plan

    def memory(self, step: int) -> tuple[list[KV] | None, tuple[int, ...]]:
        """Per-layer ``(K, V)`` of the segments uploaded for ``step`` (slot order) and their ids;
        ``(None, ())`` when there are none. Lost (corrupt) segments are never in it. This starts the
        step: from here until `release` a shrink never re-plans it (its buffer stays as it is).
        Called after `wait_ready`; should a `resize` from another thread have re-planned the step
        in between, this first waits for the new plan's buffer (`wait_ready`), and on CUDA the
        compute stream always waits on the uploads of the buffer handed out (a re-planned buffer
        ready already was handed out with the stream waiting only on the old one's). After a
        transfer thread failed it raises that error, as `wait_ready` does (a failure marks every
        buffer ready to wake its waiters, so the buffer may be partial): never a partial buffer.

        The K/V handed out are views of the step's buffer (its slots uploaded one after the other
        into one tensor per layer; a slot left empty by a lost segment is closed up in place): no
        second copy, so the device tier never holds more than its two buffers (the GPU lease)."""
        while True:
            with self._cond:
                self._raise_error()  # (under the lock: the failure sets the error and `ready` together)
                buf = self._steps[step]
                if buf.ready.is_set():
                    buf.started = True
                    slots = sorted(s for s in buf.kv if s in buf.slot_seg)
                    ids = tuple(buf.slot_seg[s] for s in slots)
                    events = list(buf.cuda_events)
                    store, packed = buf.store, buf.packed
                    break
            self.wait_ready(step)
        if not slots or store is None:
            return None, ()
        if self._cuda:  # (again for events `wait_ready` waited on: a no-op on the stream)
            stream = torch.cuda.current_stream(self.device)
            for ev in events:
                stream.wait_event(ev)
            # The uploads were made on the side stream and are read on this (the caller's) stream:
            # tell the caching allocator, so their memory is not reused before this stream is done.
            for k, v in store:
                k.record_stream(stream)
                v.record_stream(stream)
        if packed is not None:  # (packed once: packing moves slots within the buffer)
            n = packed * self.layout.tokens
            return [(k[:, :n], v[:, :n]) for k, v in store], ids
        mem = self._packed(store, slots, self.layout.tokens)
        with self._cond:
            buf.packed = len(slots)
        return mem, ids

    @staticmethod
    def _packed(store: list[KV], slots: list[int], tokens: int) -> list[KV]:
        """Per layer, the filled ``slots`` (ascending) of ``store`` as one view each: a slot after an
        empty one is moved down within the buffer first (in place: no new tensor)."""
        for i, slot in enumerate(slots):
            if slot != i:  # (slot > i: its source is never one written here before)
                for k, v in store:
                    k[:, i * tokens : (i + 1) * tokens].copy_(k[:, slot * tokens : (slot + 1) * tokens])
                    v[:, i * tokens : (i + 1) * tokens].copy_(v[:, slot * tokens : (slot + 1) * tokens])
        n = len(slots) * tokens
        return [(k[:, :n], v[:, :n]) for k, v in store]

    def release(self, step: int) -> None:
        with self._cond:
            self.pm.release_step(step)
            self._steps.pop(step, None)
            self._drain_events()

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every I/O job handed out so far has completed."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._outstanding or self.error is not None, timeout):
                raise TimeoutError("I/O jobs still outstanding")
        self._raise_error()

    def close(self) -> None:
        """Finish outstanding I/O, stop the threads (the log stays open). From its start no `resize`
        or `prepare` is accepted (RuntimeError), and a resize waiting on transfers abandons the
        re-plans it has not made, so every transfer handed out is done before the threads stop.
        Closing again is a no-op (it only joins the stopped threads)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # (a resize waiting on a step's transfers gives up its re-plan)
        try:
            if self.error is None:
                self.drain()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._uploads.put(None)
            for t in self._threads:
                t.join(timeout=10.0)

    # ---- internals (the caller holds self._cond unless said otherwise) -----------------------
    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"transfer handler is closed: cannot {what}")

    def _raise_error(self) -> None:
        """Raise what failed a transfer thread: a `TransferError` naming the log file when the system
        refused the I/O (EIO, EFBIG, EROFS...: a full disk is no failure, see `Failure`), else a
        RuntimeError (a bug)."""
        e = self.error
        if isinstance(e, OSError):
            raise TransferError(f"transfer thread failed: {self.log.path}: {e.strerror or e}") from e
        if e is not None:
            raise RuntimeError(f"transfer thread failed: {e!r}") from e

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # surfaced to the runtime's thread by _raise_error
                with self._cond:
                    self.error = e
                    for buf in self._steps.values():
                        buf.ready.set()
                    self._cond.notify_all()

        return run

    def _submit(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            if isinstance(job, Upload):
                self._uploads.put(job)
            else:
                self._io_pending[job.job_id] = job
                self._outstanding.add(job.job_id)
                if isinstance(job, WriteBack):
                    self._writing[job.job_id] = job.seg_id
        self._cond.notify_all()

    def _complete(self, job_id: int, ok: bool, failure: Failure | None = None) -> None:
        follow = self.pm.complete(job_id, ok, failure)
        self._outstanding.discard(job_id)
        self._writing.pop(job_id, None)
        self._drain_events()
        self._submit(follow)
        self._check_ready()

    def _drain_events(self) -> None:
        for e in self.pm.take_events():
            if isinstance(e, Evicted | Spilled):
                self._host.pop(e.seg_id, None)
            elif isinstance(e, DiskFull):
                for jid in e.cancelled:
                    self._io_pending.pop(jid, None)
                    self._outstanding.discard(jid)
                    self._writing.pop(jid, None)
            elif isinstance(e, Corrupt) and e.seg_id in self._read_failures:
                slot, reason = self._read_failures.pop(e.seg_id)
                e = dataclasses.replace(e, slot=slot, reason=reason)
            self.events.append(e)

    def _check_ready(self) -> None:
        for step, buf in self._steps.items():
            if not buf.ready.is_set() and self.pm.buffer_ready(step):
                buf.ready.set()

    def _next_io(self) -> IoJob | None:
        """The next job to start in PageManager order, or None when closing with nothing left."""
        while True:
            for j in self.pm.io_queue():
                job = self._io_pending.pop(j.job_id, None)
                if job is not None:
                    return job
            if self._closing:
                return None
            self._cond.wait()

    def _io_loop(self) -> None:  # no lock held on entry
        while True:
            with self._cond:
                job = self._next_io()
                if job is None:
                    return
                slot = self._slot_of.get(job.seg_id)
                payload = self._host.get(job.seg_id)
                info = self._info[job.seg_id]
            if isinstance(job, Read):
                self._do_read(job, slot)
            else:
                self._do_write(job, info, payload)

    def _do_read(self, job: Read, slot: int | None) -> None:
        data: bytes | None = None
        reason = "not in the log"
        if slot is not None:
            try:
                h, data = self._read_slot(job, slot)
                if h.segment_id != job.seg_id or len(data) != job.nbytes:
                    reason = f"holds segment {h.segment_id} of {len(data)} bytes"
                    data = None
            except CorruptSlotError as e:
                reason = e.reason
                self.log.mark_corrupt(slot, reason)  # retired: a later resume neither counts nor reports it
            except OSError as e:  # (it persisted through every retry: the slot is not retired)
                reason = f"unreadable after {max(0, self.read_retries) + 1} attempts: {e}"
        with self._cond:
            self.reads += 1
            if data is None:  # its Corrupt event says which slot failed, and why (_drain_events)
                self._read_failures[job.seg_id] = (slot, reason)
                self._complete(job.job_id, False, Failure.CORRUPT)
                return
            self.bytes_read += HEADER_SIZE + len(data)
            self._host[job.seg_id] = data
            self._complete(job.job_id, True)

    def _read_slot(self, job: Read, slot: int) -> tuple[SegmentHeader, bytes]:
        """``slot``'s header and payload through the throttle (no lock held). An OS error is retried
        ``read_retries`` times (a transient one -- EIO, EINTR, EAGAIN -- usually clears), each logged;
        the last one is raised. A failed integrity check (`CorruptSlotError`) is never retried."""
        delay, retries = self.read_retry_delay_s, max(0, self.read_retries)
        for attempt in range(1, retries + 2):
            try:
                return self.throttle.run(lambda: self.log.read(slot), HEADER_SIZE + job.nbytes)
            except CorruptSlotError:
                raise
            except OSError as e:
                if attempt > retries:
                    logger.error(
                        "%s: slot %d (segment %d): read failed %d times, giving the segment up: %s",
                        self.log.path, slot, job.seg_id, attempt, e,
                    )  # fmt: skip
                    raise
                logger.warning(
                    "%s: slot %d (segment %d): read failed (attempt %d of %d), retrying in %.3g s: %s",
                    self.log.path, slot, job.seg_id, attempt, retries + 1, delay, e,
                )  # fmt: skip
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def _do_write(self, job: WriteBack, info: SegmentInfo, payload: bytes | None) -> None:
        assert payload is not None, f"write-back of segment {job.seg_id} without a host copy"
        slot = self._append(info, payload)
        with self._cond:
            if slot is None:
                self._complete(job.job_id, False, Failure.DISK_FULL)
                return
            self._slot_of[job.seg_id] = slot
            self.bytes_written += HEADER_SIZE + len(payload)
            self._complete(job.job_id, True)

    def _append(self, info: SegmentInfo, payload: bytes) -> int | None:
        """Append one segment to the log (no lock held); its slot, or None when the log is full. An
        OS error (a failed append leaves the log as it was) is retried ``write_retries`` times, each
        logged; the last one is raised (from the I/O thread: the handler fails, loudly)."""
        p = info.pose
        delay, retries = self.write_retry_delay_s, max(0, self.write_retries)
        for attempt in range(1, retries + 2):
            try:
                return self.log.append(
                    segment_id=info.segment_id,
                    frame_start=info.frame_start,
                    frame_end=info.frame_end,
                    pose=(p.x, p.y, p.z, p.pitch, p.yaw),
                    codec=self.layout.codec,
                    position_state="post-rope",
                    position=info.frame_start,
                    payload=payload,
                    page_offsets=self.layout.page_offsets,
                )
            except LogFullError:
                return None
            except OSError as e:
                if attempt > retries:
                    logger.error(
                        "%s: segment %d: write failed %d times: %s",
                        self.log.path, info.segment_id, attempt, e,
                    )  # fmt: skip
                    raise
                logger.warning(
                    "%s: segment %d: write failed (attempt %d of %d), retrying in %.3g s: %s",
                    self.log.path, info.segment_id, attempt, retries + 1, delay, e,
                )  # fmt: skip
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def _upload_loop(self) -> None:
        while (job := self._uploads.get()) is not None:
            with self._cond:
                buf = self._steps.get(job.step)
                if buf is not None:  # else: released while queued (its host copy may be gone too)
                    payload = self._host[job.seg_id]
                    from_frame = self._info[job.seg_id].frame_start
            kv: list[KV] | None = None
            ev: torch.cuda.Event | None = None
            if buf is not None:  # else: nothing to place
                kv, ev = self._upload(payload, from_frame, buf.targets[job.slot], buf, job.slot)
            with self._cond:
                if buf is not None and kv is not None:
                    buf.kv[job.slot] = True
                    if ev is not None:
                        buf.cuda_events.append(ev)
                self._complete(job.job_id, True)

    def _upload(
        self, payload: bytes, from_frame: int, to_frame: int, buf: _StepBuf, slot: int
    ) -> tuple[list[KV], torch.cuda.Event | None]:
        """Place segment ``payload`` in ``buf``'s ``slot``, its keys re-rotated from ``from_frame`` to
        ``to_frame``: page by page (one layer's bytes staged, decoded and copied into the buffer at
        a time, `staging_bytes`), so an upload never holds a whole segment's decoded KV besides the
        buffer. The slot's views of the buffer, and on CUDA the event that says they are written."""
        layout, n = self.layout, self.layout.page_nbytes
        view = memoryview(payload)
        placed: list[KV] = []
        if not self._cuda:
            for i, off in enumerate(layout.page_offsets):
                page = torch.frombuffer(bytearray(view[off : off + n]), dtype=torch.uint8)
                kv = layout.rerotate([layout.decode_page(page)], from_frame, to_frame)[0]
                placed.append(self._place(buf, slot, i, kv))
            return placed, None
        assert self._stream is not None
        with torch.cuda.stream(self._stream):  # H2D of the compressed bytes, then decode on the device
            for i, off in enumerate(layout.page_offsets):
                host = torch.frombuffer(bytearray(view[off : off + n]), dtype=torch.uint8).pin_memory()
                dev = host.to(self.device, non_blocking=True)
                kv = layout.rerotate([layout.decode_page(dev)], from_frame, to_frame)[0]
                placed.append(self._place(buf, slot, i, kv))
                del host, dev, kv  # (reused in this stream's order: after the copies above)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        # (the stream that reads them is told in `memory`: the caller's, not this thread's)
        return placed, ev

    def _place(self, buf: _StepBuf, slot: int, layer: int, kv: KV) -> KV:
        """Copy one layer's ``kv`` into ``slot`` of ``buf``'s buffer, allocated (every layer, every
        placed slot) at its first upload; the slot's views. Upload thread only."""
        k, v = kv
        t = k.shape[1]
        if buf.store is None:
            n = len(buf.slot_seg) * t
            buf.store = [
                (k.new_empty((k.shape[0], n, *k.shape[2:])), v.new_empty((v.shape[0], n, *v.shape[2:])))
                for _ in range(self.layout.layers)
            ]
        sk, sv = buf.store[layer]
        dk, dv = sk[:, slot * t : (slot + 1) * t], sv[:, slot * t : (slot + 1) * t]
        dk.copy_(k)
        dv.copy_(v)
        return dk, dv
