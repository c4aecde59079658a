"""The rules of a Redis store url, `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]` (or
`rediss://` for TLS, which also takes redis-py's `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile` and
`ssl_cert_reqs`), in one place for the two that read one: the store (store/redis.py, which opens it)
and the config check (config_schema.py, which must not import the redis package). Standard library
only.

  split_redis_url(url) -> RedisURLParts   the url's parts; ValueError saying what is wrong
  redis_url_problem(url) -> str | None    the same rules: what is wrong, or None
  hide_userinfo(userinfo) -> str          "USER:***@", "***@" or "": the user info as it may be shown
  shown_redis_url(url) -> str             `url` (a bad one too) as a message may show it

The user info (RFC 3986 3.2) is the authority's: it ends at the last "@" before the first "/", "?"
or "#" after "//", so an "@" in the query (`?prefix=team@home`, an ssl_* path) is the query's. A
password as password tools make it, with "/", "?", "#" or "@" not %-encoded, is still taken where
the url cannot be read the RFC's way (no host, a port that is no number, a database that is no
number, a #fragment, or a user info whose RFC reading leaves an "@" in a query parameter's name, as
`redis://default:p@ss?word@cache/0` does): then the user info ends at the first later "@" after
which a good HOST[:PORT][/DB] follows (see `_userinfo_end`). A message never quotes the user info,
nor a query that holds an "@" (it may be the end of a password whose "?" was not written %3F).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from manager.units import shown

__all__ = [
    "CERT_REQS",
    "DEFAULT_PREFIX",
    "TLS_FILES",
    "TLS_PARAMS",
    "RedisURLParts",
    "hide_userinfo",
    "redis_url_problem",
    "shown_redis_url",
    "split_redis_url",
]

DEFAULT_PREFIX = "residency"
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
"""rediss:// only: the CA file (PEM) that signed the server's certificate, the client certificate and
its key: redis-py's names. The store checks that they load (the config check does not read files)."""
TLS_PARAMS = (*TLS_FILES, "ssl_cert_reqs")
CERT_REQS = ("none", "optional", "required")
"""ssl_cert_reqs: whether the server's certificate is checked (default required)."""
_ALLOWED = ("prefix", *TLS_PARAMS)
_EXPECTED = "expected redis://HOST:PORT/DB"
_ENCODE = (
    "the query holds an '@', so it is not quoted (it may be the end of a password): in a password "
    "write '?', '#', '/' and '@' as %3F, %23, %2F and %40"
)


@dataclass(frozen=True)
class RedisURLParts:
    """A redis url that keeps the rules, in parts (nothing decoded but the query)."""

    scheme: str
    """redis or rediss (lower case)."""
    userinfo: str | None
    """The user info, before the "@" that ends it (still %-encoded); None when there is none."""
    hostname: str
    """Lower case; an IPv6 address without its brackets."""
    port: int
    db: int
    params: dict[str, str]
    """The query, each name given once: prefix and (rediss:// only) the ssl_* ones."""

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"


def split_redis_url(url: str) -> RedisURLParts:
    """`url` in parts; ValueError naming what is wrong (never quoting the user info)."""
    scheme, sep, rest = url.partition("://")
    cut = _userinfo_end(scheme, rest)
    userinfo, hostpart = (rest[:cut], rest[cut + 1 :]) if cut >= 0 else (None, rest)
    parts = urlsplit(f"{scheme}{sep}{hostpart}")  # host, port, db and query: no password in them
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError("not a redis:// or rediss:// url")
    try:
        port = parts.port if parts.port is not None else 6379
    except ValueError:
        raise ValueError(f"the port must be a number 0-65535 (ASCII digits); {_EXPECTED}") from None
    if not parts.hostname:
        raise ValueError(f"no host; {_EXPECTED}")
    if any(c.isspace() or not c.isprintable() for c in parts.hostname):  # no resolver takes one
        raise ValueError(
            f"the host {shown(parts.hostname)} holds a space or a control character; {_EXPECTED}"
        )
    if parts.fragment:
        raise ValueError(f"a #fragment after the host; {_EXPECTED} (a '#' in a password goes before the '@')")
    path = parts.path.lstrip("/")
    if not (path == "" or (path.isascii() and path.isdigit())):
        raise ValueError(f"the database must be a number, like redis://HOST:PORT/0, got {shown(path)}")
    tls = parts.scheme == "rediss"
    params = parse_qs(parts.query, keep_blank_values=True)
    # An "@" left in the query: the query's (RFC 3986), or the end of a password written with a
    # bare "?" (`redis://me:4821?xyz@host`): what is wrong with it is said without quoting it.
    ambiguous = "@" in hostpart
    problem = _params_problem(params, tls=tls, show=_not_shown if ambiguous else shown)
    if problem:
        raise ValueError(f"{problem}; {_ENCODE}" if ambiguous else problem)
    return RedisURLParts(
        scheme=parts.scheme,
        userinfo=userinfo,
        hostname=parts.hostname,
        port=port,
        db=int(path or 0),
        params={k: v[0] for k, v in params.items()},
    )


