"""Review 19: the metrics endpoint served plain HTTP even with `server.tls_cert`/`tls_key` set, so the
admin bearer token that scrapers send (the one that authorises Pin, Evict and ReloadConfig) crossed
the network unencrypted. With a certificate and key it now serves HTTPS with them (as gRPC does), plain
HTTP is answered 400 naming the fix, and a client that connects and never finishes its TLS handshake
is cut off (it never holds the accept loop, and its thread only for the read timeout).

Real servers on free loopback ports with a freshly made self-signed certificate (`tls_pair`); only the
read timeout is shortened."""

from __future__ import annotations

import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import manager.metrics as metrics_mod
from manager.api.runtime import ServeError
from manager.api.server import AuthInterceptor, _serve_metrics
from manager.config import Config, load_config
from manager.metrics import Metrics, metrics_tls, serve_metrics

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TOKEN = "s3cret-token-r19"


def trusting(cert: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cert))
    return ctx


def scrape(url: str, cert: Path | None = None, token: str | None = TOKEN) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=trusting(cert) if cert else None) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Served:
    def __init__(self, tls_pair: tuple[Path, Path], allows: Any = None) -> None:
        self.metrics = Metrics()
        self.metrics.thrash.inc()
        cert, key = tls_pair
        self.httpd, self.thread = serve_metrics(
            "127.0.0.1", 0, self.metrics.registry, allows, tls=metrics_tls(str(cert), str(key))
        )
        self.port = self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def served(tls_pair: tuple[Path, Path]) -> Any:
    s = Served(tls_pair, AuthInterceptor(TOKEN).allows)
    yield s
    s.close()


def test_https_with_the_token_is_served_and_without_it_is_refused(
    served: Served, tls_pair: tuple[Path, Path]
) -> None:
    cert, _ = tls_pair
    status, body = scrape(f"https://127.0.0.1:{served.port}/metrics", cert)
    assert status == 200 and "residency_thrash_total 1.0" in body
    status, body = scrape(f"https://127.0.0.1:{served.port}/metrics", cert, token=None)
    assert status == 401 and "bearer token" in body
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # it is TLS, verified
        scrape(f"https://127.0.0.1:{served.port}/metrics", cert=None)


def test_plain_http_is_refused_with_the_fix(served: Served) -> None:
    status, body = scrape(f"http://127.0.0.1:{served.port}/metrics")
    assert status == 400
    assert "HTTPS" in body and f"https://127.0.0.1:{served.port}/metrics" not in body  # (no host guessed)
    assert "residency_thrash_total" not in body
    status, body = scrape(f"http://127.0.0.1:{served.port}/metrics", token=None)
    assert status == 400 and "HTTPS" in body


def test_a_client_that_never_handshakes_is_cut_off_and_holds_nothing_else(
    monkeypatch: pytest.MonkeyPatch, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(metrics_mod._Handler, "timeout", 0.5)
    cert, _ = tls_pair
    s = Served(tls_pair)
    try:
        with (
            socket.create_connection(("127.0.0.1", s.port), timeout=30) as silent,
            socket.create_connection(("127.0.0.1", s.port), timeout=30) as partial,
        ):
            partial.sendall(b"\x16\x03\x01")  # a TLS record's start, and then nothing
            # both connected and silent: a scrape is still answered meanwhile
            status, body = scrape(f"https://127.0.0.1:{s.port}/metrics", cert, token=None)
            assert status == 200 and "residency_thrash_total 1.0" in body
            for idle in (silent, partial):
                assert idle.recv(1) == b""  # closed by the server (its handshake timed out)
    finally:
        s.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_a_handshake_that_trickles_is_cut_off_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch, tls_pair: tuple[Path, Path]
) -> None:
    """Bytes sent one by one, each within the read timeout: the handshake as a whole is bounded."""
    monkeypatch.setattr(metrics_mod._Handler, "timeout", 0.6)
    s = Served(tls_pair)
    closed = threading.Event()
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.settimeout(0.2)
            hello = b"\x16\x03\x01\x02\x00" + b"\x01" * 64  # a record header, then a body that never ends
            for byte in hello:
                try:
                    c.sendall(bytes([byte]))
                    if c.recv(1) == b"":
                        closed.set()
                        break
                except TimeoutError:
                    continue
                except ConnectionError:
                    closed.set()
                    break
    finally:
        s.close()
    assert closed.is_set()  # 65 bytes 0.2 s apart (13 s) outlast a 0.6 s handshake: it was cut off


def config(tmp: Path, **server: Any) -> Config:
    base = load_config(CONFIG)
    return base.model_copy(update={"server": base.server.model_copy(update=server)})


def test_the_service_serves_metrics_over_tls_when_its_certificate_is_set(
    tls_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = tls_pair
    fake_manager = SimpleNamespace(metrics=Metrics())
    cfg = config(
        tmp_path, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key)
    )
    httpd, thread = _serve_metrics(cfg, fake_manager, None)  # type: ignore[arg-type]
    try:
        port = httpd.server_address[1]
        status, body = scrape(f"https://127.0.0.1:{port}/metrics", cert, token=None)
        assert status == 200 and "residency_thrash_total 0.0" in body
        assert scrape(f"http://127.0.0.1:{port}/metrics", token=None)[0] == 400
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
    plain = config(tmp_path, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
    httpd, thread = _serve_metrics(plain, fake_manager, None)  # type: ignore[arg-type]
    try:  # without a certificate: plain HTTP, as before
        assert scrape(f"http://127.0.0.1:{httpd.server_address[1]}/metrics", token=None)[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_an_unusable_certificate_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("not a certificate\n")
    with pytest.raises(ServeError, match=r"server\.tls_cert .* not a PEM certificate"):
        _serve_metrics(
            config(
                tmp_path,
                listen="127.0.0.1:0",
                metrics_listen="127.0.0.1:0",
                tls_cert=str(tmp_path / "c.pem"),
                tls_key=str(tmp_path / "c.pem"),
            ),
            SimpleNamespace(metrics=Metrics()),  # type: ignore[arg-type]
            None,
        )
