"""The live service's clock: wall time (Unix seconds, what statistics by hour of week, the request
log and traces need) that never runs backwards within a run.

`time.time()` follows every step of the system clock. A step back (NTP correcting a clock that ran
ahead, a person setting the time) made the service's times go back: a request's deadline, counted on
that clock, was put off by the step (a 30 s timeout could wait an hour), the reuse intervals of the
statistics came out negative, and keep-alives ran that much longer. `SteadyWallClock` counts from the
wall time at its start on the monotonic clock instead, so a step back is not followed: its times stay
ahead of the wall clock by the step until the next restart (logged once, with the step's size). A
step forward is followed (a home server without a real-time clock boots with a wrong time that NTP
then corrects: the statistics by hour of week need the right one), as `time.time()` did. Pure Python:
no service imports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

STEP_S = 1.0
"""A difference between the wall clock and this clock beyond this long is a step of the wall clock
(NTP slews small errors on both clocks alike, so they do not drift apart)."""


class SteadyWallClock:
    """Call it for the time now: Unix seconds that never go back. `wall` and `monotonic` are the
    clocks it reads (tests give their own)."""

    def __init__(
        self, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.wall = wall
        self.monotonic = monotonic
        self.offset = wall() - monotonic()
        self.behind_s = 0.0
        """How far the wall clock is behind this one (its steps back, not followed), as last seen."""

    def __call__(self) -> float:
        mono = self.monotonic()
        now = mono + self.offset
        wall = self.wall()
        if wall - now > STEP_S:  # stepped forward: followed
            logger.warning("the system clock stepped forward by %.1f s; the service follows it", wall - now)
            self.offset = wall - mono
            self.behind_s = 0.0
            return wall
        if now - wall > STEP_S and now - wall > self.behind_s + STEP_S:  # stepped back: not followed
            logger.warning(
                "the system clock stepped back by %.1f s; the service's times go on from where they were "
                "(ahead of the system clock by that much until the service restarts): deadlines, "
                "keep-alives and reuse intervals are not put off by the step",
                now - wall - self.behind_s,
            )
            self.behind_s = now - wall
        return now
