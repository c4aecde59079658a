"""The embedded store: one SQLite file (stdlib sqlite3, WAL mode), the default `store.url`.

Primitives:
  parse_sqlite_url - `sqlite:///PATH` -> PATH (`sqlite:///rel/x.db` is relative to the cwd,
                     `sqlite:////abs/x.db` absolute, `sqlite:///:memory:` a private in-memory db:
                     SQLAlchemy's convention, kept so existing stores stay where they are).
  relative_path_warning - what `config check` and `serve` say of a url whose relative PATH reads as
                     an absolute one (`sqlite:///tmp/x.db`), or None.
  open_sqlite      - url -> SQLiteStore (creates parent folders and the schema; with create=False,
                     as read-only commands open it, a missing file is a StoreError instead).
  SQLiteStore      - the `Store` protocol over three tables:
                       requests(id, t, model, busy_s, class, kind, client, keep_alive, wait_s,
                                outcome, source) with an index on t;
                       docs(key, value JSON); intents(model, tier).

Thread safety: one connection (`check_same_thread=False`) guarded by a lock; `requests()` reads in
pages of `PAGE` rows by (t, id), so the lock is never held while a caller iterates. Each
`append_requests` call is one transaction. The file survives restarts; WAL lets a second process
(e.g. `residency trace export`) read while the service writes.

Opening for the service (create=True): a file that is not a residency store is refused at the open,
in one line naming it and the fix, never served with every write failing: not a database, damaged
(`PRAGMA quick_check`), another program's database (tables of its own: never given ours), a
residency store of a newer schema or with tables missing, a file or folder this user may not
write, a lock another process holds past BUSY_TIMEOUT_S, a full disk.

One service per store (hold=True, for `serve`): an advisory lock on PATH.lock beside the file (the
file a symbolic link points to, as SQLite's -wal and -shm are), held while the store is open (the OS
lets it go when the process ends, however it ends), refuses a second service naming the one that
holds it. Two services on one store would each overwrite the other's statistics and intents, and
count the other's requests again at a restart. Read-only commands and other opens do not take it.

Schema versions: 2 added requests.keep_alive (a request's own keep-alive). The service's open of a
version-1 file adds the column (one ALTER TABLE, nothing rewritten); a read-only open reads a
version-1 file as it is, each request without a keep-alive of its own.

Read-only opening (create=False, `trace export` and `tune --from-store`): nothing is written (nor
the journal mode: only the service's open puts a file in WAL mode), and a file without this schema
(empty, another program's database) is refused, not given tables. A user
who may read the file but not write its folder (the service's /var/lib folder) cannot make the
-shm file WAL readers need: with the service stopped (no -wal data beside the file) the file is read
as immutable; with a -wal file holding data that user cannot open, it is refused, naming it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from manager import pidlock
from manager.store.base import (
    RECORD_FIELDS,
    STORE_ID_DOC,
    CorruptDocument,
    CorruptRow,
    OnCorrupt,
    StoreError,
    StoreId,
    aside_key,
    check_intent,
    decode_doc,
    encode_doc,
    normalize_record,
    read_store_id,
)

__all__ = [
    "PAGE",
    "SCHEMA_VERSION",
    "TRIM_CHUNK",
    "SQLiteStore",
    "open_sqlite",
    "parse_sqlite_url",
    "relative_path_warning",
]

logger = logging.getLogger(__name__)

PAGE = 1000
SCHEMA_VERSION = 2
_ADDED_IN_2 = frozenset({"keep_alive"})
"""The requests table's columns that schema version 2 added (a version-1 file lacks them)."""
BUSY_TIMEOUT_S = 10.0
"""How long a statement waits for another process's lock on the file before it fails."""
_TABLES: dict[str, frozenset[str]] = {
    "requests": frozenset(("id", *RECORD_FIELDS)),
    "docs": frozenset(("key", "value")),
    "intents": frozenset(("model", "tier")),
}
_COLUMNS = ", ".join(f'"{c}"' for c in RECORD_FIELDS)
_SCHEMA = f"""
BEGIN;
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    model TEXT NOT NULL,
    busy_s REAL NOT NULL,
    "class" TEXT,
    kind TEXT NOT NULL DEFAULT 'infer',
    client TEXT,
    wait_s REAL,
    keep_alive REAL,
    outcome TEXT,
    source TEXT
);
CREATE INDEX IF NOT EXISTS requests_t ON requests (t);
CREATE TABLE IF NOT EXISTS docs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS intents (model TEXT PRIMARY KEY, tier TEXT NOT NULL);
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""
_INSERT = f"INSERT INTO requests ({_COLUMNS}) VALUES ({', '.join('?' for _ in RECORD_FIELDS)})"
_PAGE_WHERE = "FROM requests WHERE (t, id) > (?, ?) AND t < ? ORDER BY t, id LIMIT ?"
_SELECT_PAGE = f"SELECT id, {_COLUMNS} {_PAGE_WHERE}"
# A version-1 file read as it is (a read-only open): its requests have no keep-alive of their own.
_SELECT_PAGE_V1 = (
    "SELECT id, "
    + ", ".join("NULL" if c in _ADDED_IN_2 else f'"{c}"' for c in RECORD_FIELDS)
    + f" {_PAGE_WHERE}"
)
# SQLite sorts text and blobs after every number, so a row whose t is not a number (a damaged file, a
# hand edit) is in no time range: this finds one through the index, which the pages would pass over.
_SELECT_NOT_A_TIME = "SELECT id, t FROM requests WHERE t >= ? ORDER BY t LIMIT ?"  # (-1: no limit)
TRIM_CHUNK = 5000
"""Request records deleted per transaction by `trim_requests`: the lock (and the file's write lock)
is let go between chunks, so requests keep being logged while years of records go."""
_TRIM = "DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE t < ? ORDER BY t LIMIT ?)"


def _version(db: sqlite3.Connection) -> int:
    (version,) = db.execute("PRAGMA user_version").fetchone()
    return int(version)


def _read_only(e: sqlite3.Error) -> bool:
    """True for SQLite's "attempt to write a readonly database" and "unable to open database file"
    (a WAL file whose -shm this user cannot make)."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    return code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN)


def _fix(path: str, e: sqlite3.Error) -> str:
    """What to do about an error opening the database at `path` ("" when there is nothing to say)."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    where = os.path.dirname(os.path.abspath(path))
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return (
            f"{path} is not a SQLite database, or is damaged: point store.url at another file, or move "
            f"it aside (with its -wal and -shm files) and a new, empty store is made"
        )
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return (
            f"another process has held a lock on {path} for over {BUSY_TIMEOUT_S:g} s (a write "
            "transaction: a sqlite3 shell, a VACUUM, another program); end it, then start again"
        )
    if code == sqlite3.SQLITE_READONLY:
        return (
            f"this user may not write {path} or its folder {where} (SQLite writes its -wal and -shm "
            "files beside it): give this user write access to both, or run as the store's owner"
        )
    if code == sqlite3.SQLITE_CANTOPEN:
        if os.path.isdir(path):
            return f"{path} is a folder; give store.url the path of a file"
        return f"this user may not open {path}, or may not create files in its folder {where}"
    if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
        try:
            full = os.statvfs(where).f_bavail == 0
        except OSError:
            full = code == sqlite3.SQLITE_FULL
        if full:  # (a full disk fails the -shm file's mapping as an I/O error)
            return f"the disk holding {path} is full: free some space, then start again"
        if code == sqlite3.SQLITE_IOERR:
            return f"reading or writing {path} or its -wal and -shm files failed: check the disk"
    return ""


def _identity(path: str) -> tuple[int, int] | None:
    """The file at `path` (its device and inode, following links); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _lock_file_error(e: OSError, lock: str) -> str:
    """Why the store's lock file `lock` (beside the database) could not be opened, and what to do."""
    said = f"cannot open the store's lock file: {e.strerror or e}"  # (which names it)
    where = os.path.dirname(os.path.abspath(lock))
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"{said}; the store's folder {where} must be writable by this user (the lock, and SQLite's "
            "-wal and -shm files, go beside the database): give this user write access to it, or "
            "point store.url at a writable folder"
        )
    if e.errno == errno.ENOSPC:
        return f"{said}; the disk holding {where} is full: free some space, then start again"
    return said


