"""Per-model statistics the policies read (pure Python).

- `ReuseHistogram`: reuse intervals (time between a model's request arrivals) in log-spaced bins,
  globally and by hour of week (homes are weekly creatures), plus arrivals by hour of week/day.
- `LoadCost`: load time per transition as a robust running estimate (median of recent
  measurements, seeded by the config's estimate).

Thread safety: none; the engine owns these objects and calls them from one thread.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate

WEEK_S = 7 * 24 * 3600.0
# Log-spaced bin edges from 1 s to 8 days (ratio 1.25, ~60 bins). Bin i holds [edge[i-1], edge[i]).
EDGES: tuple[float, ...] = tuple(1.25**k for k in range(0, 61))
N_BINS = len(EDGES) + 1
# Coarse edges for the hour-of-week histograms (ratio ~2.4, 16 bins): few samples land per hour.
HOW_EDGES: tuple[float, ...] = tuple(2.4**k for k in range(0, 15))
N_HOW_BINS = len(HOW_EDGES) + 1


def hour_of_week(t: float) -> int:
    """Hour of week (0 = Monday 00:00) of Unix time `t`, treating `t` as the home's wall clock."""
    # 1970-01-01 was a Thursday: shift by 3 days so Monday is 0.
    return int(((t + 3 * 86400.0) % WEEK_S) // 3600.0)


class ReuseHistogram:
    """Reuse intervals and arrival counts for one model."""

    __slots__ = ("arrivals_hod", "arrivals_how", "bins", "count", "first_t", "how_bins", "last_how", "last_t")

    def __init__(self) -> None:
        self.bins = [0] * N_BINS
        self.how_bins = [[0] * N_HOW_BINS for _ in range(168)]
        self.arrivals_how = [0] * 168
        self.arrivals_hod = [0] * 24
        self.count = 0
        self.last_t = -math.inf
        self.last_how = 0  # hour_of_week(last_t), kept to spare its recomputation per arrival
        self.first_t = math.inf

    def capture(self) -> dict[str, object]:
        """JSON-ready state (so the service's statistics survive a restart)."""
        return {
            "bins": list(self.bins), "how_bins": [list(b) for b in self.how_bins],
            "arrivals_how": list(self.arrivals_how), "arrivals_hod": list(self.arrivals_hod),
            "count": self.count, "last_t": self.last_t if self.count else None,
            "first_t": self.first_t if self.count else None,
        }  # fmt: skip

    def restore(self, doc: dict[str, object]) -> None:
        """Load what `capture` returned (ValueError if it does not fit this histogram's shape)."""
        bins, how = doc["bins"], doc["how_bins"]
        if not (isinstance(bins, list) and len(bins) == N_BINS and isinstance(how, list) and len(how) == 168):
            raise ValueError("reuse histogram: bins of the wrong shape")
        self.bins = [int(x) for x in bins]
        self.how_bins = [[int(x) for x in row] for row in how]
        self.arrivals_how = [int(x) for x in doc["arrivals_how"]]  # type: ignore[attr-defined]
        self.arrivals_hod = [int(x) for x in doc["arrivals_hod"]]  # type: ignore[attr-defined]
        self.count = int(doc["count"])  # type: ignore[call-overload]
        last, first = doc.get("last_t"), doc.get("first_t")
        self.last_t = float(last) if isinstance(last, int | float) else -math.inf
        self.last_how = hour_of_week(self.last_t) if self.last_t > -math.inf else 0
        self.first_t = float(first) if isinstance(first, int | float) else math.inf

    def observe(self, t: float) -> None:
        """Record an arrival at `t` (arrivals must come in time order)."""
        h = hour_of_week(t)
        self.arrivals_how[h] += 1
        self.arrivals_hod[h % 24] += 1
        if self.count:
            gap = t - self.last_t
            self.bins[bisect_right(EDGES, gap)] += 1
            self.how_bins[self.last_how][bisect_right(HOW_EDGES, gap)] += 1
        else:
            self.first_t = t
        self.count += 1
        self.last_t = t
        self.last_how = h

    @property
    def intervals(self) -> int:
        return max(0, self.count - 1)

    def cdf(self, x: float) -> float:
        """Fraction of reuse intervals shorter than `x` (bin-resolution, upper-bin convention)."""
        n = self.intervals
        if n == 0:
            return 0.0
        return sum(self.bins[: bisect_right(EDGES, x)]) / n

    def quantile(self, q: float) -> float:
        """Upper edge of the bin holding quantile `q` of the reuse intervals (inf when none)."""
        return self.quantiles(q)[0]

    def quantiles(self, *qs: float) -> list[float]:
        """`quantile` of each of `qs`, from one pass over the bins."""
        n = self.intervals
        if n == 0:
            return [math.inf] * len(qs)
        running = list(accumulate(self.bins))
        out = []
        for q in qs:
            # The first bin whose running total reaches q * n; a target above 0 makes it a bin that
            # holds a sample (q <= 0: the smallest interval seen).
            i = bisect_left(running, max(q * n, 0.5))
            out.append(EDGES[i] if i < len(EDGES) else math.inf)
        return out

    def p_reuse_within(self, idle: float, horizon: float) -> float:
        """P(next arrival within `horizon` | already idle for `idle`), from the interval histogram.

        Uses the hazard form (F(idle+h) - F(idle)) / (1 - F(idle)) with one pseudo-count of
        "never again" so a model seen once is not certain to return.
        """
        n = self.intervals
        if n == 0:
            return 0.0
        lo = sum(self.bins[: bisect_right(EDGES, idle)])
        hi = sum(self.bins[: bisect_right(EDGES, idle + horizon)])
        survivors = n - lo + 1
        return (hi - lo) / survivors

    def rate_per_hour(self, t: float, weeks_seen: float) -> float:
        """Expected arrivals per hour at `t`'s hour, from this hour of week (or of day) so far."""
        h = hour_of_week(t)
        if weeks_seen >= 1.0:
            return self.arrivals_how[h] / weeks_seen
        days = max(1.0, weeks_seen * 7.0)
        return self.arrivals_hod[h % 24] / days


class LoadCost:
    """Load seconds per transition: "disk" (disk -> gpu), "cached" (page cache -> gpu), "host"
    (host -> gpu) and "disk_host" (disk -> host RAM): median of the recent measurements.

    Seeded with the configured estimate, which counts as one measurement until three real ones
    exist; outliers (a single slow load while the disk was busy) move the median little.
    """

    __slots__ = ("_est", "_samples", "_seed")

    def __init__(self, disk: float, cached: float, host: float) -> None:
        self._seed = {"disk": disk, "cached": cached, "host": host, "disk_host": max(0.0, disk - host)}
        self._samples: dict[str, deque[float]] = {k: deque(maxlen=9) for k in self._seed}
        self._est = dict(self._seed)

    def get(self, source: str) -> float:
        return self._est[source]

    def measure(self, source: str, seconds: float) -> None:
        """Fold in a measured load of `seconds` from `source`."""
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            return
        s = self._samples[source]
        s.append(seconds)
        vals = sorted(s) if len(s) >= 3 else sorted([*s, self._seed[source]])
        mid = len(vals) // 2
        self._est[source] = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2.0

    def as_dict(self) -> dict[str, float]:
        return dict(self._est)

    def fresh(self) -> LoadCost:
        """A LoadCost with the same seeds and no measurement."""
        s = self._seed
        return LoadCost(s["disk"], s["cached"], s["host"])

    def capture(self) -> dict[str, list[float]]:
        """The measured samples per source (the seeds come from the config)."""
        return {k: list(v) for k, v in self._samples.items()}

    def restore(self, doc: dict[str, list[float]]) -> None:
        for source, samples in doc.items():
            if source in self._samples:
                for x in samples:
                    self.measure(source, float(x))
