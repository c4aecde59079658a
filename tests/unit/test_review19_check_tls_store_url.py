"""Review 19's user walkthrough, the command line's side (real files, real certificates):

- `_connection`: a wildcard `server.listen` from --config (0.0.0.0, ::, [::]) is dialled on loopback,
  by a loopback name the certificate holds (the TLS service's side is tests/integration/
  test_review19_cli_wildcard_tls.py).
- `residency config check` said `ok` for TLS settings `serve` then refused (a key file that is not
  there; the cert and key swapped): now it refuses them, in serve's words.
- `sqlite:///tmp/x/state.db` is relative to the working folder (SQLAlchemy's convention: four slashes
  for an absolute path), and nothing said so: the store's location is now printed with the file it
  resolves to, `config check` and `serve` warn about a relative path that reads as absolute, and the
  schema's description of store.url says so.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from manager.cli import _connection, main
from manager.config import config_json_schema
from manager.store import StoreError, open_store

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
HOME_STORE = 'url: "sqlite:///.residency/state.db"'


def _openssl_pair(tmp_path: Path, name: str, subject: str, san: str | None) -> tuple[Path, Path]:
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    extra = ["-addext", f"subjectAltName={san}"] if san else []
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", subject,
         *extra, "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _home_with(tmp_path: Path, server: str = "", store: str | None = None) -> Path:
    """configs/home.yaml with `server` lines put first (a server: section of their own) and its
    store url replaced by `store`."""
    text = HOME.read_text(encoding="utf-8")
    assert HOME_STORE in text
    if store is not None:
        text = text.replace(HOME_STORE, f'url: "{store}"', 1)
    path = tmp_path / "c.yaml"
    if server:
        text = re.sub(r"(?m)^server:.*(\n[ ]+.*)*\n", "", text, count=1)
        text = server + "\n" + text
    path.write_text(text, encoding="utf-8")
    return path


def _conn_args(config: Path | None = None, **kw: str | None) -> argparse.Namespace:
    args: dict[str, str | None] = {"config": str(config) if config else None, "target": None}
    args |= {"token_env": None, "tls_cert": None} | kw
    return argparse.Namespace(**args)


# --- the wildcard listen, dialled on loopback -------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "target"),
    [("0.0.0.0:50613", "127.0.0.1:50613"), ("[::]:50613", "[::1]:50613"), ("127.0.0.1:7", "127.0.0.1:7")],
)
def test_a_plaintext_wildcard_listen_is_dialled_on_loopback(tmp_path: Path, listen: str, target: str) -> None:
    cfg = _home_with(tmp_path, f'server: {{listen: "{listen}", auth_token_env: RESIDENCY_TOKEN}}')
    assert _connection(_conn_args(cfg)).target == target


@pytest.mark.parametrize(
    ("subject", "san", "host"),
    [
        ("/CN=localhost", "DNS:localhost,IP:127.0.0.1", "localhost"),
        ("/CN=localhost", None, "localhost"),  # a certificate of the name in its CN only
        ("/CN=x", "IP:127.0.0.1", "127.0.0.1"),  # of the address only
        ("/CN=gpu-box", "DNS:gpu-box.lan", "localhost"),  # none: the failure says --target (see integration)
    ],
)
def test_a_tls_wildcard_listen_is_dialled_by_a_loopback_name_the_certificate_holds(
    tmp_path: Path, subject: str, san: str | None, host: str
) -> None:
    cert, key = _openssl_pair(tmp_path, "c", subject, san)
    server = f'server: {{listen: "0.0.0.0:50613", auth_token_env: T, tls_cert: {cert}, tls_key: {key}}}'
    assert _connection(_conn_args(_home_with(tmp_path, server))).target == f"{host}:50613"


def test_a_target_given_is_dialled_as_given(tmp_path: Path) -> None:
    cfg = _home_with(tmp_path, 'server: {listen: "0.0.0.0:50613", auth_token_env: RESIDENCY_TOKEN}')
    assert _connection(_conn_args(cfg, target="10.0.0.2:9")).target == "10.0.0.2:9"


# --- config check refuses the TLS files serve refuses -----------------------------------------


def test_config_check_refuses_a_tls_key_that_is_not_there_in_serves_words(
    tmp_path: Path, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, _ = tls_pair
    nokey = tmp_path / "nokey.pem"
    cfg = _home_with(tmp_path, f"server: {{listen: '127.0.0.1:50051', tls_cert: {cert}, tls_key: {nokey}}}")
    assert main(["config", "check", str(cfg)]) == 2
    out, err = capsys.readouterr()
    assert "ok" not in out
    assert f"server.tls_key '{nokey}': cannot read it: No such file or directory" in err, err
    assert "Traceback" not in err


def test_config_check_refuses_a_swapped_cert_and_key_in_serves_words(
    tmp_path: Path, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = tls_pair
    cfg = _home_with(tmp_path, f"server: {{listen: '127.0.0.1:50051', tls_cert: {key}, tls_key: {cert}}}")
    assert main(["config", "check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "are not a PEM certificate and its private key" in err, err
    assert str(key) in err and str(cert) in err


def test_config_check_passes_a_usable_tls_pair(
    tmp_path: Path, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = tls_pair
    cfg = _home_with(tmp_path, f"server: {{listen: '127.0.0.1:50051', tls_cert: {cert}, tls_key: {key}}}")
    assert main(["config", "check", str(cfg)]) == 0
    assert ": ok (" in capsys.readouterr().out


# --- a relative sqlite path, said --------------------------------------------------------------


def test_a_relative_sqlite_url_is_shown_with_the_file_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from manager.store.base import store_location

    monkeypatch.chdir(tmp_path)
    real = os.getcwd()  # (tmp_path may be reached through a link)
    assert store_location("sqlite:///tmp/w/s.db") == f"sqlite:///tmp/w/s.db ({real}/tmp/w/s.db)"
    assert store_location("sqlite:////tmp/w/s.db") == "sqlite:////tmp/w/s.db"
    assert store_location("sqlite:///:memory:") == "sqlite:///:memory:"
    assert store_location("redis://me:secret@cache:6379/0") == "redis://me:***@cache:6379/0"


def test_a_store_error_names_the_file_a_relative_url_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trace export` of a store not there yet: the error names the absolute file it looked for."""
    monkeypatch.chdir(tmp_path)
    cfg = _home_with(tmp_path, store="sqlite:///tmp/w/s.db")
    assert main(["trace", "export", "--config", str(cfg), "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"sqlite:///tmp/w/s.db ({os.getcwd()}/tmp/w/s.db)" in err, err
    with pytest.raises(StoreError, match=re.escape(f"({os.getcwd()}/tmp/w/s.db)")):
        open_store("sqlite:///tmp/w/s.db", create=False)


def test_tune_from_store_names_the_file_a_relative_url_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with closing(open_store("sqlite:///tmp/w/s.db")) as s:
        s.append_requests([{"t": time.time() - 60, "model": "voice", "busy_s": 0.4}])
    cfg = _home_with(tmp_path, store="sqlite:///tmp/w/s.db")
    main(["tune", "--config", str(cfg), "--from-store", "--out", str(tmp_path / "t.yaml")])
    err = capsys.readouterr().err
    assert f"from sqlite:///tmp/w/s.db ({os.getcwd()}/tmp/w/s.db)" in err, err


def test_config_check_warns_of_a_relative_sqlite_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _home_with(tmp_path, store="sqlite:///tmp/w/s.db")
    assert main(["config", "check", str(cfg)]) == 0
    out, err = capsys.readouterr()
    assert ": ok (" in out
    assert "store.url" in err and "relative to the working folder" in err, err
    assert f"{os.getcwd()}/tmp/w/s.db" in err and "sqlite:////tmp/w/s.db" in err, err


@pytest.mark.parametrize(
    "url", ["sqlite:////tmp/w/s.db", "sqlite:///.residency/state.db", "sqlite:///./s.db"]
)
def test_config_check_is_quiet_about_an_absolute_or_plainly_relative_sqlite_path(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An absolute path, and a path that starts with a dot (the default `.residency/state.db`, which
    cannot be read as an absolute one), are not warned about."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", "check", str(_home_with(tmp_path, store=url))]) == 0
    assert "relative to the working folder" not in capsys.readouterr().err


def test_the_schema_says_how_a_sqlite_url_is_relative_or_absolute() -> None:
    text = config_json_schema()["$defs"]["StoreConfig"]["properties"]["url"]["description"]
    assert "relative to the working folder" in text and "sqlite:////" in text, text


SERVE_CONFIG = """\
store: {{url: "sqlite:///tmp/w/s.db", journal: "{work}/requests.jsonl", sessions: "{work}/sessions"}}
server: {{listen: "127.0.0.1:0"}}
devices:
  - {{name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - name: voice
    class: realtime
    adapter: silero-vad
    device: cpu0
    memory: 2181128
    load_seconds: {{disk: 0.07, cached: 0.07, host: 0.06}}
"""


def test_serve_warns_of_a_relative_sqlite_path_and_its_start_line_names_the_file(tmp_path: Path) -> None:
    """The real `serve` (in-process device hosts) from `tmp_path`: the warning, then the start line
    naming the store by its url and the absolute file."""
    (tmp_path / "c.yaml").write_text(SERVE_CONFIG.format(work=tmp_path))
    log = tmp_path / "serve.log"
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, "-m", "manager.cli", "serve", "--config", "c.yaml", "--in-process"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env
        )
    try:
        deadline = time.monotonic() + 180  # a hang guard only
        while not re.search(r"serving on \S+:\d+ .*\n", log.read_text(errors="replace")):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = log.read_text(errors="replace")
    real = os.path.realpath(tmp_path)
    warning = next((line for line in text.splitlines() if "relative to the working folder" in line), "")
    assert "sqlite:////tmp/w/s.db" in warning, text[-3000:]
    start = next(line for line in text.splitlines() if "serving on" in line)
    assert f"sqlite:///tmp/w/s.db ({real}/tmp/w/s.db)" in start, start
    assert (Path(real) / "tmp" / "w" / "s.db").exists()
