"""Review 18, the stores:

1. An "@" in a redis url's query (`?prefix=team@home`, an `ssl_ca_certs` path with an "@" in it)
   was taken for the end of the user info (everything up to the last "@" was), so the store talked
   to the wrong host with a made-up password, or refused the url with a misleading message. The
   user info is now the authority's (RFC 3986 3.2), and a password holding "/", "?", "#" or "@"
   as password tools make them still works.
2. A read-only open of the embedded SQLite store (`residency trace export`) switched a file that
   was not in WAL mode to WAL: a read that changed the file.
"""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from types import ModuleType

import pytest

from manager.cli import main
from manager.config import StoreConfig
from manager.config_schema import _redis_url_problem
from manager.store import StoreError, open_store
from manager.store.redis import RedisStore, parse_redis_url

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
T0 = 1_764_547_200.0


def _load_redis_server() -> ModuleType:
    """tests/integration/redis_server.py (the private redis-server fixtures), loaded by path: the
    unit tests are not a package."""
    path = Path(__file__).resolve().parents[1] / "integration" / "redis_server.py"
    spec = importlib.util.spec_from_file_location("review18_redis_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_redis_server = _load_redis_server()
redis_url = _redis_server.redis_url  # (fixtures)
redis_clean = _redis_server.redis_clean


# --- 1. an "@" in the query of a redis url ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "want"),
    [
        (
            "redis://h:1/0?prefix=a@b",
            {"host": "h", "port": 1, "db": 0, "username": None, "password": None, "prefix": "a@b",
             "display": "redis://h:1/0?prefix=a@b"},
        ),
        (
            "redis://u:pw@h:1/3?prefix=team@home",
            {"host": "h", "port": 1, "db": 3, "username": "u", "password": "pw", "prefix": "team@home",
             "display": "redis://u:***@h:1/3?prefix=team@home"},
        ),
        (
            "rediss://cache:6380/2?ssl_ca_certs=/etc/me@x/ca.pem",
            {"host": "cache", "port": 6380, "db": 2, "username": None, "password": None,
             "ssl_ca_certs": "/etc/me@x/ca.pem", "display": "rediss://cache:6380/2"},
        ),
        (  # a password holding "/" as password tools make it, and an "@" in the query
            "redis://:AbC/dEf@cache:6380/2?prefix=a@b",
            {"host": "cache", "port": 6380, "db": 2, "username": None, "password": "AbC/dEf",
             "prefix": "a@b", "display": "redis://:***@cache:6380/2?prefix=a@b"},
        ),
    ],
)  # fmt: skip
def test_an_at_sign_in_the_query_is_not_the_end_of_the_user_info(url: str, want: dict[str, object]) -> None:
    """Before: `redis://h:1/0?prefix=a@b` was host 'b', port 6379, db 0, user 'h', password
    '1/0?prefix=a' (and shown as redis://h:***@b:6379/0)."""
    u = parse_redis_url(url)
    assert {k: getattr(u, k) for k in want} == want
    assert _redis_url_problem(url) is None
    assert StoreConfig(url=url).url == url


def test_an_unknown_parameter_holding_an_at_sign_is_said_not_read_as_a_host() -> None:
    """Before: `?client_name=a@b` opened a store on host 'b' with user 'localhost' and password
    '6379/0?client_name=a', without a word; the parameter is unknown, and that is what is said."""
    url = "redis://localhost:6379/0?client_name=a@b"
    with pytest.raises(StoreError) as e:
        parse_redis_url(url)
    assert e.value.reason.startswith("unknown url parameter")
    assert "allowed: prefix" in e.value.reason
    assert "@b" not in str(e.value)  # no made-up host
    assert _redis_url_problem(url) == e.value.reason
    with pytest.raises(StoreError, match="unknown url parameter"):
        open_store(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://me:4821?s3cret@cache:port/0",  # a password starting "4821?": read as a port and a query
        "redis://me:4821?s3cret&k3y@cache/0",
        "redis://me:4821?prefix=&s3cret@cache/0",
    ],
)
def test_a_query_that_may_end_a_password_is_never_quoted(url: str) -> None:
    """An "@" after the "?": read as the query's (RFC 3986), but it may be the end of a password
    whose "?" was not written %3F, so no part of it (nor the port before it) is shown."""
    with pytest.raises(StoreError) as e:
        parse_redis_url(url)
    for secret in ("4821", "s3cret", "k3y"):
        assert secret not in str(e.value)
    assert "%3F" in e.value.reason  # what to do
    problem = _redis_url_problem(url)
    assert problem is not None and "s3cret" not in problem and "k3y" not in problem


