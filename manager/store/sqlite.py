"""The embedded store: one SQLite file (stdlib sqlite3, WAL mode), the default `store.url`.

Primitives:
  parse_sqlite_url - `sqlite:///PATH` -> PATH (`sqlite:///rel/x.db` is relative to the cwd,
                     `sqlite:////abs/x.db` absolute, `sqlite:///:memory:` a private in-memory db).
  open_sqlite      - url -> SQLiteStore (creates parent folders and the schema; with create=False,
                     as read-only commands open it, a missing file is a StoreError instead).
  SQLiteStore      - the `Store` protocol over three tables:
                       requests(id, t, model, busy_s, class, kind, client, wait_s, outcome, source)
                                with an index on t;
                       docs(key, value JSON); intents(model, tier).

Thread safety: one connection (`check_same_thread=False`) guarded by a lock; `requests()` reads in
pages of `PAGE` rows by (t, id), so the lock is never held while a caller iterates. Each
`append_requests` call is one transaction. The file survives restarts; WAL lets a second process
(e.g. `residency trace export`) read while the service writes.

Read-only opening (create=False, `trace export` and `tune --from-store`): nothing is written, and a
file without this schema (empty, another program's database) is refused, not given tables. A user
who may read the file but not write its folder (the service's /var/lib folder) cannot make the
-shm file WAL readers need: with the service stopped (no -wal data beside the file) the file is read
as immutable; with a -wal file holding data that user cannot open, it is refused, naming it.
"""

from __future__ import annotations

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

from manager.store.base import (
    RECORD_FIELDS,
    CorruptDocument,
    StoreError,
    check_intent,
    decode_doc,
    encode_doc,
    normalize_record,
)

__all__ = ["PAGE", "SCHEMA_VERSION", "SQLiteStore", "open_sqlite", "parse_sqlite_url"]

logger = logging.getLogger(__name__)

PAGE = 1000
SCHEMA_VERSION = 1
_COLUMNS = ", ".join(f'"{c}"' for c in RECORD_FIELDS)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    model TEXT NOT NULL,
    busy_s REAL NOT NULL,
    "class" TEXT,
    kind TEXT NOT NULL DEFAULT 'infer',
    client TEXT,
    wait_s REAL,
    outcome TEXT,
    source TEXT
);
CREATE INDEX IF NOT EXISTS requests_t ON requests (t);
CREATE TABLE IF NOT EXISTS docs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS intents (model TEXT PRIMARY KEY, tier TEXT NOT NULL);
PRAGMA user_version = {SCHEMA_VERSION};
"""
_INSERT = f"INSERT INTO requests ({_COLUMNS}) VALUES ({', '.join('?' for _ in RECORD_FIELDS)})"
_SELECT_PAGE = f"SELECT id, {_COLUMNS} FROM requests WHERE (t, id) > (?, ?) AND t < ? ORDER BY t, id LIMIT ?"
# SQLite sorts text and blobs after every number, so a row whose t is not a number (a damaged file, a
# hand edit) is in no time range: this finds one through the index, which the pages would pass over.
_SELECT_NOT_A_TIME = "SELECT id, t FROM requests WHERE t >= ? ORDER BY t LIMIT 1"


def _read_only(e: sqlite3.Error) -> bool:
    """True for SQLite's "attempt to write a readonly database" and "unable to open database file"
    (a WAL file whose -shm this user cannot make)."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    return code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN)


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


def open_sqlite(url: str, *, create: bool = True) -> SQLiteStore:
    """Open (creating if needed, unless `create` is False) the SQLite store at `url`.

    StoreError when it cannot be opened, or when `create` is False and there is no file yet."""
    return SQLiteStore(parse_sqlite_url(url), url=url, create=create)


