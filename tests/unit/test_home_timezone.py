"""The home's time zone (`policy.timezone`): the statistics by hour of week follow the home's wall
clock, summer time included, so a habit at 07:00 stays at 07:00 when the clocks change."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import zoneinfo
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from live_helpers import AUDIO, CONFIG, run

from manager.config import Config, ConfigError, load_config
from manager.live import LiveManager
from manager.live_persist import _join_hist, _read_hist
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.stats import HomeHours, ReuseHistogram, home_hours, hour_of_week
from manager.replay.report import cold_by_hour
from manager.replay.sim import replay
from manager.replay.trace import read_trace
from manager.store import open_store

ROOT = Path(__file__).resolve().parents[2]
BERLIN = ZoneInfo("Europe/Berlin")


@pytest.fixture(autouse=True)
def _local_time_as_it_was() -> Iterator[None]:
    """`home_hours(None)` sets the C library's local time from TZ (tzset): back to the variable as
    it is after each test (monkeypatch has put it back by then)."""
    yield
    time.tzset()


def local(zone: ZoneInfo, *args: int) -> float:
    """Unix time of a wall-clock time in `zone`."""
    return datetime(*args, tzinfo=zone).timestamp()  # type: ignore[misc]


def with_zone(config: Config, zone: str | None) -> Config:
    return config.model_copy(update={"policy": config.policy.model_copy(update={"timezone": zone})})


class TestHomeHours:
    def test_a_habit_at_seven_stays_at_seven_when_the_clocks_change(self) -> None:
        # Europe's clocks went forward on Sunday 2026-03-29: 07:00 on the Mondays either side is
        # 06:00 UTC before and 05:00 UTC after. On the home's clock both are Monday 07:00 (hour 7).
        before, after = local(BERLIN, 2026, 3, 23, 7, 0), local(BERLIN, 2026, 3, 30, 7, 0)
        hours = home_hours("Europe/Berlin")
        assert (hours(before), hours(after)) == (7, 7)
        assert (hour_of_week(before), hour_of_week(after)) == (6, 5)  # UTC's clock moves the habit

    def test_the_offset_changes_at_the_instant_the_clocks_do_in_either_direction(self) -> None:
        change = datetime(2026, 10, 25, 1, 0, tzinfo=ZoneInfo("UTC")).timestamp()  # 03:00 CEST -> 02:00 CET
        hours = home_hours("Europe/Berlin")
        for t in (change - 1.0, change, change - 0.5, change + 3600.0, change - 7200.0):
            expected = datetime.fromtimestamp(t, BERLIN)
            assert hours(t) == expected.weekday() * 24 + expected.hour, t

    def test_the_names_a_config_may_give(self) -> None:
        assert home_hours("UTC").zone is None  # UTC itself takes the fast path
        assert home_hours("Asia/Kolkata")(0.0) == 3 * 24 + 5  # Thursday 1970-01-01 05:30
        with pytest.raises(ValueError, match="no time zone is called 'Mars/Olympus_Mons'"):
            home_hours("Mars/Olympus_Mons")
        with pytest.raises(ValueError, match="no time zone"):
            home_hours("../../etc/passwd")

    def test_no_name_is_this_machines_zone(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TZ", "America/New_York")
        assert home_hours(None).name == "America/New_York"
        monkeypatch.setenv("TZ", ":Europe/Berlin")  # (the glibc form)
        assert home_hours(None).name == "Europe/Berlin"
        monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")  # a POSIX rule: the C library's local time
        hours = home_hours(None)
        assert hours.local and hours.zone is None and hours.name == "CET-1CEST,M3.5.0,M10.5.0/3"

    def test_a_copy_of_the_statistics_shares_the_clock_of_a_zone_read_from_a_file(self) -> None:
        """The service deep-copies the statistics to bring them up to date on a thread; a zone read
        from /etc/localtime (no name) cannot be copied, so the copies share the clock."""
        path = next(
            Path(d) / "Europe" / "Berlin"
            for d in zoneinfo.TZPATH
            if (Path(d) / "Europe" / "Berlin").is_file()
        )
        with path.open("rb") as f:
            hours = HomeHours(ZoneInfo.from_file(f, key="localtime"), "localtime")
        hist = ReuseHistogram(hours)
        hist.observe(local(BERLIN, 2026, 3, 30, 7, 0))
        twin = copy.deepcopy(hist)
        assert twin.hours is hours and twin.how_bins is not hist.how_bins and twin.last_how == 7

    def test_a_posix_rule_in_tz_is_the_machines_local_time(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Review 26: a TZ that names no zone (a POSIX rule, a file's path) fell back to
        /etc/localtime, unsaid, while the machine's local time followed the rule."""
        t = local(BERLIN, 2026, 7, 6, 7, 30)  # Monday 07:30 in Berlin's summer time (UTC+2)
        for rule in ("CET-1CEST,M3.5.0,M10.5.0/3", "/usr/share/zoneinfo/Europe/Berlin", "JST-9"):
            monkeypatch.setenv("TZ", rule)
            hours = home_hours(None)
            assert hours.name == rule and hours(t) == (7 if rule != "JST-9" else 14), rule

    def test_a_change_of_the_clocks_off_the_quarter_hours_is_found(self) -> None:
        """Review 26: the offset was looked up once per quarter hour of UTC, which some changes before
        2011 do not fall on (St. John's changed at 00:01 local, 02:31 UTC)."""
        zone = ZoneInfo("America/St_Johns")
        hours = home_hours("America/St_Johns")
        change = datetime(2010, 11, 7, 2, 31, tzinfo=ZoneInfo("UTC")).timestamp()
        for t in [change + 10.0 * i for i in range(-90, 90)]:
            d = datetime.fromtimestamp(t, zone)
            assert hours(t) == d.weekday() * 24 + d.hour, t

    def test_times_beyond_the_calendar_count_on_utc(self) -> None:
        hours = home_hours("Europe/Berlin")
        assert hours(1e300) == hour_of_week(1e300)
        assert hours(-1e18) == hour_of_week(-1e18)


