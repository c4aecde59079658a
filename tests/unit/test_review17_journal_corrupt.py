"""Review 17, the journal's replay at a restart (`manager.live_persist._not_stored`) on a real SQLite
file: a corrupt stored row inside the replayed window is named once (where it is) and left out of
the comparison; the journal's records the store lacks are written, those it holds are not again.

Bug: `_not_stored` read the window with `Store.requests`, which raises StoreError at a corrupt row;
taken for a store outage, the batch was kept and retried for ever, and no request of the journal
(nor any served after the restart) reached the store again."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.live import LiveManager
from manager.store import StoreError, open_store

T0 = 1_790_000_000.0


def _rec(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.25, "wait_s": 0.0, "outcome": "ok"}


class _FailsFirstWrite:
    """Fault injector (unit tests only) around the real store: its first request-log write fails as
    an outage does, so the replayed batch is compared with the store a second time."""

    def __init__(self, real: Any) -> None:
        self.real, self.url, self.writes = real, real.url, 0

    def append_requests(self, records: Sequence[Mapping[str, Any]]) -> None:
        self.writes += 1
        if self.writes == 1:
            raise StoreError(self.url, "append requests: connection refused (injected)")
        self.real.append_requests(records)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _killed_run(tmp_path: Path) -> tuple[str, Path, int]:
    """What a run killed between a store write and the journal's rewrite leaves: the store holds
    records the journal has too, and the journal holds one more the store lacks; plus a stored row
    inside that window that is corrupt (a hand edit, a damaged file). Returns the url, the journal
    and the corrupt row's id."""
    url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    stored = [_rec(T0 + 1.0), _rec(T0 + 3.0)]
    store = open_store(url)
    store.append_requests(stored)
    store.close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        cur = db.execute(
            "INSERT INTO requests (t, model, busy_s, kind) VALUES (?, 'voice', -1.0, 'infer')", (T0 + 2.0,)
        )
        bad_id = cur.lastrowid
    assert bad_id is not None
    lines = [*stored, _rec(T0 + 2.5, "embed")]  # the last one: not in the store yet
    journal.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return url, journal, bad_id


def _restart(url: str, journal: Path) -> LiveManager:
    lm = LiveManager(
        load_config(CONFIG), None, store=open_store(url), clock=lambda: T0 + 60.0, journal=journal
    )
    assert lm.journal is not None
    lm._log_buf = lm.journal.read() + lm._log_buf
    return lm


def _log_rows(tmp_path: Path) -> list[tuple[float, str, float]]:
    with sqlite3.connect(tmp_path / "state.db") as db:
        return [tuple(r) for r in db.execute("SELECT t, model, busy_s FROM requests ORDER BY t, id")]


def test_a_corrupt_stored_row_in_the_replayed_window_is_named_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, journal, bad_id = _killed_run(tmp_path)
    lm = _restart(url, journal)
    caplog.set_level(logging.WARNING)
    asyncio.run(lm.flush_log())
    assert lm._log_buf == []  # written, not kept for a retry
    assert _log_rows(tmp_path) == [  # the journal's new record written once, the stored ones not again
        (T0 + 1.0, "voice", 0.25),
        (T0 + 2.0, "voice", -1.0),  # (left as it is: the store's reads still name it)
        (T0 + 2.5, "embed", 0.25),
        (T0 + 3.0, "voice", 0.25),
    ]
    named = [r.getMessage() for r in caplog.records if f"row id={bad_id} is corrupt" in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert "state.db" in named[0] and "busy_s" in named[0]
    assert lm.journal is not None and lm.journal.read() == []  # the journal let them go
    lm.journal.close()
    lm.store.close()


def test_a_corrupt_row_is_named_once_over_retries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The store down at the first write: the batch is compared again at the next flush, and the
    corrupt row is not said again."""
    url, journal, bad_id = _killed_run(tmp_path)
    lm = _restart(url, journal)
    lm.store = _FailsFirstWrite(lm.store)
    caplog.set_level(logging.WARNING)
    asyncio.run(lm.flush_log())
    assert len(lm._log_buf) == 3  # kept for a retry
    asyncio.run(lm.flush_log())
    assert lm._log_buf == []
    assert [r[1] for r in _log_rows(tmp_path)] == ["voice", "voice", "embed", "voice"]
    named = [r for r in caplog.records if f"row id={bad_id} is corrupt" in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert lm.journal is not None
    lm.journal.close()
    lm.store.close()


def test_the_store_read_still_names_a_corrupt_row_without_on_corrupt(tmp_path: Path) -> None:
    """Other readers (the statistics' catch-up, `trace export`) still fail on it, naming it; given
    `on_corrupt`, a reader is told of it and the read goes on past it."""
    url, _, bad_id = _killed_run(tmp_path)
    store = open_store(url)
    try:
        with pytest.raises(StoreError, match=f"row id={bad_id} is corrupt"):
            list(store.requests(T0))
        said: list[StoreError] = []
        got = [r["t"] for r in store.requests(T0, on_corrupt=said.append)]
        assert got == [T0 + 1.0, T0 + 3.0]
        assert [f"row id={bad_id} is corrupt" in str(e) for e in said] == [True]
    finally:
        store.close()


def test_a_row_whose_t_is_not_a_time_is_skipped_given_on_corrupt(tmp_path: Path) -> None:
    url, _, _ = _killed_run(tmp_path)
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("DELETE FROM requests WHERE busy_s < 0")
        bad_id = db.execute(
            "INSERT INTO requests (t, model, busy_s, kind) VALUES ('soon', 'voice', 1.0, 'infer')"
        ).lastrowid
    store = open_store(url)
    try:
        said: list[StoreError] = []
        assert [r["t"] for r in store.requests(0, on_corrupt=said.append)] == [T0 + 1.0, T0 + 3.0]
        assert len(said) == 1 and f"row id={bad_id} is corrupt: 't' is 'soon'" in str(said[0])
    finally:
        store.close()
