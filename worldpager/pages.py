"""Page bookkeeping for WorldPager: where each segment's KV lives, and which transfers to run.

Pure Python (no torch, no I/O, no clock, no randomness). A *segment* is one MG2 block; its KV is final
after the block's clean context pass. Tiers: two GPU retrieval buffers (step ``n`` uses buffer
``n % 2``, so step n+1's slots fill while step n computes), host DRAM with a byte budget, and an NVMe
log. A transfer side runs the jobs handed out here (frozen dataclasses, unique ``job_id``).

Protocol (per step ``n``, all calls from the runtime):

1. ``add_segment(seg, nbytes)`` when a block's KV is final -> ``[WriteBack]`` (the segment is dirty
   in host), or ``Backpressure`` (NOT added; see there). When no spill can make room (every host byte
   protected or reading), the transfer side writes the segment to the log itself and registers it
   with ``add_on_nvme``; ``disk_full`` if the log refuses it.
2. ``prepare_step(n + 1, wanted)`` at the start of step n -> ``StepPlan``: ``Read`` (NVMe->host) for
   host misses, ``Upload`` (host->GPU slot) for host hits.
3. The transfer side starts I/O jobs in ``io_queue()`` order (prefetch reads > spills > write-backs;
   live: a write-back becomes a spill when its segment must leave host), uploads on its H2D stream,
   and reports each job once with ``complete(job_id, ok, failure)``, which returns follow-up jobs
   (the ``Upload`` of a segment whose ``Read`` landed; the retry of a ``TRANSIENT`` failure).
4. ``buffer_ready(n + 1)`` before step n+1 attends to its slots; ``release_step(n)`` after step n.
   A step released with uploads still in flight keeps the host copies they read (protected, never
   evicted) until each upload completes; its buffer is handed out again only then.
5. ``take_events()`` drains what happened. ``lookup`` and ``resize`` may come between any calls.
   A shrink can leave a step prepared before it out of the new lease (more slots than a buffer now
   has, or host held over budget by the segments it protects): ``needs_replan(step)`` then says so
   (until it is released), and the runtime releases it and prepares it again before it runs.

Each job is handed out once and completed once, except write-backs cancelled by ``DiskFull`` (their
completion is optional). ``Backpressure.spills`` and ``resize``'s result name write-backs that were
already handed out (now at SPILL priority): wait for them, never start them twice.

Thread safety: none. The runtime serialises every call; transfer threads report completions to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from worldpager.page_types import (
    Backpressure,
    Corrupt,
    DiskFull,
    Event,
    Evicted,
    Failure,
    GpuSlot,
    IoJob,
    IoPriority,
    Job,
    LeaseResized,
    Location,
    ProtocolError,
    Read,
    ReadBack,
    SegId,
    SegState,
    Spilled,
    StepPlan,
    Upload,
    WriteBack,
)

__all__ = [
    "Backpressure",
    "Corrupt",
    "DiskFull",
    "Event",
    "Evicted",
    "Failure",
    "GpuSlot",
    "IoJob",
    "IoPriority",
    "Job",
    "LeaseResized",
    "Location",
    "PageManager",
    "ProtocolError",
    "Read",
    "ReadBack",
    "SegId",
    "SegState",
    "Spilled",
    "StepPlan",
    "Upload",
    "WriteBack",
]

_IN_HOST = (SegState.HOST_CLEAN, SegState.HOST_DIRTY, SegState.READING)


@dataclass
class _Seg:
    nbytes: int
    state: SegState
    job: int | None = None  # its outstanding Read or WriteBack
    spill: bool = False  # leave host as soon as it is written back


@dataclass
class _Step:
    buffer: int
    slots: dict[SegId, int]
    waiting: set[SegId]  # Read outstanding, Upload not issued yet
    uploading: set[SegId]  # Upload issued, not completed
    outdated: bool = False  # a lease shrink after it was prepared may leave it out of the lease


def _check_fits(name: str, budget: int, need: int, what: str = "one segment") -> None:
    if budget < need:
        raise ValueError(f"{name}={budget} is smaller than {what} ({need} bytes); the tier cannot hold it")


class PageManager:
    """Segment residency across GPU buffers, host DRAM and NVMe (see the module docstring).

    Host rule: host bytes (clean + dirty + reserved for reads) never exceed ``host_budget_bytes``,
    except after ``resize`` shrinks it below what dirty/protected/reading segments hold: that excess
    is ``pending_bytes`` until spills complete or steps release. Only clean segments are evicted,
    least recently used first (uses: being wanted, a read or write-back landing), never one
    *protected* (wanted by an unreleased step, or read by an upload still in flight).
    ``gpu_slot_bytes``: one attention-ready slot.
    """

    def __init__(
        self,
        host_budget_bytes: int,
        gpu_slot_bytes: int,
        slots_per_buffer: int,
        nvme_enabled: bool = True,
        segment_bytes: int | None = None,
    ) -> None:
        if host_budget_bytes <= 0 or gpu_slot_bytes <= 0 or slots_per_buffer < 1:
            raise ValueError("host_budget_bytes and gpu_slot_bytes must be > 0, slots_per_buffer >= 1")
        _check_fits("host_budget_bytes", host_budget_bytes, segment_bytes or 0)
        self.host_budget_bytes, self.gpu_slot_bytes = host_budget_bytes, gpu_slot_bytes
        self.slots_per_buffer, self.nvme_enabled = slots_per_buffer, nvme_enabled
        self.gpu_budget_bytes = 2 * slots_per_buffer * gpu_slot_bytes  # the GPU lease (both buffers)
        self.host_used_bytes = 0
        self._largest = segment_bytes or 1  # a host budget must hold the largest segment
        self._segs: dict[SegId, _Seg] = {}
        self._clean: OrderedDict[SegId, None] = OrderedDict()  # LRU order, oldest first
        self._dirty: OrderedDict[SegId, None] = OrderedDict()  # age order: spill candidates first
        self._clean_bytes = 0
        self._protect: dict[SegId, int] = {}  # wanted by how many unreleased steps (or their uploads)
        self._steps: dict[int, _Step] = {}
        self._owner: list[int | None] = [None, None]  # the step holding each buffer
        self._in_flight = [0, 0]  # uploads outstanding per buffer
        self._jobs: dict[int, Job] = {}
        self._cancelled: dict[int, WriteBack] = {}
        self._events: list[Event] = []
        self._next_job = 0
        self._draining = False  # over budget after a shrink

    # ---- queries ------------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        return max(0, self.host_used_bytes - self.host_budget_bytes)

    def lookup(self, seg_id: SegId) -> Location | None:
        """Where a segment is (None: never added)."""
        seg = self._segs.get(seg_id)
        if seg is None:
            return None
        gpu = tuple(
            GpuSlot(n, st.buffer, st.slots[seg_id], seg_id not in (st.waiting | st.uploading))
            for n, st in self._steps.items()
            if seg_id in st.slots
        )
        return Location(seg_id, seg.state, seg.nbytes, gpu)

    def needs_replan(self, step: int) -> bool:
        """Whether prepared ``step`` must be released and prepared again before it runs, because a
        ``resize`` since it was prepared left it out of the lease in force: it has more slots than a
        buffer now has, or the host is still over its budget (``pending_bytes``) while it protects
        segments there. False for a step not prepared, and for one prepared after the last shrink
        (a step prepared again is planned within the lease: never re-planned twice for one shrink)."""
        st = self._steps.get(step)
        if st is None or not st.outdated:
            return False
        return len(st.slots) > self.slots_per_buffer or (self.pending_bytes > 0 and bool(st.slots))

    def buffer_ready(self, step: int) -> bool:
        """Every segment placed for ``step`` is uploaded (False if not prepared)."""
        st = self._steps.get(step)
        return st is not None and not st.waiting and not st.uploading

    def priority(self, job: IoJob) -> IoPriority:
        if isinstance(job, Read):
            return IoPriority.PREFETCH
        return IoPriority.SPILL if self._segs[job.seg_id].spill else IoPriority.WRITE_BACK

    def io_queue(self) -> list[IoJob]:
        """Outstanding NVMe jobs, the one to start first first: by (priority, issue order)."""
        io = [j for j in self._jobs.values() if not isinstance(j, Upload)]
        return sorted(io, key=lambda j: (self.priority(j), j.job_id))

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # ---- phase 1: decisions -------------------------------------------------------------------
    def add_segment(self, seg_id: SegId, nbytes: int) -> list[Job] | Backpressure:
        """A finished segment enters host dirty, with a WriteBack (none in host-only mode).

        Room comes from evicting clean unprotected LRU segments. When that cannot make room nothing
        changes, except that the oldest dirty segments are marked to spill (``Backpressure``).
        Raises ValueError for a duplicate id, or a size <= 0 or over the host budget.
        """
        if seg_id in self._segs or nbytes <= 0:
            raise ValueError(f"add_segment({seg_id}, {nbytes}): duplicate id or nbytes <= 0")
        _check_fits("host_budget_bytes", self.host_budget_bytes, nbytes)
        protected_clean = sum(self._segs[s].nbytes for s in self._protect if s in self._clean)
        room = self.host_budget_bytes - self.host_used_bytes + self._clean_bytes - protected_clean
        if room < nbytes:
            return Backpressure(seg_id, nbytes, nbytes - room, self._mark_spills(nbytes - room))
        made = self._make_room(nbytes)
        assert made, "room was counted above"
        self._largest = max(self._largest, nbytes)
        self._segs[seg_id] = _Seg(nbytes, SegState.HOST_DIRTY)
        self._dirty[seg_id] = None
        self.host_used_bytes += nbytes
        return [self._issue_write_back(seg_id)] if self.nvme_enabled else []

    def add_on_nvme(self, seg_id: SegId, nbytes: int) -> None:
        """A finished segment that is only on NVMe: written straight to the log by the transfer side
        (a write-through) because ``add_segment`` found no host room it could make (``Backpressure``
        with no spills: host holds only protected or reading bytes). It is read back when wanted,
        like a spilled segment. Raises ValueError for a duplicate id, or a size <= 0 or over the
        host budget (it could never be read back)."""
        if seg_id in self._segs or nbytes <= 0:
            raise ValueError(f"add_on_nvme({seg_id}, {nbytes}): duplicate id or nbytes <= 0")
        _check_fits("host_budget_bytes", self.host_budget_bytes, nbytes)
        self._largest = max(self._largest, nbytes)
        self._segs[seg_id] = _Seg(nbytes, SegState.NVME)

    def disk_full(self, seg_id: SegId) -> None:
        """The log refused a write made outside a WriteBack job (a write-through of ``seg_id``, which
        was not added): host-only mode, as after a write-back failing with ``DISK_FULL`` (a
        DiskFull event, the outstanding write-backs cancelled). Nothing happens in host-only mode."""
        if self.nvme_enabled:
            self._host_only(seg_id)

    def prepare_step(self, step: int, wanted: Iterable[SegId], *, place_by_id: bool = False) -> StepPlan:
        """Plan buffer ``step % 2`` for ``step``'s retrieval set (best first, duplicates ignored).

        The first ``slots_per_buffer`` available segments are placed (the rest are ``dropped``), in
        ``wanted`` order or, with ``place_by_id``, in id order (slot order is placement order); a
        miss that finds no host room is ``unavailable`` and leaves its slot to the next one wanted.
        Host hits get an Upload now; NVMe misses a Read (room from evicting clean LRU segments no
        unreleased step wants), and their Upload when it lands. Placed segments stay protected until
        ``release_step(step)``. ProtocolError if ``step`` is prepared, or its buffer is held by
        another step or still has uploads in flight.
        """
        buffer = step % 2
        if step in self._steps or self._owner[buffer] is not None or self._in_flight[buffer]:
            raise ProtocolError(
                f"prepare_step({step}): already prepared, or buffer {buffer} busy (held by step "
                f"{self._owner[buffer]}, {self._in_flight[buffer]} uploads in flight)"
            )
        unknown: list[SegId] = []
        unavailable: list[SegId] = []
        dropped: list[SegId] = []
        candidates: list[SegId] = []
        for sid in dict.fromkeys(wanted):
            seg = self._segs.get(sid)
            if seg is None:
                unknown.append(sid)
            elif seg.state is SegState.LOST:
                unavailable.append(sid)
            else:
                candidates.append(sid)
        for sid in candidates:  # protect them all first: a miss's room never evicts another wanted one
            self._protect[sid] = self._protect.get(sid, 0) + 1
        st = self._steps[step] = _Step(buffer, {}, set(), set())
        self._owner[buffer] = step
        reads: dict[SegId, Read] = {}
        first, rest = candidates[: self.slots_per_buffer], candidates[self.slots_per_buffer :]
        placed: list[SegId] = []
        # the first wanted, best first (host room goes to the best when it is short; `place_by_id`
        # orders the slots below), then the next ones for slots a miss without room left
        for sid in [*first, *rest]:
            seg = self._segs[sid]
            if len(placed) == self.slots_per_buffer:
                dropped.append(sid)
            elif seg.state is SegState.NVME and not self._make_room(seg.nbytes):
                unavailable.append(sid)
            else:
                if seg.state is SegState.NVME:  # reserve its room now (a Read needs no slot)
                    self.host_used_bytes += seg.nbytes
                    reads[sid] = self._issue_read(sid)
                placed.append(sid)
                continue
            self._unprotect(sid)
        if place_by_id:
            placed.sort()
        jobs: list[Job] = []  # in slot order
        for sid in placed:
            st.slots[sid] = len(st.slots)
            if self._segs[sid].state is SegState.READING:  # its Upload follows when the Read lands
                st.waiting.add(sid)
                if sid in reads:  # (else a Read already in flight)
                    jobs.append(reads[sid])
                continue
            if sid in self._clean:
                self._clean.move_to_end(sid)
            jobs.append(self._issue_upload(step, st, sid))
        return StepPlan(
            step, buffer, dict(st.slots), tuple(jobs), tuple(unknown), tuple(unavailable), tuple(dropped)
        )

    def release_step(self, step: int) -> None:
        """Step ``step`` is done: its segments lose protection, its buffer is free (for
        ``prepare_step`` once the uploads still in flight to it complete). A segment whose upload is
        still in flight keeps its protection until that upload completes: the copy reads its host
        bytes, so they are never evicted (handed to another segment) under it. ProtocolError if
        ``step`` is not prepared."""
        st = self._steps.pop(step, None)
        if st is None:
            raise ProtocolError(f"release_step({step}): step is not prepared")
        self._owner[st.buffer] = None
        for sid in st.slots:
            if sid not in st.uploading:  # (else unprotected when its upload completes)
                self._unprotect(sid)
        self._drain()

    def resize(self, host_budget_bytes: int | None = None, gpu_budget_bytes: int | None = None) -> list[Job]:
        """The elastic lease; growing is immediate.

        GPU (bytes for both buffers): ``slots_per_buffer = gpu_budget_bytes // (2 * gpu_slot_bytes)``
        for steps prepared from now on. A smaller host budget evicts clean LRU segments; what is still
        over is ``pending_bytes`` (no add or read is admitted meanwhile) and the oldest dirty segments
        are marked to spill: their write-backs (already handed out) are returned. Host-only mode
        cannot spill: pending bytes then last until steps release or the budget grows.
        A step prepared before a shrink keeps its plan here (its uploads may be in flight), but once
        that plan is out of the new lease ``needs_replan`` says so: the runtime re-plans it (release,
        prepare again) before it runs, so it never runs on slots or host room the lease no longer has.
        Raises ValueError for a budget smaller than one segment (or one slot per buffer); then
        neither budget changes.
        """
        if gpu_budget_bytes is not None:  # both checked before either changes
            _check_fits("gpu_budget_bytes", gpu_budget_bytes, 2 * self.gpu_slot_bytes, "one slot per buffer")
        if host_budget_bytes is not None:
            _check_fits("host_budget_bytes", host_budget_bytes, self._largest)
        if gpu_budget_bytes is not None:
            shrunk = gpu_budget_bytes // (2 * self.gpu_slot_bytes) < self.slots_per_buffer
            self.slots_per_buffer = gpu_budget_bytes // (2 * self.gpu_slot_bytes)
            self.gpu_budget_bytes = gpu_budget_bytes
            if shrunk:
                self._outdate()
        spills: tuple[WriteBack, ...] = ()
        if host_budget_bytes is not None:
            if host_budget_bytes < self.host_budget_bytes:
                self._outdate()
            self.host_budget_bytes = host_budget_bytes
            self._draining = True
            self._drain()
            spills = self._mark_spills(self.pending_bytes)
        self._events.append(LeaseResized(self.host_budget_bytes, self.slots_per_buffer, self.pending_bytes))
        return list(spills)

    # ---- phase 2: completions -----------------------------------------------------------------
    def complete(self, job_id: int, ok: bool = True, failure: Failure | None = None) -> list[Job]:
        """The transfer side finished ``job_id``; returns the follow-up jobs.

        Read ok: clean in host, Uploads for the steps waiting. Read failed: TRANSIENT -> re-read
        if a step waits; else (CORRUPT) -> LOST, a Corrupt event, taken out of its steps (never
        uploaded). WriteBack ok: clean (evicted at once if marked to spill and unprotected).
        WriteBack failed: TRANSIENT -> retried; else (DISK_FULL) -> host-only mode, a DiskFull
        event, the other write-backs cancelled; dirty segments stay in host. Upload failed: retried.
        """
        job = self._jobs.pop(job_id, None) or self._cancelled.pop(job_id, None)
        if job is None:
            raise ProtocolError(f"complete({job_id}): unknown or already completed job")
        if isinstance(job, Read):
            out = self._read_done(job, ok, failure)
        elif isinstance(job, WriteBack):
            out = self._write_done(job, ok, failure)
        else:
            out = self._upload_done(job, ok)
        self._drain()
        return out

    def _read_done(self, job: Read, ok: bool, failure: Failure | None) -> list[Job]:
        sid, seg = job.seg_id, self._segs[job.seg_id]
        seg.job = None
        waiters = [(n, st) for n, st in self._steps.items() if sid in st.waiting]
        if ok:
            self._to_clean(sid, seg)
            self._events.append(ReadBack(sid, seg.nbytes))
            for _, st in waiters:
                st.waiting.discard(sid)
            return [self._issue_upload(n, st, sid) for n, st in waiters]
        if failure is Failure.TRANSIENT and waiters:
            return [self._issue_read(sid)]  # its host room stays reserved
        self.host_used_bytes -= seg.nbytes
        seg.state = SegState.NVME if failure is Failure.TRANSIENT else SegState.LOST
        if seg.state is SegState.LOST:
            self._events.append(Corrupt(sid, seg.nbytes))
        for _, st in waiters:
            st.waiting.discard(sid)
            del st.slots[sid]
            self._unprotect(sid)
        return []

    def _write_done(self, job: WriteBack, ok: bool, failure: Failure | None) -> list[Job]:
        sid, seg = job.seg_id, self._segs[job.seg_id]
        if seg.job == job.job_id:
            seg.job = None
        if ok:  # (also for a cancelled write-back that made it to disk after all)
            del self._dirty[sid]
            self._to_clean(sid, seg)
            if seg.spill and sid not in self._protect:
                self._evict(sid, spilled=True)
            seg.spill = False
            return []
        if not self.nvme_enabled:  # a cancelled write-back failing: nothing more to do
            return []
        if failure is Failure.TRANSIENT:
            return [self._issue_write_back(sid)]
        self._host_only(sid)
        return []

    def _upload_done(self, job: Upload, ok: bool) -> list[Job]:
        self._in_flight[job.buffer] -= 1
        st = self._steps.get(job.step)
        if st is None:  # released while in flight: the copy no longer reads the segment's host bytes
            self._unprotect(job.seg_id)
            return []
        st.uploading.discard(job.seg_id)
        return [] if ok else [self._issue_upload(job.step, st, job.seg_id)]

    # ---- internals ----------------------------------------------------------------------------
    def _host_only(self, sid: SegId) -> None:
        """The log is full: no more write-backs (the outstanding ones are cancelled), a DiskFull event."""
        self.nvme_enabled = False
        cancelled = [j for j in self._jobs.values() if isinstance(j, WriteBack)]
        for wb in cancelled:
            self._cancelled[wb.job_id] = self._jobs.pop(wb.job_id)  # type: ignore[assignment]
            self._segs[wb.seg_id].job = None
        for s in self._dirty:
            self._segs[s].spill = False
        self._events.append(DiskFull(sid, tuple(wb.job_id for wb in cancelled)))

    def _new_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _issue_write_back(self, sid: SegId) -> WriteBack:
        seg = self._segs[sid]
        job = WriteBack(self._new_id(), sid, seg.nbytes)
        self._jobs[job.job_id], seg.job = job, job.job_id
        return job

    def _issue_read(self, sid: SegId) -> Read:
        seg = self._segs[sid]
        job = Read(self._new_id(), sid, seg.nbytes)
        self._jobs[job.job_id], seg.job, seg.state = job, job.job_id, SegState.READING
        return job

    def _issue_upload(self, step: int, st: _Step, sid: SegId) -> Upload:
        job = Upload(self._new_id(), sid, step, st.buffer, st.slots[sid])
        self._jobs[job.job_id] = job
        st.uploading.add(sid)
        self._in_flight[st.buffer] += 1
        return job

    def _unprotect(self, sid: SegId) -> None:
        left = self._protect.pop(sid) - 1
        if left:
            self._protect[sid] = left

    def _to_clean(self, sid: SegId, seg: _Seg) -> None:
        seg.state = SegState.HOST_CLEAN
        self._clean[sid] = None
        self._clean_bytes += seg.nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Evict clean unprotected LRU segments until ``nbytes`` fit; False if they cannot."""
        while self.host_budget_bytes - self.host_used_bytes < nbytes:
            victim = next((s for s in self._clean if s not in self._protect), None)
            if victim is None:
                return False
            self._evict(victim, spilled=False)
        return True

    def _evict(self, sid: SegId, spilled: bool) -> None:
        seg = self._segs[sid]
        del self._clean[sid]
        seg.state = SegState.NVME
        self.host_used_bytes -= seg.nbytes
        self._clean_bytes -= seg.nbytes
        self._events.append(Spilled(sid, seg.nbytes) if spilled else Evicted(sid, seg.nbytes))

    def _outdate(self) -> None:
        """A shrink: every step prepared so far may now be out of the lease (see ``needs_replan``)."""
        for st in self._steps.values():
            st.outdated = True

    def _drain(self) -> None:
        """After a shrink: back under budget as far as clean unprotected segments allow."""
        if self._draining:
            self._make_room(0)
            self._draining = self.pending_bytes > 0

    def _mark_spills(self, shortfall: int) -> tuple[WriteBack, ...]:
        """Mark the oldest dirty segments covering ``shortfall`` bytes to spill; their write-backs."""
        spills: list[WriteBack] = []
        for sid in self._dirty if self.nvme_enabled else ():
            if shortfall <= 0:
                break
            seg = self._segs[sid]
            seg.spill, shortfall = True, shortfall - seg.nbytes
            job = self._jobs[seg.job or 0]
            assert isinstance(job, WriteBack), f"dirty segment {sid} has no write-back"
            spills.append(job)
        return tuple(spills)

    # ---- invariants (tests) -------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants (O(segments), for tests)."""
        by_state: dict[SegState, set[SegId]] = {s: set() for s in SegState}
        for sid, seg in self._segs.items():
            by_state[seg.state].add(sid)
            job = self._jobs.get(seg.job or 0)
            assert seg.state is not SegState.READING or isinstance(job, Read), f"{sid} reading, no Read"
            if seg.state is SegState.HOST_DIRTY and self.nvme_enabled:
                assert isinstance(job, WriteBack), f"dirty segment {sid} has no write-back"
        assert self.host_used_bytes == sum(self._segs[s].nbytes for t in _IN_HOST for s in by_state[t])
        assert set(self._clean) == by_state[SegState.HOST_CLEAN]
        assert set(self._dirty) == by_state[SegState.HOST_DIRTY]
        assert self._clean_bytes == sum(self._segs[s].nbytes for s in self._clean)
        if self.host_used_bytes > self.host_budget_bytes:
            assert self._draining, "over the host budget without a shrink"
            assert all(s in self._protect for s in self._clean), "over budget with an evictable segment"
        counts: dict[SegId, int] = {}
        for j in self._jobs.values():  # an upload reads a host copy: protected, even once released
            if isinstance(j, Upload):
                assert self._segs[j.seg_id].state in _IN_HOST, (
                    f"upload {j.job_id}: segment {j.seg_id} not in host"
                )
                if j.step not in self._steps:
                    counts[j.seg_id] = counts.get(j.seg_id, 0) + 1
        for n, st in self._steps.items():
            assert st.buffer == n % 2 and self._owner[st.buffer] == n, f"step {n}: buffer mix-up"
            assert len(set(st.slots.values())) == len(st.slots), f"step {n}: slot handed out twice"
            assert (st.waiting | st.uploading) <= st.slots.keys() and not st.waiting & st.uploading
            for sid in st.slots:
                counts[sid] = counts.get(sid, 0) + 1
                assert self._segs[sid].state in _IN_HOST, f"placed segment {sid} not in host"
        assert counts == self._protect, "protection counts drifted"
        in_flight = [0, 0]
        for j in self._jobs.values():
            if isinstance(j, Upload):
                in_flight[j.buffer] += 1
                assert self._owner[j.buffer] in (j.step, None), "buffer reused while uploading"
        assert in_flight == self._in_flight
