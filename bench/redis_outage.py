"""Redis stopped under load and restarted: does `residency serve` keep serving and lose no request log?

usage: python bench/redis_outage.py [--outage-s 60] [--rate 100] [--clients 4] [--before-s 10]
                                    [--after-s 15] [--start-down-s 5] [--out bench/results/redis_outage.json]

Everything is real and private to this run, in a temporary directory: a `redis-server` (the binary on
PATH) on a free 127.0.0.1 port with `appendonly yes` / `appendfsync always` in its own data dir, so a
stopped and restarted Redis (same dir, same port) keeps what it held; and `residency serve --in-process`
(device hosts in the server process, no Ray) on `configs/local-cpu.yaml` with `store.url: redis://...`,
its journal in the temp dir and `server.metrics_listen` set. Readiness is polled (PING, grpc health
SERVING), never slept for.

Phase 1 (outage under load): `--clients` threads, each a stock `tritonclient.grpc` client, send
inferences of the pinned "voice" model ([1024] FP32 silence) at `--rate` requests/s in all, paced.
After `--before-s`, Redis gets SIGTERM (a clean stop); after `--outage-s` it is started again on the
same dir and port; the stream goes on for `--after-s`. A sampler scrapes the service's Prometheus
metrics (`residency_request_log_buffered`, `residency_request_log_dropped_total`) and the stream's
XLEN every 50 ms. Then the clients stop, the log must catch up (polled), and every request the service
answered OK is matched to a record of the store's request log: a record's `t` (the server's arrival
time, same clock) must fall between the client's send and receive times; the matching is a greedy
interval-point matching (optimal for intervals). `lost` = OK answers with no record, `extra` = records
with no OK answer (a batch written twice). The service is then stopped (SIGTERM: final flush and
stats) and the count checked again.
`failed_write_attempts` counts the service's "could not write" log lines: full batch writes that
failed (while the store stays down, the later tries are a ping a second, not logged).

Phase 2 (start with Redis down): Redis is stopped, `residency serve` is started against it: seconds
until SERVING. It serves `--start-down-s` of the stream; then Redis is started (same dir and port) and
we poll until the store is consistent: every OK answer of both phases in the log, the statistics
document carrying the earlier run's history (voice's request count = phase 1's + phase 2's, not reset
to phase 2's) and the intent of the pinned model (`voice: gpu`) recorded.

Prints ONE JSON object to stdout (progress goes to stderr) and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_overhead import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "local-cpu.yaml"
BIN = Path(sys.executable).parent
AUDIO = np.zeros(1024, dtype=np.float32)
READY_TIMEOUT_S = 180.0
SAMPLE_S = 0.05


def log(msg: str) -> None:
    print(f"[redis_outage] {msg}", file=sys.stderr, flush=True)


# ---- Redis ------------------------------------------------------------------------------------------


class RedisServer:
    """A private redis-server with an append-only file: stop() and start() keep its data."""

    def __init__(self, exe: str, port: int, data: Path) -> None:
        self.exe, self.port, self.data = exe, port, data
        self.proc: subprocess.Popen[bytes] | None = None
        data.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> float:
        """Start and poll PING; returns the time (time.time()) it first answered."""
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        cmd += ["--logfile", str(self.data / "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if client.ping():
                        return time.time()
                except redis.RedisError:
                    pass
                time.sleep(0.01)  # a poll interval
        finally:
            client.close()
        tail = (self.data / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a clean stop: the append-only file is flushed
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


# ---- the service ------------------------------------------------------------------------------------


@dataclass
class Service(Server):
    """`residency serve` (stopped, with what outlived it, by `Server.stop`) and its metrics address."""

    metrics: str = ""


def start_service(tmp: Path, store_url: str, name: str) -> tuple[Service, float]:
    """`residency serve --in-process` on a redis store; returns it and the seconds until SERVING."""
    metrics = f"127.0.0.1:{free_port()}"
    target = f"127.0.0.1:{free_port()}"
    cfg = tmp / f"{name}.yaml"
    journal = tmp / "requests.journal"
    cfg.write_text(
        f'store: {{url: "{store_url}", journal: "{journal}"}}\n'
        f'server: {{metrics_listen: "{metrics}"}}\n' + CONFIG.read_text()
    )
    log_path = tmp / f"{name}.log"
    t0 = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "residency"), "serve", "--config", str(cfg), "--listen", target, "--in-process"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
        )  # fmt: skip
    service = Service("in_process", proc, target, log_path, metrics=metrics)
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() - t0 < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"residency serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return service, time.monotonic() - t0
            except grpc.RpcError:
                pass
            time.sleep(0.05)  # a poll interval
    service.stop()
    raise RuntimeError(
        f"residency serve was not SERVING in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
    )


def scrape(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("residency_request_log_buffered", "residency_request_log_dropped_total"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


# ---- load -------------------------------------------------------------------------------------------


@dataclass
class Call:
    sent: float  # time.time()
    received: float
    ok: bool
    code: str = ""


@dataclass
class Load:
    """`clients` threads at `rate` requests/s in all, each with its own tritonclient."""

    target: str
    rate: float
    clients: int
    calls: list[Call] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)

    def _run(self, i: int) -> None:
        client = tc.InferenceServerClient(self.target)
        inp = tc.InferInput("audio", [1024], "FP32")
        inp.set_data_from_numpy(AUDIO)
        period = self.clients / self.rate
        nxt = time.monotonic() + period * i / self.clients
        mine: list[Call] = []
        while not self.stop_event.is_set():
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing, not a readiness wait
            nxt += period
            sent = time.time()
            try:
                client.infer("voice", [inp], client_timeout=10)
                mine.append(Call(sent, time.time(), True))
            except InferenceServerException as e:
                mine.append(Call(sent, time.time(), False, str(e.status())))
        client.close()
        with self.lock:
            self.calls.extend(mine)


@dataclass
class Sampler:
    """Metrics and the stream length, every SAMPLE_S, on a thread."""

    metrics: str
    store_url: str
    samples: list[tuple[float, float, float, int | None]] = field(default_factory=list)  # t, buf, drop, xlen
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)

    def _run(self) -> None:
        client = redis.Redis.from_url(self.store_url, socket_connect_timeout=0.2, socket_timeout=0.5)
        while not self.stop_event.is_set():
            try:
                m = scrape(self.metrics)
            except OSError:
                m = {}
            try:
                xlen: int | None = int(client.xlen("residency:requests"))
            except redis.RedisError:
                xlen = None
            self.samples.append(
                (
                    time.time(),
                    m.get("residency_request_log_buffered", float("nan")),
                    m.get("residency_request_log_dropped_total", float("nan")),
                    xlen,
                )
            )
            self.stop_event.wait(SAMPLE_S)
        client.close()


# ---- checks -----------------------------------------------------------------------------------------


def match(calls: list[Call], times: list[float]) -> tuple[int, int]:
    """(OK calls with a record whose t lies in [sent, received], records left over): greedy by
    interval end, taking the earliest free t at or after the start (optimal for intervals and points)."""
    free = sorted(times)
    matched = 0
    for c in sorted((c for c in calls if c.ok), key=lambda c: c.received):
        i = bisect.bisect_left(free, c.sent - 1e-6)
        if i < len(free) and free[i] <= c.received + 1e-6:
            free.pop(i)
            matched += 1
    return matched, len(free)


def store_times(url: str) -> list[float]:
    from manager.store import open_store

    store = open_store(url)
    try:
        return [r["t"] for r in store.requests(0.0)]
    finally:
        store.close()


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return round(ys[min(len(ys) - 1, int(q * len(ys)))] * 1000, 2)


def phase_figures(calls: list[Call]) -> dict[str, Any]:
    lat = [c.received - c.sent for c in calls if c.ok]
    codes: dict[str, int] = {}
    for c in calls:
        if not c.ok:
            codes[c.code] = codes.get(c.code, 0) + 1
    return {
        "sent": len(calls),
        "ok": sum(c.ok for c in calls),
        "errors": len(calls) - sum(c.ok for c in calls),
        "error_codes": codes,
        "p50_ms": pct(lat, 0.50),
        "p99_ms": pct(lat, 0.99),
        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None,
    }


def wait_until(pred: Any, timeout_s: float, poll_s: float = 0.05) -> float | None:
    """Poll `pred()` until true; the seconds it took, or None at the deadline."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


