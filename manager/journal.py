"""A local append-only journal of request-log records, so a killed service loses none of its request log.

Each record (a served request, or one that never ran) is appended as one JSON line (flushed to the OS at
once: a process that is killed keeps it; a power cut may lose the last moment). When a batch reaches the
store, the journal is rewritten with what is still waiting. At start, the journal's records go to the
store first. A crash between the store write and the rewrite leaves a batch the store has in the journal
too (at most one second of requests): at the next start the records the store already holds are not sent
again (`replayed`, `manager.live_persist`).
One journal serves one service: it is held (an advisory lock on a file beside it, released by `close`
and by the OS when the process ends, however it ends) for as long as it is open, and a second service
on the same file (two started from one folder, or one given a symbolic link to the other's journal) is
refused at its start, naming the one that holds it. A journal named through a symbolic link is kept in
the file the link points to (a rewrite replaces that file, and leaves the link as it is, and keeps
its mode). A journal that is not a regular file (a FIFO, a device such as /dev/null, a folder) is
refused at the start, naming it: `store.journal: null` keeps no journal.
A line that cannot be read (a torn write at a crash, a damaged byte, a record the store would refuse)
is skipped, counted and logged with its line number: one bad line must not hold up the others.
A journal knows the store it serves (`claim`: the store's own id, `Store.store_id`, kept in a file
beside it, `<journal>.store`): the records a service on another store left in it (one home's config
switched to its own store, the journal left as it was) are not sent to this store but set aside
(`<journal>.<tag>.aside`), and a later service on that store with this journal takes them back when
it starts. The id is the store's own (kept in it), so a url spelled another way or a folder moved
is the same store. Where the journal's store is reached is kept too (`<journal>.store-at`): a store
whose id this start made where that store was is the same store come back empty (a Redis restarted
without its data, a database file made anew), and takes the records kept for its earlier id as its
own (that id is gone for good: records set aside for it would never be taken back).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import stat
from pathlib import Path
from typing import Any

from manager import pidlock
from manager.store.base import normalize_record

logger = logging.getLogger(__name__)

CATCH_UP_S = 1.0
"""How often, at most, a journal that failed appends (a full disk) is written anew with the records
it missed (`RequestJournal.catch_up`): a rewrite of the whole buffer for each request would cost
more than the request while the disk stays full."""
CATCH_UP_MAX_S = 60.0
"""The longest wait between two catch-ups while they fail (the wait doubles from CATCH_UP_S)."""
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class JournalInUse(OSError):
    """Another process (or another open in this one) holds the request journal."""


def _tag(owner: str) -> str:
    """A file-name-safe tag of a store's identity (`<journal>.<tag>.aside`)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:12]


def _write_new(tmp: Path, data: bytes) -> None:
    """A new file `tmp` holding `data`: one already there (a link another user left, pointing at a file
    of this user's) is removed first, never written through (O_EXCL | O_NOFOLLOW)."""
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(data)


