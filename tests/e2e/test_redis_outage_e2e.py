"""`residency serve` on a real Redis that stops under load and comes back, and that is down at start
(issue 6; `bench/redis_outage.py` is the long version of the same drill).

The Redis here is private to each test and persistent (append-only file, fsync always) so that a stop
and a restart on the same dir and port keep what it held, as a real one does."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from integration.bench_module import load_bench
from integration.redis_server import free_port, redis_command
from tritonclient.utils import InferenceServerException

from manager.store import open_store

from .conftest import CONFIG, Server


class PersistentRedis:
    def __init__(self, exe: str, data: Path) -> None:
        self.exe, self.data, self.port = exe, data, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        cmd += ["--logfile", str(self.data / "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ok = poll(lambda: self._pong(), 15.0)
        assert ok, f"redis-server did not answer PING: {(self.data / 'redis.log').read_text()[-2000:]}"

    def _pong(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "redis-server exited"
        try:
            return redis_command(self.port, "PING", timeout=0.5) == b"+PONG"
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: a clean shutdown, the append-only file is complete
            self.proc.wait(30)
        self.proc = None


@pytest.fixture
def redis_db(tmp_path: Path) -> Iterator[PersistentRedis]:
    exe = shutil.which("redis-server")
    if exe is None:
        import os

        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not on PATH; CI must run the Redis tests")
        pytest.skip("redis-server is not on PATH")
    data = tmp_path / "redis"
    data.mkdir()
    r = PersistentRedis(exe, data)
    yield r
    r.stop()


def poll(pred: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return False


def metric(metrics: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not among the metrics")


class Stream:
    """Client threads sending voice inferences, paced; each answer kept as (sent, received, error)."""

    def __init__(self, target: str, clients: int = 2, rate: float = 40.0) -> None:
        self.target, self.period = target, clients / rate
        self.calls: list[tuple[float, float, str | None]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        c = tc.InferenceServerClient(self.target)
        inp = tc.InferInput("audio", [1024], "FP32")
        inp.set_data_from_numpy(np.zeros(1024, dtype=np.float32))
        while not self.stopped.wait(self.period):  # pacing, not a readiness wait
            sent = time.time()
            try:
                c.infer("voice", [inp], client_timeout=10)
                err = None
            except InferenceServerException as e:
                err = str(e.status())
            with self.lock:
                self.calls.append((sent, time.time(), err))
        c.close()

    def ok(self, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for s, _, e in self.calls if e is None and s >= since)

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(30)


def count(url: str) -> int:
    store = open_store(url)
    try:
        return store.count_requests()
    except Exception:
        return -1
    finally:
        store.close()


def unmatched(calls: list[tuple[float, float, str | None]], times: list[float]) -> tuple[int, int]:
    """(OK answers with no log record whose t lies between send and receive, records left over), by
    the bench's own check (`match` in bench/redis_outage.py)."""
    outage = load_bench("redis_outage")
    answered = [outage.Call(sent, received, True) for sent, received, error in calls if error is None]
    matched, extra = outage.match(answered, times)
    return len(answered) - matched, extra


def config_with_metrics() -> tuple[str, str]:
    metrics = f"127.0.0.1:{free_port()}"
    return metrics, f'server: {{metrics_listen: "{metrics}"}}\n' + CONFIG.read_text()


def test_redis_stopped_under_load_loses_no_request_and_fails_none(
    start_server: Callable[..., Server], redis_db: PersistentRedis
) -> None:
    redis_db.start()
    metrics, text = config_with_metrics()
    server = start_server(redis_db.url, "--in-process", config_text=text)
    stream = Stream(server.target)
    try:
        assert poll(lambda: stream.ok() >= 40, 30), "the stream did not get going"
        down_at = time.time()
        redis_db.stop()
        # down for a few seconds, with requests served and the log buffered meanwhile
        assert poll(
            lambda: (
                time.time() - down_at >= 3.0
                and stream.ok(down_at) >= 60
                and metric(metrics, "residency_request_log_buffered") > 0
            ),
            30,
        ), "no requests were served (or buffered) while Redis was down"
        buffered = metric(metrics, "residency_request_log_buffered")
        redis_db.start()
        up_at = time.time()
        assert poll(lambda: stream.ok(up_at) >= 40, 30), "the stream stalled after Redis came back"
    finally:
        stream.stop()
    calls = stream.calls
    errors = [e for _, _, e in calls if e is not None]
    assert errors == []  # Redis being down is no reason to fail a request
    ok = len(calls)
    served_down = sum(1 for s, _, _ in calls if down_at <= s < up_at)
    assert served_down >= 60 and buffered > 0
    # the buffer is flushed on recovery (once a second), not at the server's stop
    assert poll(lambda: count(redis_db.url) >= ok, 15), (
        f"the log holds {count(redis_db.url)} of {ok} requests"
    )
    lost, extra = unmatched(calls, load_bench("redis_outage").store_times(redis_db.url))
    assert (lost, extra) == (0, 0)  # every OK answer is in the log, at its time, once
    assert metric(metrics, "residency_request_log_dropped_total") == 0
    # back to a normal batch (the gauge drops once the flush's write has returned on its thread)
    assert poll(lambda: metric(metrics, "residency_request_log_buffered") < 100, 10)
    assert server.stop() == 0
    assert count(redis_db.url) == ok  # the stop wrote nothing twice


def test_serve_starts_with_redis_down_and_is_consistent_once_it_is_up(
    start_server: Callable[..., Server], redis_db: PersistentRedis
) -> None:
    metrics, text = config_with_metrics()
    server = start_server(redis_db.url, "--in-process", config_text=text)  # polls health: SERVING
    c = tc.InferenceServerClient(server.target)
    inp = tc.InferInput("audio", [1024], "FP32")
    inp.set_data_from_numpy(np.zeros(1024, dtype=np.float32))
    sent = []
    for _ in range(20):
        t0 = time.time()
        c.infer("voice", [inp], client_timeout=30)  # served with the store down: no error
        sent.append((t0, time.time(), None))
    c.close()
    assert poll(lambda: metric(metrics, "residency_request_log_buffered") == 20, 10)
    redis_db.start()
    store = open_store(redis_db.url)
    try:

        def consistent() -> bool:
            stats = store.get_doc("stats") or {}
            return (
                store.count_requests() == 20
                and store.intents().get("voice") == "gpu"
                and stats.get("voice", {}).get("requests") == 20
            )

        # log, intents and statistics, all soon after Redis is up (not at the next minutely save)
        assert poll(consistent, 15, every_s=0.2), (
            store.count_requests(),
            store.intents(),
            store.get_doc("stats"),
        )
        assert unmatched(sent, [r["t"] for r in store.requests(0.0)]) == (0, 0)
        assert metric(metrics, "residency_request_log_buffered") == 0
        assert metric(metrics, "residency_request_log_dropped_total") == 0
        assert server.stop() == 0
        assert store.count_requests() == 20
    finally:
        store.close()
