"""Review 17 of `residency trace synth`: a studio trace shorter than a week has its share of the
week's afternoon world sessions, not one every day (as review 14 found for the home profile's
party spikes)."""

from __future__ import annotations

from collections import Counter

import pytest

from manager.replay.synth import synth

DAY = 86400.0


def _afternoon_sessions(days: int, seed: int) -> int:
    """The studio's second world session of a day starts between 13:00 and 17:00 (the daily one
    between 20:00 and 23:00)."""
    return sum(1 for r in synth("studio", days, seed) if r.model == "world" and (r.t % DAY) / 3600.0 < 18.0)


@pytest.mark.parametrize(("days", "low", "high"), [(1, 0.2, 0.65), (2, 0.6, 1.2), (3, 1.0, 1.75)])
def test_a_short_studio_trace_has_its_share_of_a_weeks_afternoon_sessions(
    days: int, low: float, high: float
) -> None:
    """A week has 3 afternoon sessions on 3 of its 7 days; a trace of 1-3 days had one on every
    day (a 2-day trace: 2, where a week's share is 6/7 on average)."""
    counts = [_afternoon_sessions(days, seed) for seed in range(60)]
    assert low <= sum(counts) / len(counts) <= high, Counter(counts)
    assert 0 in counts  # some short traces have none


def test_a_whole_week_still_has_three_afternoon_sessions() -> None:
    assert {_afternoon_sessions(7, seed) for seed in range(10)} == {3}
