"""Review 18c: today's store-url changes, reviewed.

1. A Redis password holding an "@" and, after it, a bare "?" (`redis://default:p@ss?word@cache/0`,
   as symbol-rich password generators make them) opened the store until this morning (everything up
   to the last "@" was the user info). The RFC 3986 reading made "ss" the host and "word@cache/0" a
   query, and the url was refused ("unknown url parameter"). A query whose parameter *name* holds an
   "@" is never a query this store takes: such a url is read with the password running on to a later
   "@" again. An "@" in a parameter's value (`?prefix=team@home`, `?client_name=a@b`) stays the
   query's, as this morning's change wants.
2. `redact` (the url in `open_store`'s "not a store url" and `residency tune` / `trace export`
   messages) returned a url it could not read as SCHEME://... unchanged, password and all: a url
   missing a "/" (`redis:/:s3cret@host/0`) or with a space before it was quoted whole.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_review18_store import T0, _redis_server

from manager.config import StoreConfig
from manager.config_schema import _redis_url_problem
from manager.store import StoreError, open_store
from manager.store.base import redact
from manager.store.redis import RedisStore, parse_redis_url
from manager.store.redis_url import shown_redis_url

redis_url = _redis_server.redis_url  # (fixtures)
redis_clean = _redis_server.redis_clean


# --- 1. a password with an "@" and then a bare "?" -------------------------------------------------


@pytest.mark.parametrize(
    ("url", "user", "password", "host", "port", "db", "prefix"),
    [
        ("redis://default:p@ss?word@cache:6379/0", "default", "p@ss?word", "cache", 6379, 0, "residency"),
        ("redis://:Xk9@mR2?pQ@cache/1", None, "Xk9@mR2?pQ", "cache", 6379, 1, "residency"),
        ("rediss://u:a@b/12?x@cache:6380/2?prefix=home", "u", "a@b/12?x", "cache", 6380, 2, "home"),
        ("redis://u:a@b?c@host/0?prefix=x@y", "u", "a@b?c", "host", 6379, 0, "x@y"),
        ("redis://u:k@7?x@[::1]:7000/3", "u", "k@7?x", "::1", 7000, 3, "residency"),
    ],
)
def test_a_password_with_an_at_sign_then_a_bare_question_mark_still_opens(
    url: str, user: str | None, password: str, host: str, port: int, db: int, prefix: str
) -> None:
    """Before: refused with "unknown url parameter (not shown)" (read as host 'ss', query
    'word@cache:6379/0'); until this morning the store opened it."""
    u = parse_redis_url(url)
    assert (u.username, u.password, u.host, u.port, u.db, u.prefix) == (
        user,
        password,
        host,
        port,
        db,
        prefix,
    )
    scheme = url.partition("://")[0]
    assert u.display.startswith(f"{scheme}://{user or ''}:***@"), u.display
    for part in re.split(r"[@?/]", password):
        if len(part) >= 3:
            assert part not in u.display, (part, u.display)
    assert _redis_url_problem(url) is None
    assert StoreConfig(url=url).url == url


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:pw@h:1/0?client_name=a@b",  # an "@" in a value: the query's (an unknown parameter)
        "redis://u:pw@h:1/0?prefix=a&client_name=b@c",
        "redis://me:4821?s3cret@cache/0",  # no "@" before the "?": refused as this morning (ambiguous)
    ],
)
def test_an_at_sign_in_a_query_value_is_still_the_querys(url: str) -> None:
    with pytest.raises(StoreError, match="unknown url parameter"):
        parse_redis_url(url)
    assert _redis_url_problem(url) is not None


def test_a_password_with_an_at_sign_and_a_bare_question_mark_logs_in_to_a_real_server(
    redis_clean: str,
) -> None:
    """A real redis-server with an ACL user whose password is `p@ss?word`: the store logs in as it."""
    port = int(redis_clean.rsplit(":", 1)[1].split("/", 1)[0])
    user, password = "review18c", "p@ss?word"
    reply = _redis_server.redis_command(port, "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all")
    assert reply == b"+OK", reply
    try:
        store = open_store(f"redis://{user}:{password}@127.0.0.1:{port}/0?prefix=r18c")
        try:
            assert isinstance(store, RedisStore)
            assert store.ping()
            store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
            assert [r["model"] for r in store.requests(0)] == ["voice"]
            assert "word" not in store.url and "p@ss" not in store.url
        finally:
            store.close()
    finally:
        _redis_server.redis_command(port, "ACL", "DELUSER", user)


# --- 2. redact of a url it cannot read ---------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis:/:s3cret@host/0",  # a "/" missing
        " redis://:s3cret@host/0",  # a space before it
        "redis:/u:s3cret@host/0",
        "://u:s3cret@host",
        "s3cret@host",
        "1redis://:s3cret@host/0",  # no scheme (a scheme starts with a letter)
    ],
)
def test_redact_never_quotes_the_password_of_a_url_it_cannot_read(url: str) -> None:
    """Before: returned unchanged, so `open_store` said "store redis:/:s3cret@host/0: not a store
    url"."""
    assert "s3cret" not in redact(url)
    assert "***" in redact(url)
    with pytest.raises(StoreError) as e:
        open_store(url)
    assert "s3cret" not in str(e.value)
    assert "s3cret" not in shown_redis_url(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("sqlite:///var/lib/residency/state.db", "sqlite:///var/lib/residency/state.db"),
        ("redis://me:secret@cache:6379/0", "redis://me:***@cache:6379/0"),
        ("http://u:pw@host/x", "http://u:***@host/x"),
        ("no-url-at-all", "no-url-at-all"),
    ],
)
def test_redact_still_shows_what_holds_no_password(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize(
    "url", ["redis:/:s3cret@cache/0", " redis://:s3cret@cache/0", "redis+ssl://me:s3cret@cache/0"]
)
def test_the_config_never_quotes_the_password_of_a_store_url_it_refuses(tmp_path: Path, url: str) -> None:
    """The config's store.url check echoed a url with a bad prefix whole, password and all."""
    import json

    from manager.config import ConfigError, load_config

    home = (Path(__file__).resolve().parents[2] / "configs" / "home.yaml").read_text()
    line = '  url: "sqlite:///.residency/state.db"'
    assert line in home
    cfg = tmp_path / "c.yaml"
    cfg.write_text(home.replace(line, f"  url: {json.dumps(url)}"))
    with pytest.raises(ConfigError, match="expected a URL starting with") as e:
        load_config(cfg)
    assert "s3cret" not in str(e.value)
    assert "store.url" in str(e.value) and "@cache" in str(e.value)
