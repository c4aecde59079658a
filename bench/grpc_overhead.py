"""What the gRPC front end costs: one tiny model served in-process vs through `residency serve`.

usage: python bench/grpc_overhead.py [--n 2000] [--seconds 10] [--clients 64] [--modes in_process,ray]
                                    [--max-batch 1] [--frontends 1]

The model is `workers.demo:tiny_mlp` (width 16, input `input` FP32 [1, 16], output `output` FP32
[1, 16]; well under a millisecond of compute), so what is measured is the serving path, not the model.
`--max-batch N` turns on dynamic batching for it (its config's `max_batch`; default 1, off).
All on loopback; JSON goes to stdout, progress to stderr.

  direct            `workers.host.DeviceHost("cpu0", "cpu")` in this process, the model loaded with
                    `apply(Load(...))`, then `host.infer(...)` called `--n` times: p50/p99/mean ms.
  grpc_one_client   one `tritonclient.grpc` client, `--n` sequential infers after 100 untimed warm-up
                    calls; `overhead_p50_ms`/`overhead_p99_ms` = this minus `direct` at each percentile.
  grpc_concurrent   `--clients` concurrent clients for `--seconds`, two load generators in turn:
                      tritonclient_threads  one thread per client, each with its own InferenceServerClient;
                      grpc_aio_raw          one asyncio loop, one task per client, raw generated stubs
                                            on one grpc.aio channel (tritonclient's copy of the
                                            `inference` stubs: see the note at the imports);
                      h2load                nghttp2's C load generator (Debian: nghttp2-client; skipped
                                            when not installed): one HTTP/2 connection per client, the
                                            same ModelInfer message posted as a gRPC frame; ok calls
                                            are counted by their response messages (see bench_h2load).
                                            The Python generators take 0.2-0.3 ms of the 2 shared cores
                                            per call; this one a fraction of that.
                    Each reports completed infers/s, per-request latency p50/p99 ms and errors. To tell
                    whether the load generator or the server is the limit, each run records the CPU
                    this process used and the CPU of the server's process tree (Ray's processes
                    included), as % of one core and ms per infer, and what all other processes on
                    the machine used meanwhile (`other_processes_cpu_pct`: well above 0 means the
                    figures were taken on a shared, busy machine).
  grpc_noop         the aio generator against `ServerLive` (no manager, no model): the floor of a bare
                    gRPC call on this server (with front ends, relayed to the manager's process: two
                    gRPC hops; only ModelInfer takes the fast path).
  manager_only      no gRPC: `LiveManager.infer` from `--clients` tasks in this process for `--seconds`
                    (in-process host, SQLite store and journal): infers/s, latency, and CPU us per infer
                    (this process, all threads) - what the service costs besides gRPC.

Each server mode gets a fresh `residency serve` (config: `configs/local-cpu.yaml` plus the tiny model,
a SQLite store in a temporary directory and `server.frontends: --frontends`, default 1 as in
configs/home.yaml): `in_process` (`--in-process`, device hosts in the server
process) and `ray` (device hosts in Ray actors; the server starts a local Ray). Readiness is polled
(grpc.health.v1 SERVING, then the model's OIP ModelReady), never slept for; then, as the other
configured models load in the background for a few seconds, the server's CPU is polled until it is
quiet. Servers get SIGTERM at the end, on errors too; whatever of their process tree outlives that
(the detached device-host actor in ray mode) is killed by pid.

Goals: one client p50 overhead <= 2 ms and p99 <= 5 ms; with 64 clients >= 2000 infer/s, p99 <= 100 ms
and no errors. The concurrent goal counts as met when any load generator's run meets all three.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import tritonclient.grpc as tg
from grpc_health.v1 import health_pb2, health_pb2_grpc

# tritonclient's generated stubs, not residency_proto.inference's: both register package `inference` in
# protobuf's default pool from differently named files, so one process cannot import both
# ("duplicate symbol 'inference.ServerLiveRequest'"). The wire protocol is the same.
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workers import protocol as P  # noqa: E402
from workers.demo import write_tiny_mlp  # noqa: E402
from workers.host import DeviceHost  # noqa: E402

BIN = Path(sys.executable).parent
BASE_CONFIG = REPO / "configs" / "local-cpu.yaml"
MODEL = "tiny"
WIDTH = 16
WARMUP = 100
READY_TIMEOUT_S = 180.0
GOALS = {"one_client_p50_overhead_ms": 2.0, "one_client_p99_overhead_ms": 5.0,
         "concurrent_infer_per_s": 2000.0, "concurrent_p99_ms": 100.0, "concurrent_errors": 0}  # fmt: skip
TINY_MODEL = """\
  - name: tiny
    class: realtime
    adapter: safetensors-module
    device: cpu0
    memory: 1MiB
    load_seconds: {{disk: 0.05, cached: 0.02, host: 0.01}}
    pin: true
    keep_alive: forever
    max_batch: {max_batch}
    source: {{factory: "workers.demo:tiny_mlp", path: "{path}", kwargs: {{width: {width}}}}}