class SQLiteStore:
    """The `Store` protocol on one SQLite file (see the module docstring)."""

    def __init__(self, path: str | Path, *, url: str | None = None, create: bool = True) -> None:
        """Open `path` (":memory:" for a private in-memory database), creating folders and schema.
        With `create` False a missing file is an error and nothing is created (a mistyped path given
        to a read-only command must not become a new, empty store).

        Raises:
            StoreError: the folder cannot be created, the file is not a usable database, or it does
                not exist and `create` is False.
        """
        self.path = str(path)
        self.url = url if url is not None else f"sqlite:///{self.path}"
        self._lock = threading.Lock()
        self._closed = False
        if not create and self.path != ":memory:" and not Path(self.path).exists():
            raise StoreError(self.url, f"no store at {self.path} (nothing recorded yet?)")
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(self.url, f"cannot create the folder for the database: {e}") from None
        try:
            self._conn = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(self.url, f"cannot open the database: {e}") from None
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
            self._closed = True
            if isinstance(e, StoreError):
                raise
            raise StoreError(self.url, f"cannot open the database: {e}") from None
        logger.debug("opened sqlite store %s", self.url)

    def _init_schema(self, create: bool, *, immutable: bool = False) -> None:
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise StoreError(
                self.url, f"schema version {version} is newer than this program's ({SCHEMA_VERSION})"
            )
        if version < SCHEMA_VERSION and not create:  # a read-only command writes nothing
            raise StoreError(
                self.url,
                f"{self.path} holds no residency store (an empty file, or another program's database)",
            )
        if immutable:
            return
        (mode,) = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode != "wal" and self.path != ":memory:":
            logger.warning("sqlite store %s: journal_mode is %s, not wal", self.url, mode)
        self._conn.execute("PRAGMA synchronous=NORMAL")
        if version < SCHEMA_VERSION:  # a store at this version has its tables: nothing to write
            self._conn.executescript(_SCHEMA)  # (so a user who may only read it can export it)

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

    def requests(self, since: float, until: float | None = None) -> Iterator[dict[str, Any]]:
        if math.isnan(since) or (until is not None and math.isnan(until)):
            raise ValueError(f"requests: since and until must be numbers, got {since!r}, {until!r}")
        hi = math.inf if until is None else float(until)
        key: tuple[float, int] = (float(since), -1)
        with self._db("read requests") as db:
            bad = db.execute(_SELECT_NOT_A_TIME, (math.inf,)).fetchone()
        if bad is not None:
            raise StoreError(self.url, f"requests row id={bad[0]} is corrupt: 't' is {bad[1]!r}, not a time")
        while True:
            with self._db("read requests") as db:
                page = db.execute(_SELECT_PAGE, (*key, hi, PAGE)).fetchall()
            for row in page:
                yield self._record(row)
            if len(page) < PAGE:
                return
            key = (page[-1][1], page[-1][0])

    def _record(self, row: tuple[Any, ...]) -> dict[str, Any]:
        rec = {c: v for c, v in zip(RECORD_FIELDS, row[1:], strict=True) if v is not None}
        try:
            return normalize_record(rec)
        except ValueError as e:
            raise StoreError(self.url, f"requests row id={row[0]} is corrupt: {e}") from None

    def count_requests(self) -> int:
        with self._db("count requests") as db:
            (n,) = db.execute("SELECT COUNT(*) FROM requests").fetchone()
        return int(n)

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
            row = db.execute("SELECT value FROM docs WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        if not isinstance(row[0], str | bytes):
            raise CorruptDocument(self.url, f"document {key!r} is corrupt: stored as {type(row[0]).__name__}")
        return decode_doc(self.url, key, row[0])

    def set_intent(self, model: str, tier: str) -> None:
        check_intent(model, tier)
        with self._db(f"set intent for {model!r}") as db, db:
            db.execute(
                "INSERT INTO intents (model, tier) VALUES (?, ?) "
                "ON CONFLICT (model) DO UPDATE SET tier = excluded.tier",
                (model, tier),
            )

    def intents(self) -> dict[str, str]:
        with self._db("read intents") as db:
            rows = db.execute("SELECT model, tier FROM intents ORDER BY model").fetchall()
        out: dict[str, str] = {}
        for model, tier in rows:
            try:
                check_intent(model, tier)
            except ValueError as e:
                raise StoreError(self.url, f"intent for {model!r} is corrupt: {e}") from None
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
        logger.debug("closed sqlite store %s", self.url)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.url!r})"
