"""Review 17: the metrics endpoint cuts off a client that sends nothing for HTTP_TIMEOUT_S (review 14),
but the cut-off was Python's socketserver's unhandled error: a "Exception occurred during processing
of request" block and a TimeoutError traceback on the service's stderr for each idle connection (a
port scan, a TCP health check, a scraper that went away), and so for a client that dropped the
connection mid-request. Such a connection is now closed quietly (logged at debug). Real server on a
free loopback port; only the read timeout is shortened."""

from __future__ import annotations

import logging
import socket
import urllib.request

import pytest

import manager.metrics as metrics_mod
from manager.metrics import Metrics, serve_metrics


def test_an_idle_client_is_cut_off_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(metrics_mod._Handler, "timeout", 0.2)
    m = Metrics()
    m.thrash.inc()
    httpd, thread = serve_metrics("127.0.0.1", 0, m.registry)
    port = httpd.server_address[1]
    try:
        with caplog.at_level(logging.DEBUG, logger="manager.metrics"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"GET /metr")  # and then nothing
                assert s.recv(1) == b""  # the server closed it (after its handler ended)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                body = r.read().decode()
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
    assert "residency_thrash_total 1.0" in body  # still serving
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    assert any("timed out" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
