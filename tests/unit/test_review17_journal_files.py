"""Review 17, the request journal's file (`manager.journal.RequestJournal`).

Bugs:
- `store.journal` naming a FIFO hung the service's start for good (its open for writing waits for a
  reader); naming a device (`/dev/null`, a user's way to say "no journal") had the first rewrite,
  a second after the first request, replace the device with a regular file (as root: the system's
  /dev/null). A journal that is not a regular file is now refused at the start, naming it and
  `store.journal: null`.
- Each rewrite made the journal anew with the default mode: one its owner had made 0600 (it names
  models and clients) was world-readable (0644) a second after the start. Its mode is now kept.
- The rewrite wrote its temporary file through a symbolic link left at `<journal>.tmp` (stale, or
  planted in a shared folder): the file it pointed to was overwritten with the journal, and the link
  was then renamed over the journal, so every later record went to that file. The temporary file is
  now always a new file of its own.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from manager.journal import RequestJournal

REC = {"t": 1.0, "model": "voice", "busy_s": 0.25}


def test_a_journal_that_is_a_fifo_is_refused_naming_it(tmp_path: Path) -> None:
    fifo = tmp_path / "requests.journal"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (so that the open cannot hang this test)
    try:
        with pytest.raises(
            OSError, match=r"store\.journal '.*requests\.journal': .*is a FIFO, not a regular file.*null"
        ):
            RequestJournal(fifo)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not (tmp_path / "requests.journal.lock").exists()  # refused before anything is made


def test_a_link_to_a_journal_that_is_not_a_regular_file_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "pipe").mkdir()
    fifo = tmp_path / "pipe" / "p"
    os.mkfifo(fifo)
    link = tmp_path / "requests.journal"
    link.symlink_to(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match=r"store\.journal '.*requests\.journal': .*/pipe/p is a FIFO"):
            RequestJournal(link)
    finally:
        os.close(reader)


def test_a_rewrite_keeps_the_journals_mode(tmp_path: Path) -> None:
    path = tmp_path / "requests.journal"
    path.write_bytes(b"")
    path.chmod(0o600)
    j = RequestJournal(path)
    try:
        j.append(REC)
        j.rewrite([{**REC, "t": 2.0}])
        j.append({**REC, "t": 3.0})
    finally:
        j.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [json.loads(x)["t"] for x in path.read_text().splitlines()] == [2.0, 3.0]


def test_a_link_left_where_the_rewrite_writes_is_not_written_through(tmp_path: Path) -> None:
    path = tmp_path / "requests.journal"
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n", encoding="utf-8")
    (tmp_path / "requests.journal.tmp").symlink_to(victim)
    j = RequestJournal(path)
    try:
        j.append(REC)
        j.rewrite([{**REC, "t": 2.0}])
        j.append({**REC, "t": 3.0})
    finally:
        j.close()
    assert victim.read_text(encoding="utf-8") == "precious\n"
    assert not path.is_symlink()
    assert [json.loads(x)["t"] for x in path.read_text().splitlines()] == [2.0, 3.0]
