"""Per-model statistics the policies read (pure Python).

- `ReuseHistogram`: reuse intervals (time between a model's request arrivals) in log-spaced bins,
  globally and by hour of week (homes are weekly creatures), plus arrivals by hour of week/day.
- `LoadCost`: load time per transition as a robust running estimate (median of recent
  measurements, seeded by the config's estimate).

Thread safety: none; the engine owns these objects and calls them from one thread.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from datetime import datetime, tzinfo
from functools import cache
from itertools import accumulate
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

WEEK_S = 7 * 24 * 3600.0
# Log-spaced bin edges from 1 s to 8 days (ratio 1.25, ~60 bins). Bin i holds [edge[i-1], edge[i]).
EDGES: tuple[float, ...] = tuple(1.25**k for k in range(0, 61))
N_BINS = len(EDGES) + 1
# Coarse edges for the hour-of-week histograms (ratio ~2.4, 16 bins): few samples land per hour.
HOW_EDGES: tuple[float, ...] = tuple(2.4**k for k in range(0, 15))
N_HOW_BINS = len(HOW_EDGES) + 1


def hour_of_week(t: float) -> int:
    """Hour of week (0 = Monday 00:00) of Unix time `t` on UTC's wall clock (`HomeHours` gives it on
    a home's own)."""
    # 1970-01-01 was a Thursday: shift by 3 days so Monday is 0.
    return int(((t + 3 * 86400.0) % WEEK_S) // 3600.0)


OFFSET_BLOCK_S = 900.0
"""A zone's UTC offset is looked up once per this many seconds of Unix time, when it is the same at
both ends of the block (today's rules change at a whole local hour, half or quarter hour: on the
blocks' boundaries); in a block where it changes (some zones' changes before 2011 fell at a minute
past, Monrovia's offset until 1972 was -0:44:30) it is looked up for each time."""


class HomeHours:
    """Hour of week (0 = Monday 00:00) of a Unix time on the home's wall clock: in time zone `zone`,
    its summer time included, for homes live by it (the 07:00 voice burst stays at 07:00 after the
    clocks change). Call it with the time. `zone` None: UTC, or with `local`, this process's local
    time (the C library's: the TZ variable's rule, or /etc/localtime). `name`: for messages."""

    __slots__ = ("_last", "local", "name", "zone")

    def __init__(self, zone: tzinfo | None = None, name: str = "UTC", *, local: bool = False) -> None:
        self.zone = zone
        self.name = name
        self.local = local
        # (block, offset or None where it changes within the block): one attribute, so that threads
        # sharing this clock never read one block's offset with another's block
        self._last: tuple[float, float | None] = (math.nan, 0.0)  # (NaN equals no block)

    def _lookup(self, t: float) -> float:
        try:
            if self.local:
                return float(time.localtime(t).tm_gmtoff)
            off = datetime.fromtimestamp(t, self.zone).utcoffset()
        except (OverflowError, ValueError, OSError):  # beyond the calendar's years, or NaN
            return 0.0
        return off.total_seconds() if off is not None else 0.0

    def offset(self, t: float) -> float:
        """The zone's UTC offset in seconds at Unix time `t` (0 where `t` is out of the calendar's range)."""
        if self.zone is None and not self.local:
            return 0.0
        block = t // OFFSET_BLOCK_S
        last = self._last
        if block == last[0]:
            return last[1] if last[1] is not None else self._lookup(t)
        start = block * OFFSET_BLOCK_S
        lo, hi = self._lookup(start), self._lookup(start + OFFSET_BLOCK_S - 1.0)  # (changes: whole seconds)
        self._last = (block, lo if lo == hi else None)
        return lo if lo == hi else self._lookup(t)

    def __deepcopy__(self, memo: dict[int, object]) -> HomeHours:
        return self  # a clock, the same for every copy of the statistics that read it (and a zone
        # read from a file cannot be copied)

    def __call__(self, t: float) -> int:
        return hour_of_week(t + self.offset(t))

    def __repr__(self) -> str:
        return f"HomeHours({self.name})"


_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "Etc/Universal", "Etc/Zulu", "Universal", "Zulu"})


