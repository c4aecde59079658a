"""Review 28, the request journal and the store's own id.

A store that came back empty (a Redis restarted without its data, as the README expects of one kept
without persistence; a database file moved aside and made anew) made a new id at the next start,
and the journal set the records it kept for that very store (the stop found it down) aside as
"served by a service on another store": no service would ever take them back. Now a store says
whether its id was made by this ask (`StoreId.made`) and where it is (`StoreId.where`), and the
journal keeps where its store was (`<journal>.store-at`): a store whose id was just made where the
journal's store was takes the journal's records as its own. A store whose id existed before and
differs, or a new store elsewhere (review 26: a config switched to a store of its own), still has
them set aside.

And `claim` set another store's records aside before writing the owner file: when that write failed
(a full disk), the file went on naming the other store, and this run's records were set aside as
that store's at the next start. The stale owner file is now removed."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

import manager.journal as journal_mod
from manager.config import load_config
from manager.journal import RequestJournal
from manager.live import LiveManager
from manager.store import open_store
from manager.store.base import StoreId

T0 = 1_790_000_000.0


def _rec(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.25}


def _start_claim_read(lm: LiveManager) -> list[dict[str, Any]]:
    """What `LiveManager.start` does first with the journal: claim it by the store's id, then read."""

    async def go() -> list[dict[str, Any]]:
        await lm._claim_journal()
        assert lm.journal is not None
        return lm.journal.read()

    return asyncio.run(go())


def _takes_its_records_as_come_back_empty(
    lm: LiveManager, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`lm` started on a store come back empty: the journal's three records (T0..T0+2) are sent to it,
    none set aside, the journal now this store's; `lm` closed after."""
    with caplog.at_level(logging.WARNING, logger="manager.journal"):
        left = _start_claim_read(lm)
    assert [r["t"] for r in left] == [T0, T0 + 1, T0 + 2]  # sent to the store, not set aside
    assert not list(tmp_path.glob("*.aside"))
    assert "come back empty" in caplog.text
    assert lm.journal is not None and lm.store is not None
    assert (tmp_path / "requests.journal.store").read_text().strip() == lm.store.store_id()
    lm.journal.close()
    lm.store.close()


def test_a_sqlite_store_says_whether_this_ask_made_its_id(tmp_path: Path) -> None:
    s = open_store(f"sqlite:///{tmp_path}/state.db")
    try:
        first, again = s.store_id(), s.store_id()
    finally:
        s.close()
    assert isinstance(first, StoreId) and first.made is True
    assert isinstance(again, StoreId) and again.made is False
    assert first == again
    assert first.where == again.where == f"sqlite {(tmp_path / 'state.db').resolve()}"


def test_a_sqlite_file_made_anew_takes_the_records_kept_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, jp = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    lm = LiveManager(load_config(CONFIG), None, store=open_store(url), clock=lambda: T0, journal=jp)
    assert _start_claim_read(lm) == []
    for i in range(3):  # served while the store was down: kept in the journal at the stop
        lm._log(_rec(T0 + i))
    assert lm.journal is not None and lm.store is not None
    lm.journal.close()
    lm.store.close()
    (tmp_path / "state.db").rename(tmp_path / "state.db.damaged")  # moved aside; made anew below
    lm = LiveManager(load_config(CONFIG), None, store=open_store(url), clock=lambda: T0 + 60, journal=jp)
    _takes_its_records_as_come_back_empty(lm, tmp_path, caplog)


def test_a_store_whose_id_existed_before_still_has_another_stores_records_set_aside(
    tmp_path: Path,
) -> None:
    jp = tmp_path / "requests.journal"
    j = RequestJournal(jp)
    j.claim(StoreId("aaaa", made=True))
    j.append(_rec(1.0))
    j.close()
    j = RequestJournal(jp)
    j.claim(StoreId("bbbb", made=False))  # another store, in use before: not this journal's
    assert j.read() == []
    j.close()
    assert len(list(tmp_path.glob("*.aside"))) == 1
    j = RequestJournal(jp)
    j.claim("aaaa")  # (a plain str, as a store of an earlier release gives: not made)
    assert [r["t"] for r in j.read()] == [1.0]  # taken back by their own store
    j.close()


def test_a_new_store_elsewhere_still_has_another_stores_records_set_aside(tmp_path: Path) -> None:
    jp = tmp_path / "requests.journal"
    j = RequestJournal(jp)
    j.claim(StoreId("aaaa", made=True, where="sqlite /home/other.db"))
    j.append(_rec(1.0))
    j.close()
    assert (tmp_path / "requests.journal.store-at").exists()
    j = RequestJournal(jp)
    j.claim(StoreId("bbbb", made=True, where="sqlite /home/state.db"))  # made, but not where a's was
    assert j.read() == []
    j.close()
    j = RequestJournal(jp)
    j.claim(StoreId("aaaa", where="sqlite /home/other.db"))
    assert [r["t"] for r in j.read()] == [1.0]  # taken back by their own store
    j.close()
    j = RequestJournal(jp)
    j.claim(StoreId("cccc", made=True))  # (made, its place not known: set aside, as before)
    assert j.read() == []
    j.close()


def test_a_failed_owner_write_after_a_set_aside_leaves_the_journal_no_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jp = tmp_path / "requests.journal"
    j = RequestJournal(jp)
    j.claim("aaaa")
    j.append(_rec(1.0, "fromA"))
    j.close()
    real = journal_mod._write_new

    def full(tmp: Path, data: bytes) -> None:  # (the owner file's temp write: the disk is full)
        if tmp.name.endswith(".store.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tmp, data)

    j = RequestJournal(jp)
    with monkeypatch.context() as m:
        m.setattr(journal_mod, "_write_new", full)
        j.claim("bbbb")  # a's record set aside, then the owner file's write fails
    assert not (tmp_path / "requests.journal.store").exists()  # names no other store
    assert not (tmp_path / "requests.journal.store-at").exists()
    assert not (tmp_path / "requests.journal.store.tmp").exists()
    assert j.read() == []
    j.append(_rec(2.0, "servedOnB"))
    j.append(_rec(3.0, "servedOnB"))
    j.close()
    j = RequestJournal(jp)
    j.claim("bbbb")  # the next start on b (the disk fine now)
    assert [r["model"] for r in j.read()] == ["servedOnB", "servedOnB"]  # sent to b, not set aside
    j.close()
    assert (tmp_path / "requests.journal.store").read_text().strip() == "bbbb"
    j = RequestJournal(jp)
    j.claim("aaaa")
    assert [r["model"] for r in j.read()] == ["fromA"]  # a's record still goes back to a alone
    j.close()
