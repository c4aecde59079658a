"""Synthetic request weeks for replay and tuning (`residency trace synth`).

Primitives:
  PROFILES - profile name -> one-line description.
  synth    - (profile, days, seed[, start]) -> requests sorted by time; the same arguments always
             give the same list (one `random.Random(seed)`, never the global generator).

How a profile is built: a per-week planner makes the week-level choices (which weekday is "away",
which evenings have a party spike, ...) and then calls one small generator per activity for each
day. Every generator has the shape `(rng, day_start, weekday, out)` and appends to `out`.

Notes:
  The generators write the home's local wall clock as Unix seconds: the day starting at `day_start`
  is a calendar day in UTC and 07:00 means `day_start + 7 h`; `synth`'s `zone` then turns each into
  the Unix time that zone's clocks read it at (none: they stay UTC's). Weekdays are Monday=0 ... Sunday=6.
  Times and busy times are rounded to milliseconds, the trace format's resolution, so a trace
  written and read back equals the list returned here. Model names match configs/home.yaml:
  voice, tts, llm, world, image, embed, photos. `class` is never set (each model's class applies).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, tzinfo

from manager.policy.types import Request

__all__ = ["DEFAULT_START", "MODELS", "PROFILES", "synth"]

DEFAULT_START = datetime(2026, 11, 2, tzinfo=UTC).timestamp()  # Monday 2026-11-02 00:00
"""Default first day: a Monday at midnight."""

MODELS: tuple[str, ...] = ("voice", "tts", "llm", "world", "image", "embed", "photos")

PROFILES: dict[str, str] = {
    "home": "a family home: voice at breakfast and evenings, chats, weekend world-model sessions, "
    "nightly indexing, party spikes, one away weekday",
    "studio": "a night-owl creator's studio flat (11:00-03:00 daily): coding assistant, heavy image "
    "work, daily world-model sessions, continuous indexing, daily spikes",
}

H = 3600.0
DAY = 24 * H

Out = list[Request]
DayGen = Callable[[random.Random, float, int, Out], None]


# --- helpers -------------------------------------------------------------------------------------


def _ms(x: float) -> float:
    return round(x, 3)


def _req(out: Out, t: float, model: str, busy: float, client: str, kind: str = "infer") -> float:
    """Append one request; returns when it finishes (t + busy, at ms resolution)."""
    t, busy = _ms(t), _ms(busy)
    out.append(Request(t=t, model=model, busy_s=busy, kind=kind, client=client))
    return _ms(t + busy)


def _poisson(rng: random.Random, a: float, b: float, per_hour: float) -> list[float]:
    """Arrival times of a Poisson process with `per_hour` rate on [a, b)."""
    times: list[float] = []
    t = a
    while True:
        t += rng.expovariate(per_hour / H)
        if t >= b:
            return times
        times.append(t)


def _at(rng: random.Random, day_start: float, h0: float, h1: float) -> float:
    """A uniform time between hours h0 and h1 of the day (h1 may pass 24: after midnight)."""
    return day_start + rng.uniform(h0, h1) * H


def _voice_chain(rng: random.Random, out: Out, t: float, client: str = "voice") -> float:
    """One spoken interaction: voice (VAD+ASR), then 70 % llm + tts, 30 % tts only (a command).

    Returns when the reply has finished playing.
    """
    t = _req(out, t, "voice", rng.uniform(0.3, 3.0), client)
    if rng.random() < 0.7:
        t = _req(out, t + 0.05, "llm", rng.uniform(1.0, 6.0), client)
    return _req(out, t, "tts", rng.uniform(0.5, 4.0), client)


def _burst(
    rng: random.Random,
    out: Out,
    t: float,
    end: float,
    model: str,
    n: int,
    busy: tuple[float, float],
    gap: tuple[float, float],
    client: str,
) -> None:
    """A person at work: `n` requests, each `gap` after the previous one finished; none from `end`."""
    for _ in range(n):
        if t >= end:
            return
        t = _req(out, t, model, rng.uniform(*busy), client) + rng.uniform(*gap)


def _batch(
    rng: random.Random,
    out: Out,
    t: float,
    end: float,
    model: str,
    n: int | None,
    busy: tuple[float, float],
    gap: tuple[float, float],
    client: str,
) -> float:
    """A job filling a queue: `n` requests (None: until `end`) `gap` apart by arrival.

    Returns the time after the last one.
    """
    k = 0
    while t < end and (n is None or k < n):
        _req(out, t, model, rng.uniform(*busy), client)
        t += rng.uniform(*gap)
        k += 1
    return t


# --- home: interactive ---------------------------------------------------------------------------


def _home_voice(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """Voice bursts in the family's active windows, plus sporadic single questions."""
    if weekday < 5:
        windows, rate = [(6.5, 8.5), (17.5, 22.5)], 3.0
    else:
        windows, rate = [(8.0, 23.0)], 2.0
    for h0, h1 in windows:
        for t in _poisson(rng, day_start + h0 * H, day_start + h1 * H, rate):
            for _ in range(rng.randint(1, 5)):
                t = _voice_chain(rng, out, t) + rng.uniform(10, 90)
    for t in _poisson(rng, day_start + 9 * H, day_start + 22 * H, 0.3):
        _voice_chain(rng, out, t)