def _not_shown(_: object) -> str:
    return "(not shown)"


def _authority_end(rest: str) -> int:
    """Where the authority of `rest` (a url after its "//") ends: its first "/", "?" or "#"."""
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    return min(ends, default=len(rest))


def _host_part_fits(scheme: str, hostpart: str) -> bool:
    """Whether `hostpart`, what follows the user info, reads as HOST[:PORT][/DB][?QUERY]: a host, a
    port that is a number (not an empty one after a ":"), a database that is a number, no "@" in its
    authority and no #fragment (the query is not looked at: an "@" in it is the query's)."""
    authority = hostpart[: _authority_end(hostpart)]
    if "@" in authority or authority.endswith(":") or "#" in hostpart:
        return False
    try:
        parts = urlsplit(f"{scheme}://{hostpart}")
        parts.port  # noqa: B018  (raises ValueError for a port that is no number)
    except ValueError:
        return False
    path = parts.path.lstrip("/")
    return bool(parts.hostname) and (path == "" or (path.isascii() and path.isdigit()))


def _userinfo_end(scheme: str, rest: str) -> int:
    """The index in `rest` (a url after its "//") of the "@" that ends the user info; -1: none.

    The RFC 3986 reading first: the last "@" in the authority (or none), when what follows it fits
    (`_host_part_fits`). Else a password holding "/", "?", "#" or "@" that are not %-encoded: the
    first "@" after the authority that a fitting host part follows (the first, so that an "@" in
    the query is the query's). Else (nothing fits: the url is bad) the last "@", so that whatever
    the message says of the url's remains quotes no part of a password.

    An "@" so found after which the query has an "@" in a parameter's name
    (`redis://default:p@ss?word@cache/0`: host "ss", parameter "word@cache/0", never one this store
    takes) is inside a password holding "@" and then a bare "?": the first later "@" that a fitting
    host part with a good query follows ends it, as it did before the RFC reading (none: the url is
    read as found, and refused)."""
    end = _authority_end(rest)
    first = rest.rfind("@", 0, end)
    later = [i for i in range(end, len(rest)) if rest[i] == "@"]
    for cut in [first, *later]:
        if not _host_part_fits(scheme, rest[cut + 1 :]):
            continue
        if cut >= 0 and _name_holds_at(scheme, rest[cut + 1 :]):
            # `redis://default:p@ss?word@cache/0`: a query whose parameter name holds an "@" is no
            # query this store takes (RFC-read, "ss" is the host and "word@cache/0" a parameter): the
            # password went on past a bare "?", as before the RFC reading. (An "@" in a value, and
            # a url with no "@" before its "?", `redis://me:4821?x@host`, keep the RFC reading.)
            for c in (c for c in later if c > cut):
                hostpart = rest[c + 1 :]
                if _host_part_fits(scheme, hostpart) and not _query_problem(scheme, hostpart):
                    return c
        return cut
    return rest.rfind("@")


def _query(scheme: str, hostpart: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(f"{scheme}://{hostpart}").query, keep_blank_values=True)


