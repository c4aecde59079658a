"""Review 28, saved statistics: a histogram saved with arrivals (count > 0) but no `last_t` (null: a
damaged or hand-edited entry) was restored with last_t = -inf; merged late (the store down at
start), `_join_hist` took the hour of week of -inf, and every save and flush of the run raised
ValueError (the statistics were never saved again). Such an entry is now unreadable, and rebuilt
from the request log, as other damaged entries are."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.live import LiveManager
from manager.live_persist import _read_hist
from manager.policy.stats import ReuseHistogram
from manager.store import open_store

T0 = 1_790_000_000.0


def _capture(n: int) -> dict[str, Any]:
    h = ReuseHistogram()
    for i in range(n):
        h.observe(T0 - 1000 + i)
    return h.capture()


@pytest.mark.parametrize("field", ["first_t", "last_t"])
def test_arrivals_without_a_first_or_last_time_are_refused(field: str) -> None:
    cap = _capture(5)
    cap[field] = None
    with pytest.raises(ValueError, match="5 arrivals, but no first_t/last_t time"):
        _read_hist(cap, ReuseHistogram().hours)
    del cap[field]
    with pytest.raises(ValueError, match="no first_t/last_t time"):
        _read_hist(cap, ReuseHistogram().hours)


def test_a_histogram_without_arrivals_or_with_both_times_is_read() -> None:
    assert _read_hist(_capture(0), ReuseHistogram().hours).count == 0
    h = _read_hist(_capture(5), ReuseHistogram().hours)
    assert (h.count, h.first_t, h.last_t) == (5, T0 - 1000, T0 - 996)
    stepped = _capture(5)
    stepped["first_t"] = stepped["last_t"] + 30.0  # (a wall clock stepped back between arrivals)
    assert _read_hist(stepped, ReuseHistogram().hours).count == 5


def test_a_saved_entry_without_last_t_merged_late_is_rebuilt_and_saves_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path}/state.db"
    cap = _capture(5)
    cap["last_t"] = None
    s = open_store(url)
    s.put_doc("stats", {"voice": {"hist": cap, "cost": {}, "requests": 5, "seen_until": T0 - 900}})
    s.close()
    lm = LiveManager(load_config(CONFIG), None, store=open_store(url), clock=lambda: T0)
    try:
        lm._down_at_start = "not tried: the store did not answer its first call at start"
        lm.restore_stats()  # fresh statistics, the saved ones merged once the store answers
        lm._down_at_start = None
        lm.engine.models["voice"].hist.observe(T0 - 10)  # a request of this run
        with caplog.at_level(logging.WARNING):
            lm.save_stats()
            lm.save_stats()
        assert "unreadable (reuse histogram: 5 arrivals, but no first_t/last_t time)" in caplog.text
        assert lm.store is not None
        saved = lm.store.get_doc("stats")
        assert saved is not None and saved["voice"]["hist"]["count"] == 1  # this run's, saved
        assert saved["voice"]["hist"]["last_t"] == T0 - 10
        lm._log_buf = [{"t": T0 - 5, "model": "voice", "busy_s": 0.1}]
        asyncio.run(lm.flush_log())
        assert lm._log_buf == []
    finally:
        assert lm.store is not None
        lm.store.close()
