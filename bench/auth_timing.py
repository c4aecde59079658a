"""Does a wrong admin token take measurably different time to refuse than another wrong one?

usage: python bench/auth_timing.py [--n 3000] [--rounds 5]

Starts `residency serve --in-process` (config: the grpc_overhead bench's, plus
`server.auth_token_env` naming a 32-character token set in the server's environment) and calls the
admin `residency.v1.Residency/List` with these `authorization` headers, interleaved call by call so
that drift on the machine hits every class alike:

  none           no header
  wrong_first    the right length, the first character wrong
  wrong_last     the right length, only the last character wrong (the longest shared prefix)
  short          the first half of the token
  right          the token (the call then runs: reported, not compared)

Each refused call must get UNAUTHENTICATED. Reported per class: median, p10, p90 in microseconds,
and for each wrong class vs `wrong_first` the difference of medians with a 95 % bootstrap interval.
A difference whose interval holds 0, or that is far below the call's own spread (p90 - p10), is not
worth measuring. The comparison itself is also timed in-process (`AuthInterceptor.allows`, 200,000
calls per class). JSON to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from residency_proto.v1 import residency_pb2, residency_pb2_grpc

# grpc_overhead brings tritonclient's `inference` protos, which cannot share a process with the
# server's (manager.api.server): the in-process compare runs in a child process (--compare-only).
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKEN = "k3Jq9vXbT2wLmN8pR4sY6uZ0aC5dE7fG"  # 32 characters, a bench token (not a secret)
ENV = "RESIDENCY_BENCH_TOKEN"


def headers() -> dict[str, list[tuple[str, str]]]:
    first = ("x" if TOKEN[0] != "x" else "y") + TOKEN[1:]
    last = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
    return {
        "none": [],
        "wrong_first": [("authorization", f"Bearer {first}")],
        "wrong_last": [("authorization", f"Bearer {last}")],
        "short": [("authorization", f"Bearer {TOKEN[:16]}")],
        "right": [("authorization", f"Bearer {TOKEN}")],
    }


def pct(xs: list[float]) -> dict[str, float]:
    a = np.array(xs) * 1e6
    return {"median_us": round(float(np.median(a)), 2), "p10_us": round(float(np.percentile(a, 10)), 2),
            "p90_us": round(float(np.percentile(a, 90)), 2), "n": len(xs)}  # fmt: skip


def bootstrap_diff(a: list[float], b: list[float], reps: int = 2000, seed: int = 1) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    x, y = np.array(a) * 1e6, np.array(b) * 1e6
    d = [float(np.median(rng.choice(x, x.size)) - np.median(rng.choice(y, y.size))) for _ in range(reps)]
    ci = [round(float(np.percentile(d, 2.5)), 2), round(float(np.percentile(d, 97.5)), 2)]
    return {"diff_median_us": round(float(np.median(x) - np.median(y)), 2), "ci95_us": ci}


def over_grpc(target: str, n: int, rounds: int, log: Any) -> dict[str, list[float]]:
    hs = headers()
    times: dict[str, list[float]] = {k: [] for k in hs}
    with grpc.insecure_channel(target) as ch:
        stub = residency_pb2_grpc.ResidencyStub(ch)
        req = residency_pb2.ListRequest()
        for _ in range(200):  # warm-up
            for md in hs.values():
                with contextlib.suppress(grpc.RpcError):
                    stub.List(req, metadata=md, timeout=10)
        order = list(hs)
        for r in range(rounds):
            log(f"round {r + 1}/{rounds}")
            for _ in range(n // rounds):
                random.shuffle(order)
                for k in order:
                    t0 = time.perf_counter()
                    try:
                        stub.List(req, metadata=hs[k], timeout=10)
                        code = grpc.StatusCode.OK
                    except grpc.RpcError as e:
                        code = e.code()
                    times[k].append(time.perf_counter() - t0)
                    want = grpc.StatusCode.OK if k == "right" else grpc.StatusCode.UNAUTHENTICATED
                    if code != want:
                        raise SystemExit(f"{k}: got {code}, expected {want}")
    return times


def in_process(calls: int = 200_000) -> dict[str, Any]:
    from manager.api.server import AuthInterceptor

    auth = AuthInterceptor(TOKEN)
    out: dict[str, Any] = {}
    for k, md in headers().items():
        value = md[0][1] if md else ""
        t0 = time.perf_counter()
        for _ in range(calls):
            auth.allows(value)
        out[k] = round((time.perf_counter() - t0) / calls * 1e9, 1)
    return {"ns_per_compare": out, "calls": calls}


def write_config(tmp: Path) -> Path:
    """The grpc_overhead bench's config in `tmp` (no front ends: the manager's process answers), with
    `server.auth_token_env` naming ENV. (Prepending a second `server:` mapping, as this did before,
    made the file invalid YAML once grpc_overhead wrote `server.frontends`.)"""
    import grpc_overhead as go

    return go.write_config(tmp, auth_token_env=ENV)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="calls per header class")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare_only:
        print(json.dumps(in_process()))
        return 0
    import subprocess

    import grpc_overhead as go

    with tempfile.TemporaryDirectory(prefix="auth-") as d:
        tmp = Path(d)
        cfg = write_config(tmp)
        os.environ[ENV] = TOKEN  # the server's environment (start_server passes os.environ on)
        with go.running(cfg, "in_process", tmp) as (server, _):
            times = over_grpc(server.target, a.n, a.rounds, go.log)
    classes = {k: pct(v) for k, v in times.items()}
    spread = classes["wrong_first"]["p90_us"] - classes["wrong_first"]["p10_us"]
    diffs = {k: bootstrap_diff(times[k], times["wrong_first"]) for k in ("none", "wrong_last", "short")}
    wl = diffs["wrong_last"]
    result = {
        "bench": "auth_timing",
        "server": "residency serve --in-process, admin residency.v1.Residency/List, loopback",
        "over_grpc": classes,
        "vs_wrong_first": diffs,
        "wrong_first_spread_p90_p10_us": round(spread, 2),
        "wrong_last_vs_wrong_first_ci_holds_0": wl["ci95_us"][0] <= 0 <= wl["ci95_us"][1],
        "in_process": json.loads(
            subprocess.run(
                [sys.executable, __file__, "--compare-only"], check=True, capture_output=True
            ).stdout
        ),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
