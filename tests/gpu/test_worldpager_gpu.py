"""WorldPager on CUDA: pinned pool, side-stream overlap, D2H after compute, the runtime's CUDA path and
the full-size MG2 stand-in. Every test here is skipped without CUDA (and auto-marked `gpu`).

Sizes are MG2's: one page is one K or V of one (segment, layer), ``[1, 2640, 12, 128]`` bf16 = 7.73 MiB.
Timing assertions (overlap) keep wide margins: they check that copies and compute *overlap*, not how
fast the machine is.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import worldpager.session as session_mod
from worldpager import codecs
from worldpager.layout import SegmentLayout
from worldpager.model import KV, TINY, TinyCausalWan, TinyConfig, mg2_config
from worldpager.page_types import Corrupt, DiskFull
from worldpager.session import Session
from worldpager.trajectory import block_inputs, yaw_sweep_trajectory
from worldpager.transfer import Dropped

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PAGE_SHAPE = (1, 2640, 12, 128)  # one MG2 page: [1, frames*tokens, heads, head_dim]
PAGE_BYTES = math.prod(PAGE_SHAPE) * 2  # bf16
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[2]


def _stream() -> torch.cuda.Stream:
    return torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]


def _event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _pinned_page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    host = torch.empty(PAGE_SHAPE, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(torch.randn(PAGE_SHAPE, generator=g))
    return host


def _best_wall(fn: Callable[[], object], repeat: int = 3) -> float:
    """Fastest wall time of ``fn`` (the device synchronised before and after), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


# ---- 1. pinned pool -----------------------------------------------------------------------------------


def test_pinned_pool_page_h2d_on_a_side_stream_is_bit_exact() -> None:
    k, v = _pinned_page(1), _pinned_page(2)
    assert k.is_pinned() and v.is_pinned()
    assert k.numel() * k.element_size() == PAGE_BYTES
    side = _stream()
    with torch.cuda.stream(side):
        dk = k.to(CUDA, non_blocking=True)
        dv = v.to(CUDA, non_blocking=True)
        done = _event()
        done.record(side)
    done.synchronize()
    assert dk.is_cuda and dk.shape == PAGE_SHAPE and dk.dtype == torch.bfloat16
    assert torch.equal(dk.cpu(), k) and torch.equal(dv.cpu(), v)


# ---- 2. overlap of H2D with compute ---------------------------------------------------------------


def test_h2d_on_a_side_stream_overlaps_default_stream_compute() -> None:
    n_pages = 64  # K and V pages: 64 x 7.73 MiB ~ 0.52 GB per pass over the pool
    pool = [torch.empty(PAGE_SHAPE, dtype=torch.bfloat16, pin_memory=True).fill_(i) for i in range(n_pages)]
    dst = [torch.empty(PAGE_SHAPE, dtype=torch.bfloat16, device=CUDA) for _ in range(n_pages)]
    side = _stream()
    passes = 2

    def copy() -> None:
        with torch.cuda.stream(side):
            for _ in range(passes):
                for h, d in zip(pool, dst, strict=True):
                    d.copy_(h, non_blocking=True)

    a = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t_copy = _best_wall(copy)
    t_mm = _best_wall(lambda: torch.matmul(a, b, out=c), repeat=5)
    # compute ~ the copy time: perfect overlap is 0.5 of the serial sum, the bound below is 0.8
    iters = max(1, round(t_copy / t_mm))

    def compute() -> None:
        for _ in range(iters):
            torch.matmul(a, b, out=c)

    t_compute = _best_wall(compute)

    def both() -> None:
        copy()  # queued on the side stream (pinned + non_blocking: returns at once)
        compute()  # queued on the default stream

    t_both = _best_wall(both)
    serial = t_copy + t_compute
    assert t_both < 0.8 * serial, (
        f"no overlap: copy {t_copy * 1e3:.1f} ms, compute {t_compute * 1e3:.1f} ms "
        f"({iters} matmuls), both {t_both * 1e3:.1f} ms"
    )
    assert all(torch.equal(d[0, 0, 0, :1].cpu(), h[0, 0, 0, :1]) for h, d in zip(pool, dst, strict=True))


# ---- 3. D2H after the compute that produced the KV -------------------------------------------------


