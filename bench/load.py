"""Load ramp: how many concurrent clients one `residency serve` takes before latency climbs.

usage: python bench/load.py [--mode in_process|ray] [--idle-seconds 3] [--step-seconds 4]

One server (`--in-process` by default; `--mode ray` for the Ray default) with the tiny stand-in model
`workers.demo:tiny_mlp`, set up, started, awaited and stopped by `bench/grpc_overhead.py`'s helpers.
Load comes from its raw `grpc.aio` generator (one asyncio task per client, one channel).

First the idle p99 with one client (`--idle-seconds`). Then concurrent clients 1, 2, 4, ..., 256, each
step `--step-seconds` long, until a step's p99 exceeds `--knee-factor` (5) x the idle p99; one more step
is run past that, then the ramp stops. The knee is the last step before the first such step. Each step
records clients, infer/s, p50/p99 ms, errors (the first few messages) and the RSS of the server's
process tree at the end of the step. JSON goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc_overhead as go

CLIENTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def log(msg: str) -> None:
    print(f"[load] {msg}", file=sys.stderr, flush=True)


def rss(server: go.Server) -> int:
    """Resident memory of the server and all its descendants, bytes."""
    total = 0
    for p in server.processes():
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def step(server: go.Server, clients: int, seconds: float) -> dict[str, Any]:
    r = go.bench_aio(server, clients, seconds)
    return {"clients": clients, "seconds": r["seconds"], "infer_per_s": r["infer_per_s"],
            "p50_ms": r.get("p50_ms"), "p99_ms": r.get("p99_ms"), "errors": r["errors"],
            "first_errors": r["first_errors"], "server_cpu_pct": r["cpu"]["server_cpu_pct"],
            "client_cpu_pct": r["cpu"]["client_cpu_pct"], "server_rss_bytes": rss(server)}  # fmt: skip


def ramp(server: go.Server, a: argparse.Namespace) -> dict[str, Any]:
    rss_start = rss(server)
    idle = go.bench_aio(server, 1, a.idle_seconds)
    idle_p99 = float(idle["p99_ms"])
    limit = a.knee_factor * idle_p99
    log(f"idle: p99 {idle_p99:.3f} ms ({idle['infer_per_s']:.0f}/s); knee when p99 > {limit:.3f} ms")
    steps: list[dict[str, Any]] = []
    crossed: int | None = None  # index of the first step with p99 > limit
    for n in CLIENTS:
        s = step(server, n, a.step_seconds)
        steps.append(s)
        p99 = s["p99_ms"] if s["p99_ms"] is not None else float("inf")
        log(f"{n:4d} clients: {s['infer_per_s']:8.0f}/s p50 {s['p50_ms']} ms p99 {s['p99_ms']} ms "
            f"errors {s['errors']} rss {s['server_rss_bytes'] / 2**20:.0f} MiB")  # fmt: skip
        if crossed is not None:
            break  # the one step past the knee is done
        if p99 > limit:
            crossed = len(steps) - 1
    below = steps[:crossed] if crossed is not None else steps
    knee = below[-1] if below else None
    rss_all = [rss_start, *(s["server_rss_bytes"] for s in steps)]
    return {
        "idle_p99_ms": round(idle_p99, 4),
        "idle": {k: idle.get(k) for k in ("infer_per_s", "p50_ms", "p99_ms", "errors")},
        "knee_factor": a.knee_factor,
        "knee": None if knee is None else {k: knee[k] for k in ("clients", "infer_per_s", "p99_ms")},
        "knee_reached": crossed is not None,
        "steps": steps,
        "max_infer_per_s": max(s["infer_per_s"] for s in steps),
        "errors_below_knee": sum(s["errors"] for s in below),
        "server_rss_bytes": {"start": rss_start, "max": max(rss_all), "end": rss_all[-1]},
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["in_process", "ray"], default="in_process")
    ap.add_argument("--idle-seconds", type=float, default=3.0, help="length of the one-client idle run")
    ap.add_argument("--step-seconds", type=float, default=4.0, help="length of each ramp step")
    ap.add_argument("--knee-factor", type=float, default=5.0, help="knee: p99 above this x idle p99")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="load-") as d:
        tmp = Path(d)
        cfg = go.write_config(tmp)
        with go.running(cfg, a.mode, tmp) as (server, _ready_s):
            r = ramp(server, a)
    args = argv if argv is not None else sys.argv[1:]
    result = {"model": f"workers.demo:tiny_mlp width {go.WIDTH}, input FP32 [1, {go.WIDTH}]",
              "mode": a.mode, **r, "machine": {"cpus": os.cpu_count()},
              "command": shlex.join(["python", "bench/load.py", *args]),
              "total_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    k = r["knee"]
    log(f"knee: {k} (reached: {r['knee_reached']}); errors below knee {r['errors_below_knee']}")
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
