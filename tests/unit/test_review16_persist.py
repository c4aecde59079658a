"""Review 16 of what the live manager restores from the store (`manager.live_persist`): a saved
statistics document holding numbers of the wrong size or a histogram that contradicts itself (a
damaged file, a hand edit, another tool's write) is refused model by model, with a line naming the
model, and never stops the service's start or its decisions with a traceback; such a model's
statistics are rebuilt from the request log, which holds them. A damaged intent is named and
replaced, and a store that fails an intent write is not asked again at every decision (each one waits
on the event loop). Each test names the bug it caught."""

from __future__ import annotations

import json
import logging
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.live import LiveManager
from manager.policy.stats import ReuseHistogram
from manager.policy.types import Action, ActionKind, Tier
from manager.store import StoreError, open_store

T0 = 1_790_000_000.0
HUGE = "1" + "0" * 400  # a JSON integer no float holds


def _manager(tmp_path: Path, stats_json: str) -> LiveManager:
    """A live manager (no device hosts) on a SQLite store whose "stats" document is `stats_json`,
    written as raw text (as a damaged file or a hand edit holds it)."""
    url = f"sqlite:///{tmp_path}/state.db"
    open_store(url).close()
    with closing(sqlite3.connect(tmp_path / "state.db")) as db, db:  # (raw: put_doc refuses some)
        db.execute("INSERT INTO docs (key, value) VALUES ('stats', ?)", (stats_json,))
    return LiveManager(load_config(CONFIG), None, store=open_store(url), clock=lambda: T0)


def _hist(n: int) -> dict[str, Any]:
    h = ReuseHistogram()
    for i in range(n):
        h.observe(T0 - 3600.0 + 60.0 * i)
    return h.capture()


def _start(lm: LiveManager) -> int:
    """The statistics steps of `LiveManager.start`, then the policy's start (which reads them)."""
    n = lm.restore_stats()
    lm._catch_up_stats()
    lm.engine.start(T0)
    return n


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (f'{{"seen_until": {HUGE}}}', "it has no 'hist'"),  # (read for every model, before any entry)
        (
            f'{{"hist": {json.dumps(_hist(2))}, "cost": {{}}, "last_used": {HUGE}, "seen_until": {HUGE}}}',
            "is not a time",
        ),
    ],
)
def test_a_huge_time_in_the_saved_statistics_does_not_stop_the_start(
    tmp_path: Path, entry: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: a time too large for a float (`"seen_until": 1000…0`) raised OverflowError out of
    `restore_stats`, and `residency serve` ended at its start with a traceback."""
    good = json.dumps({"hist": _hist(3), "cost": {}, "requests": 3, "last_used": T0 - 3000.0})
    lm = _manager(tmp_path, f'{{"voice": {entry}, "embed": {good}}}')
    with caplog.at_level(logging.WARNING, "manager.live"):
        assert _start(lm) == 1  # embed's entry; voice starts fresh
    assert "statistics of voice in the store are unreadable" in caplog.text
    assert why in caplog.text
    assert lm.live["embed"].requests == 3
    assert lm.engine.models["voice"].hist.count == 0
    lm.store.close()


def test_a_load_time_too_large_for_a_float_is_refused_with_its_model_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: a saved load time too large for a float raised OverflowError out of `restore_stats`."""
    entry = f'{{"hist": {json.dumps(_hist(2))}, "cost": {{"disk": [{HUGE}]}}}}'
    lm = _manager(tmp_path, f'{{"voice": {entry}}}')
    with caplog.at_level(logging.WARNING, "manager.live"):
        assert _start(lm) == 0
    assert "statistics of voice in the store are unreadable" in caplog.text
    lm.store.close()


def test_huge_counts_are_refused_not_fed_to_the_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: a histogram whose counts no float holds was restored, and the policy's first decision
    (`q * n`, `count / hours`) raised OverflowError at the start and at every later decision."""
    h = _hist(3)
    h["count"] = int(HUGE)
    h["bins"][0] = int(HUGE) - 3
    h["arrivals_how"][0] = int(HUGE)
    lm = _manager(tmp_path, json.dumps({"embed": {"hist": h, "cost": {}}}))
    with caplog.at_level(logging.WARNING, "manager.live"):
        assert _start(lm) == 0
    assert "statistics of embed in the store are unreadable" in caplog.text
    assert lm.engine.models["embed"].hist.count == 0
    lm.store.close()


def test_a_histogram_with_more_intervals_than_arrivals_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: a saved histogram whose bins held more reuse intervals than its arrivals make (5 arrivals,
    5 intervals) was restored, and the residency policy's hazard divided by zero: the live manager's
    start (the policy's boot prewarm) raised ZeroDivisionError, so `serve` never started."""
    h = _hist(5)
    h["bins"][10] += 1  # 5 intervals for 5 arrivals: one more than they can make
    good = _hist(4)
    lm = _manager(
        tmp_path, json.dumps({"embed": {"hist": h, "cost": {}}, "world": {"hist": good, "cost": {}}})
    )
    with caplog.at_level(logging.WARNING, "manager.live"):
        assert _start(lm) == 1  # world's entry is restored
    assert "statistics of embed in the store are unreadable" in caplog.text
    assert "more intervals" in caplog.text
    assert lm.engine.models["world"].hist.count == 4
    lm.store.close()


def test_saved_nan_load_times_are_left_out_as_before(tmp_path: Path) -> None:
    """NaN and infinite load times (which `LoadCost.measure` leaves out) do not make the rest of the
    model's entry unreadable."""
    entry = f'{{"hist": {json.dumps(_hist(2))}, "cost": {{"disk": [NaN, Infinity, 2.5, 2.5, 2.5]}}}}'
    lm = _manager(tmp_path, f'{{"voice": {entry}}}')
    assert _start(lm) == 1
    assert lm.engine.models["voice"].cost.get("disk") == 2.5
    lm.store.close()


@pytest.mark.parametrize("damage", ["bin-short", "a-list"])
@pytest.mark.parametrize("late", [False, True], ids=["at-start", "store-down-at-start"])
def test_an_unreadable_entry_is_rebuilt_from_the_request_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, late: bool, damage: str
) -> None:
    """Bug: a model whose saved entry was unreadable started with empty statistics although the
    request log held every one of its requests: the catch-up took only those after the last save.
    Now the catch-up rebuilds its histogram, request count and last use from the whole log, at the
    start (`restore_stats`) and when the store, down at the start, answers (`_merge_stats`). An entry
    that is not an object at all was passed over without a word; it is said and rebuilt as well."""
    times = [T0 - 7200.0 + 90.0 * i for i in range(20)]
    good = _hist(3)
    h = _hist(3)
    h["bins"] = h["bins"][:-1]  # damaged: a bin short
    doc: dict[str, Any] = {
        "embed": {"hist": h, "cost": {}, "requests": 20, "seen_until": T0 - 60.0}
        if damage == "bin-short"
        else [1],
        "world": {"hist": good, "cost": {}, "requests": 3, "seen_until": T0 - 60.0},
    }
    lm = _manager(tmp_path, json.dumps(doc))
    lm.store.append_requests([{"t": t, "model": "embed", "busy_s": 0.5} for t in times])
    with caplog.at_level(logging.WARNING, "manager.live"):
        if late:  # read once the store answers: merged into this run's (empty) statistics
            lm._stats_unread = True
            lm.save_stats()
        else:
            assert _start(lm) == 1
    assert "statistics of embed in the store are unreadable" in caplog.text
    rebuilt = ReuseHistogram()
    for t in times:
        rebuilt.observe(t)
    assert lm.engine.models["embed"].hist.capture() == rebuilt.capture()
    assert lm.live["embed"].requests == 20
    assert lm.live["embed"].last_used == times[-1] + 0.5
    assert lm.live["world"].requests == 3  # (the readable entry as saved)
    lm.store.close()


