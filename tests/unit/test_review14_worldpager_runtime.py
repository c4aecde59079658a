"""Review 14, WorldPager runtime: lease budgets under shrinks, codec refusals, determinism."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldpager import codecs
from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.retrieval import RecencyRule
from worldpager.session import Session
from worldpager.trajectory import yaw_sweep_trajectory

CFG = TINY.on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16").payload_nbytes
SLOT = SegmentLayout.from_config(CFG, "bf16").decoded_nbytes  # one retrieval slot on the device tier


def _session(tmp_path: Path, **kw: object) -> Session:
    opts: dict[str, object] = {
        "host_budget_bytes": 16 * SEG,
        "gpu_slots": 4,
        "retrieval_k": 4,
        "rule": RecencyRule(),  # always the k newest out-of-window segments: full buffers
        "log_dir": tmp_path / "log",
    }
    opts.update(kw)
    return Session(TinyCausalWan(CFG), **opts)  # type: ignore[arg-type]


# ---- 1: a shrunk lease also holds for the step already prefetched ------------------------------


def test_a_gpu_shrink_also_trims_the_prefetched_step(tmp_path: Path) -> None:
    poses = yaw_sweep_trajectory(16)
    with _session(tmp_path) as s:
        for p in poses[:10]:
            s.step(p)
        s.handler.wait_ready(s.step_index)
        assert s.handler.buffer_bytes == 4 * SLOT  # the next step's buffer, prefetched: 4 slots
        s.resize_lease(gpu_budget_bytes=2 * SLOT)  # one slot per buffer, both buffers
        s.handler.wait_ready(s.step_index)
        assert s.handler.buffer_bytes <= 2 * SLOT  # the lease in force holds at once
        wanted = s.wanted(s.step_index)
        assert len(wanted) == 4
        assert s.step(poses[10]).retrieved == (wanted[0],)  # the rule's best is the one kept
        for p in poses[11:]:
            rec = s.step(p)
            assert len(rec.retrieved) == 1
            assert s.handler.buffer_bytes <= SLOT  # (the next step's buffer; the running one released)


def test_a_host_shrink_holds_when_resize_lease_returns(tmp_path: Path) -> None:
    poses = yaw_sweep_trajectory(16)
    with _session(tmp_path) as s:
        for p in poses[:10]:
            s.step(p)
        s.resize_lease(host_budget_bytes=2 * SEG)  # below the prefetched step's 4 protected segments
        assert s.pm.host_used_bytes <= 2 * SEG
        assert s.handler.host_bytes <= 2 * SEG
        s.pm.check()
        for p in poses[10:]:
            rec = s.step(p)
            assert rec.pm_host_used_bytes <= 2 * SEG and rec.host_bytes <= 2 * SEG
        s.handler.drain()
        s.pm.check()


# ---- 2: property: budgets hold and only written pages are served, under any steps and resizes ---


def _check_served(s: Session, payloads: dict[int, bytes], served: list[tuple[int, ...]]) -> None:
    """Spy on `TransferHandler.memory` (the real one answers): every page served for a step is one
    this session wrote, decoded and re-rotated exactly from its payload; the device tier is within
    the GPU lease while the step computes."""
    real = s.handler.memory
    fpb = CFG.frames_per_block

    def memory(step: int):  # type: ignore[no-untyped-def]
        buf = s.handler._steps[step]
        mem, ids = real(step)
        assert s.handler.buffer_bytes <= s.gpu_budget_bytes, "device tier over the GPU lease"
        served.append(ids)
        assert set(ids) <= payloads.keys(), f"step {step}: served {ids}, written {sorted(payloads)}"
        slots = sorted(sl for sl in buf.kv if sl in buf.slot_seg)
        assert tuple(buf.slot_seg[sl] for sl in slots) == ids
        for i, (sl, sid) in enumerate(zip(slots, ids, strict=True)):
            want = s.layout.rerotate(s.layout.decode(payloads[sid]), sid * fpb, buf.targets[sl])
            assert mem is not None
            tokens = want[0][0].shape[1]
            for (k, v), (wk, wv) in zip(mem, want, strict=True):
                assert torch.equal(k[:, i * tokens : (i + 1) * tokens], wk), f"segment {sid}: stale K"
                assert torch.equal(v[:, i * tokens : (i + 1) * tokens], wv), f"segment {sid}: stale V"
        return mem, ids

    s.handler.memory = memory  # type: ignore[method-assign]
    real_add = s.handler.add_segment

    def add_segment(info, payload, **kw):  # type: ignore[no-untyped-def]
        assert info.segment_id not in payloads
        payloads[info.segment_id] = payload
        return real_add(info, payload, **kw)

    s.handler.add_segment = add_segment  # type: ignore[method-assign]


_ACTIONS = st.lists(
    st.one_of(
        st.just(("step", 0)),
        st.tuples(st.just("host"), st.integers(1, 12)),  # host lease in segments (1: the minimum)
        st.tuples(st.just("gpu"), st.integers(1, 4)),  # GPU lease in slots per buffer
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_ACTIONS, mode=st.sampled_from(["prefetch", "on_demand"]))
def test_budgets_hold_and_only_written_pages_are_served(actions: list[tuple[str, int]], mode: str) -> None:
    poses = yaw_sweep_trajectory(40)
    payloads: dict[int, bytes] = {}
    served: list[tuple[int, ...]] = []
    with tempfile.TemporaryDirectory() as d, _session(Path(d), mode=mode, host_budget_bytes=8 * SEG) as s:
        _check_served(s, payloads, served)
        for p in poses[:6]:  # segments out of the rolling window, so there is something to retrieve
            s.step(p)
        for what, n in actions:
            if what == "step":
                rec = s.step(poses[s.step_index])
                assert rec.pm_host_used_bytes <= s.pm.host_budget_bytes
            elif what == "host":
                s.resize_lease(host_budget_bytes=n * SEG)
            else:
                s.resize_lease(gpu_budget_bytes=2 * n * SLOT)
            assert s.pm.host_used_bytes <= s.pm.host_budget_bytes, f"host over its lease after {what}"
            assert s.handler.host_bytes <= s.pm.host_budget_bytes
            assert s.handler.buffer_bytes <= s.gpu_budget_bytes, f"device tier over its lease after {what}"
        s.handler.drain()
        s.pm.check()
    assert any(served), "nothing was retrieved: the property was not exercised"


# ---- 3: codecs on adversarial pages: the documented bound, or a clear refusal ---------------------


def test_a_bf16_coded_fp16_page_at_fp16s_largest_value_decodes_finite() -> None:
    # 65504 (fp16's largest) rounds to 65536 in bf16: cast straight back it was +-inf in fp16
    x = torch.tensor([65504.0, -65504.0, 1.0, 65472.0], dtype=torch.float16)
    y = codecs.decode(codecs.encode(x, "bf16"))
    assert y.dtype == torch.float16 and bool(torch.isfinite(y).all())
    assert torch.equal(y[:2], x[:2]) and (y - x).abs().max().item() <= 32  # half a bf16 ulp at 2^15


def _group_scales(p: codecs.Packed) -> torch.Tensor:
    g, c = -(-p.numel // codecs.GROUP), p.numel if p.codec == "int8" else -(-p.numel // 2)
    return p.payload[c : c + 2 * g].clone().view(torch.float16).float()


_VALUES = st.one_of(
    st.floats(-65504, 65504, width=32),
    st.sampled_from([0.0, -0.0, 1e-40, -1e-40, 6e-8, -6e-8, 65504.0, -65504.0, 1.0]),
)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(_VALUES, min_size=1, max_size=300),
    codec=st.sampled_from(["int8", "int4"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_quantized_round_trip_is_within_the_documented_bound(
    values: list[float], codec: str, dtype: torch.dtype
) -> None:
    x = torch.tensor(values, dtype=torch.float32).to(dtype)  # any length: groups need not divide it
    try:
        p = codecs.encode(x, codec)
    except ValueError as e:  # only past fp16's range (bf16 rounds 65504 up to 65536), and named
        assert float(x.float().abs().max()) > 65504.0 and "out of range" in str(e)
        return
    y = codecs.decode(p)
    assert y.shape == x.shape and y.dtype == dtype and bool(torch.isfinite(y).all())
    half_scale = _group_scales(p).repeat_interleave(codecs.GROUP)[: x.numel()] / 2
    xd, yd = x.double(), y.double()
    # on top of scale/2: fp32 arithmetic and the rounding of x^ to the page's dtype
    slack = (torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps) * (xd.abs() + half_scale.double())
    assert bool(((yd - xd).abs() <= half_scale.double() + slack + 1e-30).all())


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_by_name(codec: str, bad: float) -> None:
    x = torch.randn(200)
    x[150] = bad
    with pytest.raises(ValueError, match="non-finite"):
        codecs.encode(x, codec)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_group_past_fp16s_range_is_refused(codec: str) -> None:
    x = torch.zeros(256)
    x[200] = -70000.0  # its group's zero cannot be stored in fp16
    with pytest.raises(ValueError, match="out of range"):
        codecs.encode(x, codec)
    assert torch.equal(codecs.decode(codecs.encode(torch.full((129,), 3.0), codec)), torch.full((129,), 3.0))


# ---- 4: determinism: the same poses and seed, the same outputs and tier decisions ----------------


def _run(tmp: Path, slow_writes: bool) -> tuple[list[torch.Tensor], list[tuple[object, ...]]]:
    torch.manual_seed(0)
    with _session(tmp, host_budget_bytes=3 * SEG, keep_outputs=True, seed=7) as s:
        if slow_writes:  # the real append, late: write-backs land at other points of the steps
            append = s.log.append

            def slow(**kw):  # type: ignore[no-untyped-def]
                time.sleep(0.1)
                return append(**kw)

            s.log.append = slow  # type: ignore[method-assign]
        recs = s.run(yaw_sweep_trajectory(10))
    assert s.outputs is not None
    return s.outputs, [(r.retrieved, r.hits, r.misses) for r in recs]


def test_same_poses_and_seed_give_the_same_outputs_and_tier_decisions(tmp_path: Path) -> None:
    out_a, tiers_a = _run(tmp_path / "a", slow_writes=False)
    out_b, tiers_b = _run(tmp_path / "b", slow_writes=True)
    assert tiers_a == tiers_b
    assert any(ids for ids, _, _ in tiers_a)  # retrieval was exercised
    assert len(out_a) == len(out_b) == 10
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True))
