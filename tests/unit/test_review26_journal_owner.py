"""Review 26 (README walk-through): a request journal sends its records to the store they were
served for. The README told a user switching between two homes to give one its own store; the
journal, left as it was, sent the requests a killed run of one home served to the other home's
store at its next start (4 requests of `other.db` logged, and counted by the statistics, in
`state.db`). Now the journal keeps its store's own id beside it (`Store.store_id`, kept in the
store: a url spelled another way or a folder moved is the same store): another store's records are
set aside, and taken back by the next service on their store."""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
from pathlib import Path

import pytest
from live_helpers import AUDIO, CONFIG, kill, started

from manager.config import load_config
from manager.journal import RequestJournal
from manager.store import open_store


def _rec(t: float) -> dict[str, object]:
    return {"t": t, "model": "voice", "busy_s": 0.1}


def _opened(path: Path, owner: str) -> RequestJournal:
    j = RequestJournal(path)
    j.claim(owner)
    return j


def test_another_stores_records_are_set_aside_and_taken_back_by_theirs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "requests.journal"
    j = _opened(path, "aaaa")
    j.append(_rec(1.0))
    j.append(_rec(2.0))
    j.close()  # (killed: the records were never sent)
    with caplog.at_level(logging.WARNING, logger="manager.journal"):
        j = _opened(path, "bbbb")
    assert j.read() == []  # not sent to b
    assert "2 request(s) were served by a service on another store (aaaa)" in caplog.text
    j.append(_rec(3.0))  # b's own, appended to the journal as it is now (not to the set-aside file)
    j.close()
    j = _opened(path, "aaaa")
    assert [r["t"] for r in j.read()] == [1.0, 2.0]  # a's taken back (b's set aside in turn)
    j.rewrite([])  # a's store took them
    j.close()
    j = _opened(path, "bbbb")
    assert [r["t"] for r in j.read()] == [3.0]
    j.rewrite([])
    j.close()
    assert not list(tmp_path.glob("*.aside"))
    j = _opened(path, "aaaa")
    assert j.read() == []  # each record went to its own store, once
    j.close()


def test_a_journal_of_an_earlier_release_is_the_stores_it_meets(tmp_path: Path) -> None:
    path = tmp_path / "requests.journal"
    j = RequestJournal(path)  # (no claim: as every release before this one)
    j.append(_rec(1.0))
    j.close()
    j = _opened(path, "cccc")
    assert [r["t"] for r in j.read()] == [1.0]
    assert (tmp_path / "requests.journal.store").read_text() == "cccc\n"
    j.close()


def test_a_store_that_does_not_say_its_id_takes_the_records_and_the_journal_is_no_others(
    tmp_path: Path,
) -> None:
    path = tmp_path / "requests.journal"
    j = _opened(path, "aaaa")
    j.append(_rec(1.0))
    j.close()
    j = RequestJournal(path)
    j.disown()  # (the store was down at start: its records are sent to it, as before)
    assert [r["t"] for r in j.read()] == [1.0]
    j.close()
    j = _opened(path, "bbbb")  # the next start that reads the id takes them all as its own
    assert [r["t"] for r in j.read()] == [1.0]
    j.close()


def _kill_with_three_in_the_journal(config: object, url: str, journal: Path) -> None:
    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)  # type: ignore[arg-type]
        lm._next_flush = math.inf  # the log is never written in time: the journal holds them
        for _ in range(3):
            await lm.infer("voice", AUDIO)
        kill(lm, pool)
        store.close()

    asyncio.run(killed())


def _restart(config: object, url: str, journal: Path) -> int:
    async def restarted() -> int:
        store = open_store(url)
        lm, pool = await started(config, store, journal)  # type: ignore[arg-type]
        await lm.stop()
        pool.close()
        n = store.count_requests()
        store.close()
        return n

    return asyncio.run(restarted())


def test_a_killed_homes_requests_reach_its_own_store_not_the_next_homes(tmp_path: Path) -> None:
    config = load_config(CONFIG)
    journal = tmp_path / "requests.journal"
    home, other = f"sqlite:///{tmp_path / 'state.db'}", f"sqlite:///{tmp_path / 'other.db'}"
    _kill_with_three_in_the_journal(config, other, journal)
    assert _restart(config, home, journal) == 0  # not the other home's requests
    assert _restart(config, other, journal) == 3  # its own, taken back


def test_a_home_moved_whole_is_the_same_store(tmp_path: Path) -> None:
    """The journal's store was named by its path: a home folder moved (its store and journal with it)
    set its records aside for a store that no longer was anywhere."""
    config = load_config(CONFIG)
    before, after = tmp_path / "home", tmp_path / "moved"
    before.mkdir()
    _kill_with_three_in_the_journal(config, f"sqlite:///{before / 'state.db'}", before / "requests.journal")
    shutil.move(before, after)
    assert _restart(config, f"sqlite:///{after / 'state.db'}", after / "requests.journal") == 3
    assert not list(after.glob("*.aside"))
