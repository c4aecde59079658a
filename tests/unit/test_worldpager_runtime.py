"""WorldPager runtime: a real tiny-model session through GPU buffers, host copies and the NVMe log."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
import types
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from worldpager.cli import main
from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.pages import Corrupt, DiskFull, Evicted
from worldpager.retrieval import WORLDMEM_POINTS, FovOverlapRule, Pose, SegmentInfo
from worldpager.segment_log import HEADER_SIZE, INDEX_NAME, SegmentLog
from worldpager.session import SESSION_PRESETS, WINDOW_FILE, CorruptSlot, Session, stall_stats
from worldpager.trajectory import block_inputs, yaw_sweep_trajectory
from worldpager.transfer import Throttle

CFG = TINY.on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16").payload_nbytes


def _session(tmp_path: Path, **kw: object) -> Session:
    opts: dict[str, object] = {"host_budget_bytes": 4 * SEG, "log_dir": tmp_path / "log", "retrieval_k": 2}
    opts.update(kw)
    return Session(TinyCausalWan(CFG), **opts)  # type: ignore[arg-type]


def test_throttle_paces_reads_to_the_bandwidth() -> None:
    t = Throttle(1_000_000.0)
    t0 = time.perf_counter()
    assert [t.run(lambda: 7, 20_000) for _ in range(3)] == [7, 7, 7]
    assert time.perf_counter() - t0 >= 0.06 - 1e-3  # 60 kB at 1 MB/s
    assert Throttle(None).run(lambda: 1, 10**12) == 1
    with pytest.raises(ValueError):
        Throttle(0.0)


def test_layout_round_trips_a_segment_payload() -> None:
    layout = SegmentLayout.from_config(CFG, "bf16")
    kv = [(torch.randn(layout.kv_shape), torch.randn(layout.kv_shape)) for _ in range(CFG.layers)]
    payload = layout.encode(kv)
    assert len(payload) == layout.payload_nbytes == SEG
    back = layout.decode(payload)
    for (k, v), (k2, v2) in zip(kv, back, strict=True):
        assert torch.equal(k.to(torch.bfloat16).float(), k2) and torch.equal(v.to(torch.bfloat16).float(), v2)


def test_short_session_uses_all_tiers(tmp_path: Path) -> None:
    with _session(tmp_path) as s:
        # WorldMem's rule with WorldMem's 10,000 sphere points (found in review: it sampled 500)
        assert isinstance(s.rule, FovOverlapRule) and s.rule.k_points == WORLDMEM_POINTS
        for pose in yaw_sweep_trajectory(20):
            rec = s.step(pose)
            s.pm.check()
            assert rec.pm_host_used_bytes <= s.pm.host_budget_bytes
            assert rec.host_bytes <= s.pm.host_budget_bytes
        s.handler.drain()
        summary = s.summary()
    assert summary["segments"] == 20 and summary["max_position_reached"] == 59
    assert summary["nvme_bytes_read"] > 0 and summary["host_misses"] > 0  # revisits read back
    assert any(isinstance(e, Evicted) for e in s.events)
    with SegmentLog.open(tmp_path / "log") as log:  # every segment written is readable
        assert sorted(log.header(slot).segment_id for slot in log.slots()) == list(range(20))
        for slot in log.slots():
            h, payload = log.read(slot)
            assert len(payload) == SEG and h.frame_end - h.frame_start == 3
    assert summary["nvme_bytes_written"] == 20 * (HEADER_SIZE + SEG)


def test_retrieval_off_equals_the_plain_model(tmp_path: Path) -> None:
    n = 8
    with _session(tmp_path, retrieval_k=0, keep_outputs=True) as s:
        s.run(yaw_sweep_trajectory(n))
    ref = TinyCausalWan(CFG)
    ref.reset_cache()
    assert s.outputs is not None
    for i, out in enumerate(s.outputs):
        latent, actions = block_inputs(CFG, i)
        pred, _ = ref.generate_block(latent, actions, 3 * i)
        assert torch.equal(out, pred)
    for a, b in zip(s.model.kv_cache, ref.kv_cache, strict=True):
        assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e308, -2e6])
def test_a_bad_pose_is_refused_before_the_step_and_the_session_goes_on(tmp_path: Path, bad: float) -> None:
    poses = yaw_sweep_trajectory(4)
    with _session(tmp_path) as s:
        s.step(poses[0])
        with pytest.raises(ValueError, match="finite numbers within"):
            s.step(dataclasses.replace(poses[1], yaw=bad))
        assert s.step_index == 1  # nothing ran, nothing was stored
        for pose in poses[1:]:
            s.step(pose)
        s.handler.drain()
        assert s.summary()["segments"] == 4


class _WantZero:
    """Retrieval rule: segment 0, from step `start` on."""

    def __init__(self, start: int) -> None:
        self.start = start

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        ids = {c.segment_id for c in candidates}
        return [0] if now_frame >= 3 * self.start and 0 in ids else []


def test_corrupt_slot_is_never_attended(tmp_path: Path) -> None:
    poses = yaw_sweep_trajectory(12)
    with _session(tmp_path, rule=_WantZero(8), host_budget_bytes=3 * SEG) as s:
        s.run(poses[:6])
        s.handler.drain()
        slot = s.handler.log_slot(0)
        assert slot is not None and s.pm.lookup(0) is not None
        with open(tmp_path / "log" / "segments.wplog", "r+b") as f:  # flip payload bytes of segment 0
            f.seek(slot * s.log.slot_size + HEADER_SIZE + 100)
            f.write(b"\xff\x00\xff\x00")
            f.flush()
            os.fsync(f.fileno())
        recs = s.run(poses[6:])
    assert any(isinstance(e, Corrupt) and e.seg_id == 0 for e in s.events)
    assert len(s.records) == 12
    assert all(0 not in r.retrieved for r in recs)


def test_disk_full_degrades_to_host_only(tmp_path: Path) -> None:
    from worldpager.segment_log import slot_size_for

    with _session(tmp_path, log_max_bytes=5 * slot_size_for(SEG), host_budget_bytes=20 * SEG) as s:
        s.run(yaw_sweep_trajectory(15))
        s.pm.check()
    assert any(isinstance(e, DiskFull) for e in s.events)
    assert not s.pm.nvme_enabled and len(s.records) == 15
    assert s.summary()["nvme_bytes_written"] == 5 * (HEADER_SIZE + SEG)


def _tensors_reachable(root: object, skip: Sequence[object]) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through instance attributes and containers (not through
    modules, classes or functions), never entering the objects in ``skip``."""
    opaque = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    atoms = (str, bytes, bytearray, memoryview, int, float, complex, bool, type(None), torch.dtype)
    seen = {id(o) for o in skip}
    stack, found = [root], []
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, opaque + atoms):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            stack.extend([*o.keys(), *o.values()])
        elif isinstance(o, list | tuple | set | frozenset | deque):
            stack.extend(o)
        else:
            stack.extend(getattr(o, "__dict__", {}).values())
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    stack.append(getattr(o, name, None))
    return found


