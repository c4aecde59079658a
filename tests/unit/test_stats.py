"""Statistics the policies read: reuse-interval histograms and load-cost estimates."""

from __future__ import annotations

import math

import pytest

from manager.config import load_config
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.stats import LoadCost, ReuseHistogram, hour_of_week
from manager.policy.types import Tier

MONDAY = 1793577600.0  # 2026-11-02 00:00 UTC, a Monday


class TestHourOfWeek:
    def test_monday_midnight_is_zero_and_sunday_last_hour_is_167(self) -> None:
        assert hour_of_week(MONDAY) == 0
        assert hour_of_week(MONDAY + 7 * 86400 - 1) == 167
        assert hour_of_week(MONDAY + 3600 * 30 + 5) == 30  # Tuesday 06:00


class TestReuseHistogram:
    def test_intervals_quantiles_and_hazard(self) -> None:
        h = ReuseHistogram()
        # Ten requests 60 s apart, then one 3 h gap: nine short intervals and one long one.
        t = MONDAY
        for _ in range(10):
            h.observe(t)
            t += 60.0
        h.observe(t + 3 * 3600.0)
        assert h.count == 11 and h.intervals == 10
        assert h.cdf(100.0) == pytest.approx(0.9)
        assert 60.0 <= h.quantile(0.5) <= 75.0  # the bin holding 60 s, upper edge
        assert h.quantile(0.99) >= 3 * 3600.0
        # Just after a request, another within 2 min is likely; after 10 idle minutes, it is not.
        assert h.p_reuse_within(0.0, 120.0) > 0.7
        assert h.p_reuse_within(600.0, 120.0) < 0.2

    def test_arrivals_by_hour_feed_the_rate(self) -> None:
        h = ReuseHistogram()
        for k in range(6):  # six requests on Monday 08:xx
            h.observe(MONDAY + 8 * 3600 + k * 60)
        assert h.arrivals_how[8] == 6 and h.arrivals_hod[8] == 6
        assert h.rate_per_hour(MONDAY + 8 * 3600 + 1800, weeks_seen=1.0) == 6.0
        assert h.rate_per_hour(MONDAY + 9 * 3600, weeks_seen=1.0) == 0.0

    def test_empty_histogram_is_uninformed(self) -> None:
        h = ReuseHistogram()
        assert h.quantile(0.5) == math.inf and h.cdf(10.0) == 0.0 and h.p_reuse_within(0, 60) == 0.0


class TestLoadCost:
    def test_seeded_by_config_then_median_of_measurements(self) -> None:
        c = LoadCost(disk=6.0, cached=2.0, host=1.0)
        assert c.get("disk") == 6.0 and c.get("disk_host") == 5.0  # disk -> host: disk less the copy
        c.measure("host", 0.5)  # one measurement: the seed still counts
        assert c.get("host") == pytest.approx(0.75)
        c.measure("host", 0.5)
        c.measure("host", 30.0)  # a single slow load (disk busy) barely moves the median
        assert c.get("host") == 0.5

    def test_nonsense_measurements_are_ignored(self) -> None:
        c = LoadCost(disk=6.0, cached=2.0, host=1.0)
        c.measure("disk", float("nan"))
        c.measure("disk", -1.0)
        assert c.get("disk") == 6.0


class TestMeasuredFootprint:
    def test_measured_bytes_replace_the_estimate_in_the_accounting(self) -> None:
        cfg = load_config("configs/home.yaml")
        eng = Engine(cfg, create_policy("gdsf"))
        eng.start(MONDAY)  # the pinned voice model is loaded
        voice = eng.models["voice"]
        dev = eng.state.devices["gpu0"]
        assert voice.tier == Tier.GPU and dev.used == voice.weights
        eng.measured_footprint(voice, 1000 * 2**20, MONDAY + 1)  # the worker measured 1000 MiB
        assert (
            voice.weights == 1000 * 2**20 and dev.used == 1000 * 2**20 and dev.free == dev.usable - dev.used
        )
        assert eng.counters.budget_violations == 0
