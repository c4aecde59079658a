"""Review 19's user walkthrough: `residency ps --config sec.yaml` (and `stats`, `events`, the admin
commands) failed with exit 2 against a TLS service listening on 0.0.0.0: the CLI dialled the wildcard
address itself, and TLS checked the certificate against "0.0.0.0" ("Hostname Verification Check
failed"), without a word on what to do. Now a wildcard listen from the config is dialled on loopback,
by a loopback name the certificate holds (localhost, else 127.0.0.1 or ::1); a certificate holding
none (a LAN name only), and any hostname-verification failure, is said with `--target HOST:PORT`
and the names the certificate holds.

A real service (build_server, in-process device hosts), real certificates made with openssl.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from manager.api.server import build_server
from manager.cli import main
from manager.config import load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TOKEN = "review19-wildcard-token"
ENV = "REVIEW19_WILDCARD_TOKEN"


async def cli(*argv: str) -> int:
    """`residency ARGV` (its own thread: the service runs on this event loop)."""
    return await asyncio.to_thread(main, list(argv))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _lan_only_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for a LAN host name only (no loopback name), and its key."""
    cert, key = tmp_path / "lan.pem", tmp_path / "lan.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=gpu-box",
         "-addext", "subjectAltName=DNS:gpu-box.lan", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _config(tmp_path: Path, name: str, listen: str, cert: Path, key: Path) -> Path:
    """configs/local-cpu.yaml listening on `listen` over TLS (cert, key), with a token (beyond loopback)."""
    server = f'server: {{listen: "{listen}", auth_token_env: {ENV}, tls_cert: {cert}, tls_key: {key}}}\n'
    path = tmp_path / name
    path.write_text(server + f'store: {{url: "sqlite:///{tmp_path}/state.db"}}\n' + CONFIG.read_text())
    return path


@contextlib.asynccontextmanager
async def serving(path: Path) -> AsyncIterator[tuple[int, LiveManager]]:
    """The service from the config file `path`: the port it bound, and its manager."""
    cfg = load_config(path)
    pool = create_pool(cfg, in_process=True)
    manager = LiveManager(cfg, pool)
    server, port, _ = await build_server(cfg, manager, str(path))
    await server.start()
    await manager.start()
    try:
        yield port, manager
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_a_config_listening_on_every_address_over_tls_is_reached_on_loopback(
    tmp_path: Path, tls_pair: tuple[Path, Path], host: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`ps --config` and an admin command with the service's own config (listen 0.0.0.0 or [::], its
    certificate for localhost and 127.0.0.1): they reach it."""
    monkeypatch.setenv(ENV, TOKEN)
    cert, key = tls_pair

    async def run() -> None:
        async with serving(_config(tmp_path, "serve.yaml", f"{host}:0", cert, key)) as (port, manager):
            used = _config(tmp_path, "sec.yaml", f"{host}:{port}", cert, key)  # as the user's file
            capsys.readouterr()
            assert await cli("ps", "--config", str(used)) == 0, capsys.readouterr().err
            assert " embed " in capsys.readouterr().out
            assert await cli("pin", "embed", "--config", str(used)) == 0, capsys.readouterr().err
            assert manager.engine.models["embed"].pinned

    asyncio.run(run())


def test_a_certificate_without_a_loopback_name_says_to_give_target_with_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate for the machine's LAN name only cannot be matched on loopback: exit 2, and the
    line says to give --target with the name the certificate holds."""
    monkeypatch.setenv(ENV, TOKEN)
    cert, key = _lan_only_pair(tmp_path)

    async def run() -> None:
        async with serving(_config(tmp_path, "serve.yaml", "0.0.0.0:0", cert, key)) as (port, _):
            used = _config(tmp_path, "sec.yaml", f"0.0.0.0:{port}", cert, key)
            capsys.readouterr()
            assert await cli("ps", "--config", str(used)) == 2
            line = one_line(capsys.readouterr().err)
            assert f"--target gpu-box.lan:{port}" in line, line
            assert "0.0.0.0" in line and "Traceback" not in line, line

    asyncio.run(run())


def test_a_hostname_verification_failure_says_to_give_a_name_the_certificate_holds(
    tmp_path: Path, tls_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """--target with an address the certificate does not name (the wildcard given as the flag): exit
    2, naming --target with a name the certificate holds."""
    monkeypatch.setenv(ENV, TOKEN)
    cert, key = tls_pair

    async def run() -> None:
        async with serving(_config(tmp_path, "serve.yaml", "0.0.0.0:0", cert, key)) as (port, _):
            capsys.readouterr()
            argv = ["--target", f"0.0.0.0:{port}", "--tls-cert", str(cert), "--token-env", ENV]
            assert await cli("stats", *argv) == 2
            line = one_line(capsys.readouterr().err)
            assert "Hostname" in line and f"--target localhost:{port}" in line, line

    asyncio.run(run())