def home_hours(name: str | None) -> HomeHours:
    """The home's clock for the config's `policy.timezone`: an IANA zone name ("Europe/Berlin"),
    or None for this machine's own local time: the TZ environment variable's (a zone's name, a file,
    or a POSIX rule such as "CET-1CEST,M3.5.0,M10.5.0/3"), else /etc/localtime's; UTC where neither
    says one. ValueError for a name no zone has."""
    if name is not None:
        return HomeHours(zone_named(name), name)
    tz = os.environ.get("TZ")
    if tz is not None:  # (set: the C library's local time follows it; empty is UTC)
        key = tz.removeprefix(":")
        if not key or key in _UTC_NAMES:
            return HomeHours(None, key or "UTC")
        if key in zone_names():
            return HomeHours(zone_named(key), key)
    else:
        try:
            link = os.readlink("/etc/localtime")
        except OSError:
            link = ""
        key = link.rsplit("zoneinfo/", 1)[1] if "zoneinfo/" in link else ""
        if key in _UTC_NAMES:
            return HomeHours(None, key)
        if key in zone_names():
            return HomeHours(zone_named(key), key)
        tz = "localtime"
    time.tzset()  # (the variable as it is now, as the C library reads it)
    return HomeHours(None, tz, local=True)


def hours_between(saved: str | None, saved_offset_s: float, hours: HomeHours, now: float) -> int:
    """How many hours later than the clock called `saved` (None: UTC, as releases before the zone
    counted) the home's clock `hours` reads at `now`: what the statistics counted on that clock are
    turned by (`ReuseHistogram.turn`). The same clock: 0 (its summer time is its own). A clock no
    zone name says (a POSIX rule, "localtime") is taken at `saved_offset_s`, its offset when saved."""
    if saved == hours.name:
        return 0
    try:
        before = home_hours(saved).offset(now) if saved is not None else 0.0
    except ValueError:
        before = saved_offset_s
    return round((hours.offset(now) - before) / 3600.0)


@cache
def zone_names() -> frozenset[str]:
    """The IANA zone names this machine knows (its zoneinfo files and the tzdata package's): what
    `policy.timezone` takes, and what the config's JSON Schema lists. Not "localtime", which some
    systems' zoneinfo folders hold as a link to /etc/localtime: no zone's name, it is whatever the
    machine reading it says (a config or a synthetic trace that meant another machine's time)."""
    return frozenset(available_timezones()) - {"localtime"} | {"UTC"}


def zone_named(name: str) -> tzinfo | None:
    """The zone called `name` (None for UTC itself, the fast path); ValueError naming it if none is."""
    if name in _UTC_NAMES:
        return None
    unknown = ValueError(f"no time zone is called {name!r} (an IANA name: 'Europe/Berlin', 'UTC')")
    if name not in zone_names():  # (ZoneInfo also opens any file under the zoneinfo folders)
        raise unknown
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as e:
        raise unknown from e


class ReuseHistogram:
    """Reuse intervals and arrival counts for one model."""

    __slots__ = (
        "arrivals_hod", "arrivals_how", "bins", "count", "first_t", "hours", "how_bins", "last_how", "last_t",
    )  # fmt: skip

    def __init__(self, hours: Callable[[float], int] = hour_of_week) -> None:
        self.hours = hours
        """Hour of week of a time on the home's wall clock (a `HomeHours`; UTC's by default)."""
        self.bins = [0] * N_BINS
        self.how_bins = [[0] * N_HOW_BINS for _ in range(168)]
        self.arrivals_how = [0] * 168
        self.arrivals_hod = [0] * 24
        self.count = 0
        self.last_t = -math.inf
        self.last_how = 0  # hours(last_t), kept to spare its recomputation per arrival
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
        self.last_how = self.hours(self.last_t) if self.last_t > -math.inf else 0
        self.first_t = float(first) if isinstance(first, int | float) else math.inf

    def turn(self, hours: int) -> None:
        """The counts by hour of week moved `hours` later (counted on a clock that many hours behind
        the home's: a zone changed, or an older release's UTC counts), so each habit keeps its hour."""
        k, d = hours % 168, hours % 24
        if k:
            self.arrivals_how = self.arrivals_how[-k:] + self.arrivals_how[:-k]
            self.how_bins = self.how_bins[-k:] + self.how_bins[:-k]
        if d:
            self.arrivals_hod = self.arrivals_hod[-d:] + self.arrivals_hod[:-d]
        self.last_how = self.hours(self.last_t) if self.count else 0  # (on `hours`, however turned)

    def observe(self, t: float) -> None:
        """Record an arrival at `t` (arrivals must come in time order)."""
        h = self.hours(t)
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
        h = self.hours(t)
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
