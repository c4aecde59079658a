"""The Redis store: `redis://[:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]` (or `rediss://` for TLS).

TLS (`rediss://` only) takes redis-py's query names: `ssl_ca_certs=CA.pem` (the CA that signed the
server's certificate; default: the system's), `ssl_certfile=CLIENT.pem` and `ssl_keyfile=CLIENT.key`
(a client certificate, which Redis asks for unless `tls-auth-clients no`; the key unencrypted) and
`ssl_cert_reqs=none|optional|required` (default required). `open_redis` checks that the files load.

Keys, under a prefix (default `residency`, or `?prefix=` in the url):
  <prefix>:requests      a Stream, one entry per request: field `data` = the canonical record as JSON.
                         Entry ids are `<ms>-<seq>` with ms = floor(t * 1000), so XRANGE by time
                         finds a range without a scan.
  <prefix>:requests:lag  a sorted set: member `late_ms`, the most (ms) an entry's id was ever ahead
                         of its t (kept for earlier versions, which widen every read by it);
                         `tracked_from`, the newest id's ms when this version first wrote (absent:
                         it never has), and `legacy_ms`, late_ms then: entries at or below that ms
                         may be that late; the ones above it are in `:requests:late`.
  <prefix>:requests:late a sorted set, one member per hour (of the records' t) that holds a late
                         entry: score the hour (floor(t_ms / LATE_HOUR_MS)), member `<hour>:<late_ms>`,
                         the most an entry of that hour is late. Trimmed with the log it describes.
  <prefix>:docs          a Hash, document key -> JSON object.
  <prefix>:intents       a Hash, model -> tier.
  <prefix>:requests:batch:<token>  a short-lived marker per batch written (see _BATCH_KEY).

Late records: a stream's ids only grow, so a record whose t is earlier than the newest entry (two
threads finishing out of order, or out of order in one batch, or a journal sent at a restart) gets the
newest entry's ms instead, and its lateness is kept for the hour of its t in `:requests:late`.
`requests()` widens its XRANGE by the lateness of the hours its range covers (not by one record's,
hours late, for ever: each read by what can fall in it), filters on the exact t, and re-orders through
a small heap: entries come back in time order all the same, and when nothing was late the heap holds
at most one page. A store written by an earlier version (late_ms alone) is read as it read it, for the
entries written then; `trim_requests` lets the lateness of the hours it empties go.

Primitives: parse_redis_url (url -> connection settings, display url, prefix; the url rules are
redis_url.py's, which the config check shares), open_redis (url ->
RedisStore; connects lazily), RedisStore (the `Store` protocol over an injected redis client).

Errors: any Redis or socket failure is a StoreError whose url has the password replaced by ***;
`ping()` returns False instead. A key of another type than the store keeps there (WRONGTYPE) is named
with its type, in the same words whatever the Redis version. `refused()` tells a login, a database, a
server certificate or a client certificate (missing, or not trusted) that the server refuses for good
from an outage, and a key of the store's that holds another program's data. Thread safety: redis-py
clients are thread-safe (a connection pool); a batch is one Lua script (read the newest id, place the
ids, add the entries), which Redis runs whole: all of it is written or none, and racing writers cannot
interleave with it.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import re
import socket
import ssl
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from manager.replay.trace import MAX_T
from manager.store.base import (
    STORE_ID_DOC,
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
from manager.store.redis_url import DEFAULT_PREFIX, TLS_FILES, hide_userinfo, shown_redis_url, split_redis_url

__all__ = ["DEFAULT_PREFIX", "PAGE", "TRIM_CHUNK", "RedisStore", "RedisURL", "open_redis", "parse_redis_url"]

logger = logging.getLogger(__name__)

PAGE = 1000


LATE_HOUR_MS = 3_600_000
"""The request log's lateness is kept per hour of the records' t (`<prefix>:requests:late`)."""


# One batch of the request log, as one script: Redis runs it whole, with no other command between,
# so a batch is written all or none and its ids need no retry when writers race. KEYS: the stream, the
# lag set, the call's own key (see _BATCH_KEY) and the lateness per hour; ARGV: ms, json, ms, json, ...
# Every id is placed, and every key read, before anything is written: an XADD at an id above the newest
# one cannot fail, so an error (a key of the wrong type) comes before any write. Only commands and
# forms of Redis 5 (streams): the script numbers the ids itself (`<ms>-*` is Redis 7), compares the
# lag with ZSCORE (ZADD GT is 6.2) and finds an hour's member with ZRANGEBYSCORE, so a Redis 6
# (Ubuntu 22.04, Debian 11) writes a batch whole too. Hours go in the order met (not `pairs`).
_APPEND_LUA = """
local last, seq = 0, 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      local m, s = string.match(info[i + 1], '^(%d+)-(%d+)$')
      last, seq = tonumber(m), tonumber(s)
    end
  end