class TestConfig:
    def test_a_zone_no_one_has_is_named_with_its_field(self, tmp_path: Path) -> None:
        text = CONFIG.read_text(encoding="utf-8")
        assert "policy: {name: residency}" in text
        path = tmp_path / "c.yaml"
        text = text.replace(
            "policy: {name: residency}", "policy: {name: residency, timezone: Europe/Berlinn}"
        )
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert "policy.timezone" in str(e.value) and "Europe/Berlinn" in str(e.value)
        out = subprocess.run(
            [sys.executable, "-m", "manager.cli", "replay", "--config", str(path), "--trace", str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 2 and "policy.timezone" in out.stderr and "Traceback" not in out.stderr

    def test_the_schema_documents_it(self) -> None:
        from manager.config_schema import Config as Schema

        field = Schema.model_json_schema()["$defs"]["PolicyConfig"]["properties"]["timezone"]
        assert "IANA" in field["description"]


class TestStatistics:
    def test_the_rate_at_seven_after_the_change_is_the_habits(self) -> None:
        """Three weeks of a 07:00 habit in Berlin before the clocks go forward; on the Monday after,
        the policy's rate at 07:00 is the habit's on the home's clock, and nothing on UTC's."""
        base = load_config(ROOT / "configs" / "home.yaml")
        rates = {}
        for zone in ("Europe/Berlin", "UTC"):
            engine = Engine(with_zone(base, zone), create_policy("residency"))
            hist = engine.models["llm"].hist
            for day in (9, 16, 23):
                hist.observe(local(BERLIN, 2026, 3, day, 7, 10))
            rates[zone] = hist.rate_per_hour(local(BERLIN, 2026, 3, 30, 7, 5), weeks_seen=3.0)
        assert rates == {"Europe/Berlin": 1.0, "UTC": 0.0}

    def test_restored_and_joined_histograms_keep_the_homes_clock(self) -> None:
        hours = home_hours("Europe/Berlin")
        a, b = ReuseHistogram(hours), ReuseHistogram(hours)
        a.observe(local(BERLIN, 2026, 3, 23, 7, 0))
        b.observe(local(BERLIN, 2026, 3, 30, 7, 0))
        joined = _join_hist(a, b)
        assert joined.hours is hours
        assert joined.how_bins[7] != [0] * len(joined.how_bins[7])  # the gap counted at Monday 07:00
        assert _read_hist(a.capture(), hours).last_how == 7

    def test_the_live_service_keeps_its_zone_across_a_restart(self, tmp_path: Path) -> None:
        config = with_zone(load_config(CONFIG), "Asia/Kolkata")
        url = f"sqlite:///{tmp_path / 'state.db'}"

        async def serve(lm: LiveManager) -> str:
            await lm.infer("voice", AUDIO)
            return lm.engine.models["voice"].hist.hours.name  # type: ignore[attr-defined,no-any-return]

        async def look(lm: LiveManager) -> tuple[int, bool]:
            hist = lm.engine.models["voice"].hist
            return hist.count, hist.hours is lm.engine.hours

        store = open_store(url)
        assert run(config, serve, store) == "Asia/Kolkata"
        store.close()
        store = open_store(url)
        assert run(config, look, store) == (1, True)
        store.close()


class TestRestart:
    def test_counts_of_another_clock_are_turned_to_the_homes(self, tmp_path: Path) -> None:
        """Review 26 (upgrade): an older release counted on UTC's clock, and saved no clock; restored
        on a home in Tokyo, a 07:00 UTC habit was counted at 07:00 Tokyo time and the next arrivals
        at 16:00: one habit split over two hours. Saved counts are now turned by the clocks'
        difference (none for the same clock)."""
        url = f"sqlite:///{tmp_path / 'state.db'}"

        async def serve(lm: LiveManager) -> int:
            await lm.infer("voice", AUDIO)
            return lm.engine.hours(lm.engine.models["voice"].hist.last_t)

        async def where(lm: LiveManager) -> list[int]:
            h = lm.engine.models["voice"].hist
            return [i for i, n in enumerate(h.arrivals_how) if n]

        base = load_config(CONFIG)
        store = open_store(url)
        utc_hour = run(with_zone(base, "UTC"), serve, store)
        doc = store.get_doc("stats")
        assert doc is not None and doc["voice"]["clock"] == "UTC"
        for entry in doc.values():  # as an older release wrote it: no clock
            if isinstance(entry, dict):
                entry.pop("clock", None)
                entry.pop("clock_offset_s", None)
        store.put_doc("stats", doc)
        tokyo = with_zone(base, "Asia/Tokyo")
        assert run(tokyo, where, store) == [(utc_hour + 9) % 168]
        assert run(tokyo, where, store) == [(utc_hour + 9) % 168]  # saved on Tokyo's clock: as it was
        store.close()


class TestReload:
    def test_a_reload_takes_the_new_zone_and_says_so(self) -> None:
        """Review 26: a reload that changed only `policy.timezone` said no change, and the statistics
        went on counting on the old clock until a restart."""
        from manager.reload import apply_reload, plan_reload

        base = load_config(ROOT / "configs" / "home.yaml")
        old, new = with_zone(base, "UTC"), with_zone(base, "Europe/Berlin")
        engine = Engine(old, create_policy("residency"))
        hist = engine.models["llm"].hist
        hist.observe(local(BERLIN, 2026, 3, 30, 7, 10))
        assert hist.last_how == 5  # (UTC's Monday 05:10)
        assert plan_reload(old, new) == ["policy.timezone"]
        apply_reload(engine, new)
        assert engine.hours.name == "Europe/Berlin" and hist.hours is engine.hours
        assert hist.last_how == 7 and hist.arrivals_how[7] == 1 and hist.arrivals_how[5] == 0  # turned
        hist.observe(local(BERLIN, 2026, 3, 31, 7, 10))
        assert hist.arrivals_how[24 + 7] == 1


class TestReplay:
    def test_a_whole_hour_zone_replays_a_week_as_utc_does(self) -> None:
        """The synthetic weeks are on UTC's wall clock; a zone a whole number of hours away turns
        every hour of week alike, and the figures are the same (no change of the clocks that week)."""
        base = load_config(ROOT / "configs" / "home.yaml")
        reqs = read_trace(ROOT / "bench" / "traces" / "home-week-seed1.jsonl").requests
        figures = {
            zone: json.dumps(replay(with_zone(base, zone), reqs, "residency").to_json(), sort_keys=True)
            for zone in ("UTC", "Europe/Berlin", "America/New_York")
        }
        assert len(set(figures.values())) == 1

    def test_the_reports_hours_are_the_homes(self) -> None:
        t = local(BERLIN, 2026, 3, 30, 7, 0)
        assert cold_by_hour([(t, "llm", True, 1.0)], home_hours("Europe/Berlin"))[7] == 1
        assert cold_by_hour([(t, "llm", True, 1.0)])[5] == 1  # UTC's when none is given