"""


def log(msg: str) -> None:
    print(f"[grpc_overhead] {msg}", file=sys.stderr, flush=True)


def source(tmp: Path) -> dict[str, Any]:
    return {
        "factory": "workers.demo:tiny_mlp",
        "path": str(tmp / "tiny.safetensors"),
        "kwargs": {"width": WIDTH},
    }


def summarize(lat_s: list[float]) -> dict[str, float | int]:
    a = np.asarray(lat_s) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 4),
            "p99_ms": round(float(np.percentile(a, 99)), 4), "mean_ms": round(float(a.mean()), 4),
            "max_ms": round(float(a.max()), 4)}  # fmt: skip


# ---- the server ------------------------------------------------------------------------------------


def write_config(
    tmp: Path, max_batch: int = 1, frontends: int = 0, auth_token_env: str | None = None
) -> Path:
    """local-cpu.yaml + the tiny model (first under `models:`, dynamic batching up to `max_batch`
    rows) + a SQLite store in `tmp` + `server.frontends` (and `server.auth_token_env` if given: the
    `server:` mapping is written once, so a caller cannot add a second one)."""
    write_tiny_mlp(tmp / "tiny.safetensors", WIDTH)
    base = BASE_CONFIG.read_text()
    head, sep, rest = base.partition("\nmodels:\n")
    if not sep:
        raise SystemExit(f"{BASE_CONFIG} has no top-level 'models:' list")
    tiny = TINY_MODEL.format(path=tmp / "tiny.safetensors", width=WIDTH, max_batch=max_batch)
    cfg = tmp / "config.yaml"
    token = "" if auth_token_env is None else f", auth_token_env: {auth_token_env}"
    top = f'store: {{url: "sqlite:///{tmp}/state.db"}}\nserver: {{frontends: {frontends}{token}}}\n'
    cfg.write_text(f"{top}{head}{sep}{tiny}{rest}")
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    mode: str
    proc: subprocess.Popen[bytes]
    target: str
    log: Path
    tree: set[int] = field(default_factory=set)

    def processes(self) -> list[psutil.Process]:
        """The server and all its descendants now (Ray's GCS, raylet and workers in ray mode)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self.tree.update(p.pid for p in procs)
        return procs

    def stop(self) -> int:
        self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for pid in sorted(self.tree - {self.proc.pid}):  # what outlived the server (ours, by pid)
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.kill()
                log(f"killed leftover pid {pid} ({p.name()}) of the {self.mode} server")
        return int(self.proc.returncode)


def start_server(cfg: Path, mode: str, tmp: Path) -> Server:
    target = f"127.0.0.1:{free_port()}"
    logf = tmp / f"server-{mode}.log"
    extra = ["--in-process"] if mode == "in_process" else []
    with logf.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "residency"), "serve", "--config", str(cfg), "--listen", target, *extra],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )  # fmt: skip
    return Server(mode, proc, target, logf)


