"""The store seam: what the service keeps between restarts, and the checks every backend shares.

Primitives, in the order the service meets them:
  Store          - the Protocol both backends (SQLite, Redis) implement; `open_store(url)` picks one.
  StoreError     - the backend cannot do what was asked (unreachable, corrupt row/entry, bad url);
                   its message names the url (never a password; a relative SQLite path with the
                   file it resolves to, `store_location`) and what is wrong.
  store_location - a store url as printed: password hidden, a relative SQLite path followed by the
                   absolute file it opens from the working folder.
  CorruptDocument - a StoreError: the backend answers, but the document it holds is unreadable
                   (replacing it with `put_doc` works; waiting for the store does not).
  OnCorrupt      - what a reader of the request log that can do without a corrupt row gives
                   `requests` (`on_corrupt`): told of each one, which is left out of the read.
  normalize_record - validates one request record and returns its canonical form.
  encode_doc / decode_doc, check_intent - the same for JSON documents and tier intents.

Request records (the request log) are the ▶ request-trace form of docs/ARCHITECTURE.md plus three
service extras, and nothing else, so the log can never hold payloads:
  trace keys: "t" (float Unix seconds, required), "model" (str, required), "busy_s" (float >= 0,
              required), "class" (str), "kind" ("infer" | "session"), "client" (str)
  extras:     "wait_s" (float >= 0), "outcome" ("ok" | "rejected" | "error" | "cancelled" | "unserved"),
              "source" (str)
The trace keys are checked by `manager.replay.trace.parse_line`, the very validator `read_trace` uses,
so whatever the store accepts exports to a valid trace (and its line is no longer than `read_trace`
reads). Strings must be text a store can keep (UTF-8: no lone surrogate, which `json.loads` makes of
a `"\ud800"` escape in a damaged journal line, and which every later write would fail on).
Canonical form: floats for numbers, keys whose value is None dropped, and "kind" dropped when it is
the default "infer" (as `request_to_json` does).

Errors: invalid input is a ValueError naming the key (the caller's bug); a backend that cannot serve
is a StoreError. `ping()` never raises.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from manager.replay.trace import (
    ALLOWED_FIELDS,
    MAX_LINE_CHARS,
    keep_alive_json,
    keep_alive_of_json,
    parse_line,
    parse_object,
    request_to_json,
)
from manager.store.redis_url import redact

__all__ = [
    "EXTRA_FIELDS",
    "NEVER_RAN",
    "OUTCOMES",
    "RECORD_FIELDS",
    "STORE_ID_DOC",
    "TIERS",
    "CorruptDocument",
    "OnCorrupt",
    "Store",
    "StoreError",
    "StoreId",
    "check_intent",
    "decode_doc",
    "encode_doc",
    "normalize_record",
    "read_store_id",
    "record_keep_alive",
    "redact",
    "store_location",
]

TIERS: tuple[str, ...] = ("gpu", "host", "disk")
OUTCOMES: tuple[str, ...] = ("ok", "rejected", "error", "cancelled", "unserved")
NEVER_RAN: frozenset[str] = frozenset({"rejected", "unserved"})
"""The outcomes of requests that never ran (`busy_s` 0): `rejected` (admission refused it: it can
never fit, a full queue, no room within its class's max_wait, the service still starting at its
deadline, a world model running a session) and `unserved` (admitted, it never ran: its model's load
failed or outlasted its deadline, its client left while it waited, a session's open failed). They
are demand (the statistics', which a kill's catch-up rebuilds from the log), not use: `ok`, `error`
and `cancelled` ran; `trace export` leaves them out."""
EXTRA_FIELDS: tuple[str, ...] = ("wait_s", "outcome", "source")
RECORD_FIELDS: tuple[str, ...] = ALLOWED_FIELDS + EXTRA_FIELDS
_TRACE_SET = frozenset(ALLOWED_FIELDS)
_RECORD_SET = frozenset(RECORD_FIELDS)
_PLAIN = frozenset({str, int, float})  # exact types (not bool, not numpy scalars)


def store_location(url: str) -> str:
    """`url` as the store's location is printed (the start line, `tune --from-store`, errors): a
    Redis url with its password hidden (`redact`); a sqlite url whose PATH is relative (SQLAlchemy's
    convention: `sqlite:///tmp/x.db` is ./tmp/x.db, `sqlite:////tmp/x.db` is /tmp/x.db) followed by
    the absolute file it opens from this working folder, `sqlite:///tmp/x.db (/srv/tmp/x.db)`, so
    that it is not read as /tmp/x.db; any other url as it is."""
    if not url.startswith("sqlite:///"):
        return redact(url) if url.startswith(("redis://", "rediss://")) else url
    path = url.removeprefix("sqlite:///").partition("?")[0].partition("#")[0]
    if not path or path == ":memory:" or os.path.isabs(path):
        return url
    return f"{url} ({os.path.abspath(path)})"


class StoreError(Exception):
    """The store at `url` cannot do what was asked; `reason` says why (the message has both: a
    relative SQLite path with the file it resolves to, `store_location`)."""

    def __init__(self, url: str, reason: str) -> None:
        shown = store_location(url) if url.startswith("sqlite:///") else url  # (callers redact Redis')
        super().__init__(f"store {shown}: {reason}")
        self.url = url
        self.reason = reason


class CorruptRow(StoreError):
    """One row the store holds is unreadable (its others are read): `key` is its key as stored, which
    `Store.drop_intent` takes to remove a damaged intent."""

    def __init__(self, url: str, reason: str, key: object) -> None:
        super().__init__(url, reason)
        self.key = key


class CorruptDocument(StoreError):
    """The store answers, but the document it holds under a key is not a readable JSON object."""


OnCorrupt = Callable[[StoreError], None]
"""`Store.requests`'s `on_corrupt`: told of each corrupt row/entry that the read leaves out."""


@runtime_checkable
class Store(Protocol):
    """Request log, JSON documents and tier intents, kept across restarts.

    Thread safety: every method may be called from several threads at once. `requests` reads in
    pages, so other calls may run while a caller iterates (records appended meanwhile may or may
    not be seen).
    """

    url: str
    """Where the data lives: the url given to `open_store` (Redis: normalized, password as ***)."""

    def append_requests(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append request records, served or never run (see the module docstring for the keys).

        All records are checked before any is written. Raises ValueError naming the first bad key
        or value; StoreError when the backend fails.
        """
        ...

    def requests(
        self, since: float, until: float | None = None, *, on_corrupt: OnCorrupt | None = None
    ) -> Iterator[dict[str, Any]]:
        """Canonical records with since <= t < until (no upper bound when None), in time order;
        equal times keep the order they were appended in. StoreError names a corrupt row/entry;
        given `on_corrupt`, each corrupt row/entry the read meets is passed to it instead (the
        StoreError that would have been raised: it names the row or entry) and left out, and the read
        goes on: for a reader that can do without it (the journal's replay at a start)."""
        ...

    def count_requests(self) -> int:
        """How many request records the log holds."""
        ...

    def trim_requests(self, before: float) -> int:
        """Delete every record with t < `before` (the request log's retention), no other; returns
        how many went. Done in bounded steps, so that writers and readers are not held up for long
        (records appended meanwhile are never deleted unless older than `before`). ValueError when
        `before` is not a number; StoreError when the backend fails (the steps done stay done)."""
        ...

    def put_doc(self, key: str, doc: dict[str, Any]) -> None:
        """Store (replace) JSON document `key`: stats snapshots, load-cost tables, config versions."""
        ...

    def get_doc(self, key: str) -> dict[str, Any] | None:
        """Document `key`, or None when there is none. StoreError if it is not a JSON object."""
        ...

    def store_id(self) -> str:
        """This store's own identity: a random id made at the first ask and kept in it (document
        STORE_ID_DOC), so that it is the same store however its url is spelled or wherever its file
        is moved (the request journal sends its records to their own store only). StoreError when
        the backend fails or the document is not one. The backends give a `StoreId`, which also says
        whether this very ask made the id, and where the store is (a plain str: neither known, taken
        as not made)."""
        ...

    def set_aside_doc(self, key: str) -> str | None:
        """Move document `key` as stored (read or not) to ``<key>.corrupt-<UTC time>`` and return that
        key; None when there is no document `key`. For a `CorruptDocument` about to be replaced: its
        bytes are kept for a person to look at, not overwritten."""
        ...

    def set_intent(self, model: str, tier: str) -> None:
        """Record the tier (gpu | host | disk) the manager intends `model` to be in."""
        ...

    def intents(self, *, on_corrupt: OnCorrupt | None = None) -> dict[str, str]:
        """Every recorded intent, model -> tier. CorruptRow (a StoreError) names a corrupt one; given
        `on_corrupt`, each corrupt one is passed to it instead and left out (the others are read)."""
        ...

    def drop_intent(self, key: object) -> None:
        """Forget the intent recorded under `key` (a model's name, or a damaged row's key as its
        CorruptRow holds it); nothing when there is none."""
        ...

    def ping(self) -> bool:
        """True when the backend answers; False (never an exception) when it does not."""
        ...

    def refused(self) -> str | None:
        """Why the backend refuses this store for good (a wrong password, a database it does not
        have, a key of its that holds another program's data), which no wait for it to come back
        mends; None when it answers or is only down."""
        ...

    def close(self) -> None:
        """Release connections/files; idempotent. Later calls raise StoreError (ping: False)."""
        ...


def _finite_non_negative(record: Mapping[str, Any], key: str) -> float | None:
    v = record.get(key)
    if v is None:
        return None
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    raise ValueError(f"request field {key!r} must be a finite number >= 0, got {v!r}")


def _text(what: str, v: str) -> None:
    """ValueError naming `what` unless `v` can be written as UTF-8 (what SQLite and Redis store)."""
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid text ({e.reason} at position {e.start})") from None


def _extras(record: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    wait_s = _finite_non_negative(record, "wait_s")
    if wait_s is not None:
        out["wait_s"] = wait_s
    outcome = record.get("outcome")
    if outcome is not None:
        if outcome not in OUTCOMES:
            raise ValueError(f"request field 'outcome' must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        out["outcome"] = outcome
    source = record.get("source")
    if source is not None:
        if not isinstance(source, str):
            raise ValueError(f"request field 'source' must be a string, got {source!r}")
        _text("request field 'source'", source)
        out["source"] = source
    return out


STORE_ID_DOC = "store_id"
"""The document holding the store's own identity (`Store.store_id`)."""


class StoreId(str):
    """A store's id as `Store.store_id` gives it, with `made`, whether that ask made it, and `where`,
    where the store is reached (its file's real path; the Redis server, db and prefix: never a
    password). A store whose id was only just made where another id was before is the same store
    come back empty (a Redis restarted without its data, as a Redis kept without persistence is; a
    database file moved aside and made anew): the records a request journal kept for it under its
    earlier id (the store down at a stop) are its own, not another store's to set aside
    (`RequestJournal.claim`); a new store elsewhere (a config switched to a store of its own) is
    not. A str, so a caller that only wants the id needs nothing more."""

    made: bool
    where: str | None

    def __new__(cls, sid: str, *, made: bool = False, where: str | None = None) -> StoreId:
        self = super().__new__(cls, sid)
        self.made = made
        self.where = where
        return self


def read_store_id(url: str, doc: dict[str, Any] | None) -> str:
    """The id in a STORE_ID_DOC document; CorruptDocument when there is none that is one."""
    sid = doc.get("id") if doc is not None else None
    if not isinstance(sid, str) or not sid or not sid.isascii() or not sid.isalnum():
        raise CorruptDocument(url, f"document {STORE_ID_DOC!r} holds no store id")
    return sid


def record_keep_alive(record: Mapping[str, Any]) -> float | None:
    """A normalized record's own keep-alive in seconds (inf: forever), or None."""
    return keep_alive_of_json(record.get("keep_alive"))


def normalize_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical form of one request record (see the module docstring).

    Raises:
        ValueError: not a mapping, an unknown key (named), or a bad value (key and value named).
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a request record must be a dict, got {type(record).__name__}")
    unknown = [k for k in record if k not in _RECORD_SET]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(f"unknown request field {names} (allowed: {', '.join(RECORD_FIELDS)})")
    trace = {k: v for k, v in record.items() if k in _TRACE_SET and v is not None}
    plain = all(type(v) in _PLAIN for v in trace.values())  # what JSON would give back unchanged
    line = ""
    if not plain:  # anything else goes through JSON, as the trace it exports to will
        try:
            line = json.dumps(trace)
        except (TypeError, ValueError) as e:
            raise ValueError(f"request record is not plain JSON data: {e}") from None
    try:
        r = parse_object(trace) if plain else parse_line(line, 0)
    except ValueError as e:
        raise ValueError(f"request record: {e}") from None
    text = 0
    for key, v in (("model", r.model), ("class", r.cls), ("client", r.client)):
        if v is not None:
            _text(f"request field {key!r}", v)
            text += len(v)
    # (12 characters for one: "\ud83d\ude00"; a line and its newline are at most MAX_LINE_CHARS)
    if text * 12 + 200 >= MAX_LINE_CHARS and len(request_to_json(r)) >= MAX_LINE_CHARS:
        raise ValueError(
            f"request record: its trace line would be longer than {MAX_LINE_CHARS - 1} characters, "
            "which a trace reader refuses"
        )
    out: dict[str, Any] = {"t": r.t, "model": r.model, "busy_s": r.busy_s}
    if r.cls is not None:
        out["class"] = r.cls
    if r.kind != "infer":
        out["kind"] = r.kind
    if r.client is not None:
        out["client"] = r.client
    if r.keep_alive is not None:  # (as a trace line writes it: forever as "forever", JSON has no inf)
        out["keep_alive"] = keep_alive_json(r.keep_alive)
    out.update(_extras(record))
    return out


def encode_doc(key: str, doc: Mapping[str, Any]) -> str:
    """Document `doc` as compact JSON. ValueError (naming `key`) for a bad key or a non-JSON doc."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a document key must be a non-empty string, got {key!r}")
    _text(f"document key {key!r}", key)
    if not isinstance(doc, Mapping):
        raise ValueError(f"document {key!r} must be a dict, got {type(doc).__name__}")
    try:
        return json.dumps(doc, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"document {key!r} is not plain JSON data: {e}") from None


def aside_key(key: str) -> str:
    """Where `Store.set_aside_doc` keeps document `key`: ``<key>.corrupt-<UTC time, microseconds>``."""
    return f"{key}.corrupt-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"


def decode_doc(url: str, key: str, text: str | bytes) -> dict[str, Any]:
    """Parse a stored document; StoreError naming `key` when it is not a JSON object."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptDocument(url, f"document {key!r} is corrupt: {e or type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise CorruptDocument(url, f"document {key!r} is corrupt: not a JSON object")
    return doc


def check_intent(model: str, tier: str) -> None:
    """ValueError unless `model` is a non-empty string and `tier` one of gpu, host, disk."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"a model name must be a non-empty string, got {model!r}")
    _text(f"model name {model!r}", model)
    if tier not in TIERS:
        raise ValueError(f"tier for {model!r} must be one of {', '.join(TIERS)}, got {tier!r}")
