"""PageManager (worldpager/pages.py): narrated scenarios, one step per line, then a random-operation
state machine that keeps `check()` true.

Sizes are tiny: a segment is 10 bytes, so a 30-byte host holds three. `jobs_of(result)` unwraps an
`add_segment` result that must not be backpressure.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worldpager.pages import (
    Backpressure,
    Corrupt,
    DiskFull,
    Evicted,
    Failure,
    IoPriority,
    Job,
    LeaseResized,
    PageManager,
    ProtocolError,
    Read,
    ReadBack,
    SegState,
    Spilled,
    Upload,
    WriteBack,
)

SEG = 10


def jobs_of(result: list[Job] | Backpressure) -> list[Job]:
    assert not isinstance(result, Backpressure), result
    return result


def wb(result: list[Job] | Backpressure) -> WriteBack:
    (job,) = jobs_of(result)
    assert isinstance(job, WriteBack)
    return job


def state(pm: PageManager, seg: int) -> SegState:
    loc = pm.lookup(seg)
    assert loc is not None
    return loc.state


def written(pm: PageManager, *segs: int) -> None:
    """Add each segment and complete its write-back: it ends clean in host."""
    for s in segs:
        pm.complete(wb(pm.add_segment(s, SEG)).job_id)


def kinds(jobs: tuple[Job, ...] | list[Job]) -> list[tuple[str, int]]:
    return [(type(j).__name__, j.seg_id) for j in jobs]


class TestHostEviction:
    def test_clean_lru_segments_make_room(self) -> None:
        pm = PageManager(host_budget_bytes=3 * SEG, gpu_slot_bytes=40, slots_per_buffer=2)
        written(pm, 1, 2, 3)  # host full, all clean (on NVMe too)
        assert pm.host_used_bytes == 30
        w4 = wb(pm.add_segment(4, SEG))  # 4 enters dirty; 1 (least recent) is evicted for it
        assert pm.take_events() == [Evicted(1, SEG)]
        assert state(pm, 1) is SegState.NVME and state(pm, 4) is SegState.HOST_DIRTY
        pm.complete(w4.job_id)  # 4 is clean now
        plan = pm.prepare_step(0, [2])  # wanting 2 makes it the most recent
        pm.complete(plan.jobs[0].job_id)
        pm.release_step(0)
        wb(pm.add_segment(5, SEG))  # so 3 goes, not 2
        assert pm.take_events() == [Evicted(3, SEG)]
        assert pm.host_used_bytes == 30
        pm.check()

    def test_dirty_segments_are_never_evicted_before_their_write_back(self) -> None:
        pm = PageManager(3 * SEG, 40, 2)
        w1, w2, _ = (wb(pm.add_segment(s, SEG)) for s in (1, 2, 3))  # three dirty segments
        bp = pm.add_segment(4, SEG)  # no clean segment to evict: 4 is refused, not squeezed in
        assert bp == Backpressure(4, SEG, shortfall=SEG, spills=(w1,))
        assert pm.lookup(4) is None and pm.host_used_bytes == 30
        assert pm.priority(w1) is IoPriority.SPILL  # the oldest is hurried, and will leave host
        assert pm.priority(w2) is IoPriority.WRITE_BACK
        pm.check()
        pm.complete(w2.job_id)  # an ordinary write-back: 2 turns clean and stays
        assert state(pm, 2) is SegState.HOST_CLEAN and pm.take_events() == []
        pm.complete(w1.job_id)  # the spill lands: 1 leaves host at once
        assert pm.take_events() == [Spilled(1, SEG)]
        wb(pm.add_segment(4, SEG))  # the retry fits without evicting anyone
        assert pm.take_events() == [] and pm.host_used_bytes == 30
        pm.check()

    def test_protected_segments_are_not_evicted(self) -> None:
        pm = PageManager(3 * SEG, 40, 2)
        written(pm, 1)
        plan = pm.prepare_step(0, [1])  # step 0 wants 1...
        written(pm, 2, 3)  # ...and 1 is the least recently used when host fills up
        wb(pm.add_segment(4, SEG))  # so 2 is evicted instead
        assert pm.take_events() == [Evicted(2, SEG)]
        assert state(pm, 1) is SegState.HOST_CLEAN and plan.slots == {1: 0}
        pm.check()

    def test_a_spill_wanted_by_a_step_stays_until_released(self) -> None:
        pm = PageManager(3 * SEG, 40, 2)
        w1, _, _ = (wb(pm.add_segment(s, SEG)) for s in (1, 2, 3))
        assert isinstance(pm.add_segment(4, SEG), Backpressure)  # 1 is marked to spill
        (up,) = pm.prepare_step(0, [1]).jobs  # then step 0 wants it: uploaded from its dirty copy
        pm.complete(w1.job_id)  # written back, but protected: it stays in host, clean
        assert state(pm, 1) is SegState.HOST_CLEAN and pm.take_events() == []
        pm.complete(up.job_id)
        pm.release_step(0)  # unprotected: an ordinary clean segment now (not over budget)
        assert state(pm, 1) is SegState.HOST_CLEAN
        wb(pm.add_segment(4, SEG))  # the retry evicts it, as the least recently used clean one
        assert pm.take_events() == [Evicted(1, SEG)]
        pm.check()


class TestStepPlan:
    def test_hits_upload_now_and_misses_upload_after_their_read(self) -> None:
        pm = PageManager(3 * SEG, 40, 3)
        written(pm, 1, 2, 3, 4)  # 1 was evicted for 4: it is on NVMe only
        pm.take_events()
        plan = pm.prepare_step(1, [2, 1, 99])  # step 1 -> buffer 1; 99 was never added
        assert (plan.buffer, plan.slots, plan.unknown) == (1, {2: 0, 1: 1}, (99,))
        assert kinds(plan.jobs) == [("Upload", 2), ("Read", 1)]  # the hit uploads now, the miss reads
        assert pm.take_events() == [Evicted(3, SEG)]  # room for the read: LRU 2 is wanted, so 3 goes
        up2, read1 = plan.jobs
        assert state(pm, 1) is SegState.READING and not pm.buffer_ready(1)
        assert pm.complete(up2.job_id) == []  # 2 is in slot 0; still waiting for 1
        assert not pm.buffer_ready(1)
        (up1,) = pm.complete(read1.job_id)  # the read lands: now, and only now, 1 is uploaded
        assert up1 == Upload(up1.job_id, 1, step=1, buffer=1, slot=1)
        assert pm.take_events() == [ReadBack(1, SEG)]
        assert not pm.buffer_ready(1)
        pm.complete(up1.job_id)
        assert pm.buffer_ready(1)  # step 1 may attend to buffer 1
        loc = pm.lookup(1)
        assert loc is not None and [(g.buffer, g.slot, g.ready) for g in loc.gpu] == [(1, 1, True)]
        pm.check()

    def test_more_wanted_than_slots_are_dropped_in_order(self) -> None:
        pm = PageManager(5 * SEG, 40, 2)
        written(pm, 1, 2, 3)
        plan = pm.prepare_step(0, [3, 3, 1, 2])  # duplicates ignored; 2 slots per buffer
        assert (plan.slots, plan.dropped) == ({3: 0, 1: 1}, (2,))

    def test_the_two_buffers_alternate_and_a_busy_one_is_never_handed_out(self) -> None:
        pm = PageManager(5 * SEG, 40, 2)
        written(pm, 1, 2)
        p0 = pm.prepare_step(0, [1])  # step 0 -> buffer 0
        p1 = pm.prepare_step(1, [2])  # step 1 -> buffer 1, filled while step 0 computes
        assert (p0.buffer, p1.buffer) == (0, 1)
        with pytest.raises(ProtocolError, match="buffer 0 busy"):
            pm.prepare_step(2, [1])  # buffer 0 is still step 0's
        pm.complete(p0.jobs[0].job_id)
        pm.release_step(0)  # step 0 done
        assert pm.prepare_step(2, [1]).buffer == 0  # now buffer 0 serves step 2
        pm.release_step(1)  # step 1 ends with its upload still in flight...
        with pytest.raises(ProtocolError, match="1 uploads in flight"):
            pm.prepare_step(3, [2])  # ...so buffer 1 is not reused yet
        pm.complete(p1.jobs[0].job_id)  # the late upload completes (for a released step)
        assert pm.prepare_step(3, [2]).buffer == 1
        with pytest.raises(ProtocolError, match="already prepared"):
            pm.prepare_step(3, [2])
        pm.check()

    def test_io_queue_order(self) -> None:
        pm = PageManager(4 * SEG, 40, 2)
        written(pm, 1, 2)
        w3, w4 = wb(pm.add_segment(3, SEG)), wb(pm.add_segment(4, SEG))  # host full: 2 clean, 2 dirty
        assert pm.resize(host_budget_bytes=SEG) == [w3]  # 1, 2 evicted; 3 must spill
        pm.resize(host_budget_bytes=5 * SEG)  # grown again: room for a read
        (read,) = pm.prepare_step(0, [1]).jobs  # the prefetch read is issued last...
        assert pm.io_queue() == [read, w3, w4]  # ...and runs first, then the spill, then write-back
        assert [pm.priority(j) for j in pm.io_queue()] == list(IoPriority)


class TestFailures:
    def test_disk_full_goes_host_only_and_loses_nothing(self) -> None:
        pm = PageManager(3 * SEG, 40, 2)
        w1, w2, w3 = (wb(pm.add_segment(s, SEG)) for s in (1, 2, 3))
        assert pm.complete(w1.job_id, ok=False, failure=Failure.DISK_FULL) == []  # the disk is full
        assert pm.take_events() == [DiskFull(1, cancelled=(w2.job_id, w3.job_id))]
        assert not pm.nvme_enabled and pm.io_queue() == []  # host-only: no more write-backs
        assert [state(pm, s) for s in (1, 2, 3)] == [SegState.HOST_DIRTY] * 3  # all still in host
        bp = pm.add_segment(4, SEG)  # host full of dirty segments and nothing can spill
        assert bp == Backpressure(4, SEG, SEG, spills=())
        pm.check()
        pm.complete(w2.job_id)  # a cancelled write-back that made it to disk after all: 2 is clean
        assert state(pm, 2) is SegState.HOST_CLEAN
        assert jobs_of(pm.add_segment(4, SEG)) == []  # 2 is evicted for it; no write-back issued
        assert pm.take_events() == [Evicted(2, SEG)]
        pm.complete(w3.job_id, ok=False)  # the other cancelled one fails: nothing more happens
        assert pm.take_events() == [] and state(pm, 3) is SegState.HOST_DIRTY
        pm.check()

    def test_corrupt_read_is_reported_and_never_uploaded(self) -> None:
        pm = PageManager(2 * SEG, 40, 2)
        written(pm, 1, 2, 3)  # 1 is on NVMe only
        pm.take_events()
        plan = pm.prepare_step(0, [1, 2])
        read = next(j for j in plan.jobs if isinstance(j, Read))
        assert pm.complete(read.job_id, ok=False) == []  # checksum mismatch (CORRUPT by default)
        assert pm.take_events() == [Evicted(3, SEG), Corrupt(1, SEG)]
        assert state(pm, 1) is SegState.LOST and pm.host_used_bytes == SEG  # its room is freed
        pm.complete(next(j for j in plan.jobs if isinstance(j, Upload)).job_id)  # 2's upload
        assert pm.buffer_ready(0)  # step 0 runs without 1: nothing is pending
        loc = pm.lookup(1)
        assert loc is not None and loc.gpu == ()
        pm.release_step(0)
        assert pm.prepare_step(1, [1]).unavailable == (1,)  # never read again
        pm.check()

    def test_transient_failures_are_retried(self) -> None:
        pm = PageManager(2 * SEG, 40, 2)
        w1 = wb(pm.add_segment(1, SEG))
        (w1b,) = pm.complete(w1.job_id, ok=False, failure=Failure.TRANSIENT)  # a new write-back
        assert isinstance(w1b, WriteBack) and w1b.seg_id == 1 and pm.nvme_enabled
        pm.complete(w1b.job_id)
        written(pm, 2, 3)  # 1 evicted
        (read,) = (j for j in pm.prepare_step(0, [1]).jobs if isinstance(j, Read))
        (again,) = pm.complete(read.job_id, ok=False, failure=Failure.TRANSIENT)  # re-read
        assert isinstance(again, Read) and state(pm, 1) is SegState.READING
        (up,) = pm.complete(again.job_id)
        (up2,) = pm.complete(up.job_id, ok=False)  # a failed upload is re-issued
        assert (up2.seg_id, getattr(up2, "slot", None)) == (1, 0)
        pm.check()


class TestResize:
    def test_shrink_spills_without_losing_a_segment(self) -> None:
        pm = PageManager(4 * SEG, 40, 2)
        written(pm, 1)
        w2, w3, w4 = (wb(pm.add_segment(s, SEG)) for s in (2, 3, 4))  # 1 clean, 2..4 dirty
        assert pm.resize(host_budget_bytes=2 * SEG) == [w2]  # evict 1; 2 must spill
        assert pm.take_events() == [Evicted(1, SEG), LeaseResized(2 * SEG, 2, pending_bytes=SEG)]
        assert pm.pending_bytes == SEG  # over budget until 2's write-back lands
        bp = pm.add_segment(5, SEG)  # nothing enters meanwhile; 3 must spill too, to make room for 5
        assert isinstance(bp, Backpressure) and bp.spills == (w2, w3)
        pm.check()
        pm.complete(w3.job_id)  # 3's spill lands first: the shrink is done
        assert pm.take_events() == [Spilled(3, SEG)] and pm.pending_bytes == 0
        pm.complete(w2.job_id)  # the spill lands: 2 leaves host
        assert pm.take_events() == [Spilled(2, SEG)] and pm.host_used_bytes == SEG
        pm.complete(w4.job_id)
        assert all(state(pm, s) in (SegState.HOST_CLEAN, SegState.NVME) for s in (1, 2, 3, 4))
        assert pm.host_used_bytes <= pm.host_budget_bytes
        pm.check()

    def test_gpu_shrink_applies_to_future_steps(self) -> None:
        pm = PageManager(5 * SEG, gpu_slot_bytes=40, slots_per_buffer=3)
        written(pm, 1, 2, 3)
        assert len(pm.prepare_step(0, [1, 2, 3]).slots) == 3
        pm.resize(gpu_budget_bytes=2 * 40)  # one slot per buffer from now on
        assert pm.slots_per_buffer == 1
        assert len(pm.prepare_step(1, [1, 2, 3]).slots) == 1  # step 0 keeps its 3 slots
        pm.check()

    def test_budgets_smaller_than_one_segment_are_refused(self) -> None:
        with pytest.raises(ValueError, match=r"host_budget_bytes=5 is smaller than one segment \(10 bytes\)"):
            PageManager(5, 40, 2, segment_bytes=SEG)
        pm = PageManager(5, 40, 2)
        with pytest.raises(ValueError, match=r"host_budget_bytes=5 is smaller than one segment \(10 bytes\)"):
            pm.add_segment(1, SEG)
        pm.resize(host_budget_bytes=3 * SEG)
        written(pm, 1)
        with pytest.raises(ValueError, match=r"host_budget_bytes=9 is smaller than one segment"):
            pm.resize(host_budget_bytes=9)
        with pytest.raises(ValueError, match=r"gpu_budget_bytes=79 is smaller than one slot per buffer"):
            pm.resize(gpu_budget_bytes=79)


# ---- random operations keep the invariants --------------------------------------------------------


class RandomOps(RuleBasedStateMachine):
    """Adds, steps, completions (some failing) and resizes in any order; a transfer side that
    completes whatever it was handed. `check()` after every step; nothing is ever lost."""

    def __init__(self) -> None:
        super().__init__()
        self.pm = PageManager(6 * SEG, 40, 3)
        self.outstanding: dict[int, Job] = {}
        self.next_seg = 0
        self.next_step = 0
        self.active: list[int] = []
        self.corrupt: set[int] = set()

    def hand_out(self, jobs: list[Job] | tuple[Job, ...]) -> None:
        for j in jobs:
            assert j.job_id not in self.outstanding, "a job handed out twice"
            self.outstanding[j.job_id] = j

    @rule(size=st.integers(1, 2 * SEG))
    def add(self, size: int) -> None:
        self.next_seg += 1
        out = self.pm.add_segment(self.next_seg, size)
        if isinstance(out, Backpressure):
            assert all(j.job_id in self.outstanding for j in out.spills)
        else:
            self.hand_out(out)

    @precondition(lambda self: len(self.active) < 2)
    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        step = self.next_step
        for j in list(self.outstanding.values()):  # the runtime waits for uploads to this buffer
            if isinstance(j, Upload) and j.buffer == step % 2:
                self.hand_out(self.pm.complete(self.outstanding.pop(j.job_id).job_id))
        wanted = data.draw(st.lists(st.integers(1, self.next_seg + 1), max_size=4))
        plan = self.pm.prepare_step(step, wanted)
        self.hand_out(plan.jobs)
        self.active.append(step)
        self.next_step += 1

    @precondition(lambda self: bool(self.active))
    @rule()
    def release(self) -> None:
        self.pm.release_step(self.active.pop(0))

    @precondition(lambda self: bool(self.outstanding))
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "ok", "ok", "transient", "hard"]))
    def complete(self, data: st.DataObject, outcome: str) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        self.outstanding.pop(job_id)
        failure = {"ok": None, "transient": Failure.TRANSIENT, "hard": None}[outcome]
        self.hand_out(self.pm.complete(job_id, ok=outcome == "ok", failure=failure))

    @precondition(lambda self: any(isinstance(j, Read) for j in self.outstanding.values()))
    @rule(ok=st.booleans())
    def read_lands_or_is_corrupt(self, ok: bool) -> None:
        job_id = min(j.job_id for j in self.outstanding.values() if isinstance(j, Read))
        self.outstanding.pop(job_id)
        self.hand_out(self.pm.complete(job_id, ok=ok))

    @rule(host=st.integers(2 * SEG, 8 * SEG), slots=st.integers(1, 4))
    def resize(self, host: int, slots: int) -> None:
        spills = self.pm.resize(host_budget_bytes=host, gpu_budget_bytes=2 * 40 * slots)
        assert all(j.job_id in self.outstanding for j in spills)

    @rule()
    def settle(self) -> None:
        """The transfer side catches up and every step ends: with NVMe, host is back in budget."""
        while self.active:
            self.pm.release_step(self.active.pop(0))
        while self.outstanding:
            self.hand_out(self.pm.complete(self.outstanding.popitem()[0]))
        if self.pm.nvme_enabled:
            assert self.pm.pending_bytes == 0

    @invariant()
    def invariants_hold(self) -> None:
        self.pm.check()
        self.corrupt |= {e.seg_id for e in self.pm.take_events() if isinstance(e, Corrupt)}
        for seg in range(1, self.next_seg + 1):
            loc = self.pm.lookup(seg)
            if loc is not None and loc.state is SegState.LOST:
                assert seg in self.corrupt, f"segment {seg} lost without a Corrupt event"


TestRandomOps = RandomOps.TestCase
TestRandomOps.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
