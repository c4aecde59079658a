"""Review 13: a rediss:// store url names its CA file and client certificate (redis-py's query names),
and the config check takes what the store takes. Real files in tmp_path; no server (see
tests/integration/test_review13_redis_tls.py for the TLS handshake itself)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from manager.config import StoreConfig
from manager.config_schema import _redis_url_problem
from manager.store import StoreError, open_store
from manager.store.redis import RedisStore, parse_redis_url


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed certificate and its key (PEM), made with openssl."""
    d = tmp_path_factory.mktemp("pem")
    key, crt = d / "client.key", d / "client.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=residency-test", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )  # fmt: skip
    return {"key": key, "crt": crt}


def test_rediss_url_takes_ca_and_client_certificate(pem: dict[str, Path]) -> None:
    """Before: "unknown url parameter 'ssl_ca_certs' (allowed: prefix)": a Redis with TLS and its own
    CA (or asking for client certificates, its default) could not be used at all."""
    url = (
        f"rediss://:pw@cache:6380/1?prefix=home&ssl_ca_certs={pem['crt']}"
        f"&ssl_certfile={pem['crt']}&ssl_keyfile={pem['key']}&ssl_cert_reqs=required"
    )
    u = parse_redis_url(url)
    assert (u.ssl, u.prefix, u.ssl_ca_certs, u.ssl_certfile, u.ssl_keyfile, u.ssl_cert_reqs) == (
        True, "home", str(pem["crt"]), str(pem["crt"]), str(pem["key"]), "required",
    )  # fmt: skip
    assert u.display == "rediss://:***@cache:6380/1?prefix=home"
    store = open_store(url)
    assert isinstance(store, RedisStore)
    kwargs = store._client.connection_pool.connection_kwargs  # what each connection is made with
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
        str(pem["crt"]), str(pem["crt"]), str(pem["key"]),
    )  # fmt: skip
    store.close()
    assert StoreConfig(url=url).url == url


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("ssl_ca_certs=/x/ca.pem", "ssl_ca_certs needs TLS: a rediss:// url"),
        ("ssl_cert_reqs=none", "ssl_cert_reqs needs TLS: a rediss:// url"),
    ],
)
def test_tls_parameters_on_a_plain_url_are_refused(query: str, problem: str) -> None:
    with pytest.raises(StoreError, match=problem):
        parse_redis_url(f"redis://h:1/0?{query}")
    assert _redis_url_problem(f"redis://h:1/0?{query}") == problem


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of none, optional, required"),
        ("ssl_keyfile=/x/k.pem", "ssl_keyfile needs ssl_certfile"),
        ("ssl_ca_certs=", "ssl_ca_certs must be given once, not empty"),
        ("ssl_ca_certs=/a&ssl_ca_certs=/b", "ssl_ca_certs must be given once, not empty"),
        ("ssl_ca_path=/etc/ssl", "unknown url parameter 'ssl_ca_path'"),
    ],
)
def test_bad_tls_parameters_are_named_by_the_store_and_the_config(query: str, problem: str) -> None:
    url = f"rediss://:secret@h:1/0?{query}"
    with pytest.raises(StoreError, match=problem) as e:
        parse_redis_url(url)
    assert "secret" not in str(e.value)
    config_problem = _redis_url_problem(url)
    assert config_problem is not None and config_problem.startswith(problem)
    with pytest.raises(ValueError, match=problem):
        StoreConfig(url=url)


def test_a_missing_tls_file_is_named_with_its_parameter(tmp_path: Path, pem: dict[str, Path]) -> None:
    """A missing file, or one that is no PEM certificate, said at open: a handshake that cannot
    succeed would otherwise pass for a Redis that is down, and the service would wait for ever."""
    missing = tmp_path / "nope" / "ca.pem"
    with pytest.raises(StoreError, match=rf"ssl_ca_certs: cannot read '{missing}': No such file") as e:
        open_store(f"rediss://:secret@h:1/0?ssl_ca_certs={missing}")
    assert "secret" not in str(e.value)
    with pytest.raises(StoreError, match=rf"ssl_keyfile: cannot read '{missing}'"):
        open_store(f"rediss://h:1/0?ssl_certfile={pem['crt']}&ssl_keyfile={missing}")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(StoreError, match=rf"ssl_ca_certs: '{junk}' holds no usable PEM certificate"):
        open_store(f"rediss://h:1/0?ssl_ca_certs={junk}")
    with pytest.raises(StoreError, match=rf"ssl_certfile '{pem['crt']}' and ssl_keyfile '{junk}': not a PEM"):
        open_store(f"rediss://h:1/0?ssl_certfile={pem['crt']}&ssl_keyfile={junk}")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(
        ["openssl", "rsa", "-in", str(pem["key"]), "-aes256", "-passout", "pass:x", "-out", str(encrypted)],
        check=True, capture_output=True,
    )  # fmt: skip
    with pytest.raises(StoreError, match="not a PEM certificate and its unencrypted key"):
        open_store(f"rediss://h:1/0?ssl_certfile={pem['crt']}&ssl_keyfile={encrypted}")  # not a prompt
    with pytest.raises(StoreError, match=rf"ssl_certfile: cannot read '{tmp_path}': Is a directory"):
        open_store(f"rediss://h:1/0?ssl_certfile={tmp_path}")


def test_plain_rediss_url_still_opens() -> None:
    store = open_store("rediss://cache:6380/0")
    assert isinstance(store, RedisStore)
    assert store._client.connection_pool.connection_kwargs["ssl_cert_reqs"] == "required"
    store.close()