def wait_ready(server: Server, timeout_s: float = READY_TIMEOUT_S) -> float:
    """Poll health until SERVING, then OIP ModelReady(tiny); returns the seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    serving = False
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        oip = pb_grpc.GRPCInferenceServiceStub(ch)
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.mode} server exited with {server.proc.returncode}:\n"
                                   f"{server.log.read_text()[-3000:]}")  # fmt: skip
            with contextlib.suppress(grpc.RpcError):
                if not serving:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                if serving and oip.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=1).ready:
                    return time.monotonic() - t0
            time.sleep(0.05)
    raise RuntimeError(
        f"{server.mode} server not ready within {timeout_s} s:\n{server.log.read_text()[-3000:]}"
    )


def wait_quiet(server: Server, pct: float = 25.0, timeout_s: float = 60.0) -> float:
    """Poll the server tree's CPU until two 0.25 s windows in a row stay under `pct` of one core: the
    other configured models load and prewarm in the background for a few seconds after readiness."""
    t0 = time.monotonic()
    calm = 0
    while calm < 2 and time.monotonic() - t0 < timeout_s:
        with CpuMeter(server) as cpu:
            time.sleep(0.25)  # one polling window
        calm = calm + 1 if 100 * cpu.server_s / cpu.wall < pct else 0
    return time.monotonic() - t0


# ---- CPU accounting --------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of this process and of the server's process tree over a window."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _server_cpu(self) -> dict[int, tuple[str, float]]:
        out = {}
        for p in self.server.processes():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = (p.name(), t.user + t.system)
        return out

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    def __enter__(self) -> CpuMeter:
        self.t0, self.c0, self.s0 = time.perf_counter(), time.process_time(), self._server_cpu()
        self.m0 = self._machine_busy()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.client_s = time.process_time() - self.c0
        s1 = self._server_cpu()
        self.by_proc = {
            f"{name}[{pid}]": cpu - self.s0.get(pid, (name, 0.0))[1] for pid, (name, cpu) in s1.items()
        }
        self.server_s = sum(self.by_proc.values())
        self.other_s = max(self._machine_busy() - self.m0 - self.client_s - self.server_s, 0.0)

    def report(self, infers: int) -> dict[str, Any]:
        per = max(infers, 1)
        top = sorted(self.by_proc.items(), key=lambda kv: -kv[1])[:4]
        return {
            "client_cpu_pct": round(100 * self.client_s / self.wall, 1),
            "server_cpu_pct": round(100 * self.server_s / self.wall, 1),
            "other_processes_cpu_pct": round(100 * self.other_s / self.wall, 1),
            "client_cpu_ms_per_infer": round(1e3 * self.client_s / per, 4),
            "server_cpu_ms_per_infer": round(1e3 * self.server_s / per, 4),
            "server_cpu_pct_top": {k: round(100 * v / self.wall, 1) for k, v in top if v > 0},
        }


# ---- measurements ----------------------------------------------------------------------------------


def bench_direct(tmp: Path, n: int) -> dict[str, Any]:
    host = DeviceHost("cpu0", "cpu")
    r = host.apply(P.Load(P.ModelSpec(MODEL, "safetensors-module", source(tmp))), "op")
    if not r.ok:
        raise RuntimeError(f"direct load failed: {r.error}")
    x = {"input": np.ones((1, WIDTH), np.float32)}
    for _ in range(WARMUP):
        host.infer(MODEL, x)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        res = host.infer(MODEL, x)
        lat.append(time.perf_counter() - t0)
        if not res.ok:
            raise RuntimeError(f"direct infer failed: {res.error}")
    return summarize(lat)


def bench_manager(cfg: Path, tmp: Path, clients: int, seconds: float) -> dict[str, Any]:
    """The live manager alone, no gRPC: `LiveManager.infer` from `clients` concurrent tasks in this
    process (in-process device host, SQLite store and journal, as the in_process server runs it).
    What the service costs per request besides gRPC, in CPU time of this process (all threads)."""
    from manager.config import load_config
    from manager.live import LiveManager
    from manager.store import open_store
    from manager.workers_bridge import create_pool

    async def run() -> dict[str, Any]:
        config = load_config(cfg)
        pool = create_pool(config, in_process=True)
        store = open_store(f"sqlite:///{tmp}/manager-only.db")
        lm = LiveManager(config, pool, store=store, journal=tmp / "manager-only.journal")
        await lm.start()
        x = {"input": np.ones((1, WIDTH), np.float32)}
        try:
            for _ in range(WARMUP):
                await lm.infer(MODEL, x)
            calm, t_quiet = 0, time.monotonic()  # the other models load and prewarm in the background
            while calm < 2 and time.monotonic() - t_quiet < 60:
                c0 = time.process_time()
                await asyncio.sleep(0.25)
                calm = calm + 1 if (time.process_time() - c0) / 0.25 < 0.25 else 0
            lat: list[float] = []
            deadline = 0.0

            async def client() -> None:
                while time.perf_counter() < deadline:
                    t0 = time.perf_counter()
                    await lm.infer(MODEL, x)
                    lat.append(time.perf_counter() - t0)

            c0, w0 = time.process_time(), time.perf_counter()
            deadline = w0 + seconds
            await asyncio.gather(*(client() for _ in range(clients)))
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        finally:
            await lm.stop()
            pool.close()
            store.close()
        return {"clients": clients, "infer_per_s": round(len(lat) / wall, 1),
                "cpu_us_per_infer": round(cpu / max(len(lat), 1) * 1e6, 1), **summarize(lat)}  # fmt: skip

    return asyncio.run(run())


def triton_inputs() -> tuple[list[tg.InferInput], list[tg.InferRequestedOutput]]:
    inp = tg.InferInput("input", [1, WIDTH], "FP32")
    inp.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
    return [inp], [tg.InferRequestedOutput("output")]


def bench_one_client(server: Server, n: int) -> dict[str, Any]:
    client = tg.InferenceServerClient(server.target)
    inputs, outputs = triton_inputs()
    try:
        for _ in range(WARMUP):
            client.infer(MODEL, inputs, outputs=outputs)
        lat = []
        with CpuMeter(server) as cpu:
            for _ in range(n):
                t0 = time.perf_counter()
                res = client.infer(MODEL, inputs, outputs=outputs)
                lat.append(time.perf_counter() - t0)
        out = res.as_numpy("output")
        assert out is not None and out.shape == (1, WIDTH), out
    finally:
        client.close()
    return {"client": "tritonclient.grpc", **summarize(lat), "cpu": cpu.report(n)}


@dataclass
class Tally:
    """What concurrent clients recorded: latencies of completed calls, errors (a few kept)."""

    lat: list[float] = field(default_factory=list)
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def error(self, e: Exception) -> None:
        self.errors += 1
        if len(self.first_errors) < 3:
            self.first_errors.append(f"{type(e).__name__}: {str(e)[:200]}")

    def report(self, client: str, clients: int, wall: float, cpu: CpuMeter) -> dict[str, Any]:
        return {"client": client, "clients": clients, "seconds": round(wall, 2),
                "infer_per_s": round(len(self.lat) / wall, 1), **summarize(self.lat), "errors": self.errors,
                "first_errors": self.first_errors, "cpu": cpu.report(len(self.lat))}  # fmt: skip


def bench_threads(server: Server, clients: int, seconds: float) -> dict[str, Any]:
    load, lock = Tally(), threading.Lock()
    start, stop = threading.Barrier(clients + 1), threading.Event()

    def worker() -> None:
        client = tg.InferenceServerClient(server.target)
        inputs, outputs = triton_inputs()
        mine: list[float] = []
        try:
            client.infer(MODEL, inputs, outputs=outputs)  # connect + warm before the clock starts
        finally:
            start.wait(60)
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                client.infer(MODEL, inputs, outputs=outputs, client_timeout=30)
                mine.append(time.perf_counter() - t0)
            except Exception as e:
                with lock:
                    load.error(e)
        client.close()
        with lock:
            load.lat.extend(mine)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait(60)
    with CpuMeter(server) as cpu:
        time.sleep(seconds)  # the measurement window itself, not a readiness wait
        stop.set()
        for t in threads:
            t.join()
    return load.report("tritonclient_threads", clients, cpu.wall, cpu)


def raw_request() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="input", datatype="FP32", shape=[1, WIDTH])
    req.outputs.add(name="output")
    req.raw_input_contents.append(np.ones((1, WIDTH), np.float32).tobytes())
    return req


async def _aio_load(target: str, clients: int, seconds: float, noop: bool, cpu: CpuMeter) -> Tally:
    load = Tally()
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        call: Callable[[], Any]
        if noop:
            live = pb.ServerLiveRequest()
            call = lambda: stub.ServerLive(live, timeout=30)  # noqa: E731
        else:
            req = raw_request()
            call = lambda: stub.ModelInfer(req, timeout=30)  # noqa: E731
        await asyncio.gather(*(call() for _ in range(clients)))  # connect + warm
        deadline = 0.0

        async def worker() -> None:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    await call()
                    load.lat.append(time.perf_counter() - t0)
                except Exception as e:
                    load.error(e)

        with cpu:
            deadline = time.perf_counter() + seconds
            await asyncio.gather(*(worker() for _ in range(clients)))
    return load


def h2load_frame(msg: Any) -> bytes:
    """One gRPC message on the wire: not compressed (0), its length (4 bytes, big-endian), the bytes."""
    body = msg.SerializeToString()
    return b"\0" + len(body).to_bytes(4, "big") + body


def bench_h2load(server: Server, clients: int, seconds: float, tmp: Path) -> dict[str, Any]:
    """nghttp2's `h2load`, a load generator in C: `clients` HTTP/2 connections, one call in flight on
    each, the same ModelInfer request posted as a gRPC frame. It costs the shared cores a small part
    of what a Python client does, so this shows what the server does when the load generator is not
    the other half of the machine. h2load reads HTTP statuses, not gRPC ones (an error is HTTP 200 with
    a grpc-status trailer and no message), so a call counts as ok only by its response message: every
    ok response here has the same size, and the response bytes must be a whole number of them."""
    exe = shutil.which("h2load")
    if exe is None:
        return {"client": "h2load", "skipped": "h2load is not on PATH (Debian package nghttp2-client)"}
    body, logf = tmp / "h2load-request.bin", tmp / "h2load.tsv"
    body.write_bytes(h2load_frame(raw_request()))
    logf.unlink(missing_ok=True)  # h2load appends to its log file; each run counts its own calls
    with grpc.insecure_channel(server.target) as ch:  # the size of one ok response message
        one = pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(raw_request(), timeout=30)
    frame = 5 + one.ByteSize()
    cmd = [exe, "-c", str(clients), "-m", "1", "-D", f"{round(seconds * 1000)}ms", "-d", str(body),
           "-H", "content-type: application/grpc", "-H", "te: trailers", "--log-file", str(logf),
           f"http://{server.target}/inference.GRPCInferenceService/ModelInfer"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with CpuMeter(server) as cpu:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=seconds + 120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # h2load's, reaped by run (the servers live on)
    h2_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    text = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"h2load exited with {proc.returncode}:\n{text[-2000:]}")
    lat, statuses = [], 0
    for line in logf.read_text().splitlines():
        _, code, us = line.split("\t")[:3]
        statuses += code != "200"
        lat.append(int(us) / 1e6)
    data = next((ln for ln in text.splitlines() if ln.startswith("traffic:")), "")
    data_bytes = int(data.rsplit("(", 1)[1].split(")")[0]) if "data" in data else -1
    ok = data_bytes // frame if data_bytes >= 0 and data_bytes % frame == 0 else 0
    load = Tally(lat=lat if ok == len(lat) else lat[:ok])  # throughput counts ok calls only
    load.errors = statuses + (len(lat) - ok)
    if load.errors:
        load.first_errors.append(
            f"{len(lat)} calls, {ok} ok responses ({data_bytes} response bytes, {frame} per ok "
            f"response), {statuses} HTTP statuses other than 200"
        )
    cpu.client_s, cpu.other_s = h2_s, max(cpu.other_s - h2_s, 0.0)  # the client is h2load, not us
    return load.report("h2load", clients, cpu.wall, cpu)


def bench_aio(server: Server, clients: int, seconds: float, *, noop: bool = False) -> dict[str, Any]:
    cpu = CpuMeter(server)
    load = asyncio.run(_aio_load(server.target, clients, seconds, noop, cpu))
    name = "grpc_aio_raw" + (" ServerLive (no model)" if noop else "")
    return load.report(name, clients, cpu.wall, cpu)


# ---- per mode, goals, main -------------------------------------------------------------------------


@contextlib.contextmanager
def running(cfg: Path, mode: str, tmp: Path) -> Iterator[tuple[Server, float]]:
    server = start_server(cfg, mode, tmp)
    try:
        ready_s = wait_ready(server)
        quiet_s = wait_quiet(server)
        log(f"{mode}: server ready in {ready_s:.1f} s at {server.target}, quiet after {quiet_s:.1f} s more")
        yield server, ready_s
    finally:
        rc = server.stop()
        log(f"{mode}: server stopped (exit {rc})")


def bench_mode(
    cfg: Path, mode: str, tmp: Path, a: argparse.Namespace, direct: dict[str, Any]
) -> dict[str, Any]:
    with running(cfg, mode, tmp) as (server, ready_s):
        one = bench_one_client(server, a.n)
        one["overhead_p50_ms"] = round(one["p50_ms"] - direct["p50_ms"], 4)
        one["overhead_p99_ms"] = round(one["p99_ms"] - direct["p99_ms"], 4)
        log(f"{mode}: one client p50 {one['p50_ms']:.3f} ms p99 {one['p99_ms']:.3f} ms")
        conc = []
        runs: list[Callable[[], dict[str, Any]]] = [
            lambda: bench_threads(server, a.clients, a.seconds),
            lambda: bench_aio(server, a.clients, a.seconds),
            lambda: bench_h2load(server, a.clients, a.seconds, tmp),
        ]
        for run in runs:
            r = run()
            if "skipped" in r:
                log(f"{mode}: {r['client']} skipped: {r['skipped']}")
                conc.append(r)
                continue
            log(f"{mode}: {r['client']}: {r['infer_per_s']:.0f}/s p50 {r.get('p50_ms')} "
                f"p99 {r.get('p99_ms')} errors {r['errors']} (client cpu {r['cpu']['client_cpu_pct']}%, "
                f"server {r['cpu']['server_cpu_pct']}%)")  # fmt: skip
            conc.append(r)
        noop = bench_aio(server, a.clients, min(a.seconds, 3.0), noop=True)
        log(f"{mode}: ServerLive floor: {noop['infer_per_s']:.0f}/s p50 {noop.get('p50_ms')} ms")
        out = {"server_ready_s": round(ready_s, 2), "grpc_one_client": one, "grpc_concurrent": conc,
               "grpc_noop": noop}  # fmt: skip
    out["goals_met"] = goals_met(out)
    return out


def goals_met(r: dict[str, Any]) -> dict[str, Any]:
    one = r["grpc_one_client"]
    p50_ok = one["overhead_p50_ms"] <= GOALS["one_client_p50_overhead_ms"]
    p99_ok = one["overhead_p99_ms"] <= GOALS["one_client_p99_overhead_ms"]
    per_client = {
        c["client"]: "skipped" not in c
        and c["infer_per_s"] >= GOALS["concurrent_infer_per_s"]
        and c.get("p99_ms", float("inf")) <= GOALS["concurrent_p99_ms"]
        and c["errors"] <= GOALS["concurrent_errors"]
        for c in r["grpc_concurrent"]
    }
    return {"one_client_p50_overhead": p50_ok, "one_client_p99_overhead": p99_ok,
            "concurrent": any(per_client.values()), "concurrent_by_client": per_client,
            "all": p50_ok and p99_ok and any(per_client.values())}  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="timed calls for direct and one-client runs")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each concurrent run")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--modes", default="in_process,ray", help="server modes: in_process, ray")
    ap.add_argument("--frontends", type=int, default=1,
                    help="server.frontends (home.yaml: 1; 0: the manager's process serves)")  # fmt: skip
    ap.add_argument("--max-batch", type=int, default=1,
                    help="the tiny model's max_batch (dynamic batching; 1 = off)")  # fmt: skip
    a = ap.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if bad := set(a.modes) - {"in_process", "ray"}:
        ap.error(f"unknown modes {sorted(bad)}; use in_process, ray")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0, load1 = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="grpc-overhead-") as d:
        tmp = Path(d)
        cfg = write_config(tmp, a.max_batch, a.frontends)
        direct = bench_direct(tmp, a.n)
        log(f"direct: p50 {direct['p50_ms']:.4f} ms p99 {direct['p99_ms']:.4f} ms")
        manager = bench_manager(cfg, tmp, a.clients, a.seconds)
        log(f"manager only: {manager['infer_per_s']:.0f}/s, {manager['cpu_us_per_infer']:.0f} us CPU each")
        result: dict[str, Any] = {"model": f"workers.demo:tiny_mlp width {WIDTH}, input FP32 [1, {WIDTH}]",
                                  "max_batch": a.max_batch, "frontends": a.frontends,
                                  "direct": direct, "manager_only": manager, "goals": GOALS}  # fmt: skip
        for mode in a.modes:
            result[mode] = bench_mode(cfg, mode, tmp, a, direct)
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_1m_at_start": round(load1, 2),
                         "python": sys.version.split()[0], "grpc": grpc.__version__}  # fmt: skip
    result["command"] = shlex.join(
        ["python", "bench/grpc_overhead.py", *(argv if argv is not None else sys.argv[1:])]
    )
    result["total_s"] = round(time.monotonic() - t0, 1)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
