"""Review 17: the manager's "stats" document (each model's statistics, kept across restarts), found
unreadable at the start, was overwritten by the next save: the statistics it held were lost for good.
It is now moved aside in the store (``stats.corrupt-<UTC time>``), the log line says where, and the
run starts fresh as before. Real SQLite stores in tmp_path; each test failed before its fix."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.live import LiveManager
from manager.store import open_store

BROKEN = '{"voice": {"hist": '  # a save cut off half-way (or a hand edit)


def _docs(path: Path) -> dict[str, str]:
    with closing(sqlite3.connect(path)) as db:
        return dict(db.execute("SELECT key, value FROM docs").fetchall())


def test_an_unreadable_stats_document_is_kept_aside_not_overwritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "store.db"
    with closing(open_store(f"sqlite:///{path}")) as s:
        s.put_doc("stats", {})
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE docs SET value = ? WHERE key = 'stats'", (BROKEN,))
    config = load_config(CONFIG)
    lm = LiveManager(config, None, store=open_store(f"sqlite:///{path}"))
    with caplog.at_level(logging.ERROR, logger="manager"):
        assert lm.restore_stats() == 0  # fresh statistics, as before
    lm.save_stats()
    lm.store.close()
    docs = _docs(path)
    (aside,) = [k for k in docs if k.startswith("stats.corrupt-")]
    assert docs[aside] == BROKEN  # the bytes as they were
    assert "stats" in docs and docs["stats"] != BROKEN  # the new statistics saved beside it
    assert f"kept as document {aside!r}; starting fresh" in caplog.text


def test_set_aside_doc_moves_the_document_as_stored_and_says_none_when_there_is_none(tmp_path: Path) -> None:
    with closing(open_store(f"sqlite:///{tmp_path / 'store.db'}")) as s:
        assert s.set_aside_doc("stats") is None
        s.put_doc("stats", {"a": 1})
        aside = s.set_aside_doc("stats")
        assert aside is not None and aside.startswith("stats.corrupt-")
        assert s.get_doc("stats") is None and s.get_doc(aside) == {"a": 1}
