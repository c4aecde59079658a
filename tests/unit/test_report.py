"""The tuning report: reconstruction helpers on hand-made actions, and a full page from real replays."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from manager.config import load_config
from manager.policy.types import Action, ActionKind
from manager.replay.report import cold_by_hour, gpu_bytes, tier_spans, write_report
from manager.replay.sim import ReplayResult, replay
from manager.replay.synth import synth

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GIB = 1 << 30


def act(kind: ActionKind, model: str, nbytes: int = 0, device: str = "gpu0") -> Action:
    return Action(kind, model, device, nbytes, "test")


def test_tier_spans_load_then_demote() -> None:
    spans = tier_spans(
        [(1.0, act(ActionKind.LOAD, "a", GIB)), (5.0, act(ActionKind.DEMOTE, "a", GIB))], ["a"], 0.0, 10.0
    )
    assert spans == {"a": [(0.0, 1.0, "disk"), (1.0, 5.0, "gpu"), (5.0, 10.0, "host")]}


def test_tier_spans_all_kinds_and_clamping() -> None:
    actions = [
        (-5.0, act(ActionKind.LOAD, "a", GIB)),  # before the period: a is on the GPU at t_start
        (2.0, act(ActionKind.GROW_LEASE, "a", GIB)),  # lease actions keep the tier
        (3.0, act(ActionKind.DROP, "a", GIB)),
        (1.0, act(ActionKind.LOAD_HOST, "b", GIB, "host")),
        (4.0, act(ActionKind.PROMOTE, "b", GIB)),
        (6.0, act(ActionKind.DEMOTE, "b", GIB)),
        (7.0, act(ActionKind.DROP, "b", GIB, "host")),
        (8.0, act(ActionKind.LOAD, "zzz", GIB)),  # not listed: ignored
        (20.0, act(ActionKind.LOAD, "c", GIB)),  # after the period: ignored
    ]
    spans = tier_spans(actions, ["a", "b", "c"], 0.0, 10.0)
    assert spans["a"] == [(0.0, 3.0, "gpu"), (3.0, 10.0, "disk")]
    assert spans["b"] == [
        (0.0, 1.0, "disk"),
        (1.0, 4.0, "host"),
        (4.0, 6.0, "gpu"),
        (6.0, 7.0, "host"),
        (7.0, 10.0, "disk"),
    ]
    assert spans["c"] == [(0.0, 10.0, "disk")]


def test_gpu_bytes_load_demote_and_leases() -> None:
    actions = [
        (1.0, act(ActionKind.LOAD, "a", 3 * GIB)),
        (1.0, act(ActionKind.LOAD, "w", 5 * GIB)),
        (2.0, act(ActionKind.SHRINK_LEASE, "w", 1 * GIB)),  # new lease: weights 4 GiB + 1 GiB
        (3.0, act(ActionKind.GROW_LEASE, "w", 2 * GIB)),
        (4.0, act(ActionKind.DROP, "b", GIB, "host")),  # a host drop doesn't touch the GPU
        (5.0, act(ActionKind.DEMOTE, "a", 3 * GIB)),
        (6.0, act(ActionKind.DROP, "w", 6 * GIB)),
    ]
    times, values = gpu_bytes(actions, ["a", "w"], {"a": 3 * GIB, "w": 4 * GIB}, 0.0, 10.0)
    assert times == [0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 10.0]
    assert values["a"] == [0, 3 * GIB, 3 * GIB, 3 * GIB, 0, 0, 0]
    assert values["w"] == [0, 5 * GIB, 5 * GIB, 6 * GIB, 6 * GIB, 0, 0]


def test_cold_by_hour_counts_only_cold_requests() -> None:
    monday = 1793577600.0  # 2026-11-02 00:00 UTC, a Monday
    log = [
        (monday + 60, "a", True, 2.0),
        (monday + 120, "a", False, 0.0),
        (monday + 6 * 86400 + 23 * 3600, "b", True, 1.0),
    ]
    counts = cold_by_hour(log)
    assert len(counts) == 168
    assert counts[0] == 1 and counts[167] == 1 and sum(counts) == 2


@functools.cache
def replays() -> tuple[ReplayResult, ReplayResult, dict[str, int], float, float]:
    cfg = load_config(ROOT / "configs" / "home.yaml")
    reqs = synth("home", 2, 1)
    before = replay(cfg, reqs, "lru-keepalive", record=True)
    after = replay(cfg, reqs, "residency", record=True)
    weights = {m.name: m.memory for m in cfg.models}
    return before, after, weights, reqs[0].t - 600.0, reqs[-1].t


def test_write_report_page_and_plots(tmp_path: Path) -> None:
    before, after, weights, t0, t1 = replays()
    out = tmp_path / "report"
    index = write_report(
        out,
        before=before,
        after=after,
        t_start=t0,
        t_end=t1,
        model_weights=weights,
        notes=["keep_alive <b>llm</b>"],
    )
    assert index == out / "index.html" and index.is_file()
    page = index.read_text(encoding="utf-8")
    for value in (
        before.cold_starts,
        after.cold_starts,
        before.requests,
        after.evictions,
        after.wasted_loads,
    ):
        assert f"<td>{value}</td>" in page
    assert "wait_p99_s [realtime]" in page and "budget_violations" in page
    assert "<li>keep_alive &lt;b&gt;llm&lt;/b&gt;</li>" in page
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for name in ("timeline.png", "memory.png", "cold_starts.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    imgs = re.findall(r'<img src="([^"]+)" alt="([^"]+)"', page)
    assert len(imgs) == page.count("<img") == 3
    for src, _alt in imgs:
        assert (out / src).is_file()


def test_write_report_needs_recorded_replays(tmp_path: Path) -> None:
    before, after, weights, t0, t1 = replays()
    with pytest.raises(ValueError, match="record=True"):
        write_report(
            tmp_path, before=ReplayResult("x"), after=after, t_start=t0, t_end=t1, model_weights=weights
        )
    with pytest.raises(ValueError, match="empty report period"):
        write_report(tmp_path, before=before, after=after, t_start=t1, t_end=t0, model_weights=weights)
