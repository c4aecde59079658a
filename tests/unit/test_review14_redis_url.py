"""Review 14: one set of redis url rules (manager/store/redis_url.py, standard library only) for the
store that opens a url and the config check that may not import redis; and a key of the wrong type
said the same way whatever the Redis version (the real Redis 7 beside it:
tests/integration/test_review14_redis.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from redis._parsers.base import BaseParser

from manager.config import StoreConfig
from manager.config_schema import _redis_url_problem
from manager.store import StoreError
from manager.store.redis import RedisStore, parse_redis_url

GOOD = [
    "redis://127.0.0.1:6379/0",
    "redis://cache",
    "redis://[::1]:6379/3",
    "redis://:AbC/dEf+#q?x@y==@cache:6380/2?prefix=home",
    "redis://app:pw@cache:6380/15?prefix=a.b-c",
    "rediss://cache:6380/1?ssl_ca_certs=/x/ca.pem&ssl_certfile=/x/c.pem&ssl_keyfile=/x/c.key",
    "rediss://cache:6380/1?ssl_cert_reqs=none&prefix=p",
]

BAD = [
    "redis://h:port/0",
    "redis://:pw@h:６３７９/0",
    "redis://h:99999/0",
    "redis://:6379/0",
    "redis://h:1/x",
    "redis://:Ab@Cd/eFgh@cache:6380/x",
    "redis://h:1/٣",
    "redis://h:1/0#frag",
    "redis://h:1/0?db=1",
    "redis://h:1/0?prefix=",
    "redis://h:1/0?prefix=a&prefix=b",
    "redis://h:1/0?prefix=%20a",
    "redis://h:1/0?ssl_ca_certs=/x/ca.pem",
    "rediss://h:1/0?ssl_cert_reqs=maybe",
    "rediss://h:1/0?ssl_keyfile=/x/k.pem",
    "rediss://h:1/0?ssl_certfile=",
    "rediss://h:1/0?ssl_ca_certs=/a&ssl_ca_certs=/b",
]


def _store_problem(url: str) -> str | None:
    try:
        parse_redis_url(url)
    except StoreError as e:
        return e.reason
    return None


@pytest.mark.parametrize("url", GOOD + BAD)
def test_the_store_and_the_config_say_the_same_of_a_redis_url(url: str) -> None:
    """Before: the rules were written twice (store/redis.py and config_schema.py) and had drifted
    apart: `redis://h:1/x` was "the database must be a number, like redis://HOST:PORT/0, got 'x'"
    to the store and the same without "got 'x'" to the config check, the port message differed, and
    so on; the next rule added to one would have been missed in the other."""
    problem = _store_problem(url)
    assert (problem is None) == (url in GOOD), problem
    assert _redis_url_problem(url) == problem
    if problem is None:
        assert StoreConfig(url=url).url == url
    else:
        with pytest.raises(ValidationError) as e:
            StoreConfig(url=url)
        assert problem in str(e.value)
        assert "pw" not in problem and "eFgh" not in problem and "Cd" not in problem


def test_the_url_rules_import_without_redis() -> None:
    """The config check takes its rules from the store's module, which must not pull in the redis
    client (nor the store's Redis backend): `residency check` stays light."""
    code = (
        "import sys, manager.store.redis_url, manager.config_schema\n"
        "assert manager.config_schema._redis_url_problem('redis://h:1/x') is not None\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'redis' or m == 'manager.store.redis')\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- a key of the wrong type ------------------------------------------------------------------------

# What Redis answers when the append script meets a key of another type. Redis 6.x wraps a script's
# error in its own ERR ("Error running script"; the position twice: the error handler's and the
# call's), Redis 7 passes the WRONGTYPE code on with the script's position after it.
REDIS6 = (
    "ERR Error running script (call to f_7a428cd0692138edf39b2af45f1ebe71fca10281): @user_script:23: "
    "@user_script: 23: WRONGTYPE Operation against a key holding the wrong kind of value"
)
REDIS7 = (
    "WRONGTYPE Operation against a key holding the wrong kind of value script: "
    "7a428cd0692138edf39b2af45f1ebe71fca10281, on @user_script:23."
)


class _WrongType:
    """Stands in for the redis client (see the real Redis in tests/integration/test_review14_redis.py):
    the append script fails as a Redis of one version fails it, TYPE answers as Redis does for a
    request log that is a plain string."""

    def __init__(self, script_error: str) -> None:
        # as redis-py makes it from the answer
        self.script_error = BaseParser.parse_error(script_error)  # type: ignore[no-untyped-call]
        assert isinstance(self.script_error, redis.ResponseError)

    def register_script(self, _script: str) -> Any:
        def run(**_: Any) -> Any:
            raise self.script_error

        return run

    def type(self, key: str) -> bytes:
        return b"string" if key == "residency:requests" else b"none"

    def close(self) -> None:
        pass


@pytest.mark.parametrize("answer", [REDIS6, REDIS7], ids=["redis6", "redis7"])
def test_a_key_of_the_wrong_type_is_said_the_same_on_redis_6_and_7(answer: str) -> None:
    """Before: the message was Redis's own text, which differs by version ("ResponseError: Error
    running script (call to f_...): @user_script:23: ... WRONGTYPE ..." on Redis 6), and named no key."""
    store = RedisStore(_WrongType(answer), url="redis://h:1/0")  # type: ignore[arg-type]
    with pytest.raises(StoreError) as e:
        store.append_requests([{"t": 1.0, "model": "voice", "busy_s": 0.5}])
    assert e.value.reason == (
        "append requests: ResponseError: WRONGTYPE: residency:requests holds a string, not a stream "
        "(another program's data under the prefix 'residency'? give this store its own "
        "?prefix=NAME in store.url)"
    )