def _home_chat(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """LLM chat sessions: evenings (and lunch) on weekdays, all day at weekends."""
    if weekday < 5:
        starts = _poisson(rng, day_start + 18 * H, day_start + 23 * H, 1.0)
        starts += _poisson(rng, day_start + 12 * H, day_start + 13.5 * H, 0.5)
    else:
        starts = _poisson(rng, day_start + 9 * H, day_start + 23 * H, 1.0)
    for t in starts:
        _chat_session(rng, out, t, end=day_start + DAY)


def _chat_session(rng: random.Random, out: Out, t: float, end: float) -> None:
    # Think time is lognormal (median 60 s): mostly quick follow-ups, now and then a long pause.
    for _ in range(rng.randint(3, 20)):
        if t >= end:  # the family goes to bed at midnight: no chat spills into the next day
            return
        t = _req(out, t, "llm", rng.uniform(2, 15), "chat")
        t += min(600.0, max(10.0, rng.lognormvariate(math.log(60), 0.9)))


def _home_image(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """A few image-generation bursts in the afternoon/evening (more at weekends)."""
    n, (h0, h1) = (rng.randint(1, 2), (14, 22)) if weekday < 5 else (rng.randint(2, 3), (10, 22))
    for _ in range(n):
        t = _at(rng, day_start, h0, h1)
        _burst(rng, out, t, day_start + DAY, "image", rng.randint(2, 10), (4, 12), (15, 120), "image-app")


def _home_world(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """World-model sessions: a long weekend afternoon one, sometimes a short weekday evening one."""
    if weekday >= 5:
        t, length = _at(rng, day_start, 13, 17), rng.uniform(1.5 * H, 3 * H)
    elif rng.random() < 0.3:
        t, length = _at(rng, day_start, 19, 21), rng.uniform(30 * 60, 60 * 60)
    else:
        return
    _req(out, t, "world", length, "world-app", kind="session")


def _home_party(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """An evening spike: several people at once; some requests share the exact same timestamp."""
    t0 = _ms(_at(rng, day_start, 19, 22.5))

    def when(i: int) -> float:  # the first of each model lands on t0 itself: simultaneous requests
        return t0 if i == 0 else t0 + rng.uniform(0, 10)

    for i in range(rng.randint(2, 4)):
        _voice_chain(rng, out, when(i))
    for i in range(rng.randint(1, 2)):
        _req(out, when(i), "image", rng.uniform(4, 12), "image-app")
    for i in range(rng.randint(1, 2)):
        _req(out, when(i), "llm", rng.uniform(2, 15), "chat")


# --- home: background ----------------------------------------------------------------------------


def _home_embed(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """Overnight indexing batches (01:00-04:00) and a trickle of daytime embeds."""
    t, end = _at(rng, day_start, 1, 1.5), day_start + 4 * H
    for _ in range(rng.randint(1, 3)):
        t = _batch(rng, out, t, end, "embed", rng.randint(200, 800), (0.05, 0.3), (0.5, 5), "indexer")
        t += rng.uniform(60, 600)
    for t in _poisson(rng, day_start + 8 * H, day_start + 23 * H, 2.0):
        _req(out, t, "embed", rng.uniform(0.05, 0.3), "indexer")


def _home_photos(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """The nightly photo-library batch, and on some evenings a phone upload burst."""
    t = _at(rng, day_start, 2, 3)
    _batch(rng, out, t, day_start + 5 * H, "photos", rng.randint(100, 400), (0.5, 2), (0, 2), "indexer")
    if rng.random() < 0.5:
        t = _at(rng, day_start, 19, 22)
        _batch(rng, out, t, day_start + DAY, "photos", rng.randint(20, 100), (0.5, 2), (0.2, 3), "indexer")


_HOME_INTERACTIVE: tuple[DayGen, ...] = (_home_voice, _home_chat, _home_image, _home_world)
_HOME_BACKGROUND: tuple[DayGen, ...] = (_home_embed, _home_photos)


def _home_week(rng: random.Random, days: list[tuple[float, int]], out: Out) -> None:
    weekdays = [i for i, (_, wd) in enumerate(days) if wd < 5]
    # long idle: one weekday a week nobody is home (background still runs). A part of a week (a trace
    # of 1-6 days, or the days past its last whole week) has it with the chance a whole week gives
    # those weekdays, 1 in 5 each: not always, as when one of its few weekdays had to be it
    if len(days) < 7 and rng.random() >= len(weekdays) / 5:
        weekdays = []
    away = rng.choice(weekdays) if weekdays else -1
    others = [i for i in range(len(days)) if i != away]
    n_party = rng.randint(2, 3)  # a whole week's evening spikes
    if len(days) < 7:
        # a part of a week has those of a whole week's spikes that fall on its days (of 7 drawn
        # without repeats), not all of them crammed into its few evenings: 2.5 x days / 7 on average.
        # Whole weeks draw nothing more: their traces (bench/traces) stay as they were
        n_party = sum(d < len(days) for d in rng.sample(range(7), n_party))
    party = set(rng.sample(others, min(len(others), n_party)))
    for i, (day_start, wd) in enumerate(days):
        gens = _HOME_BACKGROUND if i == away else _HOME_INTERACTIVE + _HOME_BACKGROUND
        for gen in gens:
            gen(rng, day_start, wd, out)
        if i in party:
            _home_party(rng, day_start, wd, out)


# --- studio --------------------------------------------------------------------------------------


def _work_blocks(rng: random.Random, day_start: float) -> list[tuple[float, float]]:
    """2-3 focused work blocks of 1-3 h between 11:00 and 03:00 (next day)."""
    blocks: list[tuple[float, float]] = []
    t, day_end = _at(rng, day_start, 11, 13), day_start + 27 * H
    for _ in range(rng.randint(2, 3)):
        end = min(t + rng.uniform(1 * H, 3 * H), day_end)
        if end - t < 0.5 * H:
            break
        blocks.append((t, end))
        t = end + rng.uniform(0.5 * H, 3 * H)
    return blocks


def _studio_work(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """Coding-assistant requests and continuous embedding of the code base during work blocks."""
    for a, b in _work_blocks(rng, day_start):
        _batch(rng, out, a, b, "llm", None, (1, 10), (20, 300), "ide")
        _batch(rng, out, a + rng.uniform(0, 30), b, "embed", None, (0.05, 0.3), (5, 60), "indexer")


def _studio_image(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """Heavy image work: 3-6 long bursts a day."""
    for _ in range(rng.randint(3, 6)):
        t = _at(rng, day_start, 11, 26.5)
        _burst(rng, out, t, day_start + 27 * H, "image", rng.randint(10, 40), (3, 10), (5, 60), "image-app")


def _studio_world(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """The daily evening world-model session (overlaps image and LLM work)."""
    _req(out, _at(rng, day_start, 20, 23), "world", rng.uniform(45 * 60, 120 * 60), "world-app", "session")


def _studio_world_afternoon(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    _req(out, _at(rng, day_start, 13, 17), "world", rng.uniform(30 * 60, 60 * 60), "world-app", "session")


def _studio_voice(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    for t in _poisson(rng, day_start + 11 * H, day_start + 26 * H, 0.5):
        _voice_chain(rng, out, t)


def _studio_photos(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    t = _at(rng, day_start, 4, 5)
    _batch(rng, out, t, day_start + 6 * H, "photos", rng.randint(200, 600), (0.5, 2), (0, 2), "indexer")


def _studio_spike(rng: random.Random, day_start: float, weekday: int, out: Out) -> None:
    """Once a day image, llm and voice arrive at the same instant (a render kicked off mid-call)."""
    t0 = _ms(_at(rng, day_start, 11, 26.5))
    _req(out, t0, "image", rng.uniform(3, 10), "image-app")
    _req(out, t0, "llm", rng.uniform(1, 10), "ide")
    _voice_chain(rng, out, t0)
    for _ in range(rng.randint(0, 3)):
        _req(out, t0 + rng.uniform(0, 5), "image", rng.uniform(3, 10), "image-app")


_STUDIO_DAILY: tuple[DayGen, ...] = (
    _studio_work,
    _studio_image,
    _studio_world,
    _studio_voice,
    _studio_photos,
    _studio_spike,
)


def _studio_week(rng: random.Random, days: list[tuple[float, int]], out: Out) -> None:
    # a second (afternoon) world session on 3 of a week's 7 days; a part of a week (1-6 days) has
    # those of the 3 that fall on its days, not one on each of its days. (A whole week draws what it
    # drew before: bench/traces stay as they were.)
    second_world = {d for d in rng.sample(range(7), 3) if d < len(days)}
    for i, (day_start, wd) in enumerate(days):
        for gen in _STUDIO_DAILY:
            gen(rng, day_start, wd, out)
        if i in second_world:
            _studio_world_afternoon(rng, day_start, wd, out)


_WEEK_PLANNERS: dict[str, Callable[[random.Random, list[tuple[float, int]], Out], None]] = {
    "home": _home_week,
    "studio": _studio_week,
}


MAX_DAYS = 3660
"""The longest synthetic trace: ten years is plenty, and the trace is built in memory."""


def synth(
    profile: str, days: int = 7, seed: int = 0, start: float | None = None, zone: tzinfo | None = None
) -> list[Request]:
    """A synthetic trace of `days` days for `profile`, sorted by time.

    Args:
        profile: a key of PROFILES.
        days: how many days (week-level choices are made per block of 7 days).
        seed: the only source of randomness; equal arguments give equal lists.
        start: Unix time of the first day's midnight (local wall clock); default DEFAULT_START.
        zone: the home's time zone (None: UTC). Its wall clock is what the habits keep to: 07:00 is
            07:00 there, summer time included, and the times written are true Unix times for it. A
            job (one client's run of requests) keeps the clock it started on (`_on_clock`).

    Raises:
        ValueError: unknown profile, or days < 0 or > MAX_DAYS.
    """
    if profile not in _WEEK_PLANNERS:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(sorted(PROFILES))})")
    if not 0 <= days <= MAX_DAYS:
        raise ValueError(f"days must be between 0 and {MAX_DAYS} (ten years), got {days}")
    rng = random.Random(seed)
    t0 = DEFAULT_START if start is None else float(start)
    wd0 = datetime.fromtimestamp(t0, UTC).weekday()
    out: Out = []
    for first in range(0, days, 7):
        week = [(t0 + d * DAY, (wd0 + d) % 7) for d in range(first, min(days, first + 7))]
        _WEEK_PLANNERS[profile](rng, week, out)
    out.sort(key=lambda r: r.t)  # stable: a chain keeps its order at equal timestamps
    if zone is not None:
        out = _on_clock(out, zone)
        out.sort(key=lambda r: r.t)
    return out


JOB_GAP_S = 600.0
"""One client's requests are one job (a batch, a chain, a session's steps) while each starts within
this long of the end of the one before it (`_on_clock`)."""
JOB_MAX_S = 2 * H
"""A job longer than this (a continuous stream) is cut there: what follows takes the clock anew."""


def _on_clock(out: Out, zone: tzinfo) -> Out:
    """`out` (sorted, on a wall clock written as Unix seconds, as the generators make them) at the
    Unix times `zone`'s clocks read them. Each job of a client (JOB_GAP_S, JOB_MAX_S) takes the
    offset from UTC of its first request's wall time, so a change of the clocks never cuts into one
    (an indexing batch across 03:00 keeps its spacing and order, not half of it an hour later): a
    job that starts in the hour the clocks skip is taken that much later, one that starts in the
    hour they repeat at its first pass. Millisecond resolution, as the trace format's."""
    done: dict[str | None, tuple[float, float, float]] = {}  # client -> (its job's start, end, offset)
    moved: Out = []
    for r in out:
        start, end, offset = done.get(r.client, (-math.inf, -math.inf, 0.0))
        if r.t - end > JOB_GAP_S or r.t - start > JOB_MAX_S:  # a new job: the clock as it reads now
            local = datetime.fromtimestamp(r.t, UTC).replace(tzinfo=zone)
            start, end, offset = r.t, r.t, (local.utcoffset() or timedelta(0)).total_seconds()
        done[r.client] = (start, max(end, r.t + r.busy_s), offset)
        moved.append(dataclasses.replace(r, t=_ms(r.t - offset)))
    return moved