def test_long_session_keeps_host_bytes_in_budget_and_no_step_tensors(tmp_path: Path) -> None:
    budget, steps = 5 * SEG, 40
    with _session(tmp_path, host_budget_bytes=budget, max_records=10, max_events=16) as s:
        assert s.warmup_segments == 4  # k=2 slots + the one block of the window before this one
        for pose in yaw_sweep_trajectory(steps):
            rec = s.step(pose)
            assert rec.pm_host_used_bytes <= budget and rec.host_bytes <= budget
            assert s.pm.host_used_bytes <= budget
            for f in dataclasses.fields(rec):  # a record is a few numbers
                v = getattr(rec, f.name)
                assert isinstance(v, int | float) or all(isinstance(i, int) for i in v), f.name
        # nothing per step is kept: no tensor is reachable from the session except the model's own
        # and the next step's retrieval buffer (prefetched: at most k segments of KV)
        assert s.outputs is None
        assert _tensors_reachable(s, [s.model, s.handler._steps]) == []
        assert _tensors_reachable(s, [s.handler._steps])  # (the walk does reach the model's)
        assert list(s.handler._steps) == [steps]
        buffered = _tensors_reachable(s.handler._steps, [])
        assert len(buffered) <= 2 * 2 * CFG.layers  # k segments x layers x (K, V)
        assert len(s.records) == 10 and s.records[-1].step == steps - 1
        counts = s.event_counts()
        assert len(s.events) <= 16 and sum(counts.values()) > 16 and counts["Evicted"] > 16
        summary = s.summary()
    assert summary["segments"] == steps and summary["host_peak_bytes"] <= budget
    assert summary["nvme_bytes_read"] > 0  # revisits read back
    assert isinstance(summary["rss_baseline_bytes"], int) and isinstance(summary["rss_growth_bytes"], int)
    assert summary["warmup_segments"] == 4 and isinstance(summary["rss_within_bound"], bool)


