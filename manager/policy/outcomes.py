"""What the engine hands back: an admission outcome per request, and running counters."""

from __future__ import annotations

from typing import NamedTuple


class Admission(NamedTuple):
    """Outcome of `Engine.admit`: status is "hit", "load" (ready at `ready_at`), "wait" or "reject"."""

    status: str
    ready_at: float
    reason: str = ""


class Counters:
    __slots__ = (
        "budget_violations",
        "evictions",
        "expiries",
        "lease_grows",
        "lease_shrinks",
        "loads",
        "loads_by_source",
        "prewarm_loads",
        "thrash",
        "wasted_loads",
    )

    def __init__(self) -> None:
        self.evictions = 0
        self.expiries = 0
        self.thrash = 0
        self.prewarm_loads = 0
        self.wasted_loads = 0
        self.budget_violations = 0
        self.lease_shrinks = 0
        self.lease_grows = 0
        self.loads = 0
        self.loads_by_source = {"disk": 0, "cached": 0, "host": 0}