def test_d2h_waits_for_the_compute_stream_and_lands_in_pinned_memory() -> None:
    torch.manual_seed(0)
    h = torch.randn(2640, 1536, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(1536, 1536, device=CUDA, dtype=torch.bfloat16) / math.sqrt(1536)
    for _ in range(50):  # a queue of compute on the default stream that the copy must not overtake
        h = torch.tanh(h @ w)
    k = h.view(PAGE_SHAPE)  # the "finished segment's" KV page, produced on the default stream
    v = (h * 2).view(PAGE_SHAPE)
    host_k = torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16, pin_memory=True)
    host_v = torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16, pin_memory=True)
    assert host_k.is_pinned() and host_v.is_pinned()
    side = _stream()
    side.wait_stream(torch.cuda.current_stream(CUDA))  # the KV is written by then
    with torch.cuda.stream(side):
        host_k.copy_(k, non_blocking=True)
        host_v.copy_(v, non_blocking=True)
        k.record_stream(side)
        v.record_stream(side)
        done = _event()
        done.record(side)
    done.synchronize()
    assert torch.equal(host_k, k.cpu()) and torch.equal(host_v, v.cpu())
    assert bool(host_k.abs().sum() > 0)


# ---- 4. the runtime's CUDA path ---------------------------------------------------------------------

CFG = TINY.on_the_fly()
SEG = SegmentLayout.from_config(CFG, "int4").payload_nbytes


