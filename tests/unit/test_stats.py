"""Statistics the policies read: reuse-interval histograms and load-cost estimates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager.config import load_config
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.stats import EDGES, N_BINS, LoadCost, ReuseHistogram, hour_of_week
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

    @settings(max_examples=300, deadline=None)
    @given(
        st.dictionaries(st.integers(0, N_BINS - 1), st.integers(1, 50), min_size=1, max_size=8),
        st.floats(0.0, 1.0),
    )
    def test_quantile_is_the_upper_edge_of_the_bin_holding_it(self, counts: dict[int, int], q: float) -> None:
        """By definition: the first bin holding a sample where at least q of the intervals lie at or below
        it (q = 0: the smallest interval seen)."""
        h = ReuseHistogram()
        h.bins = [counts.get(i, 0) for i in range(N_BINS)]
        h.count = sum(h.bins) + 1

        def by_definition(q: float) -> float:
            acc = 0
            for i, c in enumerate(h.bins):
                acc += c
                if c and acc >= q * h.intervals:
                    return EDGES[i] if i < len(EDGES) else math.inf
            return math.inf

        assert h.quantile(q) == by_definition(q)
        assert h.quantiles(q, 1.0 - q) == [by_definition(q), by_definition(1.0 - q)]

    def test_restored_histogram_files_the_next_interval_under_the_last_arrival_hour(self) -> None:
        h = ReuseHistogram()
        h.observe(MONDAY + 8 * 3600 + 10)  # Monday 08:00
        h2 = ReuseHistogram()
        h2.restore(h.capture())
        h2.observe(MONDAY + 9 * 3600 + 10)  # an hour later: the interval began in hour 8
        assert sum(h2.how_bins[8]) == 1 and sum(h2.how_bins[0]) == 0

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

    def test_a_model_measured_larger_than_its_estimate_makes_idle_models_leave(self) -> None:
        """The device was left over its budget on the books (and for real) until models left on
        their own; only the violation counter said so (found in review, 2026-12-01)."""
        cfg = load_config("configs/home.yaml")
        eng = Engine(cfg, create_policy("gdsf"))
        eng.start(MONDAY)
        dev = eng.state.devices["gpu0"]
        voice, llm, image = eng.models["voice"], eng.models["llm"], eng.models["image"]
        for m in (llm, image):
            if m.tier != Tier.GPU:
                assert eng.make_room(m, m.rank, MONDAY, may_evict=True)
                eng.load(m, MONDAY, prewarm=False, reason="test")
        now = MONDAY + 600
        llm.busy_until = now + 60  # serving: it stays
        grow = dev.usable - dev.used + 2**30  # voice measured 1 GiB more than the device has free
        eng.measured_footprint(voice, voice.weights + grow, now)
        assert dev.used <= dev.usable and eng.counters.budget_violations == 0
        assert image.tier != Tier.GPU and llm.tier == Tier.GPU and voice.tier == Tier.GPU