def _name_holds_at(scheme: str, hostpart: str) -> bool:
    """Whether a parameter name in the query of `hostpart` (a fitting one) holds an "@"."""
    return any("@" in name for name in _query(scheme, hostpart))


def _query_problem(scheme: str, hostpart: str) -> str | None:
    """What is wrong with the query of `hostpart` (a fitting one), or None."""
    return _params_problem(_query(scheme, hostpart), tls=scheme.lower() == "rediss", show=_not_shown)


def hide_userinfo(userinfo: str | None) -> str:
    """The user info as a url shown in a message has it: the user name kept and the password as
    *** (`USER:***@`); a lone part (`SECRET@`, a password with no user name) hidden whole; "" for
    none."""
    if userinfo is None:
        return ""
    user, colon, _ = userinfo.partition(":")
    return f"{user}:***@" if colon else "***@"


def shown_redis_url(url: str) -> str:
    """`url`, good or bad, as a message may show it: its user info hidden (`hide_userinfo`), read as
    `split_redis_url` reads it. A url with an "@" after its host (in its query, or the end of a
    password that holds "?" or "#") is shown as SCHEME://*** alone: it may be a password's."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    cut = _userinfo_end(scheme, rest)
    userinfo, hostpart = (rest[:cut], rest[cut + 1 :]) if cut >= 0 else (None, rest)
    if "@" in hostpart:
        return f"{scheme}://***"
    return f"{scheme}://{hide_userinfo(userinfo)}{hostpart}"


def _params_problem(
    params: dict[str, list[str]], *, tls: bool, show: Callable[[object], str] = shown
) -> str | None:
    """What is wrong with a redis url's query (`prefix`; the `ssl_*` ones with rediss:// only);
    `show` quotes a name or value of it."""
    unknown = sorted(params.keys() - set(_ALLOWED))
    if unknown:
        return f"unknown url parameter {show(unknown[0])} (allowed: {', '.join(_ALLOWED)})"
    values = params.get("prefix", [DEFAULT_PREFIX])
    if len(values) != 1 or not values[0] or values[0].strip() != values[0]:
        return f"prefix must be one non-empty name without spaces, got {show(values)}"
    for name in TLS_PARAMS:
        if name not in params:
            continue
        if not tls:
            return f"{name} needs TLS: a rediss:// url"
        if len(params[name]) != 1 or not params[name][0]:
            return f"{name} must be given once, not empty, got {show(params[name])}"
    reqs = params.get("ssl_cert_reqs", ["required"])[0]
    if reqs not in CERT_REQS:
        return f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, got {show(reqs)}"
    if "ssl_keyfile" in params and "ssl_certfile" not in params:
        return "ssl_keyfile needs ssl_certfile (the client certificate it is the key of)"
    return None


def redis_url_problem(url: str) -> str | None:
    """What `split_redis_url` (so the store) refuses in `url`, or None."""
    try:
        split_redis_url(url)
    except ValueError as e:
        return str(e)
    return None


_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)(.*)@", re.IGNORECASE | re.DOTALL)


def redact(url: str) -> str:
    """`url` with the password replaced by ***: what error messages and logs may show.

    A Redis url is read as the store reads it (`shown_redis_url`: an "@" in its query is not the end
    of its user info). Otherwise everything up to the last "@" counts as user info (passwords may
    hold "@" or "/"); a user name before a ":" is kept, a lone user-info part (`redis://SECRET@host`)
    is hidden whole. A url with an "@" that does not start SCHEME:// (`redis:/:SECRET@host`, a space
    before it) is shown from its last "@" on: `***@host`.
    """
    if url.lower().startswith(("redis://", "rediss://")):
        return shown_redis_url(url)
    m = _USERINFO.match(url)
    if m is None:  # (returned whole, it quoted the password of `redis:/:SECRET@host`)
        return f"***@{url.rpartition('@')[2]}" if "@" in url else url
    user, colon, _ = m.group(2).partition(":")
    return f"{m.group(1)}{user if colon else ''}{':***' if colon else '***'}@{url[m.end() :]}"
