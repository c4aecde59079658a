"""Review 16 of the request journal (manager/journal.py); each test failed before its fix. Real journal
files on a real (small, filled) file system, a real SQLite store and a real model on in-process device
hosts (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path

import pytest
from disk_helpers import fill
from live_helpers import AUDIO, lru_config, started

from manager.journal import JournalInUse, RequestJournal
from manager.store import open_store


def _lock_is_free(journal: Path) -> bool:
    fd = os.open(f"{journal}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


EARLIER = {"t": 1.0, "model": "voice", "busy_s": 0.5}
PAGE = 4096
"""tmpfs gives room by the page: a file of whole pages has none left past its end."""


class TestATornJournalOnAFullDisk:
    """A journal whose last line a kill cut short (the disk had filled up: its append failed half-way)
    on a disk that is still full: the start failed with the bare "No space left on device" (no file
    named), in the middle of opening the journal, and left the journal's lock held by the process.
    A clean journal on the same full disk started, its appends failing softly, as designed: the
    newline that ends the torn line now waits for the next append, as after a failed append."""

    def _torn_on_a_full_disk(self, disk: Path) -> Path:
        journal = disk / "requests.journal"
        good = json.dumps(EARLIER) + "\n"
        torn = '{"t": 2.0, "model": "' + "v" * (PAGE - len(good) - 21)  # cut short: no newline
        journal.write_text(good + torn, encoding="utf-8")
        assert journal.stat().st_size == PAGE  # one more byte needs a page the full disk has not
        fill(disk)
        return journal

    def test_it_opens_and_the_next_record_is_not_glued_to_the_torn_line(self, small_disk: Path) -> None:
        journal = self._torn_on_a_full_disk(small_disk)
        j = RequestJournal(journal)  # raised OSError(ENOSPC)
        try:
            j.append({"t": 2.0, "model": "voice", "busy_s": 0.25})  # the disk is still full
            assert j.failed == 1
            (small_disk / "filler").unlink()
            j.append({"t": 3.0, "model": "voice", "busy_s": 0.25})
            assert [r["t"] for r in j.read()] == [1.0, 3.0] and j.skipped == 1
        finally:
            j.close()
        assert _lock_is_free(journal)

    def test_the_service_starts_and_serves(self, small_disk: Path, tmp_path: Path) -> None:
        """The store elsewhere (a Redis, another disk): the full disk under the journal alone must not
        stop the service; what it serves still reaches the store, with the earlier run's record."""
        journal = self._torn_on_a_full_disk(small_disk)
        config = lru_config(tmp_path)  # (kept whole: the earlier record's t=1.0 is past any retention)
        keep_all = config.store.model_copy(update={"request_log_retention": None})
        config = config.model_copy(update={"store": keep_all})
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

        async def main() -> None:
            lm, pool = await started(config, store, journal)
            try:
                await lm.infer("voice", AUDIO)
                await lm.flush_log()
            finally:
                await lm.stop()
                pool.close()

        try:
            asyncio.run(main())
            times = [r["t"] for r in store.requests(0)]
            assert len(times) == 2 and times[0] == 1.0
        finally:
            store.close()
        assert _lock_is_free(journal)


class TestAJournalReachedThroughASymbolicLink:
    """`store.journal` naming a symbolic link to the journal (kept on another disk, or one service's
    journal linked into another's folder): the lock was taken beside the link, so a service given the
    link and one given the file both ran on one journal (each sent its records to the store: logged
    twice); and the first rewrite put a file of its own in the link's place, leaving the file the
    link pointed to with its old records."""

    def _linked(self, tmp_path: Path) -> tuple[Path, Path]:
        (tmp_path / "ssd").mkdir()
        (tmp_path / "state").mkdir()
        real, link = tmp_path / "ssd" / "requests.journal", tmp_path / "state" / "requests.journal"
        real.write_text(json.dumps(EARLIER) + "\n", encoding="utf-8")
        link.symlink_to(real)
        return real, link

    def test_a_service_on_the_link_and_one_on_the_file_are_two_on_one_journal(self, tmp_path: Path) -> None:
        real, link = self._linked(tmp_path)
        first = RequestJournal(real)
        try:
            with pytest.raises(JournalInUse, match=r"store\.journal '.*/state/requests\.journal': another"):
                RequestJournal(link)
        finally:
            first.close()
        second = RequestJournal(link)  # (the first has let it go)
        second.close()

    def test_a_rewrite_keeps_the_link_and_writes_the_file_it_points_to(self, tmp_path: Path) -> None:
        real, link = self._linked(tmp_path)
        j = RequestJournal(link)
        try:
            assert [r["t"] for r in j.read()] == [1.0]
            j.rewrite([])  # the store has it
            j.append({"t": 2.0, "model": "voice", "busy_s": 0.25})
        finally:
            j.close()
        assert link.is_symlink() and link.resolve() == real.resolve()
        assert [json.loads(x)["t"] for x in real.read_text().splitlines()] == [2.0]
