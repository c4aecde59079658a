"""Session: runs `TinyCausalWan` blocks one by one with tiered retrieval memory (see `Session`).

* `Session` -- generates block by block through the `TransferHandler`, offloads each block's final KV
  and measures the **stall** (the wait for the step's retrieval buffer) in ``prefetch`` or
  ``on_demand`` mode (`Mode`).
* `StepRecord` -- what one step did; `stall_stats` -- median / p99 / max of a series of seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import torch

from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.page_types import Read, StepPlan
from worldpager.pages import PageManager
from worldpager.retrieval import (
    FovOverlapRule,
    Pose,
    RetrievalRule,
    SegmentInfo,
    outside_window,
    predict_pose,
)
from worldpager.segment_log import SegmentLog, slot_size_for
from worldpager.trajectory import block_inputs
from worldpager.transfer import RuntimeEvent, Throttle, TransferHandler, sleep_until

__all__ = ["MODES", "Mode", "Session", "StepRecord", "stall_stats"]

Mode = Literal["prefetch", "on_demand"]
MODES: tuple[Mode, ...] = ("prefetch", "on_demand")


# ---- session ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    step: int
    stall_s: float
    compute_s: float
    hits: int  # retrieved segments found in host when the step was prepared
    misses: int  # retrieved segments read from NVMe
    retrieved: tuple[int, ...]  # segments attended to
    bytes_read: int  # NVMe bytes read since the previous step
    bytes_written: int  # NVMe bytes written since the previous step
    host_bytes: int  # host copies held after the step
    pm_host_used_bytes: int  # the PageManager's host accounting after the step
    rss_bytes: int
    max_position: int  # last latent frame generated


def stall_stats(values: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "p99_s", "max_s"}`` (p99: nearest rank); zeros for no values."""
    if not values:
        return {"median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    s = sorted(values)
    p99 = s[max(0, math.ceil(0.99 * len(s)) - 1)]
    return {"median_s": statistics.median(s), "p99_s": p99, "max_s": s[-1]}


class Session:
    """Runs `TinyCausalWan` blocks one by one with tiered retrieval memory.

    Step ``n`` (block frames ``[3n, 3n+3)``): ``on_demand`` prepares step n's retrieval buffer now
    (the paper's baseline); ``prefetch`` prepared it during step n-1. Then it waits for the buffer (the
    measured **stall**), prepares step n+1 (``prefetch``: its reads/uploads overlap this step's compute),
    runs `generate_block` with the memories (none when the buffer is empty), releases step n, encodes the
    block's final KV into one payload and registers it (host copy + write-behind to the log).

    Retrieval set of step m, the same in both modes: ``rule.select`` over stored segments that have left
    the rolling window at step m, queried with `predict_pose` of the poses before m, ``retrieval_k``
    segments (0 = retrieval off, the plain model). ``compute_s`` pads each step's compute to at least
    that many seconds (a calibrated compute time). ``keep_outputs`` keeps each block's prediction in
    ``outputs``. Not thread-safe; one session per model.
    """

    def __init__(
        self,
        model: TinyCausalWan,
        *,
        codec: str = "bf16",
        host_budget_bytes: int,
        gpu_slots: int = 2,
        log_dir: str | Path,
        rule: RetrievalRule | None = None,
        mode: Mode = "prefetch",
        throttle_bps: float | None = None,
        retrieval_k: int = 2,
        log_max_bytes: int | None = None,
        compute_s: float | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        keep_outputs: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if retrieval_k < 0 or gpu_slots < 1:
            raise ValueError("retrieval_k must be >= 0 and gpu_slots >= 1")
        self.model, self.cfg, self.mode, self.k, self.seed = model, model.cfg, mode, retrieval_k, seed
        self.compute_s = compute_s
        self.layout = SegmentLayout.from_config(self.cfg, codec, model.head.weight.dtype)
        self.segment_bytes = self.layout.payload_nbytes
        self.pm = PageManager(
            host_budget_bytes, self.layout.decoded_nbytes, gpu_slots, segment_bytes=self.segment_bytes
        )
        self.gpu_budget_bytes = 2 * gpu_slots * self.layout.decoded_nbytes
        self.log = SegmentLog.create(log_dir, slot_size_for(self.segment_bytes), max_bytes=log_max_bytes)
        self.handler = TransferHandler(
            self.pm, self.log, self.layout, throttle=Throttle(throttle_bps), device=device
        )
        self.rule: RetrievalRule = rule if rule is not None else FovOverlapRule(k_points=500, seed=seed)
        self.records: list[StepRecord] = []
        self.outputs: list[torch.Tensor] | None = [] if keep_outputs else None  # denoised preds
        self.poses: list[Pose] = []
        self._infos: list[SegmentInfo] = []
        self._plans: dict[int, StepPlan] = {}
        self._proc = psutil.Process()
        self.rss_start = self._proc.memory_info().rss
        self.peak_rss = self.rss_start
        self._last_read = self._last_written = 0
        model.reset_cache()

    @property
    def step_index(self) -> int:
        return len(self.records)

    @property
    def events(self) -> list[RuntimeEvent]:
        return self.handler.events

    def _window_start(self, step: int) -> int:
        fpb = self.cfg.frames_per_block
        return max(0, step * fpb - (self.cfg.window_frames - fpb))

    def wanted(self, step: int) -> list[int]:
        """Retrieval set for ``step`` (needs the poses of steps < step, known at the start of step-1)."""
        if self.k == 0 or step < 1:
            return []
        fpb = self.cfg.frames_per_block
        now = step * fpb
        cands = outside_window(self._infos, now, self.cfg.window_frames - fpb)
        if not cands:
            return []
        query = predict_pose(self.poses[max(0, step - 2) : step], 1)
        return self.rule.select(cands, query, now, self.k)

    def _prepare(self, step: int) -> None:
        # placed oldest first, so virtual positions keep true-time order (segment id = time order)
        self._plans[step] = self.handler.prepare(step, sorted(self.wanted(step)), self._window_start(step))

    def step(self, pose: Pose) -> StepRecord:
        n, fpb = self.step_index, self.cfg.frames_per_block
        self.poses.append(pose)
        t0 = time.perf_counter()
        if self.mode == "on_demand" or n == 0:
            self._prepare(n)
        stall = self.handler.wait_ready(n)
        if self.mode == "on_demand":
            stall = time.perf_counter() - t0
        if self.mode == "prefetch":
            self._prepare(n + 1)  # its reads and uploads overlap this step's compute
        memory, ids = self.handler.memory(n)
        latent, actions = block_inputs(self.cfg, n, self.seed)
        t1 = time.perf_counter()
        pred, kv = self.model.generate_block(latent, actions, n * fpb, memory)
        if self.outputs is not None:
            self.outputs.append(pred)
        if self.compute_s is not None:
            sleep_until(t1 + self.compute_s)
        compute = time.perf_counter() - t1
        self.handler.release(n)
        plan = self._plans.pop(n)
        misses = sum(isinstance(j, Read) for j in plan.jobs)
        info = SegmentInfo(n, n * fpb, (n + 1) * fpb, pose)
        self.handler.add_segment(info, self.layout.encode(kv))
        self._infos.append(info)
        rss = self._proc.memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        read, written = self.handler.bytes_read, self.handler.bytes_written
        rec = StepRecord(
            n, stall, compute, len(plan.slots) - misses, misses, ids, read - self._last_read,
            written - self._last_written, self.handler.host_bytes, self.pm.host_used_bytes, rss,
            (n + 1) * fpb - 1,
        )  # fmt: skip
        self._last_read, self._last_written = read, written
        self.records.append(rec)
        return rec

    def run(self, poses: Sequence[Pose]) -> list[StepRecord]:
        return [self.step(p) for p in poses]

    def close(self) -> None:
        """Stop the transfer threads (after outstanding I/O), release a prefetched step, close the log."""
        try:
            nxt = self.step_index
            if nxt in self._plans:
                self.handler.wait_ready(nxt)
                self.handler.release(nxt)
                del self._plans[nxt]
            self.handler.close()
        finally:
            self.log.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> dict[str, object]:
        """Totals over the steps run so far (the `worldpager session` JSON, less the CLI's keys)."""
        fpb = self.cfg.frames_per_block
        stalls = [r.stall_s for r in self.records]
        return {
            "segments": len(self.records),
            "latent_frames": len(self.records) * fpb,
            "peak_rss_bytes": self.peak_rss,
            "rss_growth_bytes": (self.records[-1].rss_bytes if self.records else self.rss_start)
            - self.rss_start,
            "host_budget_bytes": self.pm.host_budget_bytes,
            "gpu_budget_bytes": self.gpu_budget_bytes,
            "nvme_bytes_written": self.handler.bytes_written,
            "nvme_bytes_read": self.handler.bytes_read,
            "positional_table_frames": self.cfg.rope_table_frames,
            "max_position_reached": max((r.max_position for r in self.records), default=-1),
            "stall": stall_stats(stalls),
            "compute": stall_stats([r.compute_s for r in self.records]),
            "segment_bytes": self.segment_bytes,
            "codec": self.layout.codec,
            "mode": self.mode,
            "nvme_reads": self.handler.reads,
            "host_hits": sum(r.hits for r in self.records),
            "host_misses": sum(r.misses for r in self.records),
            "peak_host_bytes": max((r.pm_host_used_bytes for r in self.records), default=0),
            "events": _count_events(self.events),
        }


def _count_events(events: Sequence[RuntimeEvent]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
    return counts
