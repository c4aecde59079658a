"""Found in the 14th review of the operator's view: the metrics endpoint (manager/metrics.py) as a
scraper meets it, `residency ps` (manager/api/client.py) and the admin Events stream
(manager/api/admin.py). Each class names what failed before its fix; the exposition and Events
checks guard what held. Real components: `residency serve` in this process over in-process device
hosts, its gRPC server on a free port, prometheus_client's own text parser, TLS from openssl."""

from __future__ import annotations

import asyncio
import errno
import math
import os
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from live_helpers import until
from prometheus_client.parser import text_string_to_metric_families
from test_review13_admin import serving

import manager.api.server as server_mod
from manager.api.server import build_server, serve
from manager.cli import main
from manager.config import Config, load_config
from manager.live import EVENTS_QUEUE, LiveManager
from manager.metrics import Metrics, serve_metrics
from manager.workers_bridge import create_pool
from residency_proto.v1 import residency_pb2 as pb


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")


def free_port_on_both() -> int:
    """A port free on 127.0.0.1 and on ::1 (when there is one) alike."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not _has_ipv6_loopback():
            return port
        with socket.socket(socket.AF_INET6) as s6:
            try:
                s6.bind(("::1", port))
                return port
            except OSError:
                continue
    raise AssertionError("no port free on both loopback addresses")


def scrape(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return int(r.status), r.read().decode("utf-8")


def answers(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) == 0


# -- metrics_listen: localhost ------------------------------------------------------------------


@needs_ipv6
class TestMetricsOnLocalhostListensOnBothLoopbacks:
    """`server.metrics_listen: localhost:9100` bound only the first address the resolver gave for
    `localhost` (127.0.0.1 here, ::1 first on Fedora-like hosts), while `server.listen: localhost:…`
    binds both loopback addresses (gRPC's rule for `localhost`): a scraper of http://[::1]:9100 (or of
    127.0.0.1 where ::1 came first) found nothing listening."""

    def test_a_scraper_reaches_it_on_127_0_0_1_and_on_ipv6_loopback(self) -> None:
        m = Metrics()
        m.thrash.inc()
        port = free_port_on_both()
        httpd, thread = serve_metrics("localhost", port, m.registry)
        try:
            for url in (f"http://127.0.0.1:{port}/metrics", f"http://[::1]:{port}/metrics"):
                status, body = scrape(url)
                assert status == 200 and "residency_thrash_total 1.0" in body, url
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join(5)
        assert not thread.is_alive()
        assert not answers(socket.AF_INET, "127.0.0.1", port)
        assert not answers(socket.AF_INET6, "::1", port)

    def test_either_loopback_held_by_another_server_is_an_error_and_nothing_is_left_bound(self) -> None:
        port = free_port_on_both()
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as other:
            other.bind(("::1", port))
            other.listen()
            with pytest.raises(OSError) as e:
                serve_metrics("localhost", port, Metrics().registry)
            assert e.value.errno == errno.EADDRINUSE and f"[::1]:{port}" in str(e.value)
            # its scrapers would have split between the two servers; and the IPv4 half is let go
            assert not answers(socket.AF_INET, "127.0.0.1", port)

    def test_port_0_puts_both_on_one_port(self) -> None:
        httpd, thread = serve_metrics("localhost", 0, Metrics().registry)
        try:
            port = int(httpd.server_address[1])
            assert scrape(f"http://127.0.0.1:{port}/metrics")[0] == 200
            assert scrape(f"http://[::1]:{port}/metrics")[0] == 200
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join(5)


def test_a_resolved_address_this_host_lacks_is_skipped_when_another_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name resolving to an address this host does not have (::1 listed where IPv6 is off, here a
    documentation address) beside one it has: the first one alone was tried, and the service refused
    to start ("cannot listen: Cannot assign requested address") though the other could be served.
    (The resolver is stood in for; the binds are real.)"""
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "metrics.review14.test":
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    httpd, thread = serve_metrics("metrics.review14.test", 0, Metrics().registry)
    try:
        port = int(httpd.server_address[1])
        assert scrape(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_no_address_that_can_be_bound_is_the_bind_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "metrics.review14.test":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::1", port, 0, 0))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(OSError) as e:
        serve_metrics("metrics.review14.test", 0, Metrics().registry)
    assert e.value.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and "2001:db8::1" in str(e.value)


# -- the exposition, as a scraper parses it ---------------------------------------------------

ODD_DEVICE = 'cpu"0\\x\n✓'
ODD_CLASS = 'inter"active\\\nü'
"""Device and class names are free text in a config (model names are `[A-Za-z0-9][A-Za-z0-9_.-]*`):
a quote, a backslash, a newline and non-ASCII, each of which the exposition must escape."""


def odd_config(tmp_path: Path, metrics_port: int) -> Config:
    from test_review13_admin import config as tiny_config

    tiny_config(tmp_path)  # the TorchScript checkpoint, and c.yaml
    text = (tmp_path / "c.yaml").read_text()
    text = text.replace(
        'server: {listen: "127.0.0.1:0"}',
        f'server: {{listen: "127.0.0.1:0", metrics_listen: "localhost:{metrics_port}"}}',
    )
    text = text.replace("name: cpu0,", 'name: "cpu\\"0\\\\x\\n✓",').replace(
        "device: cpu0,", 'device: "cpu\\"0\\\\x\\n✓",'
    )
    text = text.replace("{name: interactive}", '{name: "inter\\"active\\\\\\nü"}').replace(
        "class: interactive,", 'class: "inter\\"active\\\\\\nü",'
    )
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml")
    assert [d.name for d in cfg.devices] == [ODD_DEVICE] and [c.name for c in cfg.classes] == [ODD_CLASS]
    return cfg


def serve_with(cfg: Config, monkeypatch: pytest.MonkeyPatch, body: Callable[[LiveManager], Any]) -> None:
    """`residency serve` in this process: `await body(manager)` once it serves, then a SIGTERM."""
    managers: list[LiveManager] = []

    class Recorded(LiveManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            managers.append(self)

    monkeypatch.setattr(server_mod, "LiveManager", Recorded)
    failed: list[BaseException] = []

    def ready(port: int) -> None:
        async def run() -> None:
            try:
                await body(managers[0])
            except BaseException as e:  # said after the stop
                failed.append(e)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)

        asyncio.get_running_loop().create_task(run())

    asyncio.run(serve(cfg, in_process=True, ready=ready))
    if failed:
        raise failed[0]


def check_exposition(text: str) -> dict[str, Any]:
    """Every family as Prometheus' conventions want it; returns the families by name."""
    helps = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for fam in families.values():
        exposed = fam.name + ("_total" if fam.type == "counter" else "")
        assert exposed in helps and exposed in types, f"{exposed}: HELP and TYPE"
        assert fam.name.startswith("residency_"), fam.name
        if fam.type == "counter":
            assert all(s.name in (f"{fam.name}_total",) for s in fam.samples), fam.name
        if fam.type == "histogram":
            assert fam.name.endswith("_seconds"), fam.name
        if fam.type == "gauge" and not fam.name.endswith("_created"):
            assert fam.name.endswith(("_bytes", "_depth", "_buffered")), fam.name
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)
            assert not math.isnan(s.value), key
            assert "id" not in s.labels and "request" not in s.labels  # no per-request labels
        if fam.type == "histogram":
            by_series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
            counts: dict[tuple[tuple[str, str], ...], float] = {}
            for s in fam.samples:
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                if s.name.endswith("_bucket"):
                    by_series.setdefault(rest, []).append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_count"):
                    counts[rest] = s.value
            for rest, buckets in by_series.items():
                buckets.sort()
                values = [v for _, v in buckets]
                assert values == sorted(values), f"{fam.name}{rest}: buckets not cumulative"
                assert buckets[-1][0] == math.inf and values[-1] == counts[rest], f"{fam.name}{rest}: +Inf"
    return families