class _HangingIntentsFake:
    """Fault injector (tests only) around a real store: while `down`, every intent write fails as
    one to a Redis that hangs does after its timeout (redis-py: 3 tries of 5 s, on the event loop);
    `tries` counts them."""

    def __init__(self, real: Any) -> None:
        self.real, self.down, self.tries = real, True, 0
        self.url = real.url

    def set_intent(self, model: str, tier: str) -> None:
        if self.down:
            self.tries += 1
            raise StoreError(self.url, "set intent: TimeoutError: Timeout reading from the server")
        self.real.set_intent(model, tier)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_failed_intent_write_is_not_tried_again_at_every_decision(tmp_path: Path) -> None:
    """Bug: with the store hanging, every decision's intent write (made on the event loop) waited out
    the store's timeout again (15 s each with Redis), holding every request of the service; the
    intents are rewritten whole from the engine's books once the store answers, so one failed write
    is enough to know. Now the later ones wait for that rewrite."""
    real = open_store(f"sqlite:///{tmp_path}/state.db")
    store = _HangingIntentsFake(real)
    lm = LiveManager(load_config(CONFIG), None, store=store, clock=lambda: T0)
    for kind, model in (
        (ActionKind.LOAD, "voice"),
        (ActionKind.LOAD_HOST, "embed"),
        (ActionKind.DROP, "world"),
    ):
        lm._record_intent(Action(kind, model, "cpu0", 1, "test"))
    assert store.tries == 1
    assert lm._intents_stale
    store.down = False
    lm.save_stats()  # (every SAVE_EVERY_S, or after the next flush that the store takes)
    assert not lm._intents_stale
    books = {n: {Tier.GPU: "gpu", Tier.HOST: "host"}.get(m.tier, "disk") for n, m in lm.engine.models.items()}
    assert real.intents() == books
    lm._record_intent(Action(ActionKind.LOAD, "voice", "cpu0", 1, "test"))  # written at once again
    assert real.intents()["voice"] == "gpu"
    real.close()


def test_a_damaged_intent_is_named_and_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Bug: one intent the store could not read back (a tier of "GPU", written by hand or another
    tool) made the start say only "could not read the recorded intents at start", without what or
    where, and it stayed: every later start restored no intent either. Now the line names it, and
    the next save rewrites every intent from the engine's books. (Since review 21 the others are
    restored: one damaged row dropped them all.)"""
    store = open_store(f"sqlite:///{tmp_path}/state.db")
    store.set_intent("voice", "gpu")
    with closing(sqlite3.connect(tmp_path / "state.db")) as db, db:
        db.execute("INSERT INTO intents (model, tier) VALUES ('embed', 'GPU')")
    lm = LiveManager(load_config(CONFIG), None, store=store, clock=lambda: T0)
    with caplog.at_level(logging.WARNING, "manager.live"):
        assert lm.restore_intent(T0) == ["voice (gpu)"]
    assert "intent for 'embed' is corrupt" in caplog.text
    lm.save_stats()
    books = {n: {Tier.GPU: "gpu", Tier.HOST: "host"}.get(m.tier, "disk") for n, m in lm.engine.models.items()}
    assert store.intents() == books
    store.close()
