"""Review 26 (README walk-through): a request journal sends its records to the store it served.
The README told a user switching between two homes to give one its own store; the journal, left
as it was, sent the requests a killed run of one home served to the other home's store at its next
start (4 requests of `other.db` logged, and counted by the statistics, in `state.db`). Now the
journal keeps its store's identity beside it: another store's records are set aside, and taken back
by the next service on their store."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import pytest
from live_helpers import AUDIO, CONFIG, kill, started

from manager.config import load_config
from manager.journal import RequestJournal
from manager.store import open_store, store_identity


def _rec(t: float) -> dict[str, object]:
    return {"t": t, "model": "voice", "busy_s": 0.1}


def test_another_stores_records_are_set_aside_and_taken_back_by_theirs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "requests.journal"
    j = RequestJournal(path, owner="sqlite:/home/a.db")
    j.append(_rec(1.0))
    j.append(_rec(2.0))
    j.close()  # (killed: the records were never sent)
    with caplog.at_level(logging.WARNING, logger="manager.journal"):
        j = RequestJournal(path, owner="sqlite:/home/b.db")
    assert j.read() == []  # not sent to b
    assert "2 request(s) were served by a service on another store (sqlite:/home/a.db)" in caplog.text
    j.append(_rec(3.0))  # b's own, kept apart
    j.close()
    j = RequestJournal(path, owner="sqlite:/home/a.db")
    assert [r["t"] for r in j.read()] == [1.0, 2.0]  # a's taken back (b's set aside in turn)
    j.rewrite([])  # a's store took them
    j.close()
    j = RequestJournal(path, owner="sqlite:/home/b.db")
    assert [r["t"] for r in j.read()] == [3.0]
    j.rewrite([])
    j.close()
    assert not list(tmp_path.glob("*.aside"))
    j = RequestJournal(path, owner="sqlite:/home/a.db")
    assert j.read() == []  # each record went to its own store, once
    j.close()


def test_a_journal_of_an_earlier_release_is_the_stores_it_meets(tmp_path: Path) -> None:
    path = tmp_path / "requests.journal"
    j = RequestJournal(path)  # (no owner: as every release before this one)
    j.append(_rec(1.0))
    j.close()
    j = RequestJournal(path, owner="redis://127.0.0.1:6379/0")
    assert [r["t"] for r in j.read()] == [1.0]
    assert (tmp_path / "requests.journal.store").read_text() == "redis://127.0.0.1:6379/0\n"
    j.close()


def test_a_killed_homes_requests_reach_its_own_store_not_the_next_homes(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    journal = tmp_path / "requests.journal"
    home, other = f"sqlite:///{tmp_path / 'state.db'}", f"sqlite:///{tmp_path / 'other.db'}"

    async def killed(url: str) -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        lm._next_flush = math.inf  # the log is never written in time: the journal holds them
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        kill(lm, pool)
        store.close()

    async def restarted(url: str) -> int:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        await lm.stop()
        pool.close()
        n = store.count_requests()
        store.close()
        return n

    asyncio.run(killed(other))
    assert asyncio.run(restarted(home)) == 0  # not the other home's requests
    assert asyncio.run(restarted(other)) == 3  # its own, taken back
    assert store_identity(home) != store_identity(other)
