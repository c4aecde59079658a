"""No `*_created` series on the service's /metrics (15th review: manager/metrics.py); each test that
scrapes failed before its fix.

prometheus_client gives every child of a counter, histogram and summary a `<name>_created` series
(its creation time): it doubled the series a scrape of the service stores, and a home server's
Prometheus has no use for it. The service's registry now leaves them out, in both exposition formats
and in a `?name[]=` scrape, while a process that imports `manager.metrics` keeps them in its own
registries (prometheus_client's global switch is left alone). Real components: the metrics endpoint
(`serve_metrics`) and, for the service, `residency serve` in this process with a real model.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from test_review14_observability import free_port_on_both, odd_config, serve_with

from manager.live import LiveManager
from manager.metrics import Metrics, serve_metrics

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def scrape(url: str, accept: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5.0) as r:
        assert r.status == 200
        return str(r.read().decode("utf-8"))


def series(text: str) -> set[str]:
    """The series names of an exposition's sample lines."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def created(text: str) -> list[str]:
    return sorted(n for n in series(text) if n.endswith("_created"))


@pytest.fixture
def endpoint() -> Any:
    """A `Metrics` with a child of every counter and histogram, served on a free loopback port."""
    m = Metrics()
    m.thrash.inc()
    m.log_dropped.inc()
    m.child("requests", "tiny", "interactive", "ok").inc()
    m.child("loads", "tiny", "gpu", "disk").inc()
    m.child("evictions", "tiny", "host").inc()
    m.child("failures", "gone", "missing_checkpoint").inc()
    m.child("load_seconds", "tiny", "disk->gpu").observe(0.2)
    m.child("wait", "interactive").observe(0.01)
    httpd, thread = serve_metrics("127.0.0.1", 0, m.registry)
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


COUNTED = {
    "residency_thrash_total",
    "residency_request_log_dropped_total",
    "residency_requests_total",
    "residency_loads_total",
    "residency_evictions_total",
    "residency_load_failures_total",
    "residency_load_seconds_count",
    "residency_load_seconds_bucket",
    "residency_request_wait_seconds_sum",
}


@pytest.mark.parametrize("accept", [None, OPENMETRICS], ids=["text", "openmetrics"])
def test_the_endpoint_serves_no_created_series_and_every_counter(endpoint: str, accept: str | None) -> None:
    text = scrape(endpoint, accept)
    assert created(text) == []  # was: residency_loads_created, residency_load_seconds_created, ...
    assert series(text) >= COUNTED
    assert "residency_thrash_total 1.0" in text


def test_a_scrape_of_named_series_serves_no_created_series_either(endpoint: str) -> None:
    text = scrape(endpoint + "?name[]=residency_thrash_total&name[]=residency_thrash_created")
    assert series(text) == {"residency_thrash_total"}  # was: and residency_thrash_created


def test_other_registries_of_the_process_keep_theirs() -> None:
    """Only the service's registry leaves them out: a library user's registry is as prometheus_client
    makes it (its global `disable_created_metrics()` is not called)."""
    Metrics()
    theirs = CollectorRegistry()
    Counter("library_events", "A library user's counter", registry=theirs).inc()
    assert "library_events_created" in series(generate_latest(theirs).decode())


def test_the_services_scrape_has_no_created_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`residency serve` with `server.metrics_listen`, after loads, an eviction, a failed load and
    requests (every counter and histogram has children)."""
    port = free_port_on_both()
    cfg = odd_config(tmp_path, port)
    texts: list[str] = []

    async def body(manager: LiveManager) -> None:
        x = {"input": np.zeros((1, 4), np.float32)}
        await manager.infer("tiny", x)
        manager.evict("tiny", "host")
        await manager.infer("tiny", x)
        with pytest.raises(Exception, match=r"missing\.pt"):
            await manager.preload("gone", "gpu")
        texts.append(await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics"))

    serve_with(cfg, monkeypatch, body)
    names = series(texts[0])
    assert created(texts[0]) == []  # was: one per counter and histogram child
    assert {
        "residency_requests_total",
        "residency_loads_total",
        "residency_evictions_total",
        "residency_load_failures_total",
        "residency_load_seconds_count",
        "residency_request_wait_seconds_count",
    } <= names
