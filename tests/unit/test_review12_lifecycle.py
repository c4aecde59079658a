"""Review of the service's lifecycle (`residency serve`): start-up and stopping as a user sees them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

import manager.cli as cli
from manager.api.runtime import ServeError, add_port

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def test_ctrl_c_while_starting_is_a_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A Ctrl-C in the first second of `serve` (its imports, reading the config: before the server's
    own signal handlers are in place) printed a KeyboardInterrupt traceback of importlib frames."""

    def interrupted(path: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)
    rc = cli.main(["serve", "--config", str(tmp_path / "c.yaml"), "--in-process"])
    err = capsys.readouterr().err
    assert rc == 130
    assert "residency: interrupted" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_front_ends_start_without_grpc_fork_noise(tmp_path: Path) -> None:
    """With front ends (`configs/home.yaml` runs one), every start printed gRPC core's
    "I... fork_posix.cc:71] Other threads are currently calling into gRPC, skipping fork() handlers"
    on stderr when it started them: a line a user cannot act on. The server forks only to exec."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text() + "server: {frontends: 1}\n")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    listen = f"127.0.0.1:{_free_port()}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RESIDENCY), "serve", "--config", str(cfg), "--in-process", "--listen", listen],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "serving on" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = log.read_text()
    assert "1 gRPC front ends on" in text
    assert "fork() handlers" not in text and "fork_posix" not in text, text


def _grpc_server() -> Any:
    import grpc

    return grpc.server(futures.ThreadPoolExecutor(1))


def test_a_missing_tls_file_names_its_setting(tmp_path: Path) -> None:
    """`server.tls_key` naming a file not there said "residency: [Errno 2] No such file or directory:
    'key.pem'": neither the setting nor that it is the TLS key."""
    (tmp_path / "cert.pem").write_text("x")
    server = _grpc_server()
    with pytest.raises(ServeError, match=r"server\.tls_key '.*nokey\.pem': cannot read it: No such file"):
        add_port(server, "127.0.0.1:0", (str(tmp_path / "cert.pem"), str(tmp_path / "nokey.pem")))
    with pytest.raises(ServeError, match=r"server\.tls_cert '.*nocert\.pem': cannot read it"):
        add_port(server, "127.0.0.1:0", (str(tmp_path / "nocert.pem"), str(tmp_path / "nokey.pem")))


def test_an_unusable_tls_pair_is_not_called_a_port_in_use(
    tmp_path: Path, tls_pair: tuple[Path, Path]
) -> None:
    """A cert/key that is not one (an empty file, a key of another certificate) made gRPC print three
    "E... ssl_transport_security" lines and `serve` say "cannot listen on '127.0.0.1:0' (address in use
    or not available)": the user looked for another server on the port."""
    cert, key = tls_pair
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    locked, locked_cert = tmp_path / "locked.pem", tmp_path / "locked-cert.pem"  # a passphrase on the key
    subprocess.run(
        ["openssl", "genrsa", "-aes256", "-passout", "pass:secret", "-out", str(locked), "2048"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "req", "-x509", "-new", "-key", str(locked), "-passin", "pass:secret",
         "-subj", "/CN=localhost", "-days", "1", "-out", str(locked_cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    pairs = [(empty, empty), (cert, empty), (cert, other), (locked_cert, locked)]
    for pair in ((str(c), str(k)) for c, k in pairs):
        with pytest.raises(ServeError, match="are not a PEM certificate and its private key"):
            add_port(_grpc_server(), "127.0.0.1:0", pair)
    server = _grpc_server()
    assert add_port(server, "127.0.0.1:0", (str(cert), str(key))) > 0  # the right pair still binds
    server.stop(None)


def test_an_unopenable_journal_is_said_without_errno(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`store.journal` where no file can be: "residency: [Errno 2] store.journal '…': cannot open the
    request journal: …" (the OSError's number before the sentence that already says it all)."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('store: {journal: "/proc/no-such-process/requests.journal"}\n' + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "residency: store.journal '/proc/no-such-process/requests.journal': cannot open the request journal"
        in err
    )
    assert "[Errno" not in err and "Traceback" not in err
