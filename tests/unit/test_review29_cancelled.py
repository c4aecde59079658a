"""Found in the 29th review (the operator's view). A request whose client hung up (its RPC cancelled,
as grpc.aio cancels the handler) was counted nowhere: not in `residency_requests_total`, not in
Stats, and one that was already running was missing from the request log the weekly replay and
tuning read, though the load it caused was counted. An Evict(to=host) ignored the call's deadline,
and slow clients of the metrics endpoint could hold its every slot. Each test failed before its
fix. Real components: the live manager over in-process device hosts, a real TorchScript
checkpoint, the SQLite store, prometheus_client's registry, the service's gRPC server and the
metrics HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_review13_admin import _HoldingPool, config
from test_review13_admin import serving as admin_serving

import manager.metrics as metrics_mod
from manager.config import Config
from manager.live import LiveManager
from manager.store import open_store
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

X = {"input": np.zeros((1, 4), np.float32)}


def requests_by_outcome(manager: Any) -> dict[str, float]:
    text = generate_latest(manager.metrics.registry).decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "residency_requests_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def wait_count(manager: Any) -> float:
    text = generate_latest(manager.metrics.registry).decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "residency_request_wait_seconds_count"
    )


def logged(tmp_path: Path) -> list[tuple[str, str]]:
    """The request log's (model, outcome) pairs, in order of arrival."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        return [(r["model"], r["outcome"]) for r in sorted(store.requests(0), key=lambda r: r["t"])]
    finally:
        store.close()


