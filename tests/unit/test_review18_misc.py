"""Review 18, small defects.

The memory soak (bench/soak.py) reported RSS growth 0 and `within_bound: true` when it had measured
nothing: a run too short to take a sample after its warm-up compared the last sample with itself, and
an RSS psutil could not read crashed the run (a child of the process tree it could not read was left
out of the sum, reading as a drop). Growth, slopes and the verdict are now null then, and
`not_measured_reason` says why. Real soak runs (in-process pool, real models), short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from typing import Any

import psutil
import pytest
from integration.bench_module import load_bench

OLD_RSS_FIELDS = {
    "start", "schedule_start", "after_warmup", "end", "max", "warmup_s", "growth_after_warmup",
    "growth_after_warmup_net_of_kv", "kv_mib_after_warmup_and_last", "growth_per_hour_endpoints",
    "growth_per_hour_endpoints_net_of_kv", "slope_per_hour_fit", "slope_per_hour_fit_net_of_kv",
    "last_in_schedule", "bound_after_warmup", "within_bound", "process_tree",
}  # fmt: skip
"""The `rss_mib` fields the soak wrote before (bench/RESULTS.md quotes them): all kept."""

GROWTH_FIELDS = (
    "growth_after_warmup",
    "growth_after_warmup_net_of_kv",
    "growth_per_hour_endpoints",
    "growth_per_hour_endpoints_net_of_kv",
    "slope_per_hour_fit",
    "slope_per_hour_fit_net_of_kv",
)


def _assert_not_measured(rss: dict[str, Any]) -> None:
    assert set(rss) >= OLD_RSS_FIELDS, rss
    for k in GROWTH_FIELDS:
        assert rss[k] is None, (k, rss)
    assert rss["within_bound"] is None, rss  # no data is not a pass (nor a fail)
    assert rss["not_measured_reason"], rss


def test_a_soak_with_no_sample_after_its_warm_up_reports_no_growth_and_no_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    soak = load_bench("soak")
    # 3 s of schedule, warm-up 0.6 s, a sample every 5 s: no sample after the warm-up, or (where a
    # busy machine stretches the schedule past 5 s) one, which is no growth either
    assert soak.main(["--minutes", "0.05", "--cycle-seconds", "3", "--sample-seconds", "5"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out)
    assert r["errors"] == 0, r["first_errors"]
    rss = r["rss_mib"]
    _assert_not_measured(rss)
    said = rss["not_measured_reason"]
    assert "sample after the warm-up" in said and "--sample-seconds" in said, said
    assert rss["samples_after_warmup"] in (0, 1)
    assert ("no sample" in said) == (rss["samples_after_warmup"] == 0), said
    assert rss["start"] > 0 and rss["end"] > 0  # what was read is still reported
    assert '"growth_after_warmup": null' in out and '"within_bound": null' in out


class _UnreadableProcess:
    """psutil.Process as it is where the process's memory may not be read."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid

    def memory_info(self) -> Any:
        raise psutil.AccessDenied(self.pid, "soak-test")

    def children(self, recursive: bool = False) -> list[Any]:
        return []


def test_a_soak_whose_rss_psutil_cannot_read_reports_no_growth_and_no_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    soak = load_bench("soak")
    unreadable = types.SimpleNamespace(
        Process=_UnreadableProcess,
        Error=psutil.Error,
        NoSuchProcess=psutil.NoSuchProcess,
        AccessDenied=psutil.AccessDenied,
    )
    monkeypatch.setattr(soak, "psutil", unreadable)  # the soak's RSS reads only; the workers' stay real
    # 6 s of schedule, warm-up 1.2 s, a sample every second: samples after the warm-up, none readable
    r = soak.run_soak(soak.Options(minutes=0.1, cycle_s=3.0, sample_s=1.0))
    assert r["errors"] == 0, r["first_errors"]
    rss = r["rss_mib"]
    _assert_not_measured(rss)
    assert rss["samples_after_warmup"] >= 2
    assert "psutil could not read the process's RSS" in rss["not_measured_reason"]
    assert "AccessDenied" in rss["not_measured_reason"]
    assert rss["samples_unread"] == r["samples"]
    assert rss["start"] is None and rss["max"] is None


def test_a_child_in_the_process_tree_that_cannot_be_read_is_not_left_out_of_the_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    soak = load_bench("soak")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = psutil.Process.memory_info

        def memory_info(self: psutil.Process) -> Any:
            if self.pid == child.pid:
                raise psutil.AccessDenied(self.pid, "soak-test")
            return real(self)

        assert soak.rss_bytes(True) > soak.rss_bytes(False)  # the child counts
        monkeypatch.setattr(psutil.Process, "memory_info", memory_info)
        with pytest.raises(psutil.AccessDenied):  # (a sample of part of the tree would read as a drop)
            soak.rss_bytes(True)
        assert soak.rss_bytes(False) > 0
    finally:
        child.kill()
        child.wait()


def _samples(ts_rss_kv: list[tuple[float, float | None, float]]) -> list[dict[str, Any]]:
    return [{"t": t, "rss_mib": rss, "kv_mib": kv} for t, rss, kv in ts_rss_kv]


def test_rss_growth_is_measured_between_the_readable_samples_after_the_warm_up() -> None:
    soak = load_bench("soak")
    # start, schedule start (t=10), warm-up 5 s, samples at 15..45 (one unread), the final one
    samples = _samples(
        [(0, 300, 0), (10, 800, 0), (15, 900, 10), (25, 905, 20), (35, None, 20), (45, 930, 30), (50, 990, 0)]
    )
    rss = soak.rss_summary(samples, 10.0, 5.0, 96.0, False, "AccessDenied: x")
    assert rss["not_measured_reason"] is None
    assert rss["after_warmup"] == 900 and rss["last_in_schedule"] == 930 and rss["end"] == 990
    assert rss["growth_after_warmup"] == 30 and rss["growth_after_warmup_net_of_kv"] == 10
    assert rss["growth_per_hour_endpoints"] == 3600.0
    assert rss["slope_per_hour_fit"] is not None and rss["within_bound"] is True
    assert rss["samples_after_warmup"] == 4 and rss["samples_unread"] == 1
    over = soak.rss_summary(samples, 10.0, 5.0, 5.0, False)
    assert over["within_bound"] is False


def test_one_readable_sample_after_the_warm_up_is_not_a_growth_of_zero() -> None:
    soak = load_bench("soak")
    samples = _samples([(0, 300, 0), (10, 800, 0), (15, 900, 0), (20, None, 0), (25, 950, 0)])
    rss = soak.rss_summary(samples, 10.0, 5.0, 96.0, True)
    _assert_not_measured(rss)
    assert "one readable sample after the warm-up" in rss["not_measured_reason"]
    assert rss["after_warmup"] == 900  # what was read is still reported