end
local newest = last  -- entries at or below this ms were written before this batch
local late, ids, hours, most = 0, {}, {}, {}
for i = 1, #ARGV, 2 do
  local ms = tonumber(ARGV[i])
  if ms > last then last, seq = ms, 0 else seq = seq + 1 end
  local d = last - ms
  if d > 0 then
    if d > late then late = d end
    local h = math.floor(ms / HOUR_MS)
    if most[h] == nil then hours[#hours + 1] = h; most[h] = d elseif d > most[h] then most[h] = d end
  end
  ids[#ids + 1] = string.format('%.0f-%.0f', last, seq)
end
local lag = tonumber(redis.call('ZSCORE', KEYS[2], 'late_ms'))  -- a wrong type fails here, unwritten
local tracked = redis.call('ZSCORE', KEYS[2], 'tracked_from')
local held = {}
for k = 1, #hours do
  local h = string.format('%.0f', hours[k])
  held[k] = redis.call('ZRANGEBYSCORE', KEYS[4], h, h)  -- (and here)
end
-- KEYS[3] names this call: a copy of it that redis-py sent again (a timeout while Redis was busy, and
-- the first copy ran all the same) writes nothing
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', 600) then return -1 end
-- (numbers go to Redis through '%.0f': Lua's own conversion writes 1e+14 from 15 digits on)
if not tracked then  -- this version's first write: what is in the stream is as late as late_ms says
  redis.call('ZADD', KEYS[2], string.format('%.0f', newest), 'tracked_from', string.format('%.0f', lag or 0),
    'legacy_ms')
end
if late > 0 and (lag == nil or late > lag) then
  redis.call('ZADD', KEYS[2], string.format('%.0f', late), 'late_ms')
end
for k = 1, #hours do
  local h = hours[k]
  local d = most[h]
  for _, m in ipairs(held[k]) do
    local v = tonumber(string.match(m, '^%d+:(%d+)$'))
    if v ~= nil and v > d then d = v end
  end
  local member = string.format('%.0f:%.0f', h, d)
  for _, m in ipairs(held[k]) do  -- (one that is not HOUR:LATE_MS stays, for a read to name)
    if m ~= member and string.match(m, '^%d+:%d+$') then redis.call('ZREM', KEYS[4], m) end
  end
  redis.call('ZADD', KEYS[4], string.format('%.0f', h), member)
end
for k = 1, #ids do
  redis.call('XADD', KEYS[1], ids[k], 'data', ARGV[2 * k])
end
return late
""".replace("HOUR_MS", str(LATE_HOUR_MS))


# One step of `trim_requests`: up to ARGV[2] of the oldest entries with ids up to ARGV[1] (inclusive;
# a bare ms is that ms's last id) deleted, as one script (no entry data leaves Redis); returns how many
# went. XRANGE and XDEL, as Redis 5 has them (XTRIM MINID is 6.2), a bounded step at a time: one
# XTRIM of years of entries would hold the server for its whole length.
_TRIM_LUA = """
local entries = redis.call('XRANGE', KEYS[1], '-', ARGV[1], 'COUNT', tonumber(ARGV[2]))
if #entries == 0 then return 0 end
local ids = {}
for i = 1, #entries do ids[i] = entries[i][1] end
return redis.call('XDEL', KEYS[1], unpack(ids))
"""
TRIM_CHUNK = 1000
"""Entries deleted per step of `trim_requests` (each step one script, which Redis runs whole)."""


_BATCH_KEY = "{prefix}:requests:batch:{token}"
"""Set (for 10 minutes) by the batch whose digest is `token`: redis-py sends a command again when it
timed out, and Redis may run both copies (it reads a socket only between commands: a busy or paused
server runs the first copy late); so does the service, which sends a batch the store failed again,
as it was. The second copy finds the key and writes nothing. (Two batches of the same records within
10 minutes would be one: records of the same requests, to the microsecond.)"""


def _ms(t: float) -> int:
    """Stream id milliseconds for time `t`: monotone in t, so ranges by ms never miss a record."""
    return math.floor(t * 1000)


_LATE_MEMBER = re.compile(r"(\d{1,15}):(\d{1,15})")
"""A member of `<prefix>:requests:late`: HOUR:LATE_MS."""


@dataclass(frozen=True)
class _Lateness:
    """How far (ms) the entries a read can meet may have their ids ahead of their records' t.

    An entry whose record's t is in an hour of `hours` is at most that hour's late_ms late; in another
    hour, not late (its id is its t's ms), unless it is at or below `legacy_upto` (written before this
    version kept the lateness per hour: then up to `legacy_ms`; None: every entry). `unknown`: the
    lateness could not be read (told to on_corrupt): any entry may be any late."""

    hours: tuple[tuple[int, int, str], ...] = ()
    """(hour, late_ms, member as stored) by hour: the hours that hold a late entry, of those read."""
    legacy_upto: int | None = None
    legacy_ms: int = 0
    unknown: bool = False

    def end(self, until_ms: int) -> int | None:
        """The highest id ms an entry of a record with t_ms <= until_ms may have (of the hours read);
        None when there is no telling."""
        if self.unknown:
            return None
        end = until_ms + max((late for _, late, _ in self.hours), default=0)
        legacy = until_ms + self.legacy_ms
        return max(end, legacy if self.legacy_upto is None else min(self.legacy_upto, legacy))


class _Floor:
    """For a read going up the stream: the lowest t_ms that an entry not read yet may have."""

    def __init__(self, lateness: _Lateness) -> None:
        self._late = lateness
        self._next = 0  # the first hour of lateness.hours not yet begun
        self._open: list[tuple[int, int, int]] = []  # (first ms, last ms, late_ms) of hours begun

    def at(self, last_ms: int) -> float:
        """The lowest t_ms of an entry whose id is above one of `last_ms` (the newest read): its own
        ms less its lateness, at the least; -inf when the lateness is unknown."""
        late = self._late
        if late.unknown:
            return -math.inf
        floor = last_ms
        if late.legacy_upto is None or last_ms <= late.legacy_upto:
            floor -= late.legacy_ms
        hours = late.hours
        while self._next < len(hours) and hours[self._next][0] * LATE_HOUR_MS <= last_ms:
            hour, ms, _ = hours[self._next]
            self._open.append((hour * LATE_HOUR_MS, (hour + 1) * LATE_HOUR_MS - 1, ms))
            self._next += 1
        # an hour whose entries all have ids below last_ms (read, all of them) bounds nothing more
        self._open = [h for h in self._open if h[1] + h[2] >= last_ms]
        for first, _, ms in self._open:
            floor = min(floor, max(first, last_ms - ms))
        return floor


@dataclass(frozen=True)
class RedisURL:
    """A parsed redis url: connection settings, the url to show (no password) and the key prefix."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    ssl: bool
    prefix: str
    display: str
    ssl_ca_certs: str | None = None
    """rediss:// only: the CA file (PEM) that signed the server's certificate; None: the system's."""
    ssl_certfile: str | None = None
    """rediss:// only: the client certificate (PEM; Redis asks for one unless tls-auth-clients no)."""
    ssl_keyfile: str | None = None
    """rediss:// only: the client certificate's key, when ssl_certfile does not hold it."""
    ssl_cert_reqs: str = "required"
    """rediss:// only: none, optional or required: whether the server's certificate is checked."""


def _check_tls_files(u: RedisURL) -> None:
    """StoreError naming the parameter and path of a TLS file that cannot be read or used (a CA file
    or a client certificate and key that do not load): such a url never connects, and a failed
    handshake would otherwise look like a server that is down."""
    for name in TLS_FILES:
        path = getattr(u, name)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise StoreError(u.display, f"{name}: cannot read {path!r}: {e.strerror or e}") from None
    ctx = ssl.create_default_context()
    try:
        if u.ssl_ca_certs is not None:
            ctx.load_verify_locations(cafile=u.ssl_ca_certs)
    except ssl.SSLError as e:
        raise StoreError(
            u.display, f"ssl_ca_certs: {u.ssl_ca_certs!r} holds no usable PEM certificate: {e}"
        ) from None
    try:
        if u.ssl_certfile is not None:
            # An empty password: an encrypted key fails here instead of OpenSSL asking on the terminal.
            ctx.load_cert_chain(certfile=u.ssl_certfile, keyfile=u.ssl_keyfile, password=lambda: b"")
    except ssl.SSLError as e:
        files = repr(u.ssl_certfile) + (
            "" if u.ssl_keyfile is None else f" and ssl_keyfile {u.ssl_keyfile!r}"
        )
        raise StoreError(
            u.display, f"ssl_certfile {files}: not a PEM certificate and its unencrypted key: {e}"
        ) from None


def parse_redis_url(url: str) -> RedisURL:
    """Parse `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]`; StoreError when it is bad
    (the rules: redis_url.py, which the config check uses too).

    The user info is the authority's (RFC 3986): an "@" in the query is the query's. A password may
    still hold "/", "#", "?" or "@" as password tools make them (`openssl rand -base64`) where the
    url cannot be read otherwise (redis_url.py says how); "%XX" in it is decoded.
    """
    try:
        parts = split_redis_url(url)
    except ValueError as e:
        raise StoreError(shown_redis_url(url), str(e)) from None
    username, colon, password = (parts.userinfo or "").partition(":")
    prefix = parts.params.get("prefix", DEFAULT_PREFIX)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    query = "" if prefix == DEFAULT_PREFIX else f"?prefix={prefix}"
    return RedisURL(
        host=parts.hostname,
        port=parts.port,
        db=parts.db,
        username=unquote(username) if username else None,
        password=unquote(password) if colon else None,
        ssl=parts.tls,
        prefix=prefix,
        # (built from the parts, not by `redact`, which takes an "@" in the query for the user info's)
        display=f"{parts.scheme}://{hide_userinfo(parts.userinfo)}{host}:{parts.port}/{parts.db}{query}",
        ssl_ca_certs=parts.params.get("ssl_ca_certs"),
        ssl_certfile=parts.params.get("ssl_certfile"),
        ssl_keyfile=parts.params.get("ssl_keyfile"),
        ssl_cert_reqs=parts.params.get("ssl_cert_reqs", "required"),
    )


def open_redis(url: str, *, timeout_s: float = 5.0) -> RedisStore:
    """A RedisStore for `url`. Connects lazily: an unreachable server shows as ping() False and as
    StoreError from the other methods, so a service can start before its Redis does."""
    u = parse_redis_url(url)
    tls: dict[str, Any] = {}
    if u.ssl:
        _check_tls_files(u)
        tls = {
            "ssl_ca_certs": u.ssl_ca_certs,
            "ssl_certfile": u.ssl_certfile,
            "ssl_keyfile": u.ssl_keyfile,
            "ssl_cert_reqs": u.ssl_cert_reqs,
        }
    client = redis.Redis(
        host=u.host,
        port=u.port,
        db=u.db,
        username=u.username,
        password=u.password,
        ssl=u.ssl,
        **tls,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        # A couple of quick retries ride out a blip; redis-py's default (10, up to 1 s apart) would
        # make ping() on a dead server take seconds.
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
    )
    return RedisStore(client, url=u.display, prefix=u.prefix, tls=u if u.ssl else None, timeout_s=timeout_s)


PROBE_S = 2.0
"""How long `ping()` and `refused()` wait for the server's answer to their PING (once, not retried)."""

_NOT_READY = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN")
"""Error replies of a server that is busy or not ready yet (a script running, a dataset loading, a
replica without its master): an outage, which the service rides out, not a refusal for good."""

_CERT_ALERTS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",  # TLS 1.3: no client certificate
        "SSLV3_ALERT_HANDSHAKE_FAILURE",  # TLS 1.2: no client certificate (or nothing in common)
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_ACCESS_DENIED",
        "TLSV1_ALERT_DECRYPT_ERROR",
    }
)
"""TLS alerts with which a server refuses this client's certificate (or its lack): for good."""

_CLIENT_CERT = "?ssl_certfile=CLIENT.pem&ssl_keyfile=CLIENT.key"
_VERIFY = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _tls_refusal(u: RedisURL, timeout_s: float) -> str | None:
    """Why the TLS server of `u` refuses this client for good, from the alert with which it ends a
    bare handshake (no client certificate, or one it does not trust); None when it sends none (it is
    down, or it takes the handshake). Sends no password and no command: the handshake, then a read.
    Under TLS 1.3 a server sends that alert only after the handshake, and a client that writes first
    (redis-py sends its first command) may find the socket closed and the alert lost: an SSLEOFError,
    which looks like an outage."""
    try:
        ctx = ssl.create_default_context(cafile=u.ssl_ca_certs)
        ctx.check_hostname = False  # the ping that failed checked the name (a mismatch is said first)
        ctx.verify_mode = _VERIFY[u.ssl_cert_reqs]
        if u.ssl_certfile is not None:
            ctx.load_cert_chain(u.ssl_certfile, u.ssl_keyfile, password=lambda: b"")
        with (
            socket.create_connection((u.host, u.port), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw, server_hostname=u.host) as conn,
        ):
            conn.recv(1)  # a server that took the handshake waits for a command: a timeout
        return None
    except ssl.SSLError as e:
        reason = e.reason
        if reason not in _CERT_ALERTS:
            return None
        alert = reason.split("_ALERT_", 1)[1].lower().replace("_", " ")  # "certificate required"
    except OSError:
        return None
    if u.ssl_certfile is not None:
        return (
            f"the server does not accept the client certificate {u.ssl_certfile!r} (TLS alert: "
            f"{alert}) (store.url: ssl_certfile must be signed by a CA the server trusts, its "
            "tls-ca-cert-file, and not expired)"
        )
    if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return (
            f"the server asks for a client certificate and store.url gives none (TLS alert: {alert}) "
            f"(store.url: add {_CLIENT_CERT}, signed by a CA the server trusts)"
        )
    return (
        f"the server ends the TLS handshake (TLS alert: {alert}): it most likely asks for a client "
        f"certificate and store.url gives none (store.url: add {_CLIENT_CERT}, signed by a CA the "
        "server trusts)"
    )


def _text(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


class RedisStore:
    """The `Store` protocol on Redis (see the module docstring). `client` must not decode responses."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        tls: RedisURL | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """`tls`: the parsed rediss:// url the client was made from, for `refused` to ask a TLS
        server why it ends the connection (see _tls_refusal); `timeout_s` bounds that question."""
        self.url = url
        self.prefix = prefix
        self._client = client
        self._closed = False
        self._tls = tls
        self._timeout_s = timeout_s
        self.answered: bool | None = None
        """Whether the server answered `refused()`'s PING (None: not asked yet): a service told it did
        not tries none of its start's reads, each of which would wait for its own timeout."""
        self._requests_key = f"{prefix}:requests"
        self._lag_key = f"{prefix}:requests:lag"
        self._late_key = f"{prefix}:requests:late"
        self._docs_key = f"{prefix}:docs"
        self._intents_key = f"{prefix}:intents"
        self._types = {  # what each key holds, as Redis's TYPE names it
            self._requests_key: "stream",
            self._lag_key: "zset",
            self._late_key: "zset",
            self._docs_key: "hash",
            self._intents_key: "hash",
        }
        self._append = client.register_script(_APPEND_LUA)
        self._trim = client.register_script(_TRIM_LUA)

    @contextmanager
    def _errors(self, what: str) -> Iterator[redis.Redis]:
        """The client; Redis and socket errors become StoreError naming `what` and the url."""
        if self._closed:
            raise StoreError(self.url, f"{what}: the store is closed")
        try:
            yield self._client
        except redis.ResponseError as e:
            # Redis 6 wraps a script's WRONGTYPE in its own "Error running script" text; 7 does not
            if "WRONGTYPE" in str(e):
                raise StoreError(self.url, f"{what}: ResponseError: WRONGTYPE: {self._wrong_types()}") from e
            raise StoreError(self.url, f"{what}: {type(e).__name__}: {e}") from e
        except (redis.RedisError, OSError) as e:
            raise StoreError(self.url, f"{what}: {type(e).__name__}: {e}") from e

    def _wrong_types(self) -> str:
        """Which of this store's keys hold another kind of value than the store keeps there, and
        what to do: the message of a WRONGTYPE error, the same whatever the Redis version."""
        return self._wrong_types_in(self._key_types())

    def _key_types(self) -> dict[str, str]:
        """What each of this store's keys holds, as Redis's TYPE names it ({}: no answer)."""
        try:
            return {key: _text(self._client.type(key)) for key in self._types}
        except (redis.RedisError, OSError):
            return {}

    def _wrong_types_in(self, found: dict[str, str]) -> str:
        wrong = [
            f"{key} holds a {kind}, not a {self._types[key]}"
            for key, kind in found.items()
            if kind not in ("none", self._types[key])
        ]
        what = ", ".join(wrong) or f"a key under the prefix {self.prefix!r} holds another kind of value"
        return (
            f"{what} (another program's data under the prefix {self.prefix!r}? give this store its own "
            "?prefix=NAME in store.url)"
        )

    # ---- request log -----------------------------------------------------------------------------

    def append_requests(self, records: Sequence[Mapping[str, Any]]) -> None:
        rows = [(_ms(rec["t"]), json.dumps(rec)) for rec in map(normalize_record, records)]
        if not rows:
            return
        args: list[str | int] = [x for row in rows for x in row]
        # the batch's own digest: the same batch sent again (redis-py's resend after a timeout, or
        # the service's retry of a write that timed out) writes nothing once a copy of it has run
        digest = hashlib.sha256("\n".join(f"{ms} {row}" for ms, row in rows).encode()).hexdigest()
        batch_key = _BATCH_KEY.format(prefix=self.prefix, token=digest[:32])
        with self._errors("append requests") as r:
            keys = [self._requests_key, self._lag_key, batch_key, self._late_key]
            late = self._append(keys=keys, args=args, client=r)
        if late > 0:
            logger.debug("records up to %s ms late stored at later ids", late)

    def _corrupt(self, key: str, what: str) -> StoreError:
        return StoreError(
            self.url,
            f"{key} is corrupt: {what}; another program's data under the prefix {self.prefix!r}? give "
            "this store its own ?prefix=NAME in store.url",
        )

    def _lateness(
        self, r: redis.Redis, lo_ms: int | None, hi_ms: int | None, on_corrupt: OnCorrupt | None = None
    ) -> _Lateness:
        """How late the entries of records with lo_ms <= t_ms <= hi_ms (None: no bound) may be.
        StoreError naming the key when the lag set or the lateness per hour holds what no lateness is
        (an infinite or huge score, which no stream id can be widened by); given `on_corrupt`, it is
        told instead, and the lateness taken as unknown (the read goes to the stream's end)."""
        pipe = r.pipeline(transaction=False)
        pipe.zrange(self._lag_key, 0, -1, withscores=True)
        pipe.zrangebyscore(
            self._late_key,
            "-inf" if lo_ms is None else lo_ms // LATE_HOUR_MS,
            "+inf" if hi_ms is None else hi_ms // LATE_HOUR_MS,
        )
        lag, members = pipe.execute()
        try:
            return self._read_lateness(lag, members)
        except StoreError as e:
            if on_corrupt is None:
                raise
            on_corrupt(e)
            return _Lateness(unknown=True)

    def _read_lateness(self, lag: list[tuple[bytes, float]], members: list[bytes]) -> _Lateness:
        scores = {_text(m): v for m, v in lag}
        most = _ms(MAX_T)
        for name, top, what in (
            ("late_ms", most, "a lateness in ms"),
            ("legacy_ms", most, "a lateness in ms"),
            ("tracked_from", 2**64, "a stream id's ms"),
        ):
            v = scores.get(name)
            if v is not None and not 0 <= v <= top:  # (NaN, either infinity and negatives too)
                raise self._corrupt(self._lag_key, f"its {name} score {v!r} is not {what} (0 to {top})")
        hours = []
        for raw in members:
            m = _LATE_MEMBER.fullmatch(_text(raw))
            if m is None or int(m[2]) > most:
                raise self._corrupt(
                    self._late_key,
                    f"member {_text(raw)!r} is not HOUR:LATE_MS (a lateness in ms, 0 to {most})",
                )
            hours.append((int(m[1]), int(m[2]), _text(raw)))
        hours.sort()
        tracked = scores.get("tracked_from")
        if tracked is None:  # never written by this version: any entry may be as late as late_ms says
            return _Lateness(tuple(hours), None, max(int(scores.get("late_ms", 0)), 0))
        return _Lateness(tuple(hours), max(int(tracked), 0), max(int(scores.get("legacy_ms", 0)), 0))

    def requests(
        self, since: float, until: float | None = None, *, on_corrupt: OnCorrupt | None = None
    ) -> Iterator[dict[str, Any]]:
        if math.isnan(since) or (until is not None and math.isnan(until)):
            raise ValueError(f"requests: since and until must be numbers, got {since!r}, {until!r}")
        if since > MAX_T or (until is not None and until <= max(since, 0)):
            return  # no record has t outside [0, MAX_T] (nor a stream id for such a bound)
        lo = _ms(since) if since > 0 else 0
        hi = None if until is None or until > MAX_T else _ms(until)
        with self._errors("read requests") as r:
            lateness = self._lateness(r, lo, hi, on_corrupt)
        start = str(lo) if since > 0 else "-"
        stop = None if hi is None else lateness.end(hi)
        end = "+" if stop is None else str(stop)
        floor = _Floor(lateness)
        heap: list[tuple[float, int, dict[str, Any]]] = []  # (t, read order, record)
        n = 0
        while True:
            page = self._page(start, end, on_corrupt)
            for _, rec in page:
                if rec is not None and since <= rec["t"] and (until is None or rec["t"] < until):
                    heapq.heappush(heap, (rec["t"], n, rec))
                    n += 1
            if len(page) < PAGE:
                break
            last_id = page[-1][0]
            start = f"({last_id}"
            # Unread entries have ids above last_id: no t below `floor.at` its ms; 1 ms of slack
            # covers float rounding in t * 1000.
            floor_t = (floor.at(int(last_id.split("-", 1)[0])) - 1) / 1000
            while heap and heap[0][0] < floor_t:
                yield heapq.heappop(heap)[2]
        while heap:
            yield heapq.heappop(heap)[2]

    def _page(
        self, start: str, end: str, on_corrupt: OnCorrupt | None = None
    ) -> list[tuple[str, dict[str, Any] | None]]:
        """Up to PAGE entries with start <= id <= end, as (id, canonical record); a corrupt entry is
        a StoreError, or, given `on_corrupt`, told to it and (id, None)."""
        with self._errors("read requests") as r:
            entries = r.xrange(self._requests_key, min=start, max=end, count=PAGE) or []
        out: list[tuple[str, dict[str, Any] | None]] = []
        for eid, fields in entries:
            entry_id = _text(eid or b"?")
            try:
                out.append((entry_id, self._record(entry_id, fields)))
            except StoreError as e:
                if on_corrupt is None:
                    raise
                on_corrupt(e)
                out.append((entry_id, None))
        return out

    def _record(self, entry_id: str, fields: Mapping[bytes | str, bytes | str] | None) -> dict[str, Any]:
        where = f"entry {entry_id} of {self._requests_key}"
        data = None if fields is None else fields.get(b"data", fields.get("data"))
        if data is None:
            raise StoreError(self.url, f"{where} is corrupt: no 'data' field")
        try:
            rec = json.loads(data)
            return normalize_record(rec)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
            raise StoreError(self.url, f"{where} is corrupt: {e}") from None

    def count_requests(self) -> int:
        with self._errors("count requests") as r:
            return int(r.xlen(self._requests_key))

    def trim_requests(self, before: float) -> int:
        """Entries whose id is below `before`'s ms hold records with t < `before` (an id is never
        below its record's ms) and go in steps (`_TRIM_LUA`); a record with t < `before` may also have
        an id in `before`'s own ms, or up to its hour's lateness above it (a late record: its id placed
        ahead of its t): the entries of those ms are read, and the ones whose t is below `before` go
        too. Then the lateness of the hours wholly before `before` goes (see _Lateness)."""
        if not isinstance(before, int | float) or isinstance(before, bool) or math.isnan(before):
            raise ValueError(f"trim_requests: before must be a number, got {before!r}")
        if before <= 0:
            return 0  # (no record has t below 0)
        edge = _ms(min(before, MAX_T + 1.0))  # the first ms whose ids are not all below `before`
        with self._errors("trim requests") as r:
            lateness = self._lateness(r, None, edge)  # (of the records with t < before)
        gone, n = 0, TRIM_CHUNK if edge > 0 else 0
        while n == TRIM_CHUNK:
            with self._errors("trim requests") as r:
                n = int(self._trim(keys=[self._requests_key], args=[str(edge - 1), TRIM_CHUNK], client=r))
            gone += n
        gone += self._trim_late(before, str(edge), str(lateness.end(edge)))
        # The hours now empty (every t in them below `before`) no longer widen a read. The members as
        # read: one that a late write raised meanwhile (its record perhaps not trimmed) is another
        # member, and stays.
        empty = [member for hour, _, member in lateness.hours if (hour + 1) * LATE_HOUR_MS <= edge]
        if empty:
            with self._errors("trim requests") as r:
                r.zrem(self._late_key, *empty)
        return gone

    def _trim_late(self, before: float, start: str, end: str) -> int:
        """Delete the entries with start <= id <= end whose record's t is below `before`; returns how
        many went. An entry that cannot be read is left (`requests` names it)."""
        gone = 0
        while True:
            with self._errors("trim requests") as r:
                entries = r.xrange(self._requests_key, min=start, max=end, count=PAGE) or []
            ids = [_text(eid or b"?") for eid, _ in entries]
            old = []
            for eid, (_, fields) in zip(ids, entries, strict=True):
                try:
                    if self._record(eid, fields)["t"] < before:
                        old.append(eid)
                except StoreError:
                    continue
            if old:
                with self._errors("trim requests") as r:
                    gone += int(r.xdel(self._requests_key, *old))
            if len(entries) < PAGE:
                return gone
            start = f"({ids[-1]}"

    # ---- documents and intents -------------------------------------------------------------------

    def put_doc(self, key: str, doc: dict[str, Any]) -> None:
        text = encode_doc(key, doc)
        with self._errors(f"put document {key!r}") as r:
            r.hset(self._docs_key, key, text)

    def get_doc(self, key: str) -> dict[str, Any] | None:
        with self._errors(f"get document {key!r}") as r:
            text = r.hget(self._docs_key, key)
        return None if text is None else decode_doc(self.url, key, text)

    def store_id(self) -> str:
        import uuid

        made = encode_doc(STORE_ID_DOC, {"id": uuid.uuid4().hex})
        with self._errors("read the store's id") as r:  # (HSETNX: the first ask's is kept)
            new = r.hsetnx(self._docs_key, STORE_ID_DOC, made)
        # (made now: a new store, or one that came back empty, as a Redis without persistence does)
        kw = self._client.connection_pool.connection_kwargs  # (where: no password in it)
        where = f"redis {kw.get('host') or kw.get('path')}:{kw.get('port')}/{kw.get('db')} {self.prefix}"
        return StoreId(read_store_id(self.url, self.get_doc(STORE_ID_DOC)), made=bool(new), where=where)

    def set_aside_doc(self, key: str) -> str | None:
        aside = aside_key(key)
        with self._errors(f"set document {key!r} aside") as r:
            text = r.hget(self._docs_key, key)
            if text is None:
                return None
            with r.pipeline() as p:  # (MULTI/EXEC: the copy and the delete together)
                p.hset(self._docs_key, aside, text)
                p.hdel(self._docs_key, key)
                p.execute()
        return aside

    def set_intent(self, model: str, tier: str) -> None:
        check_intent(model, tier)
        with self._errors(f"set intent for {model!r}") as r:
            r.hset(self._intents_key, model, tier)

    def drop_intent(self, key: object) -> None:
        if not isinstance(key, (str, bytes)):
            raise StoreError(self.url, f"drop intent: a key must be text, not {type(key).__name__}")
        with self._errors(f"drop intent for {key!r}") as r:
            r.hdel(self._intents_key, key)

    def intents(self, *, on_corrupt: OnCorrupt | None = None) -> dict[str, str]:
        with self._errors("read intents") as r:
            raw = r.hgetall(self._intents_key)
        out: dict[str, str] = {}
        for k, v in raw.items():
            model, tier = _text(k), _text(v)
            try:
                check_intent(model, tier)
            except ValueError as e:
                error = CorruptRow(
                    self.url, f"intent for {model!r} in {self._intents_key} is corrupt: {e}", k
                )
                if on_corrupt is None:
                    raise error from None
                on_corrupt(error)
                continue
            out[model] = tier
        return dict(sorted(out.items()))

    # ---- lifecycle -------------------------------------------------------------------------------

    def _probe(self) -> None:
        """One PING on a connection of its own, within PROBE_S and not retried (the client's would
        wait for three 5 s timeouts when Redis hangs); what it met is raised. Outside the client's
        pool: a connection the pool makes is counted in it for good, and a probe every few seconds
        through an outage used up its 100 connections."""
        if self._closed:
            raise StoreError(self.url, "ping: the store is closed")
        pool = self._client.connection_pool
        wait = min(PROBE_S, self._timeout_s)
        kwargs = dict(pool.connection_kwargs, socket_timeout=wait, socket_connect_timeout=wait)
        conn: Any = None
        try:
            conn = pool.connection_class(**(kwargs | {"retry": Retry(NoBackoff(), 0)}))
            conn.connect()  # (its login and database: a refusal of either is raised here)
            conn.send_command("PING")
            conn.read_response()
        finally:
            if conn is not None:
                conn.disconnect()

    def ping(self) -> bool:
        """`Store.ping`: one short probe (`_probe`)."""
        try:
            self._probe()
        except (redis.RedisError, OSError, StoreError) as e:
            logger.debug("redis store ping failed: %s", e)
            return False
        return True

    def refused(self) -> str | None:
        """See `Store.refused`. Its PING is `_probe`'s (a server that hangs, a paused Redis, held the
        start for three timeouts, 15 s, before the service even listened); `answered` says afterwards
        whether the server answered it."""
        self.answered = False
        try:
            self._probe()
        except StoreError:  # (closed)
            return None
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            return f"the server refuses this login: {e} (the user and password in store.url)"
        except redis.ResponseError as e:  # NOAUTH, WRONGPASS, an out-of-range database number
            if str(e).startswith(_NOT_READY):  # busy for now: an outage, not a refusal
                return None
            return f"the server refuses this store: {e} (store.url)"
        except redis.ConnectionError as e:
            cause = e.__cause__ or e.__context__
            if isinstance(cause, ssl.SSLCertVerificationError):
                return (
                    f"the server's TLS certificate is not trusted: {e} (store.url: give the CA that "
                    "signed it as ?ssl_ca_certs=PATH)"
                )
            if isinstance(cause, ssl.SSLError) and self._tls is not None:
                return _tls_refusal(self._tls, self._timeout_s)
            return None
        except (redis.RedisError, OSError):
            return None  # down, or unreachable: an outage, which the service rides out
        self.answered = True
        found = self._key_types()
        if any(kind not in ("none", self._types[key]) for key, kind in found.items()):
            # another program's data where this store keeps its own: every read and write of that
            # key would fail for the whole run (said once, then read as an outage), which no wait mends
            return f"WRONGTYPE: {self._wrong_types_in(found)}"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"
