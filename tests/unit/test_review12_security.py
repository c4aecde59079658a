"""Security review of `residency serve` (manager/api/server.py, manager/metrics.py, the front ends'
private sockets): one class per bug found; each docstring says what failed before."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from live_helpers import local_config

from manager import metrics as metrics_mod
from manager.api.runtime import ServeError
from manager.api.server import AuthInterceptor, Frontends, auth_token, serve
from manager.config import Config

TOKEN = "review12-s3cret"
VAR = "RESIDENCY_REVIEW12_TOKEN"


def config(tmp_path: Path, **server: Any) -> Config:
    return local_config(tmp_path, ("voice",), **server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


class TestATokenVariableSetButEmpty:
    """`server.auth_token_env` naming a variable that is set but empty (`RESIDENCY_TOKEN=$(cat
    a-missing-file)`) or blank was taken as no token at all: on loopback the service started and
    every admin call (Evict, ReloadConfig, the events) was open to any local user, without a word."""

    @pytest.mark.parametrize("value", ["", "   "], ids=["empty", "blank"])
    def test_it_is_refused_at_start_naming_the_variable(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
    ) -> None:
        monkeypatch.setenv(VAR, value)
        with pytest.raises(ServeError, match=f"\\${VAR}, which is set but empty"):
            auth_token(config(tmp_path, auth_token_env=VAR))

    def test_an_unset_variable_on_loopback_still_means_no_token(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv(VAR, raising=False)
        assert auth_token(config(tmp_path, auth_token_env=VAR)) is None


class TestATokenEndingInASpace:
    """A token with a trailing space (read from a file) was accepted, but HTTP/2 forbids a header
    value that ends in one: grpcurl (the tool the README names) strips it, so every admin call it
    made with the right token was UNAUTHENTICATED, and nothing said why."""

    @pytest.mark.parametrize("value", [f"{TOKEN} ", f" {TOKEN}"], ids=["trailing", "leading"])
    def test_it_is_refused_at_start_without_showing_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
    ) -> None:
        monkeypatch.setenv(VAR, value)
        with pytest.raises(ServeError, match="starts or ends with a space") as e:
            auth_token(config(tmp_path, auth_token_env=VAR))
        assert VAR in str(e.value) and TOKEN not in str(e.value)

    def test_a_space_inside_is_still_taken_as_it_is(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(VAR, "a b")
        assert auth_token(config(tmp_path, auth_token_env=VAR)) == "a b"


def serve_until_ready(cfg: Config, on_ready: Callable[[int], None]) -> None:
    """`residency serve` in this process: `on_ready(port)` once it serves, then SIGTERM stops it."""

    def ready(port: int) -> None:
        try:
            on_ready(port)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    asyncio.run(serve(cfg, in_process=True, ready=ready))


class TestMetricsBeyondLoopback:
    """`server.metrics_listen: "0.0.0.0:9100"` was served to the whole LAN with no token, whether one
    was set or not, and without a word: anyone there could read which models the home runs and when
    each is used (requests per model and class, queue depths), though the gRPC listener beside it is
    refused beyond loopback without a token."""

    def test_without_a_token_it_is_refused_at_start(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv(VAR, raising=False)
        cfg = config(tmp_path, auth_token_env=VAR, metrics_listen=f"0.0.0.0:{free_port()}")
        with pytest.raises(ServeError, match=r"metrics_listen .* beyond loopback"):
            auth_token(cfg)
        with pytest.raises(ServeError, match="beyond loopback"):
            asyncio.run(serve(cfg, in_process=True))  # refused before anything starts
        # on loopback, as before, no token is needed
        assert auth_token(config(tmp_path, metrics_listen="127.0.0.1:9100")) is None

    def test_with_a_token_scrapers_must_send_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(VAR, TOKEN)
        port = free_port()
        cfg = config(tmp_path, auth_token_env=VAR, metrics_listen=f"0.0.0.0:{port}")
        seen: list[tuple[int, str]] = []

        def scrape(_: int) -> None:
            url = f"http://127.0.0.1:{port}/metrics"
            seen.extend([get(url), get(url, "wrong"), get(url, TOKEN)])

        serve_until_ready(cfg, scrape)
        (no, no_body), (wrong, _), (ok, body) = seen
        assert (no, wrong, ok) == (401, 401, 200)
        assert "bearer token" in no_body and TOKEN not in no_body
        assert "residency_requests" in body


@pytest.fixture
def metrics_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, Any]]:
    """The metrics HTTP server on a free loopback port, with a 0.5 s read timeout and 2 slots."""
    monkeypatch.setattr(metrics_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(metrics_mod, "HTTP_MAX_CONNECTIONS", 2)
    m = metrics_mod.Metrics()
    httpd, thread = metrics_mod.serve_metrics("127.0.0.1", 0, m.registry, AuthInterceptor(TOKEN).allows)
    try:
        yield int(httpd.server_address[1]), httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


class TestMetricsIdleClients:
    """prometheus_client's HTTP server gave every connection a thread with no read timeout and no
    bound: a client that connected and sent nothing (or a few bytes now and then) held its thread for
    ever, and many of them exhausted the service's threads and memory."""

    def test_a_client_that_sends_nothing_is_cut_off(self, metrics_server: tuple[int, Any]) -> None:
        port, _ = metrics_server
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed by the server, not our 10 s timeout
            assert time.monotonic() - t0 < 5

    def test_connections_past_the_bound_are_closed_and_service_resumes(
        self, metrics_server: tuple[int, Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        port, _ = metrics_server
        monkeypatch.setattr(metrics_mod._Handler, "timeout", 30.0)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            time.sleep(0.3)  # both accepted, each holding a slot
            with socket.create_connection(("127.0.0.1", port)) as third:
                third.settimeout(5)
                assert third.recv(100) == b""  # refused at once
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        status = 0
        while time.monotonic() < deadline and status != 200:
            try:
                status, _ = get(f"http://127.0.0.1:{port}/metrics", TOKEN)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert status == 200


class TestStalePrivateSocketsAfterACrash:
    """A manager with `server.frontends` that was killed (SIGKILL, OOM) left its private directory
    with its gRPC and fast-path sockets under TMPDIR for ever: every crash added one, and nothing
    cleaned them up."""

    def test_the_next_start_removes_dead_managers_dirs_only(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="r12-"))  # short: the sockets' paths must fit
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "keep").write_text("x")
        try:
            stale = tmp / f"residency-front-{dead.pid}-abcd1234"
            stale.mkdir(mode=0o700)
            with socket.socket(socket.AF_UNIX) as s:  # a stale socket, as a killed manager leaves it
                s.bind(str(stale / "fast.sock"))
            running = tmp / f"residency-front-{alive.pid}-efgh5678"
            running.mkdir(mode=0o700)
            link = tmp / f"residency-front-{dead.pid}-link"
            link.symlink_to(elsewhere)
            fronts = Frontends(config(tmp_path, frontends=1), None)  # type: ignore[arg-type]
            try:
                assert not stale.exists()
                assert running.is_dir()  # its manager runs
                assert (elsewhere / "keep").exists() and link.is_symlink()  # a link is not followed
                assert Path(fronts.dir).name.startswith(f"residency-front-{os.getpid()}-")
                assert Path(fronts.dir).stat().st_mode & 0o777 == 0o700
            finally:
                asyncio.run(fronts.stop())
            assert not Path(fronts.dir).exists()
        finally:
            alive.kill()
            alive.wait()
            shutil.rmtree(tmp, ignore_errors=True)


def test_config_check_says_what_serve_now_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` refuses metrics beyond loopback without a token, and a token variable set but empty;
    `config check` passed both without a word."""
    from manager.cli import main

    home = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"
    text = home.read_text(encoding="utf-8")
    lan = tmp_path / "metrics.yaml"
    lan.write_text(
        text.replace("server:\n", 'server:\n  metrics_listen: "0.0.0.0:9100"\n', 1), encoding="utf-8"
    )
    assert main(["config", "check", str(lan)]) == 2
    assert "server.metrics_listen '0.0.0.0:9100' is beyond loopback" in capsys.readouterr().err
    named = tmp_path / "named.yaml"
    named.write_text(text.replace("auth_token_env: null", "auth_token_env: RES_TEST_TOKEN"), encoding="utf-8")
    monkeypatch.setenv("RES_TEST_TOKEN", "  ")
    assert main(["config", "check", str(named)]) == 0  # the variable may be right where it serves
    assert "$RES_TEST_TOKEN, which is set but empty here" in capsys.readouterr().err