def _poses(n: int) -> list[Pose]:
    return yaw_sweep_trajectory(n)


def _run_outputs(log: Path, poses: Sequence[Pose], **kw: object) -> Session:
    with _session(log.parent, log_dir=log, keep_outputs=True, **kw) as s:
        s.run(poses)
    return s


@pytest.mark.parametrize("k", [0, 2])
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path, k: int) -> None:
    n, m = 9, 7
    poses = _poses(n + m)
    opts = {"retrieval_k": k, "host_budget_bytes": 8 * SEG}  # room for every read: no timing
    ref = _run_outputs(tmp_path / "ref", poses, **opts)
    with _session(tmp_path, log_dir=tmp_path / "a", **opts) as a:
        a.run(poses[:n])
    b = Session.resume(tmp_path / "a", TinyCausalWan(CFG), keep_outputs=True, **opts)  # type: ignore[arg-type]
    with b:
        assert b.step_index == n and b.window_source == "checkpoint" and b.model.cached_frames() == 6
        recs = b.run(poses[n:])
    assert [r.step for r in recs] == list(range(n, n + m))
    assert [r.retrieved for r in recs] == [r.retrieved for r in ref.records[n:]]
    assert b.outputs is not None and ref.outputs is not None
    for out, want in zip(b.outputs, ref.outputs[n:], strict=True):
        assert torch.equal(out, want)
    summary = b.summary()
    assert summary["first_segment"] == n and summary["max_position_reached"] == 3 * (n + m) - 1
    if k:  # segments written before the restart come back from NVMe
        assert summary["nvme_bytes_read"] > 0
        assert any(i < n for r in recs if r.misses for i in r.retrieved)
    with SegmentLog.open(tmp_path / "a") as log:  # one log holds the whole session
        assert sorted(log.header(slot).segment_id for slot in log.slots()) == list(range(n + m))


def test_resume_without_the_window_file_rebuilds_it_from_the_log(tmp_path: Path) -> None:
    """After a crash (no window.bin) the window comes from the log: exact when the codec is lossless
    for the model's dtype (bf16 model, bf16 codec), codec precision otherwise."""
    n, m = 6, 4
    poses = _poses(n + m)
    for dtype, tol in ((torch.bfloat16, 0.0), (torch.float32, 1e-2)):
        d = tmp_path / str(dtype)
        opts: dict[str, object] = {"retrieval_k": 2, "host_budget_bytes": 8 * SEG}
        with Session(TinyCausalWan(CFG, dtype=dtype), log_dir=d / "ref", keep_outputs=True, **opts) as ref:  # type: ignore[arg-type]
            ref.run(poses)
        with Session(TinyCausalWan(CFG, dtype=dtype), log_dir=d / "a", **opts) as a:  # type: ignore[arg-type]
            a.run(poses[:n])
        (d / "a" / WINDOW_FILE).unlink()
        with Session.resume(d / "a", TinyCausalWan(CFG, dtype=dtype), keep_outputs=True, **opts) as b:
            assert b.window_source == "log" and b.step_index == n
            b.run(poses[n:])
        assert b.outputs is not None and ref.outputs is not None
        for out, want in zip(b.outputs, ref.outputs[n:], strict=True):
            err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
            assert err <= tol, (dtype, err)


class _Want:
    """Retrieval rule: the given segments (those that are candidates), from frame `start` on."""

    def __init__(self, ids: Sequence[int], start: int) -> None:
        self.ids, self.start = list(ids), start

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        have = {c.segment_id for c in candidates}
        return [i for i in self.ids if i in have][:k] if now_frame >= self.start else []


def _flip(log_dir: Path, slot: int, offset: int, slot_size: int) -> None:
    with open(log_dir / "segments.wplog", "r+b") as f:
        f.seek(slot * slot_size + offset)
        f.write(b"\xff\x00\xff\x00")
        f.flush()
        os.fsync(f.fileno())


