"""`worldpager bench-stall`: prefetch vs on-demand stall around the bandwidth limit L.

Setup (the paper's forced-NVMe experiment, scaled down): a `SegmentLog` of ``segments`` real segment
files (random KV encoded with the codec, ``segment_bytes`` payload each). Each step retrieves ``k``
segments; the host budget holds only ``2k`` segments (the current step's and the next's) and the
retrieval sets sweep the log cyclically (``a_yaw``-like: the camera keeps turning, views come back
only after ``segments / k`` steps), so every retrieved segment is read from NVMe, through a `Throttle`
at the row's bandwidth, then decoded and re-rotated by the `TransferHandler`'s upload stage.

Compute per step is calibrated: a sleep of ``compute_s`` (the paper's ~1.2 s MG2 segment scaled down to
keep CI short; the tiny model itself takes milliseconds, too little to overlap anything measurable).

``L = k * (header + payload bytes) / compute_s``: the read bandwidth at which one step's fetch takes
exactly one step's compute. Each row runs both modes for ``steps`` measured steps after one warm-up
step (step 0 has no earlier compute to hide its fetch behind in either mode; it is left out):

* ``prefetch``: step n+1's retrieval set is prepared as soon as step n's buffer is ready, so its reads
  overlap step n's compute; the stall is the wait for step n's buffer.
* ``on_demand``: step n's set is prepared when step n starts; the stall is prepare + wait.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from worldpager import codecs
from worldpager.layout import SegmentLayout
from worldpager.page_types import Upload
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import HEADER_SIZE, SegmentLog, slot_size_for
from worldpager.session import MODES, Mode, stall_stats
from worldpager.transfer import Throttle, TransferHandler

DEFAULT_MULTIPLIERS: tuple[float, ...] = (0.5, 0.8, 1.05, 1.5, 3.0)
DEFAULTS: dict[str, Any] = {
    "segments": 16, "segment_bytes": 1 << 20, "codec": "bf16", "k": 2, "compute_s": 0.2, "steps": 12,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "segments": 8, "segment_bytes": 128 << 10, "codec": "bf16", "k": 2, "compute_s": 0.04, "steps": 4,
}  # fmt: skip
_HEADS, _HEAD_DIM, _LAYERS, _FRAMES = 4, 16, 2, 3


def layout_for_payload(target_bytes: int, codec: str) -> SegmentLayout:
    """A 2-layer, 4-head x 16 layout whose payload is about ``target_bytes`` (at least one token/frame)."""
    per_token = _LAYERS * 2 * codecs.packed_nbytes(_HEADS * _HEAD_DIM, codec)
    tpf = max(1, target_bytes // (per_token * _FRAMES))
    return SegmentLayout(_LAYERS, _HEADS, _HEAD_DIM, _FRAMES, 1, tpf, codec)


def limit_bytes_per_s(segment_bytes: int, codec: str, k: int, compute_s: float) -> float:
    """L: the read bandwidth (bytes/s) at which one step's fetch (``k`` segments, header + payload)
    takes exactly ``compute_s``; inf when ``compute_s`` is too small for a float."""
    fetched = k * (HEADER_SIZE + layout_for_payload(segment_bytes, codec).payload_nbytes)
    try:
        return fetched / compute_s
    except OverflowError:
        return math.inf


def bench_needs(segment_bytes: int, codec: str, segments: int, k: int) -> tuple[int, int]:
    """About how many bytes of memory and of disk `run_bench` needs with these settings: every
    segment's payload is kept in RAM (the log is built from them), plus the host tier (2k payloads),
    the retrieval buffers (2k decoded segments) and one encode/decode's working set; on disk, one log
    slot per segment."""
    layout = layout_for_payload(segment_bytes, codec)
    pay, dec = layout.payload_nbytes, layout.decoded_nbytes
    memory = segments * pay + 2 * k * (pay + dec) + 2 * (pay + 2 * dec)
    return memory, segments * slot_size_for(pay)


def _build_log(directory: Path, layout: SegmentLayout, n: int, seed: int) -> tuple[SegmentLog, list[bytes]]:
    log = SegmentLog.create(directory, slot_size_for(layout.payload_nbytes))
    g = torch.Generator().manual_seed(seed)
    payloads: list[bytes] = []
    for i in range(n):
        kv = [(torch.randn(layout.kv_shape, generator=g), torch.randn(layout.kv_shape, generator=g))]
        payload = layout.encode(kv * layout.layers)
        log.append(
            segment_id=i, frame_start=3 * i, frame_end=3 * i + 3, pose=(0.0, 0.0, 0.0, 0.0, 0.0),
            codec=layout.codec, position_state="post-rope", position=3 * i, payload=payload,
            page_offsets=layout.page_offsets,
        )  # fmt: skip
        payloads.append(payload)
    log.flush()
    return log, payloads


def run_mode(
    log: SegmentLog,
    layout: SegmentLayout,
    payloads: Sequence[bytes],
    *,
    mode: Mode,
    bytes_per_s: float | None,
    k: int,
    compute_s: float,
    steps: int,
) -> dict[str, Any]:
    """One mode at one bandwidth: stall stats over ``steps`` measured steps, plus host hits / reads."""
    n, seg = len(payloads), layout.payload_nbytes
    pm = PageManager(2 * k * seg, layout.decoded_nbytes, k, segment_bytes=seg)
    h = TransferHandler(pm, log, layout, throttle=Throttle(bytes_per_s))
    origin = Pose(0.0, 0.0, 0.0, 0.0, 0.0)
    stalls: list[float] = []
    hits = 0
    try:
        for i, p in enumerate(payloads):  # already on NVMe; host keeps the newest 2k (clean)
            h.add_segment(SegmentInfo(i, 3 * i, 3 * i + 3, origin), p, on_disk_slot=i)

        def prepare(s: int) -> int:
            plan = h.prepare(s, [(s * k + j) % n for j in range(k)], 3 * s)
            return sum(isinstance(j, Upload) for j in plan.jobs)  # host hits; misses get a Read

        last = steps  # step 0 is the warm-up
        for s in range(last + 1):
            t0 = time.perf_counter()
            if mode == "on_demand" or s == 0:
                hits += prepare(s)
            stall = h.wait_ready(s)
            if mode == "on_demand":
                stall = time.perf_counter() - t0
            if mode == "prefetch" and s < last:
                hits += prepare(s + 1)
            t1 = time.perf_counter()
            h.memory(s)
            while (left := t1 + compute_s - time.perf_counter()) > 0:
                time.sleep(left)
            h.release(s)
            if s > 0:
                stalls.append(stall)
        h.close()
    except BaseException:
        h.close()
        raise
    return {**stall_stats(stalls), "host_hits": hits, "nvme_reads": h.reads, "nvme_bytes_read": h.bytes_read}


def run_bench(
    *,
    segments: int = DEFAULTS["segments"],
    segment_bytes: int = DEFAULTS["segment_bytes"],
    codec: str = DEFAULTS["codec"],
    k: int = DEFAULTS["k"],
    compute_s: float = DEFAULTS["compute_s"],
    steps: int = DEFAULTS["steps"],
    multipliers: Sequence[float] = DEFAULT_MULTIPLIERS,
    log_dir: str | Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The bench-stall JSON: ``{"limit_gbps", "rows": [{"bandwidth_gbps", "prefetch", "on_demand"}...]}``
    (rows by bandwidth, ascending) plus the settings. ValueError for bad settings."""
    if k < 1 or steps < 1 or not compute_s > 0 or segment_bytes < 1:
        raise ValueError("need k >= 1, steps >= 1, compute_s > 0, segment_bytes >= 1")
    if segments < 4 * k:
        raise ValueError(f"segments must be >= 4k = {4 * k} so that every retrieved segment misses host")
    if not multipliers or any(not (m > 0 and math.isfinite(m)) for m in multipliers):
        raise ValueError("bandwidth multipliers must be positive finite numbers")
    if not math.isfinite(compute_s):
        raise ValueError(f"compute_s must be finite, got {compute_s}")
    bandwidths = [m * limit_bytes_per_s(segment_bytes, codec, k, compute_s) for m in multipliers]
    if any(not (0 < b < math.inf) for b in bandwidths):
        raise ValueError(
            "a bandwidth (multiplier x L) is 0 or infinite: compute_s or a multiplier is extreme"
        )
    layout = layout_for_payload(segment_bytes, codec)
    with tempfile.TemporaryDirectory(prefix="wp-stall-") as tmp:
        directory = Path(log_dir) if log_dir is not None else Path(tmp) / "log"
        log, payloads = _build_log(directory, layout, segments, seed)
        try:
            fetched = k * (HEADER_SIZE + layout.payload_nbytes)
            limit = fetched / compute_s  # bytes/s
            rows: list[dict[str, Any]] = []
            for m in sorted(multipliers):
                row: dict[str, Any] = {"bandwidth_gbps": m * limit / 1e9, "multiple_of_limit": m}
                for mode in MODES:
                    row[mode] = run_mode(
                        log, layout, payloads, mode=mode, bytes_per_s=m * limit, k=k,
                        compute_s=compute_s, steps=steps,
                    )  # fmt: skip
                rows.append(row)
        finally:
            log.close()
    return {
        "limit_gbps": limit / 1e9,
        "rows": rows,
        "segment_payload_bytes": layout.payload_nbytes,
        "bytes_fetched_per_step": fetched,
        "retrieved_per_step": k,
        "compute_s": compute_s,
        "compute": "calibrated",
        "steps": steps,
        "warmup_steps": 1,
        "segments": segments,
        "codec": codec,
    }


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Stall (median and p99) vs bandwidth for both modes, L marked; PNG via the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = [r["bandwidth_gbps"] * 1e3 for r in result["rows"]]
    for mode, color in (("prefetch", "tab:blue"), ("on_demand", "tab:red")):
        ax.plot(xs, [r[mode]["median_s"] for r in result["rows"]], "o-", color=color, label=f"{mode} median")
        ax.plot(xs, [r[mode]["p99_s"] for r in result["rows"]], "x--", color=color, label=f"{mode} p99")
    ax.axvline(result["limit_gbps"] * 1e3, color="gray", linestyle=":", label="L")
    ax.set_xscale("log")
    ax.set_xlabel("NVMe read bandwidth (MB/s, throttled)")
    ax.set_ylabel("stall per step (s)")
    ax.set_title(f"WorldPager stall, compute {result['compute_s']:g} s/step, {result['codec']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)


def text_table(result: dict[str, Any]) -> str:
    head = f"{'bandwidth MB/s':>15} {'xL':>5}  {'prefetch med/p99/max (s)':>26}  {'on-demand (s)':>26}"
    lines = [
        f"L = {result['limit_gbps'] * 1e3:.3f} MB/s "
        f"({result['bytes_fetched_per_step']:,} B per step / {result['compute_s']:g} s compute)",
        head,
    ]
    keys = ("median_s", "p99_s", "max_s")
    for r in result["rows"]:
        pre, ond = ("/".join(f"{r[m][key]:.3f}" for key in keys) for m in ("prefetch", "on_demand"))
        lines.append(f"{r['bandwidth_gbps'] * 1e3:>15.3f} {r['multiple_of_limit']:>5g}  {pre:>26}  {ond:>26}")
    return "\n".join(lines)