@contextlib.asynccontextmanager
async def serving(
    cfg: Config, tmp_path: Path, hold: tuple[str, ...] = ()
) -> AsyncIterator[tuple[pb_grpc.ResidencyStub, LiveManager, _HoldingPool]]:
    """Review 13's service (its gRPC server over in-process hosts, the results of the models in `hold`
    kept back) with the SQLite store: the request log is read once the manager has stopped."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        async with admin_serving(cfg, hold, store) as served:
            yield served
    finally:
        store.close()


def test_a_request_cancelled_while_its_model_loads_is_counted_cancelled(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(config(tmp_path), tmp_path, hold=("tiny",)) as (stub, manager, pool):
            call = asyncio.ensure_future(manager.infer("tiny", X, timeout_s=20))
            await until(lambda: ("load", "tiny") in pool.sent, "the cold load to be sent")
            call.cancel()  # what grpc.aio does to the handler when its client goes away
            await asyncio.gather(call, return_exceptions=True)
            assert call.cancelled()
            pool.hold.clear()
            assert requests_by_outcome(manager) == {"cancelled": 1.0}
            stats = await stub.Stats(pb.StatsRequest())
            assert (stats.cancelled, stats.requests, stats.errors, stats.rejected) == (1, 0, 0, 0)
            assert wait_count(manager) == 0  # it never ran: no wait before a run to observe
            await manager.infer("tiny", X, timeout_s=20)  # the service goes on
            assert requests_by_outcome(manager) == {"cancelled": 1.0, "ok": 1.0}
        # the log holds the requests that ran, and (review 31) the one that never ran, as demand
        assert logged(tmp_path) == [("tiny", "unserved"), ("tiny", "ok")]

    asyncio.run(body())


class _SlowInfer:
    """Around the in-process pool (unit tests only): `infer` of the model in `slow` blocks its thread
    until `go` is set, as a long forward pass does."""

    def __init__(self, real: Any, slow: str) -> None:
        self.real, self.slow = real, slow
        self.started, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float) -> Any:
        if model == self.slow:
            self.started.set()
            assert self.go.wait(30), "the test never let the forward end"
        return self.real.infer(device, model, inputs, timeout_s)


def test_a_request_cancelled_while_it_runs_is_counted_and_logged_when_it_ends(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(config(tmp_path), tmp_path) as (stub, manager, pool):
            await manager.infer("tiny", X, timeout_s=20)  # loaded (and its call time learned)
            slow = _SlowInfer(pool.real, "tiny")
            manager.pool = slow
            manager._infer_s["tiny"] = 1.0  # (on a thread, as a model that takes a while is)
            call = asyncio.ensure_future(manager.infer("tiny", X, timeout_s=20))
            await until(slow.started.is_set, "the forward to start")
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            assert requests_by_outcome(manager) == {"ok": 1.0, "cancelled": 1.0}
            assert manager.live["tiny"].inflight == 1  # it still runs on the device host
            slow.go.set()
            await until(lambda: manager.live["tiny"].inflight == 0, "the forward to end")
            assert wait_count(manager) == 1  # Stats' and the metric's waits are served requests'
            stats = await stub.Stats(pb.StatsRequest())
            assert (stats.cancelled, stats.requests, stats.cold_starts) == (1, 1, 1)
            manager.pool = pool
        assert logged(tmp_path) == [("tiny", "ok"), ("tiny", "cancelled")]

    asyncio.run(body())


def test_an_evict_to_host_answers_within_the_callers_deadline(tmp_path: Path) -> None:
    """Evict(to=host) waited its fixed 20 s for the demote whatever the call's deadline, so a caller
    with a 3 s deadline got a bare DEADLINE_EXCEEDED; now it is answered (`loading`: the demote goes
    on) before its deadline, as Pin and Preload are."""

    async def body() -> None:
        async with serving(config(tmp_path), tmp_path) as (stub, manager, pool):
            await manager.infer("tiny", X, timeout_s=20)
            pool.hold.add("tiny")  # the device host's answer to the demote is slow
            answer = await stub.Evict(pb.EvictRequest(name="tiny", to="host"), timeout=3)
            assert answer.tier == "loading", answer
            pool.hold.clear()
            await until(lambda: manager.live["tiny"].tier == "host", "the demote to be confirmed")

    asyncio.run(body())


def _trickle(port: int, stop: threading.Event, cut: list[bool], tls: ssl.SSLContext | None = None) -> None:
    """A client (at 127.0.0.2) that sends its request a byte at a time, each within the read timeout
    (`tls`: over TLS, its handshake done first)."""
    raw = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
    s = raw
    try:
        if tls is not None:
            s = tls.wrap_socket(raw, server_hostname="localhost")
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        while not stop.is_set():
            s.sendall(b"X")
            time.sleep(0.1)
    except OSError:  # cut off, or refused (ssl.SSLError too)
        cut.append(True)
    finally:
        with contextlib.suppress(OSError):
            s.close()
        raw.close()


@pytest.mark.parametrize("https", [False, True])
def test_a_client_sending_a_byte_at_a_time_holds_no_slot_for_good(
    https: bool, monkeypatch: pytest.MonkeyPatch, tls_pair: tuple[Path, Path]
) -> None:
    """The metrics endpoint's read timeout is each read's: clients that sent a byte now and then held
    every slot for as long as they liked, and every scrape was closed unanswered. Now one client
    address holds at most HTTP_PER_CLIENT slots, and each connection is cut HTTP_CONNECTION_S after
    it was accepted, over HTTPS too (the cut first reached only the socket TLS had detached)."""
    monkeypatch.setattr(metrics_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(metrics_mod, "HTTP_MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metrics_mod, "HTTP_PER_CLIENT", 3)
    monkeypatch.setattr(metrics_mod, "HTTP_CONNECTION_S", 1.5)
    cert, key = tls_pair
    served_tls = metrics_mod.metrics_tls(str(cert), str(key)) if https else None
    client_tls = ssl.create_default_context(cafile=str(cert)) if https else None
    httpd, thread = metrics_mod.serve_metrics("127.0.0.1", 0, metrics_mod.Metrics().registry, tls=served_tls)
    port = int(httpd.server_address[1])
    stop, cut = threading.Event(), list[bool]()
    tricklers = [threading.Thread(target=_trickle, args=(port, stop, cut, client_tls)) for _ in range(4)]
    try:
        for t in tricklers:
            t.start()
        time.sleep(0.5)  # 3 of them hold slots (the fourth, over its address's share, was closed)
        scheme = "https://127.0.0.1" if https else "http://127.0.0.1"
        with urllib.request.urlopen(f"{scheme}:{port}/metrics", timeout=10, context=client_tls) as r:
            assert r.status == 200  # the slot left beside one client's share
        deadline = time.monotonic() + 20
        while len(cut) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(cut) == 4, f"only {len(cut)} of the 4 slow clients were cut off"
    finally:
        stop.set()
        for t in tricklers:
            t.join(10)
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
