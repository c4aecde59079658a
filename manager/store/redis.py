"""The Redis store: `redis://[:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]` (or `rediss://` for TLS).

TLS (`rediss://` only) takes redis-py's query names: `ssl_ca_certs=CA.pem` (the CA that signed the
server's certificate; default: the system's), `ssl_certfile=CLIENT.pem` and `ssl_keyfile=CLIENT.key`
(a client certificate, which Redis asks for unless `tls-auth-clients no`; the key unencrypted) and
`ssl_cert_reqs=none|optional|required` (default required). `open_redis` checks that the files load.

Keys, under a prefix (default `residency`, or `?prefix=` in the url):
  <prefix>:requests      a Stream, one entry per request: field `data` = the canonical record as JSON.
                         Entry ids are `<ms>-<seq>` with ms = floor(t * 1000), so XRANGE by time
                         finds a range without a scan.
  <prefix>:requests:lag  a sorted set, member `late_ms`: how far (ms) an entry's id is ahead of its t.
  <prefix>:docs          a Hash, document key -> JSON object.
  <prefix>:intents       a Hash, model -> tier.
  <prefix>:requests:batch:<token>  a short-lived marker per batch written (see _BATCH_KEY).

Late records: a stream's ids only grow, so a record whose t is earlier than the newest entry (two
threads finishing out of order, or out of order in one batch) gets the newest entry's ms instead, and
the largest such lateness is kept in `:requests:lag`. `requests()` widens its XRANGE by
that lateness, filters on the exact t, and re-orders through a small heap: entries come back in time
order all the same, and when nothing was late the heap holds at most one page.

Primitives: parse_redis_url (url -> connection settings, display url, prefix; the url rules are
redis_url.py's, which the config check shares), open_redis (url ->
RedisStore; connects lazily), RedisStore (the `Store` protocol over an injected redis client).

Errors: any Redis or socket failure is a StoreError whose url has the password replaced by ***;
`ping()` returns False instead. A key of another type than the store keeps there (WRONGTYPE) is named
with its type, in the same words whatever the Redis version. `refused()` tells a login, a database, a
server certificate or a client certificate (missing, or not trusted) that the server refuses for
good from an outage. Thread safety: redis-py clients are thread-safe (a connection pool);
a batch is one Lua script (read the newest id, place the ids, add the entries), which Redis runs
whole: all of it is written or none, and racing writers cannot interleave with it.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import socket
import ssl
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from manager.replay.trace import MAX_T
from manager.store.base import (
    StoreError,
    check_intent,
    decode_doc,
    encode_doc,
    normalize_record,
    redact,
)
from manager.store.redis_url import DEFAULT_PREFIX, TLS_FILES, split_redis_url

__all__ = ["DEFAULT_PREFIX", "PAGE", "TRIM_CHUNK", "RedisStore", "RedisURL", "open_redis", "parse_redis_url"]

logger = logging.getLogger(__name__)

PAGE = 1000


# One batch of the request log, as one script: Redis runs it whole, with no other command between,
# so a batch is written all or none and its ids need no retry when writers race. KEYS: the stream, the
# lag set and the call's own key (see _BATCH_KEY); ARGV: ms, json, ms, json, ... Every id is placed
# before anything is written: an XADD at an id above the newest one cannot fail, so an error (a key of
# the wrong type) comes before any write. Only commands and forms of Redis 5 (streams): the script
# numbers the ids itself (`<ms>-*` is Redis 7) and compares the lag with ZSCORE (ZADD GT is 6.2), so a
# Redis 6 (Ubuntu 22.04, Debian 11) writes a batch whole too.
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
local late, ids = 0, {}
for i = 1, #ARGV, 2 do
  local ms = tonumber(ARGV[i])
  if ms > last then last, seq = ms, 0 else seq = seq + 1 end
  if last - ms > late then late = last - ms end
  ids[#ids + 1] = string.format('%.0f-%.0f', last, seq)
end
local lag = tonumber(redis.call('ZSCORE', KEYS[2], 'late_ms'))  -- a wrong type fails here, unwritten
-- KEYS[3] names this call: a copy of it that redis-py sent again (a timeout while Redis was busy, and
-- the first copy ran all the same) writes nothing
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', 600) then return -1 end
if late > 0 and (lag == nil or late > lag) then redis.call('ZADD', KEYS[2], late, 'late_ms') end
for k = 1, #ids do
  redis.call('XADD', KEYS[1], ids[k], 'data', ARGV[2 * k])
end
return late
"""


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
"""Set (for 10 minutes) by the batch whose `append_requests` call drew `token`: redis-py sends a
command again when it timed out, and Redis may run both copies (it reads a socket only between
commands: a busy server runs the first copy late). The second copy finds the key and writes nothing."""