# ---- the drill --------------------------------------------------------------------------------------


def outage_phase(a: argparse.Namespace, tmp: Path, rds: RedisServer) -> tuple[dict[str, Any], list[Call]]:
    service, start_s = start_service(tmp, rds.url, "phase1")
    log(f"serving in {start_s:.1f} s on {service.target} (store {rds.url})")
    sampler = Sampler(service.metrics, rds.url)
    load = Load(service.target, a.rate, a.clients)
    try:
        sampler.start()
        load.start()
        time.sleep(a.before_s)  # the schedule of the drill: load before the outage
        down_at = time.time()
        rds.stop()
        log(f"redis stopped; down for {a.outage_s} s")
        time.sleep(a.outage_s)  # the outage itself
        up_at = rds.start()
        log("redis is back")
        time.sleep(a.after_s)  # load after the outage
        load.stop()
        ended = time.time()
        calls = load.calls
        ok_total = sum(c.ok for c in calls)
        # the log catches up (written once a second): poll until the stream holds every OK answer
        rclient = redis.Redis.from_url(rds.url)
        caught_up = wait_until(lambda: int(rclient.xlen("residency:requests")) >= ok_total, 30.0)
        sampler.stop()
        times = store_times(rds.url)
        matched, extra = match(calls, times)
        code = service.stop()
        after_stop = int(rclient.xlen("residency:requests"))
        rclient.close()
    finally:
        load.stop_event.set()
        sampler.stop()
        service.stop()
    before = [c for c in calls if c.sent < down_at]
    during = [c for c in calls if down_at <= c.sent < up_at]
    after = [c for c in calls if c.sent >= up_at]
    ok_before_up = sum(c.ok and c.received < up_at for c in calls)
    flushed = next(
        (t for t, _, _, n in sampler.samples if t >= up_at and n is not None and n >= ok_before_up), None
    )
    dropped = [d for _, _, d, _ in sampler.samples if d == d]
    out = {
        "seconds_to_serving": round(start_s, 2),
        "window_s": {
            "before": a.before_s,
            "outage": round(up_at - down_at, 2),
            "after": round(ended - up_at, 2),
        },
        "requests": {
            "sent": len(calls),
            "ok": ok_total,
            "errors": len(calls) - ok_total,
            "before": phase_figures(before),
            "during_outage": phase_figures(during),
            "after": phase_figures(after),
        },
        "request_log": {
            "ok_answers": ok_total,
            "records_in_store": len(times),
            "ok_matched_to_a_record": matched,
            "lost": ok_total - matched,
            "extra_records": extra,
            "records_after_service_stop": after_stop,
            "caught_up_after_load_s": None if caught_up is None else round(caught_up, 2),
        },
        "buffer": {
            "buffered_peak": max((b for _, b, _, _ in sampler.samples if b == b), default=None),
            "dropped_total": max(dropped, default=None),
            "flush_after_recovery_s": None if flushed is None else round(flushed - up_at, 2),
            "failed_write_attempts": service.log.read_text(errors="replace").count("could not write"),
        },
        "service_exit_code": code,
    }
    return out, calls