@pytest.mark.parametrize(
    ("url", "password", "host"),
    [
        ("redis://default:?abc@host/0", "?abc", "host"),
        ("redis://default:#abc@host/0", "#abc", "host"),
        ("redis://me:p@ss@h:1/0", "p@ss", "h"),
        ("redis://:AbC/dEf+#q?x@y==@cache:6380/2?prefix=home", "AbC/dEf+#q?x@y==", "cache"),
        ("redis://me:a%40b%3Fc@h:1/0?prefix=x@y", "a@b?c", "h"),
    ],
)
def test_passwords_with_url_characters_still_open(url: str, password: str, host: str) -> None:
    """What the store took before (a password as password tools make it) it takes still."""
    u = parse_redis_url(url)
    assert (u.password, u.host) == (password, host)
    assert password not in u.display and "***" in u.display
    assert _redis_url_problem(url) is None


def test_a_store_with_an_at_sign_in_its_prefix_uses_the_server_and_prefix_given(redis_clean: str) -> None:
    """A real redis-server: before, `?prefix=team@home` made the store dial a host named 'home'."""
    url = f"{redis_clean}?prefix=team@home"
    store = open_store(url)
    try:
        assert isinstance(store, RedisStore)
        assert store.ping()
        store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
        assert [r["model"] for r in store.requests(0)] == ["voice"]
        keys = {k.decode() if isinstance(k, bytes) else k for k in store._client.keys("*")}
        assert keys and all(k.startswith("team@home:") for k in keys), keys
    finally:
        store.close()


# --- 2. a read-only open of an SQLite store ---------------------------------------------------------


def _journal_mode(db: Path) -> str:
    with closing(sqlite3.connect(db)) as c:
        (mode,) = c.execute("PRAGMA journal_mode").fetchone()
    return str(mode)


@pytest.fixture
def rollback_store(tmp_path: Path) -> Iterator[Path]:
    """A residency store with one request, its file in rollback-journal (DELETE) mode, as a user may
    keep it (a file system where WAL's shared memory does not work, a copy made with sqlite3)."""
    db = tmp_path / "state.db"
    store = open_store(f"sqlite:///{db}")
    store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
    store.close()
    with closing(sqlite3.connect(db)) as c:
        c.execute("PRAGMA journal_mode=DELETE")
    assert _journal_mode(db) == "delete"
    yield db


def test_a_read_only_open_leaves_the_journal_mode_alone(rollback_store: Path) -> None:
    """Before: open_store(url, create=False) ran PRAGMA journal_mode=WAL, rewriting the file's header
    (and leaving -wal and -shm files beside it)."""
    before = rollback_store.read_bytes()
    store = open_store(f"sqlite:///{rollback_store}", create=False)
    try:
        assert [r["model"] for r in store.requests(0)] == ["voice"]
    finally:
        store.close()
    assert _journal_mode(rollback_store) == "delete"
    assert rollback_store.read_bytes() == before


def test_trace_export_does_not_change_the_store(rollback_store: Path, tmp_path: Path) -> None:
    before = rollback_store.read_bytes()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        CONFIG.read_text() + f"store: {{url: 'sqlite:///{rollback_store}', journal: '{tmp_path}/j'}}\n"
    )
    out = tmp_path / "week.jsonl"
    assert main(["trace", "export", "--config", str(cfg), "--since", "100000d", "--out", str(out)]) == 0
    assert '"model":"voice"' in out.read_text()
    assert _journal_mode(rollback_store) == "delete"
    assert rollback_store.read_bytes() == before


def test_the_service_open_still_sets_wal(rollback_store: Path) -> None:
    """The service's read-write open is what puts a store in WAL mode (readers beside a writer)."""
    open_store(f"sqlite:///{rollback_store}").close()
    assert _journal_mode(rollback_store) == "wal"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://me:secret@cache:6379/0", "redis://me:***@cache:6379/0"),
        ("redis://cache:6379/0?prefix=team@home", "redis://***"),  # was redis://cache:***@home
        ("rediss://me:a@b@cache:6380/2", "rediss://me:***@cache:6380/2"),
        ("sqlite:///var/lib/residency/store.db", "sqlite:///var/lib/residency/store.db"),
    ],
)
def test_redact_reads_a_redis_url_as_the_store_does(url: str, shown: str) -> None:
    """`redact` (the store url in `residency tune` / `trace export` messages) read everything up to
    the last "@" as user info, so a Redis url with an "@" in its query was shown with a made-up host
    and password; it now shows a Redis url as the store reads it."""
    from manager.store.base import redact

    assert redact(url) == shown
