"""Review 27: `trace synth --timezone ZONE`. The synthetic weeks were on UTC's wall clock alone, so
a home in a zone with summer time could not have a trace whose habits keep to its own clock across
the change (the service's statistics do, since `policy.timezone`). With a zone, 07:00 is 07:00 there,
before and after the clocks change, and the times written are true Unix times for it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from manager.policy.stats import home_hours, zone_named
from manager.policy.types import Request
from manager.replay.synth import synth
from manager.replay.trace import read_trace

BERLIN = ZoneInfo("Europe/Berlin")
AUTUMN = datetime(2026, 10, 19, tzinfo=UTC).timestamp()  # a Monday; Europe's clocks go back on the 25th
SPRING = datetime(2027, 3, 22, tzinfo=UTC).timestamp()  # a Monday; they go forward on the 28th


def _wall(t: float, zone: ZoneInfo | None) -> datetime:
    return datetime.fromtimestamp(t, zone or UTC).replace(tzinfo=None)


def _skipped_or_repeated(wall: datetime) -> bool:
    """Whether Berlin's clocks skip or repeat `wall` (02:00-03:00 on the two Sundays), or it is the
    hour a skipped wall time is taken at (03:00-04:00 in spring)."""
    return (wall.month, wall.day, wall.hour) in ((10, 25, 2), (3, 28, 2), (3, 28, 3))


def _as_read(reqs: list[Request], zone: ZoneInfo | None) -> Counter[tuple[str, str, float, str]]:
    return Counter(
        (_wall(r.t, zone).isoformat(timespec="milliseconds"), r.model, r.busy_s, r.client)
        for r in reqs
        if not _skipped_or_repeated(_wall(r.t, zone))
    )


def test_the_habits_keep_to_the_zones_wall_clock_across_both_changes() -> None:
    for start in (AUTUMN, SPRING):
        on_utc = synth("home", 14, seed=3, start=start)
        on_berlin = synth("home", 14, seed=3, start=start, zone=BERLIN)
        assert len(on_berlin) == len(on_utc)
        assert [r.t for r in on_berlin] == sorted(r.t for r in on_berlin)
        # every request is where its wall time says, on Berlin's clock: the same as on UTC's
        assert _as_read(on_berlin, BERLIN) == _as_read(on_utc, None)
        # so the offset from UTC is an hour before the change and two after it, or the other way
        offsets = {round(home_hours("Europe/Berlin").offset(r.t)) for r in on_berlin}
        assert offsets == {3600, 7200}
        # and the statistics' hours of week (the service's, on the same zone) are the generator's
        hours, utc = home_hours("Europe/Berlin"), home_hours("UTC")
        by_hour = Counter(hours(r.t) for r in on_berlin if not _skipped_or_repeated(_wall(r.t, BERLIN)))
        assert by_hour == Counter(utc(r.t) for r in on_utc if not _skipped_or_repeated(_wall(r.t, None)))


def test_a_wall_time_the_clocks_skip_is_taken_an_hour_later() -> None:
    on_utc = synth("home", 14, seed=3, start=SPRING)
    on_berlin = synth("home", 14, seed=3, start=SPRING, zone=BERLIN)
    skipped = sorted(
        _wall(r.t, None)
        for r in on_utc
        if (_wall(r.t, None).month, _wall(r.t, None).day, _wall(r.t, None).hour) == (3, 28, 2)
    )
    assert skipped, "the nightly indexing runs at 02:00-03:00"
    moved = sorted(
        _wall(r.t, BERLIN)
        for r in on_berlin
        if (_wall(r.t, BERLIN).month, _wall(r.t, BERLIN).day, _wall(r.t, BERLIN).hour) == (3, 28, 3)
    )
    assert all(w.replace(hour=3) in moved for w in skipped)


def test_utc_and_no_zone_are_the_trace_as_it_was() -> None:
    assert zone_named("UTC") is None
    assert synth("home", 7, seed=1) == synth("home", 7, seed=1, zone=zone_named("UTC"))


def test_the_command_writes_it_and_names_a_bad_zone(tmp_path: Path) -> None:
    out = tmp_path / "week.jsonl"
    cmd = [sys.executable, "-m", "manager.cli", "trace", "synth", "--days", "14", "--seed", "3"]
    done = subprocess.run(
        [*cmd, "--timezone", "Europe/Berlin", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "time zone Europe/Berlin" in done.stderr
    got = read_trace(out).requests
    want = synth("home", 14, seed=3, zone=BERLIN)
    assert [(r.t, r.model, r.busy_s) for r in got] == [(r.t, r.model, r.busy_s) for r in want]

    bad = subprocess.run(
        [*cmd, "--timezone", "Europe/Berlinn", "--out", str(tmp_path / "new" / "x.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--timezone" in bad.stderr and "Europe/Berlinn" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "new").exists()  # said before --out's folder