def _ms(t: float) -> int:
    """Stream id milliseconds for time `t`: monotone in t, so ranges by ms never miss a record."""
    return math.floor(t * 1000)


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

    Everything up to the last "@" is the user info, as `redact` takes it: a password may hold "/",
    "#", "?" or "@" as password tools make them (`openssl rand -base64`); "%XX" in it is decoded.
    """
    try:
        parts = split_redis_url(url)
    except ValueError as e:
        raise StoreError(redact(url), str(e)) from None
    userinfo, at = (parts.userinfo, "@") if parts.userinfo is not None else ("", "")
    username, colon, password = userinfo.partition(":")
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
        display=redact(f"{parts.scheme}://{userinfo}{at}{host}:{parts.port}/{parts.db}{query}"),
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
        self._requests_key = f"{prefix}:requests"
        self._lag_key = f"{prefix}:requests:lag"
        self._docs_key = f"{prefix}:docs"
        self._intents_key = f"{prefix}:intents"
        self._types = {  # what each key holds, as Redis's TYPE names it
            self._requests_key: "stream",
            self._lag_key: "zset",
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
        try:
            found = {key: _text(self._client.type(key)) for key in self._types}
        except (redis.RedisError, OSError):
            found = {}
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
        batch_key = _BATCH_KEY.format(prefix=self.prefix, token=uuid.uuid4().hex)
        with self._errors("append requests") as r:
            late = self._append(keys=[self._requests_key, self._lag_key, batch_key], args=args, client=r)
        if late > 0:
            logger.debug("records up to %s ms late stored at later ids", late)

    def _lag_ms(self, r: redis.Redis) -> int:
        """How far (ms) an entry's id may be ahead of its t; StoreError when the lag set holds no
        such number (an infinite or huge score, which no stream id can be widened by)."""
        lag = r.zscore(self._lag_key, "late_ms")
        if lag is None or lag <= 0:
            return 0
        if not lag <= _ms(MAX_T):  # (NaN and infinity too)
            raise StoreError(
                self.url,
                f"{self._lag_key} is corrupt: its late_ms score {lag!r} is not a lateness in ms (0 to "
                f"{_ms(MAX_T)}); another program's data under the prefix {self.prefix!r}? give this "
                "store its own ?prefix=NAME in store.url",
            )
        return int(lag)

    def requests(self, since: float, until: float | None = None) -> Iterator[dict[str, Any]]:
        if math.isnan(since) or (until is not None and math.isnan(until)):
            raise ValueError(f"requests: since and until must be numbers, got {since!r}, {until!r}")
        if since > MAX_T or (until is not None and until <= max(since, 0)):
            return  # no record has t outside [0, MAX_T] (nor a stream id for such a bound)
        with self._errors("read requests") as r:
            lag = self._lag_ms(r)
        start = str(max(_ms(since), 0)) if since > 0 else "-"
        end = "+" if until is None or until > MAX_T else str(_ms(until) + lag)
        heap: list[tuple[float, int, dict[str, Any]]] = []  # (t, read order, record)
        n = 0
        while True:
            page = self._page(start, end)
            for _, rec in page:
                if since <= rec["t"] and (until is None or rec["t"] < until):
                    heapq.heappush(heap, (rec["t"], n, rec))
                    n += 1
            if len(page) < PAGE:
                break
            last_id = page[-1][0]
            start = f"({last_id}"
            # Unread entries have ids >= last_id, so their t is at least (ms - lag); 1 ms of slack
            # covers float rounding in t * 1000.
            floor_t = (int(last_id.split("-", 1)[0]) - lag - 1) / 1000
            while heap and heap[0][0] < floor_t:
                yield heapq.heappop(heap)[2]
        while heap:
            yield heapq.heappop(heap)[2]

    def _page(self, start: str, end: str) -> list[tuple[str, dict[str, Any]]]:
        """Up to PAGE entries with start <= id <= end, as (id, canonical record)."""
        with self._errors("read requests") as r:
            entries = r.xrange(self._requests_key, min=start, max=end, count=PAGE) or []
        return [(_text(eid or b"?"), self._record(_text(eid or b"?"), fields)) for eid, fields in entries]

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
        an id in `before`'s own ms, or up to the lag above it (a late record: its id placed ahead of
        its t): the entries of those few ms are read, and the ones whose t is below `before` go too."""
        if not isinstance(before, int | float) or isinstance(before, bool) or math.isnan(before):
            raise ValueError(f"trim_requests: before must be a number, got {before!r}")
        if before <= 0:
            return 0  # (no record has t below 0)
        edge = _ms(min(before, MAX_T + 1.0))  # the first ms whose ids are not all below `before`
        gone, n = 0, TRIM_CHUNK if edge > 0 else 0
        while n == TRIM_CHUNK:
            with self._errors("trim requests") as r:
                n = int(self._trim(keys=[self._requests_key], args=[str(edge - 1), TRIM_CHUNK], client=r))
            gone += n
        with self._errors("trim requests") as r:
            lag = self._lag_ms(r)
        return gone + self._trim_late(before, str(edge), str(edge + lag))

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

    def set_intent(self, model: str, tier: str) -> None:
        check_intent(model, tier)
        with self._errors(f"set intent for {model!r}") as r:
            r.hset(self._intents_key, model, tier)

    def intents(self) -> dict[str, str]:
        with self._errors("read intents") as r:
            raw = r.hgetall(self._intents_key)
        out: dict[str, str] = {}
        for k, v in raw.items():
            model, tier = _text(k), _text(v)
            try:
                check_intent(model, tier)
            except ValueError as e:
                raise StoreError(
                    self.url, f"intent for {model!r} in {self._intents_key} is corrupt: {e}"
                ) from None
            out[model] = tier
        return dict(sorted(out.items()))

    # ---- lifecycle -------------------------------------------------------------------------------

    def ping(self) -> bool:
        try:
            with self._errors("ping") as r:
                return bool(r.ping())
        except StoreError as e:
            logger.debug("redis store ping failed: %s", e)
            return False

    def refused(self) -> str | None:
        try:
            self._client.ping()
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            return f"the server refuses this login: {e} (the user and password in store.url)"
        except redis.ResponseError as e:  # NOAUTH, WRONGPASS, an out-of-range database number
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
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"