def _cannot_open(url: str, path: str, e: sqlite3.Error) -> StoreError:
    fix = _fix(path, e)
    return StoreError(url, f"cannot open the database: {e}" + (f"; {fix}" if fix else ""))


def parse_sqlite_url(url: str) -> str:
    """The database path in `sqlite:///PATH`; StoreError naming the url when there is none."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        raise StoreError(url, "not a sqlite:/// url")
    if parts.netloc or not url.startswith("sqlite:///"):
        raise StoreError(url, "expected sqlite:///PATH (three slashes; a relative PATH is from the cwd)")
    if parts.query or parts.fragment:
        raise StoreError(url, "a sqlite url takes no ?query or #fragment")
    path = parts.path[1:]
    if not path or path.endswith("/"):
        raise StoreError(url, "no database file in the url; expected sqlite:///PATH/TO/FILE.db")
    return path


def relative_path_warning(url: str) -> str | None:
    """The warning for a sqlite `url` whose PATH is relative and may be read as absolute (three
    slashes: `sqlite:///tmp/x.db` is ./tmp/x.db, from the folder the service is started in), naming
    the file it opens from this working folder and the four-slash url of the absolute path; None for
    another url, an absolute path, `:memory:`, a url the store refuses (said as an error elsewhere),
    and a PATH that starts with a dot (`.residency/state.db`, the default, or `./x.db`: plainly
    relative, and where the README says the store is)."""
    try:
        path = parse_sqlite_url(url) if url.startswith("sqlite:") else ""
    except StoreError:
        return None
    if not path or path == ":memory:" or os.path.isabs(path) or path.startswith("."):
        return None
    return (
        f"store.url {url!r} names a relative path, relative to the working folder: the store is "
        f"{os.path.abspath(path)} when the service is started from {os.getcwd()}; an absolute path "
        f"takes four slashes (sqlite:////{path} for /{path})"
    )


def open_sqlite(url: str, *, create: bool = True, hold: bool = False) -> SQLiteStore:
    """Open (creating if needed, unless `create` is False) the SQLite store at `url`; `hold`: as the
    one service on it (see the module docstring).

    StoreError when it cannot be opened, when `create` is False and there is no file yet, or when
    `hold` and another service holds it."""
    return SQLiteStore(parse_sqlite_url(url), url=url, create=create, hold=hold)


def _text_or_bytes(raw: bytes) -> str | bytes:
    """A TEXT value as str, or as its bytes where they are not UTF-8 (`_rows`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _rows(db: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    """`sql`'s rows, a TEXT value that is not UTF-8 (a damaged page, another program's write) given as
    its bytes: sqlite3's own decoding raised for the whole read, which was taken as the store being
    down (the journal's replay retried for ever, the statistics' catch-up lost every request, the
    intents were never restored). Read so, the damaged row is that row's corrupt case, left out and
    said as others are. The caller holds the store's lock (`SQLiteStore._db`): no other read meets
    the connection's text factory while it is set."""
    db.text_factory = _text_or_bytes
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.text_factory = str


class SQLiteStore:
    """The `Store` protocol on one SQLite file (see the module docstring)."""

    def __init__(
        self, path: str | Path, *, url: str | None = None, create: bool = True, hold: bool = False
    ) -> None:
        """Open `path` (":memory:" for a private in-memory database), creating folders and schema.
        With `create` False a missing file is an error and nothing is created (a mistyped path given
        to a read-only command must not become a new, empty store). With `hold`, the store is held
        for this service until `close` (see the module docstring).

        Raises:
            StoreError: the folder cannot be created, the file is not a usable database, it does
                not exist and `create` is False, or `hold` and another service holds it.
        """
        self.path = str(path)
        self.url = url if url is not None else f"sqlite:///{self.path}"
        self._lock = threading.Lock()
        self._closed = False
        self._select_page = _SELECT_PAGE
        self._hold_fd = -1
        self._identity: tuple[int, int] | None = None
        if not create and self.path != ":memory:" and not Path(self.path).exists():
            raise StoreError(self.url, f"no store at {self.path} (nothing recorded yet?)")
        if self.path != ":memory:":
            parent = Path(self.path).parent
            try:
                parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (a new one: private)
            except OSError as e:
                raise StoreError(
                    self.url, f"cannot create the folder {parent} for the database: {e.strerror or e}"
                ) from None
            if create:  # a new database file is private (SQLite's own is 0644): it holds the home's
                # timeline of use; its -wal and -shm files take its mode
                with contextlib.suppress(OSError):  # (one there already, FileExistsError, is kept)
                    os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            if hold:
                self._hold_fd = self._hold()
        try:
            self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        except sqlite3.Error as e:
            self._let_go()
            raise _cannot_open(self.url, self.path, e) from None
        try:
            try:
                self._init_schema(create)
            except sqlite3.Error as e:
                if create or self.path == ":memory:" or not _read_only(e):
                    raise
                self._conn.close()
                self._conn = self._open_immutable(e)
                self._init_schema(create, immutable=True)
        except (sqlite3.Error, StoreError) as e:
            self._conn.close()
            self._let_go()
            self._closed = True
            if isinstance(e, StoreError):
                raise
            raise _cannot_open(self.url, self.path, e) from None
        # a service's store: the file it opened, told apart from another put at its path later
        if hold and self.path != ":memory:":
            self._identity = _identity(self.path)
        logger.debug("opened sqlite store %s", self.url)

    def _hold(self) -> int:
        """The lock file beside the store, held, with this process's id in it (for a refused service
        to name); StoreError when another process holds it. Beside the file the path reaches: a
        service given a symbolic link to the store and one given the file are two on one store."""
        path = f"{os.path.realpath(self.path)}.lock"
        try:
            fd, unlocked = pidlock.hold(path)
        except pidlock.Held as e:
            who = f"another residency service (pid {e.pid})" if e.pid else "another residency service"
            raise StoreError(
                self.url,
                f"{who} is serving this store (it holds {path}); stop that one, or give this one a "
                "store.url of its own",
            ) from None
        except OSError as e:
            raise StoreError(self.url, _lock_file_error(e, path)) from None
        if unlocked is not None:  # a file system without locks (some network ones): served, unguarded
            logger.warning(
                "%s: cannot lock the store (%s); a second service on it would not be refused", path, unlocked
            )
        return fd

    def _let_go(self) -> None:
        fd, self._hold_fd = self._hold_fd, -1
        if fd >= 0:
            os.close(fd)  # the lock goes with its last descriptor

    def _init_schema(self, create: bool, *, immutable: bool = False) -> None:
        version = _version(self._conn)
        if version > SCHEMA_VERSION:
            raise StoreError(
                self.url,
                f"schema version {version} is newer than this program's ({SCHEMA_VERSION}): {self.path} "
                "was written by a newer residency; run that version, or point store.url at another file",
            )
        if version == 0 and not create:  # a read-only command writes nothing
            raise StoreError(
                self.url,
                f"{self.path} holds no residency store (an empty file, or another program's database)",
            )
        self._check_tables(version)
        self._select_page = _SELECT_PAGE_V1 if version == 1 else _SELECT_PAGE
        if immutable or not create:  # a read-only command leaves the file's journal mode as it is
            return
        (mode,) = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode != "wal" and self.path != ":memory:":
            logger.warning("sqlite store %s: journal_mode is %s, not wal", self.url, mode)
        self._conn.execute("PRAGMA synchronous=NORMAL")
        if create and version > 0:  # (a new file is written just below)
            self._check_writable()
            self._check_intact()
        if version == 1:  # an older store: the column added, in one transaction with the version
            self._conn.executescript(
                "BEGIN; ALTER TABLE requests ADD COLUMN keep_alive REAL; "
                f"PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
            )
            self._select_page = _SELECT_PAGE
            logger.info("sqlite store %s: schema 1 -> %d (requests.keep_alive)", self.url, SCHEMA_VERSION)
        elif version < SCHEMA_VERSION:  # a store at this version has its tables: nothing to write
            self._conn.executescript(_SCHEMA)  # (so a user who may only read it can export it)

    def _check_tables(self, version: int) -> None:
        """StoreError unless the file holds this store's tables with their columns (all of them at
        this schema version; before it, a new file, none but ours: another program's database is
        never given tables of ours, its own `user_version` set, or served with every write failing)."""
        rows = self._conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%'"
        ).fetchall()
        tables = {name for (name,) in rows}
        foreign = sorted(tables - _TABLES.keys())
        missing = sorted(_TABLES.keys() - tables) if version > 0 else []
        if foreign or missing:
            names, plural = (foreign, "s" if len(foreign) > 1 else "") if foreign else (missing, "")
            what = (
                f"table{plural} {', '.join(names)} of its own"
                if foreign
                else f"no {', '.join(names)} table{'s' if len(names) > 1 else ''}"
            )
            raise StoreError(
                self.url,
                f"{self.path} is not a residency store ({what}: another program's database?); "
                "point store.url at a file of its own",
            )
        for table in sorted(tables):
            columns = {row[1] for row in self._conn.execute(f'PRAGMA table_info("{table}")')}
            lacking = sorted(_TABLES[table] - columns - (_ADDED_IN_2 if version == 1 else frozenset()))
            if lacking:
                raise StoreError(
                    self.url,
                    f"{self.path} is not a residency store (its {table} table has no column "
                    f"{', '.join(lacking)}: another program's database?); point store.url at a file "
                    "of its own",
                )

    def _check_writable(self) -> None:
        """A write, rolled back: SQLite opens a file this user may not write read-only, without a
        word, and the service would then fail every write while it serves. Waits BUSY_TIMEOUT_S for
        another process's write lock."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        finally:
            self._conn.rollback()

    def _check_intact(self) -> None:
        """StoreError when `PRAGMA quick_check` finds the file damaged (a few tenths of a second per
        million requests): said at the start, not as a write or a read that fails while serving."""
        try:
            (first,) = self._conn.execute("PRAGMA quick_check(1)").fetchone()
        except sqlite3.DatabaseError as e:
            first = str(e)
        if first != "ok":
            first = " ".join(str(first).replace("*** in database main ***", "").split())  # one line
            raise StoreError(
                self.url,
                f"{self.path} is damaged ({first}): move it aside (with its -wal and -shm files) and a "
                f"new, empty store is made, or recover what it holds: sqlite3 {self.path} .recover",
            )

    def _open_immutable(self, cause: sqlite3.Error) -> sqlite3.Connection:
        """The file read as immutable (no -shm, no locks), for a reader who cannot write its folder;
        StoreError when a -wal file holds data the file lacks (the service running or killed)."""
        wal = f"{self.path}-wal"
        try:
            wal_size = os.path.getsize(wal)
        except FileNotFoundError:
            wal_size = 0
        except OSError as e:
            raise StoreError(self.url, f"cannot open the database ({cause}): {wal}: {e.strerror}") from None
        if wal_size > 0:
            raise StoreError(
                self.url,
                f"cannot open the database ({cause}): its write-ahead log {wal} holds records not yet "
                "in the file, and this user may not write the folder to read it; run as the service's "
                "user, or after the service has stopped cleanly",
            )
        uri = f"file:{quote(os.path.abspath(self.path))}?immutable=1"
        logger.debug(
            "sqlite store %s: its folder is read-only to this user; reading it as immutable", self.url
        )
        return sqlite3.connect(uri, uri=True, timeout=10.0, check_same_thread=False)

    @contextmanager
    def _db(self, what: str) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock; sqlite errors become StoreError naming `what`."""
        with self._lock:
            if self._closed:
                raise StoreError(self.url, f"{what}: the store is closed")
            if self._identity is not None and _identity(self.path) != self._identity:
                # deleted (or replaced) under the service: its writes went to a file nobody could
                # read, and the journal let the requests go as stored. A store that fails keeps them.
                raise StoreError(
                    self.url,
                    f"{what}: {self.path} was removed or replaced while the service had it open; "
                    "what it serves is kept in memory and in the request journal until a restart "
                    "opens the store at that path",
                )
            try:
                yield self._conn
            except sqlite3.Error as e:
                raise StoreError(self.url, f"{what}: {e}") from e

    # ---- request log -----------------------------------------------------------------------------

    def append_requests(self, records: Sequence[Mapping[str, Any]]) -> None:
        rows = []
        for rec in map(normalize_record, records):
            rows.append(tuple(rec.get(c, "infer" if c == "kind" else None) for c in RECORD_FIELDS))
        if not rows:
            return
        with self._db("append requests") as db, db:
            db.executemany(_INSERT, rows)

    def requests(
        self, since: float, until: float | None = None, *, on_corrupt: OnCorrupt | None = None
    ) -> Iterator[dict[str, Any]]:
        if math.isnan(since) or (until is not None and math.isnan(until)):
            raise ValueError(f"requests: since and until must be numbers, got {since!r}, {until!r}")
        hi = math.inf if until is None else float(until)
        key: tuple[float, int] = (float(since), -1)
        with self._db("read requests") as db:
            # (all of them for on_corrupt; else the first one is the error)
            bad = db.execute(_SELECT_NOT_A_TIME, (math.inf, 1 if on_corrupt is None else -1)).fetchall()
        for row_id, t in bad:  # (in no time range: passed over by every read)
            e = StoreError(self.url, f"requests row id={row_id} is corrupt: 't' is {t!r}, not a time")
            if on_corrupt is None:
                raise e
            on_corrupt(e)
        while True:
            with self._db("read requests") as db:
                if self._select_page is _SELECT_PAGE_V1 and _version(db) > 1:  # the service migrated it
                    self._select_page = _SELECT_PAGE
                page = _rows(db, self._select_page, (*key, hi, PAGE))
            for row in page:
                try:
                    rec = self._record(row)
                except StoreError as e:
                    if on_corrupt is None:
                        raise
                    on_corrupt(e)
                    continue
                yield rec
            if len(page) < PAGE:
                return
            key = (page[-1][1], page[-1][0])

    def _record(self, row: tuple[Any, ...]) -> dict[str, Any]:
        rec = {c: v for c, v in zip(RECORD_FIELDS, row[1:], strict=True) if v is not None}
        for c, v in rec.items():  # (`_rows`: text that is not UTF-8, or a BLOB)
            if isinstance(v, bytes):
                raise StoreError(self.url, f"requests row id={row[0]} is corrupt: {c!r} is {v!r}, not text")
        try:
            return normalize_record(rec)
        except ValueError as e:
            raise StoreError(self.url, f"requests row id={row[0]} is corrupt: {e}") from None

    def count_requests(self) -> int:
        with self._db("count requests") as db:
            (n,) = db.execute("SELECT COUNT(*) FROM requests").fetchone()
        return int(n)

    def trim_requests(self, before: float) -> int:
        if not isinstance(before, int | float) or isinstance(before, bool) or math.isnan(before):
            raise ValueError(f"trim_requests: before must be a number, got {before!r}")
        gone = 0
        while True:  # one transaction a chunk, through the index on t
            with self._db("trim requests") as db, db:
                n = db.execute(_TRIM, (float(before), TRIM_CHUNK)).rowcount
            gone += n
            if n < TRIM_CHUNK:
                return gone

    # ---- documents and intents -------------------------------------------------------------------

    def put_doc(self, key: str, doc: dict[str, Any]) -> None:
        text = encode_doc(key, doc)
        with self._db(f"put document {key!r}") as db, db:
            db.execute(
                "INSERT INTO docs (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, text),
            )

    def get_doc(self, key: str) -> dict[str, Any] | None:
        with self._db(f"get document {key!r}") as db:
            # as bytes: text that is not UTF-8 (a damaged page) failed sqlite3's decoding, read as the
            # store being down (never set aside, nor replaced) rather than as a damaged document
            row = db.execute(
                "SELECT typeof(value), CAST(value AS BLOB) FROM docs WHERE key = ?", (key,)
            ).fetchone()
        if row is None:
            return None
        if row[0] not in ("text", "blob"):
            raise CorruptDocument(self.url, f"document {key!r} is corrupt: stored as {row[0]}")
        return decode_doc(self.url, key, row[1])

    def store_id(self) -> str:
        import uuid

        with self._db("read the store's id") as db, db:  # (made once: the first ask's is kept)
            made = db.execute(
                "INSERT OR IGNORE INTO docs (key, value) VALUES (?, ?)",
                (STORE_ID_DOC, encode_doc(STORE_ID_DOC, {"id": uuid.uuid4().hex})),
            ).rowcount
        # (made now: a new file, or one made anew where an earlier one was moved aside)
        where = f"sqlite {os.path.realpath(self.path)}"
        return StoreId(read_store_id(self.url, self.get_doc(STORE_ID_DOC)), made=made == 1, where=where)

    def set_aside_doc(self, key: str) -> str | None:
        aside = aside_key(key)
        with self._db(f"set document {key!r} aside") as db, db:
            moved = db.execute("UPDATE docs SET key = ? WHERE key = ?", (aside, key)).rowcount
        return aside if moved else None

    def set_intent(self, model: str, tier: str) -> None:
        check_intent(model, tier)
        with self._db(f"set intent for {model!r}") as db, db:
            db.execute(
                "INSERT INTO intents (model, tier) VALUES (?, ?) "
                "ON CONFLICT (model) DO UPDATE SET tier = excluded.tier",
                (model, tier),
            )

    def drop_intent(self, key: object) -> None:
        # (bytes: a damaged row's name as `intents` read it, text that is not UTF-8 or a BLOB; a
        # TEXT value is never equal to a BLOB in SQLite, so the name is compared as bytes)
        where = "CAST(model AS BLOB) = ?" if isinstance(key, bytes) else "model = ?"
        with self._db(f"drop intent for {key!r}") as db, db:
            db.execute(f"DELETE FROM intents WHERE {where}", (key,))

    def intents(self, *, on_corrupt: OnCorrupt | None = None) -> dict[str, str]:
        with self._db("read intents") as db:
            rows = _rows(db, "SELECT model, tier FROM intents ORDER BY model", ())
        out: dict[str, str] = {}
        for model, tier in rows:
            try:
                for what, v in (("model", model), ("tier", tier)):  # (`_rows`: not UTF-8, or a BLOB)
                    if isinstance(v, bytes):
                        raise ValueError(f"its {what} is {v!r}, not text")
                check_intent(model, tier)
            except ValueError as e:
                error = CorruptRow(self.url, f"intent for {model!r} is corrupt: {e}", model)
                if on_corrupt is None:
                    raise error from None
                on_corrupt(error)
                continue
            out[model] = tier
        return out

    # ---- lifecycle -------------------------------------------------------------------------------

    def refused(self) -> str | None:
        return None  # (a file that cannot be opened as a store was refused at the open)

    def ping(self) -> bool:
        try:
            with self._db("ping") as db:
                db.execute("SELECT 1").fetchone()
        except StoreError as e:
            logger.debug("sqlite store ping failed: %s", e)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conn.close()
            self._let_go()
        logger.debug("closed sqlite store %s", self.url)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.url!r})"
