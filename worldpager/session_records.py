"""What a `Session` reports: `StepRecord` (one step, numbers only), its events (`SessionEvent`,
`CorruptSlot`, `MissingSegment`, kept bounded by `EventLog`) and `stall_stats` (median / p99 / max of
a series of seconds).

Events are drained from the transfer handler every step into counts, the rare notable ones (`Corrupt`,
`DiskFull`, `CorruptSlot`, `MissingSegment`), the first `Dropped` and the last ``max_events`` others
(host-only mode drops one every step), the last ``max_events`` `LeaseResized` ones (a lease can be
resized any number of times in a long session) and the last ``max_events`` routine ones.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from heapq import merge

from worldpager.page_types import Corrupt, DiskFull, LeaseResized
from worldpager.transfer import Dropped, RuntimeEvent

__all__ = ["CorruptSlot", "EventLog", "MissingSegment", "SessionEvent", "StepRecord", "stall_stats"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    stall_s: float
    compute_s: float
    hits: int  # retrieved segments found in host when the step was prepared
    misses: int  # retrieved segments read from NVMe
    retrieved: tuple[int, ...]  # segments attended to
    bytes_read: int  # NVMe bytes read since the previous step
    bytes_written: int  # NVMe bytes written since the previous step
    host_bytes: int  # host copies held after the step
    pm_host_used_bytes: int  # the PageManager's host accounting after the step
    rss_bytes: int
    max_position: int  # last latent frame generated


@dataclass(frozen=True)
class CorruptSlot:
    """A log slot found corrupt (or unreadable) when a saved session was reopened: never used."""

    slot: int
    reason: str


@dataclass(frozen=True)
class MissingSegment:
    """A segment a reopened session had generated (below the step it continues at) that its log does
    not hold now (lost, corrupt, or never written): never retrieved."""

    segment_id: int
    reason: str


SessionEvent = RuntimeEvent | CorruptSlot | MissingSegment
_NOTABLE = (Corrupt, DiskFull, CorruptSlot, MissingSegment)  # kept, all of them
# (`LeaseResized` and `Dropped` are notable too, but only some are kept: see `EventLog`)


def stall_stats(values: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "p99_s", "max_s"}`` (p99: nearest rank); zeros for no values."""
    if not values:
        return {"median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    s = sorted(values)
    p99 = s[max(0, math.ceil(0.99 * len(s)) - 1)]
    return {"median_s": statistics.median(s), "p99_s": p99, "max_s": s[-1]}


class EventLog:
    """Counts of every event by type name (all of them, kept or not), every notable event, the first
    `Dropped` event and the last ``max_events`` others (a session in host-only mode drops a segment
    every step: kept all, they grew without bound), the last ``max_events`` `LeaseResized` events and
    the last ``max_events`` others."""

    def __init__(self, max_events: int) -> None:
        if max_events < 0:
            raise ValueError(f"max_events must be >= 0, got {max_events}")
        self._counts: dict[str, int] = {}
        self._seq = 0  # events recorded so far: keeps the notable ones and the resizes in their order
        self._notable: list[tuple[int, SessionEvent]] = []
        self._resized: deque[tuple[int, SessionEvent]] = deque(maxlen=max_events)
        self._first_dropped: list[tuple[int, SessionEvent]] = []  # (when host-only mode began)
        self._dropped: deque[tuple[int, SessionEvent]] = deque(maxlen=max_events)
        self._recent: deque[SessionEvent] = deque(maxlen=max_events)

    def record(self, e: SessionEvent) -> None:
        name = type(e).__name__
        self._counts[name] = self._counts.get(name, 0) + 1
        self._seq += 1
        if isinstance(e, LeaseResized):
            self._resized.append((self._seq, e))
        elif isinstance(e, Dropped):
            (self._dropped if self._first_dropped else self._first_dropped).append((self._seq, e))
        elif isinstance(e, _NOTABLE):
            self._notable.append((self._seq, e))
        else:
            self._recent.append(e)

    def extend(self, events: Iterable[SessionEvent]) -> None:
        for e in events:
            self.record(e)

    def events(self) -> list[SessionEvent]:
        """Notable events (all of them, with the first and the last ``max_events`` `Dropped` ones
        and the last ``max_events`` `LeaseResized` ones among them, in the order they came) and then
        the last ``max_events`` routine ones."""
        kept = merge(
            self._notable, self._first_dropped, self._dropped, self._resized, key=lambda item: item[0]
        )
        return [*(e for _, e in kept), *self._recent]

    def counts(self) -> dict[str, int]:
        """How many events of each type were recorded, including those no longer kept."""
        return dict(self._counts)
