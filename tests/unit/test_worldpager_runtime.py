"""WorldPager runtime: a real tiny-model session through GPU buffers, host copies and the NVMe log."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from worldpager.cli import main
from worldpager.layout import SegmentLayout
from worldpager.model import TINY, TinyCausalWan
from worldpager.pages import Corrupt, DiskFull, Evicted
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import HEADER_SIZE, SegmentLog
from worldpager.session import Session, stall_stats
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
    assert out["nvme_bytes_read"] > 0 and out["host_budget_bytes"] <= 64 << 20


@pytest.mark.parametrize(
    "args",
    [["--host-memory", "1KiB"], ["--host-memory", "12XB"], ["--host-memory", "1MiB", "--segments", "0"]],
)
def test_cli_session_bad_input(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["session", "--preset", "tiny", "--segments", "3", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: ") and "Traceback" not in err
