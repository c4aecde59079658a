"""Promote bandwidth on a GPU: a model's host tier in pinned vs pageable memory, through the device host.

usage: python bench/workers_gpu.py [--mib 1024] [--repeats 3]

Builds a safetensors-module model of `--mib` MiB (a stack of Linear layers, random weights: a
stand-in for an LLM's weights), loads it to the host tier on a CUDA device host (pinned memory),
then times promote (host→gpu, non-blocking copies + sync) and demote (gpu→host into pinned memory).
For comparison it times the same bytes copied from pageable memory. Prints one JSON object. Without
CUDA it prints {"skipped": "needs CUDA"} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from torch import nn


def _build(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return 0
    from workers import protocol as P
    from workers.host import DeviceHost
    from workers.st_io import write_safetensors

    width = 4096
    layers = max(1, a.mib * 2**20 // (width * width * 2))
    mod = types.ModuleType("bench_factories")
    mod.build = lambda: _build(layers, width).to(torch.bfloat16)  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        write_safetensors(_build(layers, width).to(torch.bfloat16).state_dict(), path)
        spec = P.ModelSpec(
            "big", "safetensors-module", {"factory": "bench_factories:build", "path": str(path)}
        )
        host = DeviceHost("gpu0", "cuda")
        load = host.apply(P.Load(spec, "host"), "load")
        assert load.ok, load.error
        promote, demote = [], []
        for i in range(a.repeats):
            p = host.apply(P.Promote("big"), f"p{i}")
            d = host.apply(P.Demote("big"), f"d{i}")
            assert p.ok and d.ok, (p.error, d.error)
            promote.append(p.bytes_moved / p.timing.to_device_s / 1e9)
            demote.append(d.bytes_moved / d.timing.to_device_s / 1e9)
        nbytes = load.bytes_moved
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pageable.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "bytes": nbytes, "layers": layers,
        "promote_pinned_gbps": statistics.median(promote), "demote_pinned_gbps": statistics.median(demote),
        "h2d_pageable_gbps": nbytes / statistics.median(times) / 1e9,
        "disk_to_host_s": load.timing.total_s,
        "command": "python bench/workers_gpu.py " + " ".join(sys.argv[1:]),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