def _device_block_inputs(dev: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`block_inputs` with its tensors on ``dev``: `Session` takes them from `block_inputs` on the CPU
    and `TinyCausalWan` does not move its inputs to its own device."""

    def make(cfg: TinyConfig, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        latent, actions = block_inputs(cfg, step, seed)
        return latent.to(dev), actions.to(dev)

    return make


def _run_session(
    model: TinyCausalWan, tmp_path: Path, device: torch.device, steps: int, seen: list[torch.device]
) -> Session:
    orig = model.generate_block

    def spy(
        latent: torch.Tensor,
        actions: torch.Tensor,
        start_frame: int,
        memory: Sequence[KV] | None = None,
        *,
        noise_seed: int | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        if memory is not None:
            seen.append(memory[0][0].device)
        return orig(latent, actions, start_frame, memory, noise_seed=noise_seed)

    model.generate_block = spy  # type: ignore[method-assign]
    s = Session(
        model, codec="int4", host_budget_bytes=4 * SEG, gpu_slots=2, log_dir=tmp_path / "log",
        mode="prefetch", throttle_bps=20e6, retrieval_k=2, device=device, keep_outputs=True,
    )  # fmt: skip
    with s:
        s.run(yaw_sweep_trajectory(steps))
        s.handler.drain()
    return s


def test_prefetch_session_runs_on_cuda_and_matches_the_cpu_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 20
    cpu_seen: list[torch.device] = []
    cpu = _run_session(TinyCausalWan(CFG), tmp_path / "cpu", torch.device("cpu"), steps, cpu_seen)
    monkeypatch.setattr(session_mod, "block_inputs", _device_block_inputs(CUDA))
    gpu_seen: list[torch.device] = []
    gpu_model = TinyCausalWan(CFG).to(CUDA)  # built on the CPU: the same weights as the CPU run
    gpu = _run_session(gpu_model, tmp_path / "gpu", CUDA, steps, gpu_seen)

    assert gpu.handler.error is None
    assert [r.step for r in gpu.records] == list(range(steps))
    assert all(r.stall_s >= 0 and r.compute_s > 0 for r in gpu.records)
    assert not any(isinstance(e, Corrupt | DiskFull | Dropped) for e in gpu.events)
    summary = gpu.summary()
    misses = summary["host_misses"]
    assert summary["segments"] == steps and isinstance(misses, int) and misses > 0  # NVMe reads uploaded
    assert gpu_seen and all(d.type == "cuda" for d in gpu_seen)  # memory came up on the device
    assert cpu_seen and all(d.type == "cpu" for d in cpu_seen)
    assert gpu.outputs is not None and cpu.outputs is not None and len(gpu.outputs) == steps
    assert all(o.is_cuda and bool(torch.isfinite(o).all()) for o in gpu.outputs)
    # the same retrieval in both runs; outputs equal up to float32 device rounding (and the odd int4
    # code that rounding flips)
    assert [r.retrieved for r in gpu.records] == [r.retrieved for r in cpu.records]
    assert any(r.retrieved for r in gpu.records)
    for g, c in zip(gpu.outputs, cpu.outputs, strict=True):
        rel = float((g.cpu() - c).norm() / c.norm())
        assert rel < 5e-2, rel


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
def test_codec_decode_on_cuda_equals_decode_on_cpu(codec: str) -> None:
    g = torch.Generator().manual_seed(3)
    page = torch.randn(PAGE_SHAPE, generator=g).to(torch.bfloat16)
    packed = codecs.encode(page, codec)
    on_cpu = codecs.decode(packed)
    on_gpu = codecs.decode(packed, CUDA)
    assert on_gpu.is_cuda and on_gpu.dtype == torch.bfloat16 and on_gpu.shape == PAGE_SHAPE
    assert torch.equal(on_gpu.cpu(), on_cpu)
    # the payload can also be moved first (the TransferHandler's way: H2D of the bytes, decode there)
    moved = codecs.Packed(packed.codec, packed.shape, packed.dtype, packed.payload.pin_memory().to(CUDA))
    assert torch.equal(codecs.decode(moved).cpu(), on_cpu)


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_codec_encode_on_cuda_matches_cpu(codec: str) -> None:
    g = torch.Generator().manual_seed(4)
    page = torch.randn(PAGE_SHAPE, generator=g).to(torch.bfloat16)
    p_cpu, p_gpu = codecs.encode(page, codec), codecs.encode(page.to(CUDA), codec)
    assert p_gpu.device.type == "cuda" and p_gpu.nbytes == p_cpu.nbytes
    n = math.prod(PAGE_SHAPE)
    codes = n if codec == "int8" else n // 2
    a, b = p_cpu.payload, p_gpu.payload.cpu()
    assert torch.equal(a[codes:], b[codes:])  # fp16 scales and zeros: min/max and bit operations
    mismatched = int((a[:codes] != b[:codes]).sum())
    assert mismatched <= codes * 1e-5, mismatched  # codes: at most a rare division rounding tie


def test_segment_layout_decode_and_rerotate_on_cuda_equal_cpu() -> None:
    cfg = mg2_config(on_the_fly=True)
    layout = SegmentLayout.from_config(cfg, "int4", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    kv: list[KV] = []
    for _ in range(layout.layers):  # K and V share a tensor: half the host memory
        t = torch.randn(layout.kv_shape, generator=g).to(torch.bfloat16)
        kv.append((t, t))
    payload = layout.encode(kv)
    assert len(payload) == layout.payload_nbytes == 129_254_400
    host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    ref = layout.rerotate(layout.decode(host), 30, -6)
    got = layout.rerotate(layout.decode(host.pin_memory().to(CUDA, non_blocking=True)), 30, -6)
    for (rk, rv), (gk, gv) in zip(ref, got, strict=True):
        assert gk.is_cuda and torch.equal(gv.cpu(), rv)
        # float64 complex rotation on both devices, cast to bf16: equal up to a bf16 ulp
        torch.testing.assert_close(gk.cpu(), rk, rtol=2**-7, atol=1e-2)


# ---- 5. full-size MG2 stand-in ------------------------------------------------------------------


@pytest.mark.slow
def test_full_size_mg2_stand_in_runs_one_block_on_cuda() -> None:
    cfg = mg2_config(on_the_fly=True)
    free, _ = torch.cuda.mem_get_info()
    if free < 8 * 2**30:
        pytest.skip(f"needs ~8 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    model = TinyCausalWan(cfg, device=CUDA, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.1e9 < n_params < 1.3e9
    g = torch.Generator().manual_seed(0)
    latent = torch.randn((cfg.frames_per_block, cfg.tokens_per_frame, cfg.dim), generator=g).to(CUDA)
    actions = torch.randn((cfg.frames_per_block, cfg.action_dim), generator=g).to(CUDA)
    pred, kv = model.generate_block(latent, actions, 0)
    torch.cuda.synchronize()
    assert pred.shape == (3, 880, 1536) and pred.is_cuda and pred.dtype == torch.bfloat16
    assert bool(torch.isfinite(pred).all())
    assert len(kv) == 30
    for k, v in kv:
        assert k.shape == v.shape == PAGE_SHAPE and k.dtype == torch.bfloat16
        assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    assert model.cached_frames() == 3
    # the second block rolls into the window at frames 3..5
    pred2, kv2 = model.generate_block(latent, actions, 3, kv)
    assert bool(torch.isfinite(pred2).all()) and model.cached_frames() == 6
    assert len(kv2) == 30 and all(k.shape == PAGE_SHAPE for k, _ in kv2)


@pytest.mark.slow
def test_gpu_benchmark_script_reports_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "worldpager_gpu.py"), "--pages", "8", "--json"],
        capture_output=True, text=True, timeout=600, check=True, cwd=ROOT,
    )  # fmt: skip
    res = json.loads(out.stdout)
    assert "skipped" not in res
    for key in (
        "h2d_pinned_gbps",
        "d2h_pinned_gbps",
        "h2d_pageable_gbps",
        "overlap",
        "decode_int4_segment_s",
    ):
        assert key in res, key
    assert res["h2d_pinned_gbps"]["bf16"] > 0 and res["decode_int4_segment_s"] > 0
