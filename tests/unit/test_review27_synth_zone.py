"""Review 27: `trace synth --timezone ZONE`. The synthetic weeks were on UTC's wall clock alone, so
a home in a zone with summer time could not have a trace whose habits keep to its own clock across
the change (the service's statistics do, since `policy.timezone`). With a zone, 07:00 is 07:00 there,
before and after the clocks change, and the times written are true Unix times for it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from manager.policy.stats import home_hours, zone_named, zone_names
from manager.policy.types import Request
from manager.replay.synth import JOB_GAP_S, synth
from manager.replay.trace import read_trace

BERLIN = ZoneInfo("Europe/Berlin")
AUTUMN = datetime(2026, 10, 19, tzinfo=UTC).timestamp()  # a Monday; Europe's clocks go back on the 25th
SPRING = datetime(2027, 3, 22, tzinfo=UTC).timestamp()  # a Monday; they go forward on the 28th


def _wall(t: float, zone: ZoneInfo | None) -> datetime:
    return datetime.fromtimestamp(t, zone or UTC).replace(tzinfo=None)


def _near_a_change(wall: datetime) -> bool:
    """Whether `wall` is in the small hours of a Sunday Berlin's clocks change (00:00-06:00), where a
    job that started before the change keeps the clock it started on."""
    return (wall.month, wall.day) in ((10, 25), (3, 28)) and wall.hour < 6


def _as_read(reqs: list[Request], zone: ZoneInfo | None) -> Counter[tuple[str, str, float, str | None]]:
    return Counter(
        (_wall(r.t, zone).isoformat(timespec="milliseconds"), r.model, r.busy_s, r.client)
        for r in reqs
        if not _near_a_change(_wall(r.t, zone))
    )


def _by_client(reqs: list[Request]) -> dict[str | None, list[Request]]:
    out: dict[str | None, list[Request]] = defaultdict(list)
    for r in reqs:
        out[r.client].append(r)
    return out


@pytest.mark.parametrize("start", [AUTUMN, SPRING], ids=["autumn", "spring"])
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_the_habits_keep_to_the_zones_wall_clock_across_a_change(start: float, seed: int) -> None:
    on_utc = synth("home", 14, seed=seed, start=start)
    on_berlin = synth("home", 14, seed=seed, start=start, zone=BERLIN)
    assert [r.t for r in on_berlin] == sorted(r.t for r in on_berlin)
    # every request away from the change is where its wall time says, on Berlin's clock
    assert _as_read(on_berlin, BERLIN) == _as_read(on_utc, None)
    # so the offset from UTC is an hour before the change and two after it, or the other way
    berlin = home_hours("Europe/Berlin")
    assert {round(berlin.offset(r.t)) for r in on_berlin} == {3600, 7200}
    # and the statistics' hours of week (the service's, on the same zone) are the generator's
    utc = home_hours("UTC")
    by_hour = Counter(berlin(r.t) for r in on_berlin if not _near_a_change(_wall(r.t, BERLIN)))
    assert by_hour == Counter(utc(r.t) for r in on_utc if not _near_a_change(_wall(r.t, None)))


@pytest.mark.parametrize("start", [AUTUMN, SPRING], ids=["autumn", "spring"])
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_a_change_of_the_clocks_never_cuts_into_a_job(start: float, seed: int) -> None:
    """Review 27 (read-through): each request was moved on its own, so the nightly indexing batch
    across 03:00 on the spring Sunday had its first part (02:xx, a time the clocks skip) moved an
    hour later, past its second part: the batch's order broken, two hours' work in one. Now each
    client's requests keep their order, and their spacing but at the one place its clock changed."""
    on_utc, on_berlin = (
        _by_client(synth("home", 14, seed=seed, start=start)),
        _by_client(synth("home", 14, seed=seed, start=start, zone=BERLIN)),
    )
    assert on_berlin.keys() == on_utc.keys()
    for client, reqs in on_utc.items():
        moved = on_berlin[client]
        assert [(r.model, r.busy_s) for r in moved] == [(r.model, r.busy_s) for r in reqs], client
        spacing = [round(b.t - a.t, 3) for a, b in pairwise(reqs)]
        kept = [round(b.t - a.t, 3) for a, b in pairwise(moved)]
        changed = [i for i, (x, y) in enumerate(zip(spacing, kept, strict=True)) if abs(x - y) > 0.002]
        assert len(changed) == 1, (client, changed)  # where the job after the change took its clock
        assert abs(abs(spacing[changed[0]] - kept[changed[0]]) - 3600) < 0.01


def test_a_job_that_starts_in_the_hour_the_clocks_skip_is_taken_an_hour_later() -> None:
    found = 0
    for seed in range(6):
        on_utc = _by_client(synth("home", 14, seed=seed, start=SPRING))
        on_berlin = _by_client(synth("home", 14, seed=seed, start=SPRING, zone=BERLIN))
        for client, reqs in on_utc.items():
            for i, r in enumerate(reqs):
                wall = _wall(r.t, None)
                after_a_pause = i == 0 or r.t - (reqs[i - 1].t + reqs[i - 1].busy_s) > JOB_GAP_S
                if (wall.month, wall.day, wall.hour) == (3, 28, 2) and after_a_pause:  # a new job
                    assert _wall(on_berlin[client][i].t, BERLIN) == wall.replace(hour=3), (seed, client)
                    found += 1
    assert found, "no job starts at 02:00-03:00 on the spring Sunday in these weeks"


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


def test_localtime_is_no_zones_name() -> None:
    """Review 27: Debian's zoneinfo folder holds `localtime`, a link to /etc/localtime, and it was
    taken as a zone's name: a trace (or a config) that then meant whichever machine read it."""
    with pytest.raises(ValueError, match="no time zone is called 'localtime'"):
        zone_named("localtime")
    assert "localtime" not in zone_names()