def test_resume_reports_corrupt_slots_and_never_uses_them(tmp_path: Path) -> None:
    n, poses = 10, _poses(18)
    with _session(tmp_path, log_dir=tmp_path / "a", host_budget_bytes=3 * SEG) as a:
        a.run(poses[:n])
        slots = {sid: a.handler.wait_written(sid) for sid in range(n)}  # after each write-behind
        slot_size = a.log.slot_size
    # slot of segment 2: header damaged, found when the index is rebuilt on reopen
    _flip(tmp_path / "a", slots[2] or 0, 64, slot_size)
    (tmp_path / "a" / INDEX_NAME).unlink()
    with Session.resume(
        tmp_path / "a", TinyCausalWan(CFG), host_budget_bytes=3 * SEG, rule=_Want([2, 3], 33)
    ) as b:
        corrupt = [e for e in b.events if isinstance(e, CorruptSlot)]
        assert [e.slot for e in corrupt] == [slots[2]] and corrupt[0].reason
        recs = b.run(poses[n:])
    assert all(2 not in r.retrieved for r in recs) and any(3 in r.retrieved for r in recs)

    # a trusted index: segment 8's payload (read back into host on resume) and segment 1's (read
    # when wanted) are damaged; both are reported and never attended to
    with _session(tmp_path, log_dir=tmp_path / "c", host_budget_bytes=3 * SEG) as c:
        c.run(poses[:n])
        slots = {sid: c.handler.wait_written(sid) for sid in range(n)}  # after each write-behind
    for sid in (1, 8):
        _flip(tmp_path / "c", slots[sid] or 0, HEADER_SIZE + 100, slot_size)
    with Session.resume(
        tmp_path / "c", TinyCausalWan(CFG), host_budget_bytes=3 * SEG, rule=_Want([1, 8], 33)
    ) as d:
        assert [e.slot for e in d.events if isinstance(e, CorruptSlot)] == [slots[8]]
        recs = d.run(poses[n:])
    assert any(isinstance(e, Corrupt) and e.seg_id == 1 for e in d.events)
    assert all(not {1, 8} & set(r.retrieved) for r in recs)


def test_resume_rejects_what_does_not_fit(tmp_path: Path) -> None:
    with _session(tmp_path, log_dir=tmp_path / "a") as a:
        a.run(_poses(4))
    other = dataclasses.replace(CFG, layers=3)
    with pytest.raises(ValueError, match="config"):
        Session.resume(tmp_path / "a", TinyCausalWan(other), host_budget_bytes=4 * SEG)
    with pytest.raises(ValueError, match="seed"):
        Session.resume(tmp_path / "a", TinyCausalWan(CFG), host_budget_bytes=4 * SEG, seed=5)
    with pytest.raises(FileNotFoundError):
        Session.resume(tmp_path / "none", TinyCausalWan(CFG), host_budget_bytes=4 * SEG)
    with pytest.raises(FileExistsError):  # a new session never overwrites a saved one
        _session(tmp_path, log_dir=tmp_path / "a")


def test_session_presets() -> None:
    tiny = SegmentLayout.from_config(SESSION_PRESETS["tiny"], "bf16").payload_nbytes
    assert (64 << 20) // tiny == 18  # revisits read back from NVMe at a 64 MiB host budget
    assert SESSION_PRESETS["micro"] == TINY
    for cfg in SESSION_PRESETS.values():
        assert (cfg.rope_table_frames, cfg.action_rope_table_frames) == (16, 40)


def test_prefetch_stalls_no_more_than_on_demand(tmp_path: Path) -> None:
    poses = yaw_sweep_trajectory(16)
    medians = {}
    for mode in ("prefetch", "on_demand"):
        opts = {"mode": mode, "host_budget_bytes": 3 * SEG, "throttle_bps": 2e6, "compute_s": 0.04}
        with _session(tmp_path / mode, **opts) as s:
            s.run(poses)
        assert sum(r.misses for r in s.records) > 0
        medians[mode] = statistics.median(r.stall_s for r in s.records[1:])
    assert medians["prefetch"] <= medians["on_demand"]