def _replace_text(path: Path, text: str) -> None:
    """`path` holding the line `text`, whole or as it was (through a temp file beside it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_new(tmp, (text + "\n").encode("utf-8"))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


class RequestJournal:
    def __init__(self, path: Path) -> None:
        """OSError naming the file (and the `store.journal` setting) when it cannot be opened;
        `JournalInUse` (an OSError) when another service holds it."""
        self.path = path
        """As configured (what messages name); `file` is where it is written."""
        self.file = self.lock_path = path
        self._lock_fd = self._fd = -1
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # a journal reached through a symbolic link is the file it points to: its lock is beside
            # that file (a service given the link and one given the file are refused as two on one
            # journal, not both served), and a rewrite replaces that file, not the link
            self.file = Path(os.path.realpath(path))
            self._check_file()
            self.lock_path = self.file.with_name(self.file.name + ".lock")
            self._lock_fd = self._lock()
            self._fd = self._open()
        except OSError as e:
            self._close_lock()
            if isinstance(e, JournalInUse):
                raise
            raise OSError(
                e.errno, f"store.journal {str(path)!r}: cannot open the request journal: {e.strerror or e}"
            ) from None
        self.replayed: list[dict[str, Any]] = []
        """The records `read` gave (an earlier run's), until the store has them: those it held already
        (written just before a kill, the journal not yet rewritten) are not sent again."""
        self.corrupt_said: set[str] = set()
        """Corrupt stored rows met while `replayed` was compared with the store, each said once
        (`manager.live_persist`): a retry of the comparison does not say them again."""
        self.skipped = 0
        self.lines = 0
        """Records in the file (as far as this process knows: read, appended, rewritten)."""
        self.failed = 0
        """Records that could not be appended (a full disk): they are in memory only."""
        self.behind = 0
        """Records in memory only since the journal last held every one (`catch_up` writes them)."""
        self._caught_up_at = -math.inf
        self._catch_up_wait = CATCH_UP_S
        self._torn = False  # a failed append may have left part of its line: end it first
        self._closed = False
        self._end_line()

    def claim(self, owner: str) -> None:
        """The journal as the store `owner`'s (its id, `Store.store_id`), before `read`: another
        store's records are set aside, those set aside for `owner` taken back (`_own`). Never raises:
        a failure (a full disk) is said, and the records are then sent to this store, as before
        journals knew theirs."""
        if self._closed:
            return
        try:
            self._close_fd()  # (the file may be renamed: appends go to the journal as it is after)
            self._own(owner)
        except OSError as e:
            logger.warning(
                "%s: cannot keep the store the journal serves beside it (%s): its records are sent to "
                "this store", self.path, e,
            )  # fmt: skip
        finally:
            with contextlib.suppress(OSError):  # (failing, the next append tries again)
                self._fd = self._open()
            self._torn = False
            self._end_line()  # (a journal taken back may end in a torn line)

    def disown(self) -> None:
        """The store's id could not be read (it is down at start): the journal's records go to it
        all the same, as before journals knew theirs, and the journal is no other store's any more
        (a start that can read the id then takes them all as its own)."""
        for name in (".store", ".store-at"):
            with contextlib.suppress(OSError):
                self.file.with_name(self.file.name + name).unlink(missing_ok=True)

    def _own(self, owner: str) -> None:
        """The journal as `owner`'s (its lock held): records another store's service left are set
        aside, records set aside for `owner` are taken back, and the owner is written beside it
        (`<journal>.store`), with where that store is reached (`<journal>.store-at`, a tag of
        `StoreId.where`). A store whose id this start made (`StoreId.made`) where the journal's store
        was is that store come back empty (a Redis restarted without its data, a database file made
        anew): the records kept for its earlier id are its own, and sent to it (set aside, no service
        would ever take them back: that id is gone). A new store elsewhere (a config switched to a
        store of its own) has another store's records set aside, as one whose id existed before."""
        owner_file = self.file.with_name(self.file.name + ".store")
        at_file = self.file.with_name(self.file.name + ".store-at")
        try:
            said: str | None = owner_file.read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            said = None  # (a journal of an earlier release: its records are this store's, as they were)
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("%s: cannot read the journal's store (%s); taken as this one's", owner_file, e)
            said = None
        try:  # (none: written by a release that did not keep it, or the place not known)
            said_at: str | None = at_file.read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError):
            said_at = None
        where = getattr(owner, "where", None)
        here = _tag(where) if isinstance(where, str) else None
        emptied = getattr(owner, "made", False) is True and here is not None and said_at == here
        held = self._records_held()
        if said is not None and said != owner and held and emptied:
            logger.warning(
                "%s: %d request(s) were kept for the store %s, which is this one (%s) come back empty "
                "(its id made anew at this start where that store was: a Redis restarted without its "
                "data, a database file made anew): taken as this store's and sent to it",
                self.path, held, said, owner,
            )  # fmt: skip
        elif said is not None and said != owner and held:
            aside = self.file.with_name(f"{self.file.name}.{_tag(said)}.aside")
            if aside.exists():  # (two outages of that store: both kept, in order; whole or not at all)
                tmp = aside.with_name(aside.name + ".tmp")
                try:
                    kept = aside.read_bytes()
                    sep = b"\n" if kept and not kept.endswith(b"\n") else b""
                    _write_new(tmp, kept + sep + self.file.read_bytes())
                    os.replace(tmp, aside)
                finally:
                    tmp.unlink(missing_ok=True)
                self.file.unlink()
            else:
                os.replace(self.file, aside)
            logger.warning(
                "%s: %d request(s) were served by a service on another store (%s), not this one (%s): "
                "set aside in %s, not sent here (a service on that store with this journal takes "
                "them back at its start)",
                self.path, held, said, owner, aside,
            )  # fmt: skip
            held = 0
        if said != owner:  # written before a set-aside journal is taken back: a crash between the two
            try:  # leaves the records set aside
                if here is None:
                    at_file.unlink(missing_ok=True)  # (the other store's place)
                else:
                    _replace_text(at_file, here)
                _replace_text(owner_file, owner)
            except OSError:
                # (a full disk) the file must not go on naming the other store: this run's records
                # would be set aside as that store's at the next start. Without it, the journal is no
                # store's (as `disown` leaves it), and the next start takes its records as its own.
                self.disown()
                raise
        elif here is not None and said_at != here:  # (kept by an earlier release, or a home moved)
            with contextlib.suppress(OSError):  # (only a hint: without it, as before it was kept)
                _replace_text(at_file, here)
        mine = self.file.with_name(f"{self.file.name}.{_tag(owner)}.aside")
        if not held and mine.exists():
            os.replace(mine, self.file)
            logger.info("%s: the request(s) set aside for this store (%s) are taken back", self.path, owner)

    def _records_held(self) -> int:
        """How many lines the journal file holds (0 when there is none)."""
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return 0
        return sum(1 for line in data.split(b"\n") if line.strip())

    def _check_file(self) -> None:
        """OSError naming the file unless it is a regular file or missing: a FIFO would hold the start
        for good (its open waits for a reader), and a rewrite would replace a device (`/dev/null`)."""
        try:
            mode = os.stat(self.file).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISREG(mode):
            return
        if stat.S_ISDIR(mode):
            what = "a folder"
        elif stat.S_ISFIFO(mode):
            what = "a FIFO"
        else:
            what = "a device or socket"
        raise OSError(
            errno.EINVAL,
            f"{self.file} is {what}, not a regular file: give the path of a file (`store.journal: null` "
            "keeps no journal)",
        )

    def _lock(self) -> int:
        """Hold the lock file beside the journal, with this process's id in it (for a refused one to
        name). Two services on one journal would both append to it, both send it to the store at
        their start (the other's records logged twice), and one's rewrite would cut what the other
        had just appended. The journal itself is not what is locked: its rewrite replaces the file."""
        try:
            fd, unlocked = pidlock.hold(self.lock_path)
        except pidlock.Held as e:
            who = f"another residency service (pid {e.pid})" if e.pid else "another residency service"
            raise JournalInUse(
                errno.EAGAIN,
                f"store.journal {str(self.path)!r}: {who} is using this request journal (it holds "
                f"{str(self.lock_path)!r}); stop that one, or give this one a store.journal of its own",
            ) from None
        if unlocked is not None:  # a file system without locks (some network ones): served, unguarded
            logger.warning(
                "%s: cannot lock the request journal (%s); a second service on it would not be refused",
                self.path, unlocked,
            )  # fmt: skip
        return fd

    def _end_line(self) -> None:
        """End a torn last line (a kill mid-write) so the next record starts a line of its own
        instead of being glued to the torn one and lost with it. Never raises: where the newline
        cannot be written now (a full disk, the very state a kill mid-write may have come from), the
        next record that is appended starts with it, as after a failed append; the start goes on."""
        try:
            with self.file.open("rb") as f:
                if f.seek(0, os.SEEK_END) == 0:
                    return
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                os.write(self._fd, b"\n")
        except OSError as e:
            self._torn = True  # (a needless newline is an empty line, which `read` skips)
            logger.warning("%s: cannot end the journal's torn last line now (%s)", self.path, e)

    def _open(self) -> int:
        return os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # (the home's timeline)

    def append(self, rec: dict[str, Any]) -> None:
        """Never raises: the request was served, and a journal that cannot take its record (a full
        disk) must not fail it; the record is still in memory (logged and counted in `failed`)."""
        # one write(2) of the whole line on an O_APPEND descriptor: in the OS at once, no buffer
        if self._closed:  # (a request that ended after the stop: its lock is given up, never written)
            self.failed += 1
            return
        data = (_ENCODE(rec) + "\n").encode()
        if self._torn:  # a line cut short by an earlier failure: this record starts a line of its own
            data = b"\n" + data
        try:
            if self._fd < 0 and not self._closed:  # a rewrite that could not open it again
                self._fd = self._open()
            while data:  # a regular file takes it whole; a short write (disk filling up) goes on
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            self._torn = True
            self._missed(e)
            return
        self._torn = False
        self.lines += 1

    def _missed(self, e: OSError) -> None:
        self.failed += 1
        self.behind += 1
        if self.behind == 1 or self.behind % 1000 == 0:  # (each time it starts failing again, too)
            logger.warning(
                "%s: cannot append to the request journal (%s); %d record(s) in memory only",
                self.path, e, self.behind,
            )  # fmt: skip

    def catch_up(self, pending: list[dict[str, Any]], now: float, *, force: bool = False) -> bool:
        """After appends failed (`behind`), the journal written anew with `pending` (every record the
        store does not have yet, the newest last); True when done. At most once every CATCH_UP_S
        (`now`: a monotonic clock) unless `force` (the stop): the records the journal could not take
        were in memory only until the store took them, so a kill once the disk had room again still
        lost them. Only by a temp file renamed over it, never cut in place (on a disk still full that
        would lose what it holds). False when not tried or not done: the caller appends its new
        record as usual (a disk with room for a line, not for a second copy, still takes it)."""
        if self._closed or (not force and now - self._caught_up_at < self._catch_up_wait):
            return False
        self._caught_up_at = now
        behind = self.behind
        failure = self._replace_with(pending)
        if failure is not None:  # (a disk with room for lines, not for a copy: each try writes up to
            # the whole buffer, on the event loop; tried less often while it fails, a minute at most)
            self._catch_up_wait = min(2 * self._catch_up_wait, CATCH_UP_MAX_S)
            return False
        self.behind, self._catch_up_wait = 0, CATCH_UP_S
        logger.info(
            "%s: the request journal takes records again; the %d it could not take are in it now",
            self.path, behind,
        )  # fmt: skip
        return True

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return out
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            self.lines += 1
            try:
                # the store's own check: a record it would refuse would block the whole log
                out.append(normalize_record(json.loads(raw.decode("utf-8"))))
                continue
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, too deep, not a record
                reason = str(e) or type(e).__name__
            self.skipped += 1
            logger.warning("%s:%d: unreadable journal line skipped (%s)", self.path, n, reason[:200])
        self.replayed = list(out)
        return out

    def rewrite(self, pending: list[dict[str, Any]]) -> None:
        """Replace the journal with `pending` (atomically: a temp file renamed over it). Never raises:
        it runs after the store took a batch, and a failure taken for the store's would send the batch
        again. Without room for the temp file (a full disk) the journal is cut and `pending` written
        in place, so it does not keep what the store has (sent again at the next start)."""
        if self._closed:
            return
        failure = self._replace_with(pending)
        if failure is not None:
            logger.warning(
                "%s: cannot rewrite the request journal (%s); cut and rewritten in place", self.path, failure
            )
            self.behind = 0  # (what the rewrite in place cannot append is counted again)
            self._rewrite_in_place(pending)
            return
        self.behind, self._catch_up_wait = 0, CATCH_UP_S

    def _replace_with(self, pending: list[dict[str, Any]]) -> OSError | None:
        """The journal replaced by a temp file holding `pending`; the OSError that stopped it (the
        journal then as it was, the temp file removed), None when done."""
        if self._closed:  # (its lock given up: another service may hold the file now)
            return OSError(errno.EBADF, "the journal is closed")
        tmp = self.file.with_name(self.file.name + ".tmp")
        try:
            try:  # the journal's mode (its owner may have made it private)
                mode: int | None = stat.S_IMODE(os.stat(self.file).st_mode)
            except OSError:
                mode = None
            tmp.unlink(missing_ok=True)  # (O_EXCL: a new file, never one a link left there points to)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode or 0o600)
            with open(fd, "w", encoding="utf-8") as f:
                if mode is not None:
                    os.fchmod(fd, mode)  # (as it was, not as the umask leaves it)
                for rec in pending:
                    f.write(_ENCODE(rec) + "\n")
            self._close_fd()
            os.replace(tmp, self.file)
            with contextlib.suppress(OSError):  # (replaced: done; the next append opens it again)
                self._fd = self._open()
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if self._fd < 0 and not self._closed:  # (closed before a failed rename: open it again)
                with contextlib.suppress(OSError):
                    self._fd = self._open()
            return e
        self._torn = False
        self.lines = len(pending)
        return None

    def _rewrite_in_place(self, pending: list[dict[str, Any]]) -> None:
        if self._closed:
            return
        try:
            self._close_fd()
            self._fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            logger.error("%s: cannot rewrite the request journal (%s)", self.path, e)
            self.behind += max(len(pending), 1)  # (not cut: whether it holds them is not known)
            return  # (the next append tries to open it again; a catch-up writes them)
        self._torn = False
        self.lines = 0
        for rec in pending:
            self.append(rec)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1  # never written again once closed: its number may be reused
        if fd >= 0:
            os.close(fd)

    def _close_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # the lock goes with its last descriptor

    def close(self) -> None:
        """Idempotent: the journal is written no more, and another service may have it."""
        self._closed = True
        self._close_fd()
        self._close_lock()
