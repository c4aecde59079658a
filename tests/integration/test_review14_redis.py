"""Review 14, against a real redis-server: a TLS Redis that asks for client certificates says so at
start (it read as an outage), and a key of the wrong type is said in the store's words, not in the
words of one Redis version.

A redis-server built without TLS skips the TLS tests, as tests/integration/test_review13_redis_tls.py
does (CI's Debian build has TLS); a missing redis-server fails them under CI=true."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.store import StoreError, open_store
from manager.store.redis import RedisStore

from .redis_server import _stop, client, free_port, redis_clean, redis_url, rstore  # noqa: F401
from .test_review13_redis_tls import _openssl, _signed, _tls_ready, old_redis  # noqa: F401

T0 = 1_764_547_200.0
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


@pytest.fixture(scope="module", params=["TLSv1.2 TLSv1.3", "TLSv1.2"], ids=["tls13", "tls12"])
def tls_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A private redis-server serving TLS only, client certificates required (Redis's default,
    `tls-auth-clients yes`), speaking the TLS versions of the param (TLS 1.3, which a client takes
    when it can, tells a missing certificate after the handshake; 1.2 during it):
    {"port", "ca", "crt", "key" (a client's, signed by the CA), "other_crt", "other_key" (a
    client's that the server does not trust)}."""
    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not on PATH (apt-get install redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; CI must run the Redis tests")
        pytest.skip(msg)
    d = tmp_path_factory.mktemp("redis-tls")
    ca = (d / "ca.crt", d / "ca.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=residency test CA",
             "-keyout", ca[1], "-out", ca[0])  # fmt: skip
    other = (d / "other.crt", d / "other.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=not trusted",
             "-keyout", other[1], "-out", other[0])  # fmt: skip
    srv_crt, srv_key = _signed(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    cli_crt, cli_key = _signed(d, "client", ca, None)
    log, err = d / "redis.log", d / "redis.stderr"
    for _ in range(3):  # another process may take the free port first
        port = free_port()
        with err.open("wb") as stderr:
            proc = subprocess.Popen(
                [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--tls-cert-file", str(srv_crt), "--tls-key-file", str(srv_key),
                 "--tls-ca-cert-file", str(ca[0]), "--tls-protocols", request.param, "--dir", str(d),
                 "--logfile", str(log)],
                stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        if _tls_ready(port, ca[0], cli_crt, cli_key, proc):
            break
        exited = proc.poll() is not None
        _stop(proc)
        said = err.read_text(errors="replace") + (log.read_text(errors="replace") if log.exists() else "")
        low = said.lower()
        # A build without TLS stops at once naming TLS; a TLS build that cannot load our files names
        # the certificate or key, and that is a failure of this test, not a skip.
        if exited and "tls" in low and "certificate" not in low and "private key" not in low:
            why = f"this redis-server was built without TLS support (it said: {said.strip()[-300:]})"
            if os.environ.get("CI") == "true":  # CI's Debian build has TLS: the tests must run there
                pytest.fail(why)
            pytest.skip(why)
    else:
        pytest.fail(
            f"TLS redis-server did not answer; its log ends:\n{log.read_text(errors='replace')[-2000:]}"
        )
    try:
        yield {"port": port, "ca": ca[0], "crt": cli_crt, "key": cli_key, "other_crt": other[0],
               "other_key": other[1]}  # fmt: skip
    finally:
        _stop(proc)


def test_a_tls_redis_asking_for_a_client_certificate_says_so(tls_redis: dict[str, Any]) -> None:
    """Before: refused() was None (the server "could not be reached": ConnectionError, "EOF occurred
    in violation of protocol" or "tlsv13 alert certificate required", whichever redis-py met), so
    `serve` started and retried the store for ever instead of saying what store.url lacks."""
    t = tls_redis
    with closing(open_store(f"rediss://:secret@127.0.0.1:{t['port']}/0?ssl_ca_certs={t['ca']}")) as s:
        assert s.ping() is False
        for _ in range(5):  # redis-py meets the alert or an EOF by chance: the answer is the same
            why = s.refused()
            assert why is not None, "a missing client certificate read as an outage"
            assert "client certificate and store.url gives none" in why or "asks for a client" in why, why
            assert "ssl_certfile=CLIENT.pem&ssl_keyfile=CLIENT.key" in why and "secret" not in why


def test_a_client_certificate_the_server_does_not_trust_is_said(tls_redis: dict[str, Any]) -> None:
    t = tls_redis
    url = (
        f"rediss://127.0.0.1:{t['port']}/0?ssl_ca_certs={t['ca']}"
        f"&ssl_certfile={t['other_crt']}&ssl_keyfile={t['other_key']}"
    )
    with closing(open_store(url)) as s:
        assert s.ping() is False
        why = s.refused()
        assert why is not None
        assert f"the server does not accept the client certificate '{t['other_crt']}'" in why, why
        assert "TLS alert: unknown ca" in why


def test_a_tls_redis_that_takes_the_certificate_or_is_down_is_not_refused(tls_redis: dict[str, Any]) -> None:
    """The question asked of a TLS server is asked only when a connection fails at the TLS level;
    a server that is down is still an outage, which the service rides out."""
    t = tls_redis
    good = f"rediss://127.0.0.1:{t['port']}/0?ssl_ca_certs={t['ca']}&ssl_certfile={t['crt']}&ssl_keyfile={t['key']}"
    with closing(open_store(good)) as s:
        assert s.ping() is True and s.refused() is None
    with closing(open_store(f"rediss://127.0.0.1:{free_port()}/0?ssl_ca_certs={t['ca']}")) as down:
        assert down.ping() is False and down.refused() is None


@pytest.mark.timeout(120)  # before, serve never stopped: a hang, not a failure, without this
def test_serve_without_the_client_certificate_stops_at_once(
    tls_redis: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: `serve` started, said the store could not be reached and retried it once a second for
    ever, keeping every request in memory only."""
    import manager.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")
    config = tmp_path / "c.yaml"
    url = f"rediss://:secret@127.0.0.1:{tls_redis['port']}/0?ssl_ca_certs={tls_redis['ca']}"
    config.write_text(f'store: {{url: "{url}"}}\n' + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(config), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "client certificate" in last and "ssl_certfile=" in last and "ssl_keyfile=" in last, err
    assert "secret" not in err and "Traceback" not in err and "serving on" not in err


# --- a key of the wrong type --------------------------------------------------------------------


def _wrong_types(c: redis.Redis, s: RedisStore) -> None:
    """Each of the store's keys of another type than it keeps there is named, with its type."""
    tail = (
        "(another program's data under the prefix 'residency'? give this store its own ?prefix=NAME in "
        "store.url)"
    )
    stream = f"ResponseError: WRONGTYPE: residency:requests holds a string, not a stream {tail}"
    c.set("residency:requests", "not a stream")
    with pytest.raises(StoreError) as e:
        s.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
    assert e.value.reason == f"append requests: {stream}"
    with pytest.raises(StoreError) as e:
        s.count_requests()
    assert e.value.reason == f"count requests: {stream}"
    c.delete("residency:requests")
    c.rpush("residency:docs", "x")
    with pytest.raises(StoreError) as e:
        s.get_doc("stats")
    assert e.value.reason == (
        f"get document 'stats': ResponseError: WRONGTYPE: residency:docs holds a list, not a hash {tail}"
    )


def test_a_key_of_the_wrong_type_is_named(rstore: RedisStore, client: redis.Redis) -> None:  # noqa: F811
    """Before: Redis's own words ("WRONGTYPE Operation against a key holding the wrong kind of value
    script: <sha>, on @user_script:4." on Redis 7, "Error running script (call to f_<sha>): ..." on
    Redis 6), naming no key. tests/unit/test_review14_redis_url.py holds Redis 6's answer."""
    _wrong_types(client, rstore)


def test_a_key_of_the_wrong_type_is_named_on_redis_older_than_7(old_redis: redis.Redis) -> None:  # noqa: F811
    port = old_redis.connection_pool.connection_kwargs["port"]
    old_redis.flushall()
    with closing(open_store(f"redis://127.0.0.1:{port}/0")) as s:
        assert isinstance(s, RedisStore)
        _wrong_types(old_redis, s)
