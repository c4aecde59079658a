"""Review 17: PageManager bookkeeping. A step released while its uploads (host -> GPU copies) are still
in flight kept no hold on the host copies those uploads read: they could be evicted (their host memory
handed to another segment) under the copy. Each test failed before its fix."""

from __future__ import annotations

from worldpager.pages import Backpressure, Evicted, PageManager, SegState, Spilled, Upload, WriteBack

SEG = 10


def _clean(pm: PageManager, *segs: int) -> None:
    """Add ``segs`` and land their write-backs: clean host copies, evictable once unprotected."""
    for sid in segs:
        out = pm.add_segment(sid, SEG)
        assert not isinstance(out, Backpressure), out
        for job in out:
            pm.complete(job.job_id)


def _state(pm: PageManager, sid: int) -> SegState:
    loc = pm.lookup(sid)
    assert loc is not None
    return loc.state


def test_a_segment_whose_upload_is_in_flight_is_not_evicted_for_a_new_one_after_its_step_is_released() -> (
    None
):
    pm = PageManager(SEG, 40, 2)  # host holds one segment
    _clean(pm, 1)
    (up,) = pm.prepare_step(0, [1]).jobs
    assert isinstance(up, Upload)
    pm.release_step(0)  # (a caller bug: the runtime waits for the step's uploads first)
    pm.check()
    # the upload still reads 1's host copy: no room may be made from it
    assert pm.add_segment(2, SEG) == Backpressure(2, SEG, SEG, spills=())
    assert _state(pm, 1) is SegState.HOST_CLEAN and pm.take_events() == []
    pm.check()
    assert pm.complete(up.job_id) == []  # the copy is done: 1 is an ordinary clean segment again
    out = pm.add_segment(2, SEG)
    assert not isinstance(out, Backpressure) and [type(j) for j in out] == [WriteBack]
    assert pm.take_events() == [Evicted(1, SEG)]
    pm.check()


def test_a_host_shrink_does_not_evict_a_segment_an_upload_of_a_released_step_still_reads() -> None:
    pm = PageManager(2 * SEG, 40, 2)
    _clean(pm, 1)
    (w2,) = pm.add_segment(2, SEG)  # type: ignore[misc]  # dirty: its write-back outstanding
    (up,) = pm.prepare_step(0, [1]).jobs
    pm.release_step(0)
    assert pm.resize(host_budget_bytes=SEG) == [w2]  # 2 must spill; 1 stays while it is read
    assert _state(pm, 1) is SegState.HOST_CLEAN and pm.pending_bytes == SEG
    assert not any(isinstance(e, Evicted) for e in pm.take_events())
    pm.check()
    pm.complete(up.job_id)  # the upload is done: the drain evicts 1 now
    assert pm.take_events() == [Evicted(1, SEG)] and pm.pending_bytes == 0
    pm.complete(w2.job_id)  # the spill lands: 2 leaves host
    assert pm.take_events() == [Spilled(2, SEG)] and pm.host_used_bytes == 0
    pm.check()


def test_a_failed_upload_of_a_released_step_is_not_retried_and_lets_its_segment_go() -> None:
    pm = PageManager(SEG, 40, 2)
    _clean(pm, 1)
    (up,) = pm.prepare_step(0, [1]).jobs
    pm.release_step(0)
    assert pm.complete(up.job_id, ok=False) == []  # its step is gone: nothing to upload for
    assert not isinstance(pm.add_segment(2, SEG), Backpressure)  # 1 evicted for it
    assert pm.take_events() == [Evicted(1, SEG)]
    assert pm.prepare_step(2, [2]).buffer == 0  # the buffer is free again
    pm.check()
