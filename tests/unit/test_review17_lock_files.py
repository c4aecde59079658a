"""Review 17, the lock files that keep one service per request journal and per SQLite store.

Bugs:
- `pidlock.hold` opened its lock file through a symbolic link and truncated the file the link points
  to, writing its pid in it: a `requests.journal.lock` or `state.db.lock` that is a link (a stale
  one, or one planted in a shared folder) cost the user that file's contents. A lock file that is a
  link (or not a regular file) is now refused, naming it; the file it points to is left alone.
- The SQLite store's lock was beside the path as given, so a service given a symbolic link to the
  store and one given the file itself took two different locks and were both served on one store
  (each overwriting the other's statistics and intents). It is now beside the file the path reaches,
  as the request journal's is.
"""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path

import pytest

from manager import pidlock
from manager.journal import RequestJournal
from manager.store import StoreError, open_store


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n", encoding="utf-8")
    lock = tmp_path / "x.lock"
    lock.symlink_to(victim)
    with pytest.raises(OSError, match=r"x\.lock is a symbolic link"):
        pidlock.hold(lock)
    assert victim.read_text(encoding="utf-8") == "precious\n"


def test_a_journal_whose_lock_file_is_a_link_is_refused_naming_it(tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n", encoding="utf-8")
    (tmp_path / "requests.journal.lock").symlink_to(victim)
    with pytest.raises(OSError, match=r"store\.journal .*requests\.journal\.lock is a symbolic link"):
        RequestJournal(tmp_path / "requests.journal")
    assert victim.read_text(encoding="utf-8") == "precious\n"


def test_a_store_whose_lock_file_is_a_link_is_refused_naming_it(tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n", encoding="utf-8")
    (tmp_path / "state.db.lock").symlink_to(victim)
    with pytest.raises(StoreError, match=r"lock file: .*state\.db\.lock is a symbolic link"):
        open_store(f"sqlite:///{tmp_path}/state.db", hold=True)
    assert victim.read_text(encoding="utf-8") == "precious\n"


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "x.lock"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"x\.lock is not a regular file"):
        pidlock.hold(fifo)


def test_a_service_on_a_link_to_the_store_and_one_on_the_store_are_two_on_one_store(
    tmp_path: Path,
) -> None:
    (tmp_path / "ssd").mkdir()
    real = tmp_path / "ssd" / "state.db"
    link = tmp_path / "state.db"
    with closing(open_store(f"sqlite:///{real}")):  # (made)
        pass
    link.symlink_to(real)
    refused = r"another residency service \(pid \d+\) is serving this store"
    with closing(open_store(f"sqlite:///{real}", hold=True)), pytest.raises(StoreError, match=refused):
        open_store(f"sqlite:///{link}", hold=True)
    with closing(open_store(f"sqlite:///{link}", hold=True)) as store:  # (the first has let it go)
        with pytest.raises(StoreError, match="another residency service"):
            open_store(f"sqlite:///{real}", hold=True)
        store.append_requests([{"t": 1.0, "model": "voice", "busy_s": 0.25}])
    with closing(open_store(f"sqlite:///{real}", create=False)) as reader:
        assert reader.count_requests() == 1


def test_a_lock_file_that_cannot_be_opened_is_the_one_named(tmp_path: Path) -> None:
    """Before: "store.journal '...requests.journal': cannot open the request journal: Is a
    directory", naming the journal (which was fine), not its lock file (a folder here; the same for
    one owned by another user)."""
    (tmp_path / "requests.journal.lock").mkdir()
    with pytest.raises(OSError, match=r"request journal: .*requests\.journal\.lock: Is a dir"):
        RequestJournal(tmp_path / "requests.journal")
    (tmp_path / "state.db.lock").mkdir()
    with pytest.raises(StoreError, match=r"lock file: .*/state\.db\.lock: Is a directory$"):
        open_store(f"sqlite:///{tmp_path}/state.db", hold=True)