def test_stall_stats() -> None:
    assert stall_stats([]) == {"median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    assert stall_stats([0.3, 0.1, 0.2]) == {"median_s": 0.2, "p99_s": 0.3, "max_s": 0.3}


def test_trajectory_is_deterministic_and_revisits() -> None:
    a, b = yaw_sweep_trajectory(30, seed=3), yaw_sweep_trajectory(30, seed=3)
    assert a == b and a != yaw_sweep_trajectory(30, seed=4)
    assert abs(a[11].yaw - a[13].yaw) < 10.0  # the sweep turns back over the same views


def test_cli_session_contract(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["session", "--preset", "tiny", "--segments", "60", "--host-memory", "64MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {
        "segments", "latent_frames", "peak_rss_bytes", "rss_growth_bytes", "host_budget_bytes",
        "gpu_budget_bytes", "nvme_bytes_written", "nvme_bytes_read", "positional_table_frames",
        "max_position_reached", "stall",
    }  # fmt: skip
    assert keys <= out.keys() and set(out["stall"]) == {"median_s", "p99_s", "max_s"}
    assert out["segments"] == 60 and out["latent_frames"] == 180
    assert out["max_position_reached"] >= 10 * out["positional_table_frames"]
    # the host budget is the user's --host-memory (no hidden cap), and revisits still read back
    assert out["host_budget_bytes"] == 64 << 20 and out["host_segments_cap"] == 0
    assert out["host_segments"] == (64 << 20) // out["segment_bytes"] < 60
    assert out["nvme_bytes_read"] > 0 and out["host_misses"] > 0 and "read_back" not in out
    assert out["host_peak_bytes"] <= out["host_budget_bytes"]
    assert out["warmup_segments"] >= 2 and out["rss_baseline_bytes"] > 0
    assert isinstance(out["rss_growth_bytes"], int) and isinstance(out["rss_within_bound"], bool)
    assert out["rss_bound_bytes"] == int(1.05 * out["host_budget_bytes"])


def test_cli_session_micro_explains_missing_read_back(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["session", "--preset", "micro", "--segments", "12", "--host-memory", "64MiB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nvme_bytes_read"] == 0 and out["read_back"].startswith("none: the host budget holds")
    assert out["tables_passed_x"] == {"self_attn": 2.25, "action": 0.9}


def test_cli_session_save_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["session", "--host-memory", "150KiB", "--log-dir", str(tmp_path / "s"), "--json"]
    assert main([*base, "--preset", "micro", "--segments", "8"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["first_segment"] == 0 and first["total_segments"] == 8 and not first["resumed"]
    assert main([*base, "--resume", "--segments", "6"]) == 0  # preset, codec, seed: the saved ones
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "micro" and out["resumed"] and out["window_source"] == "checkpoint"
    assert out["first_segment"] == 8 and out["segments"] == 6 and out["total_segments"] == 14
    assert out["max_position_reached"] == 14 * 3 - 1 and out["nvme_bytes_read"] > 0
    assert main([*base, "--preset", "micro", "--segments", "2"]) == 2  # the log exists: not overwritten
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--host-memory", "1KiB"],
        ["--host-memory", "12XB"],
        ["--host-memory", "1MiB", "--segments", "0"],
        ["--resume"],
        ["--warmup-segments", "-1"],
        ["--resume", "--log-dir", "/nonexistent/wp-session"],
    ],
)
def test_cli_session_bad_input(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["session", "--preset", "tiny", "--segments", "3", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: ") and "Traceback" not in err


def test_the_lease_shrinks_and_grows_at_run_time_without_losing_a_segment(tmp_path: Path) -> None:
    poses = yaw_sweep_trajectory(24)
    with _session(tmp_path, host_budget_bytes=10 * SEG) as s:
        for pose in poses[:12]:
            s.step(pose)
        s.resize_lease(host_budget_bytes=4 * SEG)  # the manager takes host RAM back mid-session
        s.pm.check()
        assert s.pm.host_budget_bytes == 4 * SEG
        assert s.pm.host_used_bytes <= 4 * SEG  # spills landed before resize returned
        for pose in poses[12:18]:  # generation goes on within the smaller lease
            rec = s.step(pose)
            assert rec.pm_host_used_bytes <= 4 * SEG
        s.resize_lease(host_budget_bytes=10 * SEG)  # and gets it back later
        for pose in poses[18:]:
            s.step(pose)
        s.handler.drain()
        s.pm.check()
        with pytest.raises(ValueError):
            s.resize_lease(host_budget_bytes=SEG // 2)  # below one segment: refused, named
    assert not any(isinstance(e, Corrupt) for e in s.events)
    with SegmentLog.open(tmp_path / "log") as log:  # every segment is still there, readable
        assert sorted(log.header(slot).segment_id for slot in log.slots()) == list(range(24))
