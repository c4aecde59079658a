"""`worldpager bench-stall`: shape of the result (benchmarks measure; tests assert behaviour only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worldpager.cli import main


def test_bench_stall_quick_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "stall.png"
    assert main(["bench-stall", "--quick", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["limit_gbps"] > 0
    rows = out["rows"]
    assert len(rows) == 5
    bws = [r["bandwidth_gbps"] for r in rows]
    assert bws == sorted(bws)
    for r in rows:
        for mode in ("prefetch", "on_demand"):
            stats = r[mode]
            assert {"median_s", "p99_s", "max_s"} <= stats.keys()
            assert all(stats[k] >= 0 for k in ("median_s", "p99_s", "max_s"))
            assert stats["median_s"] <= stats["p99_s"] <= stats["max_s"]
            assert stats["host_hits"] == 0  # every retrieved segment came from NVMe
            assert stats["nvme_reads"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_stall_text_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-stall", "--quick", "--multipliers", "1,2", "--steps", "2"]) == 0
    assert "L = " in capsys.readouterr().out
    assert main(["bench-stall", "--quick", "--segments", "3"]) == 2
    assert capsys.readouterr().err.startswith("worldpager: ")
    assert main(["bench-stall", "--compute-s", "-1"]) == 2