def test_the_served_exposition_parses_and_keeps_to_prometheus_conventions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scraped from a running service after loads, an eviction, a failed load and requests, with a
    device and a class whose names need escaping: every family has HELP and TYPE, names carry their
    unit, counters `_total`, histograms are cumulative up to +Inf, no series twice, no NaN, and the
    odd label values come back exactly (escaped on the wire)."""
    port = free_port_on_both()
    cfg = odd_config(tmp_path, port)
    texts: list[str] = []

    async def body(manager: LiveManager) -> None:
        x = {"input": np.zeros((1, 4), np.float32)}
        for _ in range(3):
            await manager.infer("tiny", x)
        manager.evict("tiny", "host")
        await manager.infer("tiny", x)
        with pytest.raises(Exception, match=r"missing\.pt"):
            await manager.preload("gone", "gpu")
        texts.append((await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics"))[1])
        if _has_ipv6_loopback():
            texts.append((await asyncio.to_thread(scrape, f"http://[::1]:{port}/metrics"))[1])

    serve_with(cfg, monkeypatch, body)
    fams = check_exposition(texts[0])
    requests = fams["residency_requests"].samples
    assert {(s.labels["model"], s.labels["cls"], s.labels["outcome"], s.value) for s in requests} == {
        ("tiny", ODD_CLASS, "ok", 4.0)
    }
    resident = {(s.labels["device"], s.labels["tier"]) for s in fams["residency_resident_bytes"].samples}
    assert resident == {(ODD_DEVICE, "gpu"), ("host", "host")}
    failures = {(s.labels["model"], s.labels["code"]) for s in fams["residency_load_failures"].samples}
    assert failures == {("gone", "missing_checkpoint")}
    loads = {
        (s.labels["model"], s.labels["tier"], s.labels["source"]) for s in fams["residency_loads"].samples
    }
    # (its first load from disk, or from the OS page cache as the books price it)
    assert loads & {("tiny", "gpu", "disk"), ("tiny", "gpu", "cached")} and ("tiny", "gpu", "host") in loads
    waits = [s for s in fams["residency_request_wait_seconds"].samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in waits] == [({"cls": ODD_CLASS}, 4.0)]


# -- residency ps and TLS -------------------------------------------------------------------


@pytest.fixture
def tls_residency(
    tls_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[int, Path, Path]]:
    """The service's gRPC server over TLS (a fresh self-signed certificate) on a free port over
    in-process hosts, its admin token in $PS_TOK_14, in a thread of its own: (port, cert, key)."""
    from test_review13_admin import config as tiny_config

    cert, key = tls_pair
    tiny_config(tmp_path)
    text = (
        (tmp_path / "c.yaml")
        .read_text()
        .replace(
            'server: {listen: "127.0.0.1:0"}',
            f'server: {{listen: "127.0.0.1:0", tls_cert: {cert}, tls_key: {key}, auth_token_env: PS_TOK_14}}',
        )
    )
    (tmp_path / "c.yaml").write_text(text)
    monkeypatch.setenv("PS_TOK_14", "s3cret")
    cfg = load_config(tmp_path / "c.yaml")
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started: futures.Future[int] = futures.Future()

    async def run() -> None:
        pool = create_pool(cfg, in_process=True)
        manager = LiveManager(cfg, pool)
        server, port, _ = await build_server(cfg, manager)
        await server.start()
        await manager.start()
        started.set_result(port)
        try:
            await stop.wait()
        finally:
            await server.stop(None)
            await manager.stop()
            pool.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),))
    thread.start()
    try:
        yield started.result(30), cert, key
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


class TestPsWithACertificateFileThatHoldsNone:
    """`residency ps --tls-cert FILE` (or the config's `server.tls_cert`) with a file that holds no
    certificate (the key given instead, a wrong file) printed four lines of gRPC's C core ("Could not
    load any root certificate", "Handshaker factory creation failed…") and then "UNAVAILABLE: failed to
    connect to all addresses; … Failed to create security handshaker", naming neither the file nor
    what is wrong with it."""

    def test_it_is_one_line_saying_the_file_holds_no_certificate(
        self,
        tls_residency: tuple[int, Path, Path],
        capfd: pytest.CaptureFixture[str],
    ) -> None:
        port, _, key = tls_residency
        argv = ["ps", "--target", f"127.0.0.1:{port}", "--token-env", "PS_TOK_14", "--tls-cert", str(key)]
        assert main(argv) == 2
        out, err = capfd.readouterr()
        assert out == ""
        assert err.strip().count("\n") == 0, err  # one line, nothing from gRPC's core
        assert "PEM certificate" in err and "--tls-cert" in err and "handshaker" not in err, err

    def test_a_real_certificate_still_works(
        self,
        tls_residency: tuple[int, Path, Path],
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        port, cert, _ = tls_residency
        argv = ["ps", "--target", f"127.0.0.1:{port}", "--token-env", "PS_TOK_14", "--tls-cert", str(cert)]
        assert main([*argv, "--json"]) == 0
        assert '"name": "tiny"' in capsys.readouterr().out


def test_ps_in_plaintext_against_a_tls_server_hints_at_tls(
    tls_residency: tuple[int, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --tls-cert against a server that speaks TLS only, `ps` said "UNAVAILABLE: … Socket
    closed", which reads as a server that is down."""
    port, _, _ = tls_residency
    assert main(["ps", "--target", f"127.0.0.1:{port}", "--token-env", "PS_TOK_14"]) == 2
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "TLS" in err and "--tls-cert" in err, err


def test_ps_with_no_service_there_is_exit_2_naming_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])  # bound, not listening: connections are refused
        assert main(["ps", "--target", f"127.0.0.1:{port}", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"127.0.0.1:{port}: UNAVAILABLE" in err and "TLS" not in err


# -- the admin Events stream ----------------------------------------------------------------


def tiny_config(tmp_path: Path) -> Config:
    from test_review13_admin import config as cfg

    return cfg(tmp_path)


class TestEventsStream:
    """Guards: many watchers each get every event in order; one that hangs up is unsubscribed; a
    watcher that does not read holds at most its queue, then a note where events were dropped."""

    def test_many_watchers_in_order_and_hang_ups_leave_nothing(self, tmp_path: Path) -> None:
        async def body() -> None:
            async with serving(tiny_config(tmp_path)) as (stub, manager, _):
                calls = [stub.Events(pb.EventsRequest()) for _ in range(20)]
                await until(lambda: len(manager._subscribers) == 20, "all watchers subscribed")
                for i in range(50):
                    manager._publish("note", "tiny", f"e{i}", "cpu0", float(i))
                for call in calls:
                    assert [(await call.read()).detail for _ in range(50)] == [f"e{i}" for i in range(50)]
                for call in calls[:10]:
                    call.cancel()
                await until(lambda: len(manager._subscribers) == 10, "the ones that hung up unsubscribed")
                manager._publish("note", "tiny", "after", "cpu0", 99.0)
                for call in calls[10:]:
                    assert (await call.read()).detail == "after"
                    call.cancel()
                await until(lambda: not manager._subscribers, "every watcher unsubscribed")

        asyncio.run(body())

    def test_a_watcher_that_does_not_read_is_bounded_and_told_of_the_gap(self, tmp_path: Path) -> None:
        """Its note on the gap came only with the next event published once it had caught up (which
        may be hours later): having read what its queue held, a watcher was left waiting without a
        word on the last events, which were dropped (the end of a burst: often the latest state)."""

        async def body() -> None:
            async with serving(tiny_config(tmp_path)) as (stub, manager, _):
                call = stub.Events(pb.EventsRequest())
                await until(lambda: len(manager._subscribers) == 1, "the watcher subscribed")
                big = "x" * 20_000  # past what gRPC's buffers take: the rest waits in the queue
                n = 3 * EVENTS_QUEUE
                for i in range(n):
                    manager._publish("note", "tiny", f"{i} {big}", "cpu0", float(i))
                    if i % 100 == 0:
                        await asyncio.sleep(0)
                assert manager._subscribers[0].qsize() <= EVENTS_QUEUE
                numbers: list[int] = []
                dropped = 0
                while len(numbers) + dropped < n:  # nothing published meanwhile: the note comes all the same
                    e = await asyncio.wait_for(call.read(), 10)
                    if e.kind == "events_dropped":
                        dropped += int(e.detail.split()[0])
                    else:
                        numbers.append(int(e.detail.split()[0]))
                assert numbers == sorted(numbers) and numbers[0] == 0  # in order, from the first
                assert dropped > 0 and len(numbers) + dropped == n  # each one read or counted as dropped
                call.cancel()

        asyncio.run(body())


def test_ps_over_tls_against_a_plaintext_server_hints_at_it(
    tmp_path: Path, tls_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """With --tls-cert against a plaintext server, `ps` said only "Tls handshake failed …
    WRONG_VERSION_NUMBER", naming no cause."""
    cert, _ = tls_pair
    cfg = tiny_config(tmp_path)

    async def ps_over_tls() -> int:
        pool = create_pool(cfg, in_process=True)
        server, port, _ = await build_server(cfg, LiveManager(cfg, pool))
        await server.start()
        try:
            return await asyncio.to_thread(
                main, ["ps", "--target", f"127.0.0.1:{port}", "--tls-cert", str(cert)]
            )
        finally:
            await server.stop(None)
            pool.close()

    assert asyncio.run(ps_over_tls()) == 2
    err = capsys.readouterr().err
    assert "WRONG_VERSION_NUMBER" in err and "does not speak TLS" in err, err
