"""Review 15, WorldPager: a lease shrunk through the page manager itself (`PageManager.resize`, or
`TransferHandler.resize`, which only calls it) between a step's prefetch and its run. Before, only
`Session.resize_lease` re-planned the prefetched step: shrunk any other way, the step ran on its old
plan -- all its slots on a GPU lease that no longer had them, its protected segments holding the host
over its new budget. Now the page manager says which prepared steps a shrink left out of the lease
(`PageManager.needs_replan`), and the session re-plans such a step before it runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.pages import PageManager, WriteBack
from worldpager.retrieval import RecencyRule
from worldpager.session import Session
from worldpager.trajectory import yaw_sweep_trajectory

CFG = TINY.on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16").payload_nbytes
SLOT = SegmentLayout.from_config(CFG, "bf16").decoded_nbytes  # one retrieval slot on the device tier
POSES = yaw_sweep_trajectory(14)
WARM = 10  # steps before the shrink: the retrieval buffers are full by then


# ---- the page manager alone -----------------------------------------------------------------------


def _written(pm: PageManager, *segs: int, nbytes: int = 10) -> None:
    for s in segs:
        res = pm.add_segment(s, nbytes)
        assert isinstance(res, list)
        (job,) = res
        assert isinstance(job, WriteBack)
        pm.complete(job.job_id)


def test_a_gpu_shrink_marks_the_prepared_step_for_a_replan_once() -> None:
    pm = PageManager(5 * 10, gpu_slot_bytes=40, slots_per_buffer=3)
    _written(pm, 1, 2, 3)
    plan = pm.prepare_step(0, [1, 2, 3])
    assert not pm.needs_replan(0) and not pm.needs_replan(7)  # (7: not prepared)
    pm.resize(gpu_budget_bytes=2 * 40)  # one slot per buffer
    assert pm.needs_replan(0) and pm.gpu_budget_bytes == 80
    for job in plan.jobs:  # its uploads land; then it is released and prepared again
        pm.complete(job.job_id)
    pm.release_step(0)
    assert len(pm.prepare_step(0, [1, 2, 3]).slots) == 1
    assert not pm.needs_replan(0)  # planned within the lease: not re-planned twice for one shrink
    pm.resize(gpu_budget_bytes=6 * 40)  # a grow outdates nothing
    assert not pm.needs_replan(0)
    pm.check()


def test_a_host_shrink_marks_a_step_whose_protected_segments_hold_the_host_over_budget() -> None:
    pm = PageManager(5 * 10, gpu_slot_bytes=40, slots_per_buffer=3)
    _written(pm, 1, 2, 3, 4)
    pm.prepare_step(0, [1, 2, 3])
    pm.resize(host_budget_bytes=4 * 10)  # 4 evicted; 1, 2, 3 protected: within the budget
    assert not pm.needs_replan(0) and pm.pending_bytes == 0
    pm.resize(host_budget_bytes=2 * 10)  # the step's 3 protected segments hold 30 > 20
    assert pm.pending_bytes == 10 and pm.needs_replan(0)
    pm.resize(host_budget_bytes=3 * 10)  # grown back before it ran: its plan fits again
    assert not pm.needs_replan(0)
    pm.check()


# ---- a session whose lease is shrunk between a prefetch and the step's run ------------------------


def _run(tmp_path: Path, shrink: Callable[[Session], None] | None) -> tuple[list[torch.Tensor], list[int]]:
    """WARM steps, the shrink (the next step prefetched and its buffer filled), then the rest; the
    outputs and, per step run after the shrink, how often it was prepared. Spies check that the
    lease in force holds while each step computes (device tier and host tier)."""
    prepared: dict[int, int] = {}
    with Session(
        TinyCausalWan(CFG), host_budget_bytes=16 * SEG, gpu_slots=4, retrieval_k=4, rule=RecencyRule(),
        log_dir=tmp_path / "log", keep_outputs=True,
    ) as s:  # fmt: skip
        real_memory, real_prepare = s.handler.memory, s.handler.prepare

        def memory(step: int):  # type: ignore[no-untyped-def]
            assert s.handler.buffer_bytes <= s.gpu_budget_bytes, f"step {step}: device tier over its lease"
            assert s.pm.host_used_bytes <= s.pm.host_budget_bytes, f"step {step}: host over its lease"
            return real_memory(step)

        def prepare(step: int, *a, **kw):  # type: ignore[no-untyped-def]
            prepared[step] = prepared.get(step, 0) + 1
            return real_prepare(step, *a, **kw)

        s.handler.memory = memory  # type: ignore[method-assign]
        s.handler.prepare = prepare  # type: ignore[method-assign]
        for p in POSES[:WARM]:
            s.step(p)
        s.handler.wait_ready(s.step_index)
        assert len(s.handler.memory(s.step_index)[1]) == 4  # the prefetched step: 4 slots uploaded
        if shrink is not None:
            shrink(s)
        for p in POSES[WARM:]:
            s.step(p)
        s.handler.drain()
        s.pm.check()
        assert s.outputs is not None
        return list(s.outputs), [prepared[n] for n in range(WARM, len(POSES))]


def _direct_pm(**lease: int) -> Callable[[Session], None]:
    def shrink(s: Session) -> None:
        s.handler.drain()  # the transfer threads idle: the page manager's calls stay serialised
        assert s.pm.resize(**lease) == []  # (nothing dirty: no spill to wait for)

    return shrink


LEASES = {"gpu": {"gpu_budget_bytes": 2 * SLOT}, "host": {"host_budget_bytes": 2 * SEG}}


@pytest.mark.parametrize("kind", sorted(LEASES))
@pytest.mark.parametrize("how", ["page_manager", "transfer_handler"])
def test_a_lease_shrunk_past_resize_lease_still_holds_for_the_prefetched_step(
    tmp_path: Path, kind: str, how: str
) -> None:
    lease = LEASES[kind]
    want, prepared = _run(tmp_path / "ref", lambda s: s.resize_lease(**lease))
    assert prepared == [2, 1, 1, 1]  # resize_lease re-planned the prefetched step once; no step twice
    if how == "page_manager":
        got, prepared = _run(tmp_path / "got", _direct_pm(**lease))
    else:
        got, prepared = _run(tmp_path / "got", lambda s: s.handler.resize(**lease))
    assert prepared == [2, 1, 1, 1]  # re-planned when it started, once
    assert len(got) == len(want) == len(POSES)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {n}: output differs from the resize_lease run"


def test_a_shrink_the_prefetched_plan_still_fits_changes_nothing(tmp_path: Path) -> None:
    """8 segments of host hold the prefetched step's 4 protected ones: no re-plan, the same outputs as
    a run without the resize."""
    want, prepared = _run(tmp_path / "ref", None)
    assert prepared == [1, 1, 1, 1]
    got, prepared = _run(tmp_path / "got", _direct_pm(host_budget_bytes=8 * SEG))
    assert prepared == [1, 1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_summary_reports_a_gpu_lease_set_through_the_page_manager(tmp_path: Path) -> None:
    with Session(TinyCausalWan(CFG), host_budget_bytes=10 * SEG, log_dir=tmp_path / "l") as s:
        s.handler.resize(gpu_budget_bytes=2 * SLOT)
        assert s.gpu_budget_bytes == 2 * SLOT and s.summary()["gpu_budget_bytes"] == 2 * SLOT