def start_down_phase(
    a: argparse.Namespace, tmp: Path, rds: RedisServer, earlier: list[Call]
) -> dict[str, Any]:
    from manager.store import open_store

    store = open_store(rds.url)
    doc = store.get_doc("stats") or {}
    voice_before = int(doc.get("voice", {}).get("requests", 0))
    # phase 1 recorded the intents: clear them, so that finding them again proves phase 2 wrote them
    assert store.intents(), "phase 1 recorded no intent"
    redis.Redis.from_url(rds.url).delete("residency:intents")
    store.close()
    rds.stop()
    service, start_s = start_service(tmp, rds.url, "phase2")  # raises if it never gets to SERVING
    serving_at = time.time()
    log(f"serving with redis down in {start_s:.1f} s")
    load = Load(service.target, a.rate / 4, 1)
    try:
        load.start()
        time.sleep(a.start_down_s)  # serve a while with the store down
        load.stop()
        calls = load.calls
        ok = sum(c.ok for c in calls)
        up_at = rds.start()
        store = open_store(rds.url)
        state: dict[str, Any] = {}

        def consistent() -> bool:
            times = [r["t"] for r in store.requests(0.0)]
            matched, extra = match(earlier + calls, times)
            stats = store.get_doc("stats") or {}
            intents = store.intents()
            state.update(
                lost=sum(c.ok for c in earlier + calls) - matched,
                extra_records=extra,
                stats_voice_requests=int(stats.get("voice", {}).get("requests", 0)),
                intent_voice=intents.get("voice"),
            )
            return (
                state["lost"] == 0
                and state["stats_voice_requests"] == voice_before + ok
                and state["intent_voice"] == "gpu"
            )

        took = wait_until(consistent, a.consistent_timeout_s, poll_s=0.25)
        parts = {
            "log": state["lost"] == 0,
            "stats_history_kept": state["stats_voice_requests"] == voice_before + ok,
            "intent_recorded": state["intent_voice"] == "gpu",
        }
        store.close()
    finally:
        load.stop_event.set()
        service.stop()
    return {
        "serving_with_redis_down": True,
        "seconds_to_serving": round(start_s, 2),
        "requests_while_down": phase_figures(calls),
        "redis_down_after_serving_s": round(up_at - serving_at, 2),
        "consistent_after_redis_up_s": None if took is None else round(took, 2),
        "consistent_within_timeout": took is not None,
        "consistent_parts": parts,
        "stats_voice_requests": {
            "earlier_run": voice_before,
            "served_now": ok,
            "in_store": state.get("stats_voice_requests"),
        },
        "lost": state.get("lost"),
        "extra_records": state.get("extra_records"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outage-s", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=100.0, help="requests/s, all clients together")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--before-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=15.0)
    p.add_argument("--start-down-s", type=float, default=5.0)
    p.add_argument("--consistent-timeout-s", type=float, default=90.0)
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, redis data)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "redis_outage.json")
    a = p.parse_args()
    exe = shutil.which("redis-server")
    if exe is None:
        log("redis-server is not on PATH")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="redis-outage-"))
    rds = RedisServer(exe, free_port(), tmp / "redis")
    try:
        rds.start()
        phase1, calls = outage_phase(a, tmp, rds)
        log(json.dumps(phase1["request_log"]))
        phase2 = start_down_phase(a, tmp, rds, calls)
    finally:
        rds.stop()
    result = {
        "bench": "redis_outage",
        "mode": "residency serve --in-process (device hosts in the server process), store redis://",
        "redis": "redis-server "
        + subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()[2],
        "config": {
            k: getattr(a, k) for k in ("outage_s", "rate", "clients", "before_s", "after_s", "start_down_s")
        },
        "outage_under_load": phase1,
        "start_with_redis_down": phase2,
    }
    text = json.dumps(result, indent=2)
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text + "\n")
    if a.keep_tmp:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
