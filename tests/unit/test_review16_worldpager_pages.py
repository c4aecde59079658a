"""Review 16: PageManager bookkeeping."""

from __future__ import annotations

import pytest

from worldpager.pages import PageManager


def test_a_refused_resize_changes_neither_budget() -> None:
    pm = PageManager(host_budget_bytes=1000, gpu_slot_bytes=10, slots_per_buffer=4, segment_bytes=100)
    pm.add_segment(1, 100)
    with pytest.raises(ValueError, match="host_budget_bytes=50"):
        pm.resize(host_budget_bytes=50, gpu_budget_bytes=20)
    assert (pm.slots_per_buffer, pm.gpu_budget_bytes, pm.host_budget_bytes) == (4, 80, 1000)
    with pytest.raises(ValueError, match="gpu_budget_bytes=10"):
        pm.resize(host_budget_bytes=500, gpu_budget_bytes=10)
    assert (pm.slots_per_buffer, pm.gpu_budget_bytes, pm.host_budget_bytes) == (4, 80, 1000)
    assert pm.take_events() == []
    pm.check()
