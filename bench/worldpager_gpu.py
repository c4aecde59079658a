"""WorldPager on a GPU: pinned-pool throughput, H2D/compute overlap at MG2's full dims, int4 decode.

usage: python bench/worldpager_gpu.py [--pages N] [--json]

Without CUDA it prints ``{"skipped": "needs CUDA"}`` and exits 0. With CUDA it prints a short table, or
with ``--json`` one JSON object (keys below). Runs in well under 3 minutes on an H200-class GPU (the
slowest part is one block of the stand-in with its on-the-fly RoPE, built on the CPU). Needs about
2.5 GB of pinned host memory at the default ``--pages 64`` and 10 GiB of free GPU memory for the
full-size block (~6 GB used); with less, the only compute load is a calibrated matmul loop.

A *page* is one K or V of one (segment, layer): ``[1, 2640, 12, 128]``, 8,110,080 bytes in bf16 and
2,154,240 bytes int4-packed (4.25 bits per value). A *segment* is 30 layers x (K, V) = 60 pages
(486.6 MB bf16, 129.3 MB int4). GB/s are 10^9 bytes per second. Times are the fastest of a few
repeats after a warm-up, wall clock with the device synchronised before and after (so they include
the host's launch time), in seconds.

JSON keys
---------
* ``device``, ``torch``, ``cuda``, ``pages``, ``page_bytes`` (per codec), ``segment_bytes`` (per codec).
* ``h2d_pinned_gbps`` / ``d2h_pinned_gbps``: ``{"bf16", "int4", "one_buffer"}`` -- ``--pages`` pages
  copied one page per copy on a side stream between a pre-allocated pinned host pool and device
  buffers (the runtime's pattern, vLLM's CPU tier); ``one_buffer`` is the same bytes as one copy
  (the link's ceiling without per-copy overhead).
* ``h2d_pageable_gbps``: ``{"bf16", "int4"}`` -- the same H2D from ordinary (pageable) host memory.
* ``h2d_pin_on_the_fly_gbps``: ``{"bf16", "int4"}`` -- one segment payload from Python ``bytes`` the
  way `TransferHandler._upload` moves it: ``bytearray`` copy, ``.pin_memory()``, H2D. Compare with
  the pool figures (docs §4.6: on-the-fly pinning can be slower than a pre-allocated pool).
* ``compute``: ``kind`` (``"mg2_block"`` or ``"matmul"``), and for ``mg2_block``: ``block_s`` -- one
  full MG2 block of the stand-in (`TinyCausalWan(mg2_config())`, random bf16 weights, 4 passes:
  3 denoising + the context pass) at steady state (full 6-frame window) with 2 retrieved segments of
  memory per layer, the RoPE tables on the device; ``block_no_memory_s`` -- the same without memory;
  ``block_on_the_fly_rope_s`` -- with memory, RoPE computed on the fly as the stand-in does for
  ``table=None`` (complex128 frequencies built on the CPU every layer and copied to the device).
* ``overlap``: per case (``bf16_segment_vs_block``, ``int4_segment_vs_block`` when the block fits,
  ``bf16_segment_vs_matmul`` always): ``copy_s`` (H2D of one segment from a pinned buffer on a side
  stream, alone), ``compute_s`` (alone, default stream), ``both_s`` (both queued together),
  ``hidden`` = (copy + compute - both) / min(copy, compute): 1.0 = the shorter one fully hidden,
  0.0 = serialised; ``compute_slowdown`` = both / compute - 1 (what a prefetch costs the block).
  The matmul load is calibrated to take about as long as the bf16 copy.
* ``decode_int4_segment_s``: decode one int4 segment (60 pages) to bf16 on the GPU, payload already
  on the device; ``rerotate_segment_s``: re-rotate its 30 K pages to new frames (`rope.rerotate_time`);
  ``upload_int4_segment_s``: `TransferHandler`'s whole upload of one int4 segment from ``bytes``
  (pin on the fly, H2D on a side stream, decode, re-rotate, event synchronised).
* ``elapsed_s``: the benchmark's own wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from worldpager import codecs
from worldpager.layout import SegmentLayout
from worldpager.model import KV, TinyCausalWan, TinyConfig, _ActionBranch, _SelfAttention, mg2_config

PAGE_SHAPE = (1, 2640, 12, 128)
PAGE_NUMEL = math.prod(PAGE_SHAPE)
CODECS = ("bf16", "int4")
BLOCK_FREE_BYTES = 10 * 2**30  # free GPU memory needed to run the full-size block
GB = 1e9


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_time(fn: Callable[[], object], dev: torch.device, repeat: int = 3, warmup: int = 1) -> float:
    """Fastest wall time of ``fn`` over ``repeat`` runs (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    best = math.inf
    for _ in range(repeat):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _rnd(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


# ---- copies -----------------------------------------------------------------------------------------


def _on(stream: torch.cuda.Stream | None, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run with ``stream`` as the current stream (None: as is)."""
    if stream is None:
        return fn

    def run() -> None:
        with torch.cuda.stream(stream):
            fn()

    return run


def _copies(dst: list[torch.Tensor], src: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)

    return run


def throughput(
    dev: torch.device, stream: torch.cuda.Stream | None, pages: int, nbytes: int
) -> dict[str, dict[str, float]]:
    """GB/s of one page per copy between host pools and device buffers (see the module docstring)."""
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda") for _ in range(pages)]
    pageable = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(pages)]
    for i, p in enumerate(pinned):
        p.fill_(i % 251)
    device = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(pages)]
    total = pages * nbytes
    h2d = best_time(_on(stream, _copies(device, pinned)), dev)
    d2h = best_time(_on(stream, _copies(pinned, device)), dev)
    h2d_pageable = best_time(_on(stream, _copies(device, pageable)), dev)
    return {
        "h2d_pinned": {"gbps": _rnd(total / h2d / GB)},
        "d2h_pinned": {"gbps": _rnd(total / d2h / GB)},
        "h2d_pageable": {"gbps": _rnd(total / h2d_pageable / GB)},
    }


def one_buffer(dev: torch.device, stream: torch.cuda.Stream | None, nbytes: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda").fill_(7)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = best_time(_on(stream, _copies([device], [host])), dev)
    d2h = best_time(_on(stream, _copies([host], [device])), dev)
    return {"h2d_gbps": _rnd(nbytes / h2d / GB), "d2h_gbps": _rnd(nbytes / d2h / GB)}


def pin_on_the_fly(dev: torch.device, stream: torch.cuda.Stream | None, payload: bytes) -> float:
    """GB/s of `TransferHandler`'s H2D: ``bytes`` -> bytearray -> ``pin_memory()`` -> device."""

    def run() -> None:
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if dev.type == "cuda":
            host = host.pin_memory()
        host.to(dev, non_blocking=True)

    return _rnd(len(payload) / best_time(_on(stream, run), dev) / GB)


# ---- compute ----------------------------------------------------------------------------------------


def rope_tables_to(model: TinyCausalWan, dev: torch.device | None) -> None:
    """Put the model's RoPE tables on ``dev`` (None: drop them -> on-the-fly positions on the CPU).

    The stand-in keeps its tables (and builds on-the-fly frequencies) on the CPU and copies them to the
    activations' device at every layer; MG2 keeps its `freqs` on the GPU. Tables on the device make the
    stand-in's block time mostly GPU work.
    """
    for m in model.modules():
        if isinstance(m, _SelfAttention):
            if dev is None or model.rope_table is None:
                m.table = None
            else:
                t, h, w = model.rope_table
                m.table = (t.to(dev), h.to(dev), w.to(dev))
        elif isinstance(m, _ActionBranch):
            m.table = (
                None if dev is None or model.action_rope_table is None else model.action_rope_table.to(dev)
            )


class Mg2Block:
    """One full-size MG2 block of the stand-in at steady state: window full, start frame 6 (``cfg``:
    another size, for a smoke run on the CPU)."""

    def __init__(
        self,
        dev: torch.device,
        k_memory: int = 2,
        cfg: TinyConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.cfg = cfg = cfg if cfg is not None else mg2_config()
        self.model = TinyCausalWan(cfg, device=dev, dtype=dtype)
        rope_tables_to(self.model, dev)
        g = torch.Generator().manual_seed(0)
        fpb = self.fpb = cfg.frames_per_block
        self.latent = torch.randn((fpb, cfg.tokens_per_frame, cfg.dim), generator=g).to(dev)
        self.actions = torch.randn((fpb, cfg.action_dim), generator=g).to(dev)
        kv: list[KV] = []
        for start in (0, fpb):  # fill MG2's 6-frame window
            _, kv = self.model.generate_block(self.latent, self.actions, start)
        self.kv = kv  # the last block's final KV: a realistic segment
        self.memory: list[KV] = [
            (torch.cat([k] * k_memory, dim=1), torch.cat([v] * k_memory, dim=1)) for k, v in kv
        ]

    def run(self, memory: bool = True) -> None:
        self.model.generate_block(self.latent, self.actions, 2 * self.fpb, self.memory if memory else None)


class Matmuls:
    """A bf16 matmul loop calibrated to take about ``target_s``."""

    def __init__(self, dev: torch.device, target_s: float, n: int = 8192) -> None:
        self.a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.iters = 1
        one = best_time(self.run, dev, repeat=5)
        self.iters = max(1, round(target_s / one))

    def run(self) -> None:
        for _ in range(self.iters):
            torch.matmul(self.a, self.b, out=self.c)


def overlap(
    dev: torch.device, stream: torch.cuda.Stream, copy: Callable[[], None], compute: Callable[[], None]
) -> dict[str, float]:
    """Copy alone (side stream), compute alone (default stream), both queued together."""
    side = _on(stream, copy)
    t_copy = best_time(side, dev)
    t_compute = best_time(compute, dev)

    def both() -> None:
        side()  # pinned + non_blocking: queued, returns at once
        compute()

    t_both = best_time(both, dev)
    return {
        "copy_s": _rnd(t_copy),
        "compute_s": _rnd(t_compute),
        "both_s": _rnd(t_both),
        "hidden": _rnd((t_copy + t_compute - t_both) / min(t_copy, t_compute), 3),
        "compute_slowdown": _rnd(t_both / t_compute - 1, 3),
    }


# ---- decode -----------------------------------------------------------------------------------------


def mg2_layout(codec: str) -> SegmentLayout:
    return SegmentLayout.from_config(mg2_config(), codec, torch.bfloat16)


def random_segment(dev: torch.device, layers: int) -> list[KV]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(PAGE_SHAPE, generator=g).to(dev, torch.bfloat16),
         torch.randn(PAGE_SHAPE, generator=g).to(dev, torch.bfloat16))
        for _ in range(layers)
    ]  # fmt: skip


def decode_figures(
    dev: torch.device, stream: torch.cuda.Stream | None, layout: SegmentLayout, payload: bytes
) -> dict[str, float]:
    on_dev = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    decoded = layout.decode(on_dev)
    t_decode = best_time(lambda: layout.decode(on_dev), dev)
    t_rerotate = best_time(lambda: layout.rerotate(decoded, 6, -6), dev)

    def upload() -> None:  # TransferHandler._upload on CUDA
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if dev.type == "cuda":
            host = host.pin_memory()
        layout.rerotate(layout.decode(host.to(dev, non_blocking=True)), 6, -6)

    t_upload = best_time(_on(stream, upload), dev)
    return {
        "decode_int4_segment_s": _rnd(t_decode),
        "rerotate_segment_s": _rnd(t_rerotate),
        "upload_int4_segment_s": _rnd(t_upload),
    }


# ---- main -------------------------------------------------------------------------------------------


def run(pages: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    page_bytes = {c: codecs.packed_nbytes(PAGE_NUMEL, c) for c in CODECS}
    layouts = {c: mg2_layout(c) for c in CODECS}
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pages": pages,
        "page_bytes": page_bytes,
        "segment_bytes": {c: layouts[c].payload_nbytes for c in CODECS},
    }
    tp = {c: throughput(dev, stream, pages, page_bytes[c]) for c in CODECS}
    buf = one_buffer(dev, stream, pages * page_bytes["bf16"])
    out["h2d_pinned_gbps"] = {c: tp[c]["h2d_pinned"]["gbps"] for c in CODECS} | {
        "one_buffer": buf["h2d_gbps"]
    }
    out["d2h_pinned_gbps"] = {c: tp[c]["d2h_pinned"]["gbps"] for c in CODECS} | {
        "one_buffer": buf["d2h_gbps"]
    }
    out["h2d_pageable_gbps"] = {c: tp[c]["h2d_pageable"]["gbps"] for c in CODECS}

    block: Mg2Block | None = None
    if torch.cuda.mem_get_info(dev)[0] >= BLOCK_FREE_BYTES:
        try:
            block = Mg2Block(dev)
        except torch.cuda.OutOfMemoryError:
            block = None
            torch.cuda.empty_cache()
    kv = block.kv if block is not None else random_segment(dev, layouts["bf16"].layers)
    payloads = {c: layouts[c].encode(kv) for c in CODECS}
    out["h2d_pin_on_the_fly_gbps"] = {c: pin_on_the_fly(dev, stream, payloads[c]) for c in CODECS}

    seg_host = {c: torch.frombuffer(bytearray(payloads[c]), dtype=torch.uint8).pin_memory() for c in CODECS}
    seg_dev = {c: torch.empty_like(seg_host[c], device=dev) for c in CODECS}
    copy = {c: _copies([seg_dev[c]], [seg_host[c]]) for c in CODECS}
    ov: dict[str, dict[str, float]] = {}
    if block is not None:
        b = block
        out["compute"] = {
            "kind": "mg2_block",
            "block_s": _rnd(best_time(b.run, dev)),
            "block_no_memory_s": _rnd(best_time(lambda: b.run(memory=False), dev)),
        }
        for c in CODECS:
            ov[f"{c}_segment_vs_block"] = overlap(dev, stream, copy[c], b.run)
        rope_tables_to(b.model, None)
        out["compute"]["block_on_the_fly_rope_s"] = _rnd(best_time(b.run, dev, repeat=1, warmup=0))
        rope_tables_to(b.model, dev)
    else:
        out["compute"] = {"kind": "matmul"}
    t_copy = best_time(_on(stream, copy["bf16"]), dev)
    mm = Matmuls(dev, t_copy)
    ov["bf16_segment_vs_matmul"] = overlap(dev, stream, copy["bf16"], mm.run) | {"matmuls": mm.iters}
    out["overlap"] = ov
    del mm
    out |= decode_figures(dev, stream, layouts["int4"], payloads["int4"])
    out["elapsed_s"] = _rnd(time.perf_counter() - t_start, 3)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['device']}  (torch {res['torch']}, CUDA {res['cuda']}, {res['pages']} pages per pool)"]
    for key in ("h2d_pinned_gbps", "d2h_pinned_gbps", "h2d_pageable_gbps", "h2d_pin_on_the_fly_gbps"):
        lines.append(f"  {key:26s} " + "  ".join(f"{k} {v:g}" for k, v in res[key].items()))
    lines.append("  compute                    " + "  ".join(f"{k} {v}" for k, v in res["compute"].items()))
    for name, o in res["overlap"].items():
        lines.append(f"  overlap {name:18s} " + "  ".join(f"{k} {v:g}" for k, v in o.items()))
    for key in ("decode_int4_segment_s", "rerotate_segment_s", "upload_int4_segment_s", "elapsed_s"):
        lines.append(f"  {key:26s} {res[key]:g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="WorldPager GPU benchmark (skipped without CUDA)")
    ap.add_argument("--pages", type=int, default=64, help="pages per pinned pool (default 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args(argv)
    if a.pages < 1:
        ap.error("--pages must be >= 1")
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return 0
    res = run(a.pages)
    print(json.dumps(res, indent=1) if a.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
