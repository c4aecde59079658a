"""The Redis store against a real redis-server (review 13): a password as password tools make it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import redis

from manager.store import open_store

from .redis_server import client, redis_clean, redis_url  # noqa: F401

T0 = 1_764_547_200.0
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
PASSWORD = "AbC/dEf+#q?x@y=="  # base64's "/", "+", "=" and a "#", "?", "@" besides
USER = "review13"


@pytest.fixture
def acl_user(client: redis.Redis) -> Iterator[str]:  # noqa: F811 - the imported fixture
    """A user of the private server whose password holds url characters; removed afterwards."""
    client.acl_setuser(USER, enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], commands=["+@all"])
    try:
        yield USER
    finally:
        client.acl_deluser(USER)


def test_a_password_with_url_characters_logs_in(redis_clean: str, acl_user: str) -> None:  # noqa: F811
    """Such a password was split into the url's port, path or fragment: the store never connected
    ("the port must be a number"), and an error could show part of the password."""
    url = redis_clean.replace("redis://", f"redis://{acl_user}:{PASSWORD}@")
    with closing(open_store(url)) as s:
        assert s.ping() is True
        s.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
        assert [r["model"] for r in s.requests(0)] == ["voice"]
        assert PASSWORD not in s.url and f"{acl_user}:***@" in s.url
    with closing(open_store(url.replace(PASSWORD, PASSWORD[:-1]))) as wrong:
        assert wrong.ping() is False  # the password is what is checked, not ignored


@pytest.mark.parametrize("wrong", ["password", "database"])
def test_serve_with_a_login_or_database_the_server_refuses_stops_at_once(
    redis_clean: str,  # noqa: F811
    acl_user: str,
    wrong: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A wrong password (or a database number the server does not have) read as an outage: `serve`
    started and retried the store once a second for ever, keeping every request in memory only."""
    import manager.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")
    url = redis_clean.replace("redis://", f"redis://{acl_user}:{PASSWORD}@")
    url = url.replace(PASSWORD, "not-it") if wrong == "password" else url.rsplit("/", 1)[0] + "/999"
    config = tmp_path / "c.yaml"
    config.write_text(f'store: {{url: "{url}"}}\n' + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(config), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "the server refuses" in last and "store.url" in last, err
    assert "not-it" not in err and "Traceback" not in err
    assert "serving on" not in err
