"""The rules of a Redis store url, `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]` (or
`rediss://` for TLS, which also takes redis-py's `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile` and
`ssl_cert_reqs`), in one place for the two that read one: the store (store/redis.py, which opens it)
and the config check (config_schema.py, which must not import the redis package). Standard library
only.

  split_redis_url(url) -> RedisURLParts   the url's parts; ValueError saying what is wrong
  redis_url_problem(url) -> str | None    the same rules: what is wrong, or None

Everything up to the last "@" is the user info (a password may hold "/", "#", "?" or "@" as password
tools make them), as `redact` takes it. A message never quotes the user info: it may hold a password.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from manager.units import shown

__all__ = [
    "CERT_REQS",
    "DEFAULT_PREFIX",
    "TLS_FILES",
    "TLS_PARAMS",
    "RedisURLParts",
    "redis_url_problem",
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


@dataclass(frozen=True)
class RedisURLParts:
    """A redis url that keeps the rules, in parts (nothing decoded but the query)."""

    scheme: str
    """redis or rediss (lower case)."""
    userinfo: str | None
    """Everything before the last "@" (still %-encoded); None when the url has no "@"."""
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
    userinfo, at, hostpart = rest.rpartition("@")
    parts = urlsplit(f"{scheme}{sep}{hostpart}")  # host, port, db and query: no password in them
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError("not a redis:// or rediss:// url")
    try:
        port = parts.port if parts.port is not None else 6379
    except ValueError:
        raise ValueError(f"the port must be a number 0-65535 (ASCII digits); {_EXPECTED}") from None
    if not parts.hostname:
        raise ValueError(f"no host; {_EXPECTED}")
    if parts.fragment:
        raise ValueError(f"a #fragment after the host; {_EXPECTED} (a '#' in a password goes before the '@')")
    path = parts.path.lstrip("/")
    if not (path == "" or (path.isascii() and path.isdigit())):
        raise ValueError(f"the database must be a number, like redis://HOST:PORT/0, got {shown(path)}")
    tls = parts.scheme == "rediss"
    params = parse_qs(parts.query, keep_blank_values=True)
    problem = _params_problem(params, tls=tls)
    if problem:
        raise ValueError(problem)
    return RedisURLParts(
        scheme=parts.scheme,
        userinfo=userinfo if at else None,
        hostname=parts.hostname,
        port=port,
        db=int(path or 0),
        params={k: v[0] for k, v in params.items()},
    )


def _params_problem(params: dict[str, list[str]], *, tls: bool) -> str | None:
    """What is wrong with a redis url's query (`prefix`; the `ssl_*` ones with rediss:// only)."""
    unknown = sorted(params.keys() - set(_ALLOWED))
    if unknown:
        return f"unknown url parameter {shown(unknown[0])} (allowed: {', '.join(_ALLOWED)})"
    values = params.get("prefix", [DEFAULT_PREFIX])
    if len(values) != 1 or not values[0] or values[0].strip() != values[0]:
        return f"prefix must be one non-empty name without spaces, got {shown(values)}"
    for name in TLS_PARAMS:
        if name not in params:
            continue
        if not tls:
            return f"{name} needs TLS: a rediss:// url"
        if len(params[name]) != 1 or not params[name][0]:
            return f"{name} must be given once, not empty, got {shown(params[name])}"
    reqs = params.get("ssl_cert_reqs", ["required"])[0]
    if reqs not in CERT_REQS:
        return f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, got {shown(reqs)}"
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
