"""Review 28, SQLite: a request or intent row holding text that is not UTF-8 (one damaged byte) made
sqlite3's `fetchall()` raise for the whole page, read as the store being down: the journal's replay
retried for ever, the statistics' catch-up lost every request of the log, `trace export` failed as a
whole, and no intent was restored. Now such a row is that row's corrupt case (left out, and told to
`on_corrupt`, as a row damaged in another way is); its neighbours are read."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.live import LiveManager
from manager.store import StoreError, open_store
from manager.store.base import CorruptRow
from manager.store.export import export_trace
from manager.store.sqlite import SQLiteStore

T0 = 1_790_000_000.0
_BAD_VOICE = "CAST(x'ff766f696365' AS TEXT)"  # 'voice' behind a byte that is not UTF-8


def _damaged_log(tmp_path: Path, n: int, bad_t: float) -> str:
    url = f"sqlite:///{tmp_path}/state.db"
    s = open_store(url)
    s.append_requests([{"t": T0 + i, "model": "voice", "busy_s": 0.25} for i in range(n)])
    s.close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute(f"UPDATE requests SET model = {_BAD_VOICE} WHERE t = ?", (bad_t,))
    db.close()
    return url


def test_a_request_row_that_is_not_utf8_is_left_out_alone(tmp_path: Path) -> None:
    url = _damaged_log(tmp_path, 3, T0 + 1)
    s = open_store(url, create=False)
    try:
        told: list[StoreError] = []
        got = list(s.requests(0, on_corrupt=told.append))
        assert [r["t"] for r in got] == [T0, T0 + 2]
        assert (
            len(told) == 1 and "requests row id=2 is corrupt" in str(told[0]) and "not text" in str(told[0])
        )
        with pytest.raises(StoreError, match="requests row id=2 is corrupt"):
            list(s.requests(0))  # (without on_corrupt: the row is named, as other damaged rows are)
        skipped: list[StoreError] = []
        assert export_trace(s, 10 * 86400, T0 + 60, io.StringIO(), skipped=skipped) == 2
        assert len(skipped) == 1
        assert [r["t"] for r in s.requests(T0 + 2)] == [T0 + 2]  # (the text factory is back to str)
        assert s.get_doc("nothing") is None
    finally:
        s.close()


def test_the_statistics_catch_up_loses_only_the_damaged_request(tmp_path: Path) -> None:
    url = _damaged_log(tmp_path, 50, T0 + 10)
    lm = LiveManager(load_config(CONFIG), None, store=open_store(url), clock=lambda: T0 + 3600)
    try:
        lm.restore_stats()
        assert lm.live["voice"].requests == 49
        assert lm.engine.models["voice"].hist.count == 49
    finally:
        assert lm.store is not None
        lm.store.close()


def test_an_intent_that_is_not_utf8_is_left_out_and_can_be_dropped(tmp_path: Path) -> None:
    p = tmp_path / "s.db"
    s = SQLiteStore(p)
    s.set_intent("voice", "gpu")
    s.set_intent("embed", "host")
    s.close()
    with sqlite3.connect(p) as db:
        db.execute("INSERT INTO intents VALUES (CAST(x'ff6f6c64' AS TEXT), 'gpu')")
        db.execute("INSERT INTO intents VALUES ('chat', CAST(x'ff677075' AS TEXT))")
    db.close()
    s = SQLiteStore(p)
    try:
        told: list[StoreError] = []
        assert s.intents(on_corrupt=told.append) == {"embed": "host", "voice": "gpu"}
        assert len(told) == 2 and all(isinstance(e, CorruptRow) for e in told)
        keys = sorted((e.key for e in told if isinstance(e, CorruptRow)), key=repr)
        assert keys == ["chat", b"\xffold"]
        with pytest.raises(CorruptRow):
            s.intents()
        for k in keys:  # (what `save_intents` does with a damaged row's key)
            s.drop_intent(k)
        assert s.intents() == {"embed": "host", "voice": "gpu"}
    finally:
        s.close()
