"""Session: runs `TinyCausalWan` blocks one by one with tiered retrieval memory (see `Session`).

* `Session` -- generates block by block through the `TransferHandler`, offloads each block's final KV
  and measures the **stall** (the wait for the step's retrieval buffer) in ``prefetch`` or
  ``on_demand`` mode (`Mode`). `Session.resume` reopens a saved session and continues it.
* `SESSION_PRESETS` -- the stand-in's sizes for `worldpager session` (``tiny``: segments big enough
  that a 64 MiB host tier holds 18 of them, so revisits read back from NVMe; ``micro``: the unit tests'
  `TINY`, 36 KiB segments).
* `StepRecord` -- what one step did (numbers only); `CorruptSlot` -- a log slot found corrupt when a
  session was reopened; `stall_stats` -- median / p99 / max of a series of seconds.

Bounded memory: a session keeps no per-step tensors (a block's KV becomes its payload, the prediction
is dropped unless ``keep_outputs``), per-step records are small numbers and only the last
``max_records`` are kept (the stall/compute series are arrays of floats), events are drained from the
transfer handler every step into counts, the rare notable ones (`Corrupt`, `DiskFull`, `Dropped`,
`LeaseResized`, `CorruptSlot`) and the last ``max_events`` routine ones. What grows with the session is
the segment index (the log index, the PageManager, the retrieval candidates and the rule's cache:
about 2.3 KB of RSS per segment measured over 1,500 ``micro`` steps). On glibc, ``trim_memory``
returns the allocator's free memory to the OS after each step (``malloc_trim``), so RSS follows live
bytes rather than the allocator's high-water mark.

RSS: sampled right after each block's compute and at the end of each step (after the trim). The
baseline is the RSS at the end of the warm-up (the first ``warmup_segments`` steps of this run; by
default until the retrieval buffers can first be full, at least 2), so torch and allocator warm-up are
excluded. ``rss_growth_bytes`` is the largest end-of-step RSS after the warm-up minus the baseline, both
less the retrieval buffers held at that moment when the device is the CPU: those buffers are the device
tier (``gpu_budget_bytes``), emulated in RAM on a CPU run and in device memory on a GPU run.
``rss_growth_raw_bytes`` is the same without that correction; ``rss_step_peak_bytes`` is the largest
RSS sampled after a block's compute (on the CPU it includes the emulated device tier's whole working
set: both buffers, activations, the block's KV). `summary` also reports ``host_peak_bytes`` (the
accounted host tier) and whether ``rss_growth_bytes <= 1.05 * host_budget_bytes`` (`RSS_SLACK`).

Save / resume: the log directory holds the `SegmentLog` (segments, ``index.json``, ``meta.json``) and
``session.json`` (seed, codec, model config, the next step, the last poses; written at creation and by
``close()``); ``close()`` also writes ``window.bin``, the rolling window's K/V exactly as the model holds
it. `Session.resume` reopens the log and its index, registers every stored segment with the PageManager
(the newest that fit the host budget are read back into host, verified; the rest stay on NVMe),
restores the rolling window (from ``window.bin`` when it matches the log, else rebuilt from the last
segments in the log at codec precision: keys are stored post-RoPE at their true positions, as the cache
holds them) and continues at the next frame. Slots found corrupt when the log is reopened are reported
as `CorruptSlot` events and never indexed, so never attended to.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import statistics
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from worldpager.layout import SegmentLayout
from worldpager.model import KV, TINY, TinyCausalWan, TinyConfig
from worldpager.page_types import Corrupt, DiskFull, LeaseResized, Read, SegState, StepPlan
from worldpager.pages import PageManager
from worldpager.retrieval import (
    FovOverlapRule,
    Pose,
    RetrievalRule,
    SegmentInfo,
    outside_window,
    predict_pose,
)
from worldpager.segment_log import CorruptSlotError, SegmentHeader, SegmentLog, SegmentLogError, slot_size_for
from worldpager.trajectory import block_inputs
from worldpager.transfer import Dropped, RuntimeEvent, Throttle, TransferHandler, sleep_until

__all__ = [
    "MODES",
    "RSS_SLACK",
    "SESSION_FILE",
    "SESSION_PRESETS",
    "WINDOW_FILE",
    "CorruptSlot",
    "Mode",
    "Session",
    "SessionEvent",
    "StepRecord",
    "read_saved_state",
    "stall_stats",
]

Mode = Literal["prefetch", "on_demand"]
MODES: tuple[Mode, ...] = ("prefetch", "on_demand")

SESSION_FILE, WINDOW_FILE = "session.json", "window.bin"
_FORMAT, _VERSION = "worldpager-session", 1
RSS_SLACK = 1.05  # the contract: RSS growth over a session <= host budget x 1.05

SESSION_PRESETS: dict[str, TinyConfig] = {
    # TINY's structure, deeper and wider: 32 layers x 2 x 108 tokens x 256 dims in bf16 = 3.375 MiB per
    # segment, 18 per 64 MiB; about 0.3 s per block on 2 CPU cores. Tables stay 16 / 40 frames.
    "tiny": dataclasses.replace(
        TINY, layers=32, dim=256, heads=4, ffn_dim=256, latent_h=6, latent_w=6, action_layers=16
    ),
    "micro": TINY,  # the unit tests' stand-in: 36 KiB segments
}


# ---- records and events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True)
class CorruptSlot:
    """A log slot found corrupt (or unreadable) when a saved session was reopened: never used."""

    slot: int
    reason: str


SessionEvent = RuntimeEvent | CorruptSlot
_NOTABLE = (Corrupt, DiskFull, Dropped, LeaseResized, CorruptSlot)


def stall_stats(values: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "p99_s", "max_s"}`` (p99: nearest rank); zeros for no values."""
    if not values:
        return {"median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    s = sorted(values)
    p99 = s[max(0, math.ceil(0.99 * len(s)) - 1)]
    return {"median_s": statistics.median(s), "p99_s": p99, "max_s": s[-1]}


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (free allocator memory back to the OS), or None elsewhere."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int

    def trim() -> None:
        fn(0)

    return trim


# ---- saved state ----------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_saved_state(log_dir: str | Path) -> dict[str, Any] | None:
    """The ``session.json`` of a saved session, or None when it is missing or unreadable."""
    try:
        state = json.loads((Path(log_dir) / SESSION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("format") != _FORMAT or state.get("version") != _VERSION:
        return None
    return state


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def _config_dict(cfg: TinyConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# ---- session ------------------------------------------------------------------------------------------


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
    ``outputs``. ``codec`` defaults to bf16 and ``seed`` to 0 (a resumed session: the saved ones).
    ``resume``: reopen the saved session in ``log_dir`` instead of creating one (see `Session.resume`).
    Memory and RSS measurement: see the module docstring. Not thread-safe; one session per model.
    """

    def __init__(
        self,
        model: TinyCausalWan,
        *,
        codec: str | None = None,
        host_budget_bytes: int,
        gpu_slots: int = 2,
        log_dir: str | Path,
        rule: RetrievalRule | None = None,
        mode: Mode = "prefetch",
        throttle_bps: float | None = None,
        retrieval_k: int = 2,
        log_max_bytes: int | None = None,
        compute_s: float | None = None,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        keep_outputs: bool = False,
        warmup_segments: int | None = None,
        trim_memory: bool = True,
        max_records: int | None = 10_000,
        max_events: int = 1_000,
        metadata: Mapping[str, Any] | None = None,
        resume: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if retrieval_k < 0 or gpu_slots < 1:
            raise ValueError("retrieval_k must be >= 0 and gpu_slots >= 1")
        if warmup_segments is not None and warmup_segments < 0:
            raise ValueError(f"warmup_segments must be >= 0, got {warmup_segments}")
        self.log_dir = Path(log_dir)
        saved = read_saved_state(self.log_dir) if resume else None
        codec = self._resolved("codec", codec, saved, "bf16")
        seed = self._resolved("seed", seed, saved, 0)
        if saved is not None and saved.get("config") != _config_dict(model.cfg):
            raise ValueError(f"{self.log_dir}: the model's config differs from the saved session's")
        self.model, self.cfg, self.mode, self.k, self.seed = model, model.cfg, mode, retrieval_k, seed
        self.compute_s = compute_s
        self.metadata: dict[str, Any] = dict(metadata or (saved or {}).get("metadata") or {})
        self.layout = SegmentLayout.from_config(self.cfg, codec, model.head.weight.dtype)
        self.segment_bytes = self.layout.payload_nbytes
        self.pm = PageManager(
            host_budget_bytes, self.layout.decoded_nbytes, gpu_slots, segment_bytes=self.segment_bytes
        )
        self.gpu_budget_bytes = 2 * gpu_slots * self.layout.decoded_nbytes
        if resume:
            self.log = SegmentLog.open(self.log_dir, max_bytes=log_max_bytes)
            if self.log.slot_size != slot_size_for(self.segment_bytes):
                self.log.close()
                raise ValueError(
                    f"{self.log_dir}: log slots of {self.log.slot_size} bytes do not match this "
                    f"session's {self.segment_bytes}-byte segments"
                )
        else:
            self.log = SegmentLog.create(
                self.log_dir, slot_size_for(self.segment_bytes), max_bytes=log_max_bytes
            )
        self.handler = TransferHandler(
            self.pm, self.log, self.layout, throttle=Throttle(throttle_bps), device=device
        )
        self.rule: RetrievalRule = rule if rule is not None else FovOverlapRule(k_points=500, seed=seed)
        self.max_records = max_records
        self.records: list[StepRecord] = []  # the last `max_records` steps of this run
        self.outputs: list[torch.Tensor] | None = [] if keep_outputs else None  # denoised preds
        self._infos: list[SegmentInfo] = []  # retrieval candidates: every stored segment, id order
        self._poses: dict[int, Pose] = {}  # the last three steps' poses (predict_pose needs two)
        self._plans: dict[int, StepPlan] = {}
        self._stalls, self._computes = array("d"), array("d")
        self._hits = self._misses = 0
        self._max_position = -1
        self._event_counts: dict[str, int] = {}
        self._notable: list[SessionEvent] = []
        self._recent: deque[SessionEvent] = deque(maxlen=max_events)
        self._trim = _malloc_trim() if trim_memory else None
        self._closed = False
        lag = -(-(self.cfg.window_frames - self.cfg.frames_per_block) // self.cfg.frames_per_block)
        auto_warmup = max(2, min(retrieval_k, gpu_slots) + lag + 1)  # until the buffers first fill
        self.warmup_segments = auto_warmup if warmup_segments is None else warmup_segments
        self._proc = psutil.Process()
        self.rss_start = self._rss()
        self.peak_rss = self.rss_start
        self.rss_baseline: int | None = self.rss_start if self.warmup_segments == 0 else None
        self._baseline_buffers = 0
        # after the warm-up, at step ends: max RSS less the RAM-held retrieval buffers, max RSS; and the
        # max RSS sampled right after each block's compute
        self._after = (0, 0, 0)
        self._buffers_in_ram = torch.device(device).type == "cpu"  # the device tier, emulated in RAM
        self.host_peak_bytes = 0
        self._last_read = self._last_written = 0
        self.window_source: str | None = None  # resumed: "checkpoint" (window.bin) or "log"
        model.reset_cache()
        self._first = self._next = 0
        try:
            if resume:
                self._restore(saved)
            else:
                self._save_state(window=None)
        except BaseException:
            with contextlib.suppress(Exception):
                self.handler.close()
            self.log.close()
            raise

    @classmethod
    def resume(cls, log_dir: str | Path, model: TinyCausalWan, **kwargs: Any) -> Session:
        """Reopen the session saved in ``log_dir`` (see the module docstring) and continue it at the
        next frame; ``kwargs`` as for the constructor (``codec``/``seed`` default to the saved ones).
        ValueError if ``model`` or the log does not fit the saved session; FileNotFoundError if there
        is no log; `SegmentLogError` if the rolling window cannot be restored."""
        return cls(model, log_dir=log_dir, resume=True, **kwargs)

    @staticmethod
    def _resolved(name: str, given: Any, saved: dict[str, Any] | None, default: Any) -> Any:
        if saved is None or name not in saved:
            return default if given is None else given
        if given is not None and given != saved[name]:
            raise ValueError(f"{name}={given!r} differs from the saved session's {saved[name]!r}")
        return saved[name]

    # ---- properties -----------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """The next step to run (= segments generated so far, restored ones included)."""
        return self._next

    @property
    def steps_run(self) -> int:
        """Steps run by this object (a resumed session starts at 0)."""
        return self._next - self._first

    @property
    def events(self) -> list[SessionEvent]:
        """Notable events (all of them) and the last ``max_events`` routine ones."""
        self._drain_events()
        return [*self._notable, *self._recent]

    def event_counts(self) -> dict[str, int]:
        self._drain_events()
        return dict(self._event_counts)

    # ---- retrieval ------------------------------------------------------------------------------
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
        history = [self._poses[i] for i in range(max(0, step - 2), step) if i in self._poses]
        if not history:
            return []
        return self.rule.select(cands, predict_pose(history, 1), now, self.k)

    def _prepare(self, step: int) -> None:
        # placed oldest first, so virtual positions keep true-time order (segment id = time order)
        self._plans[step] = self.handler.prepare(step, sorted(self.wanted(step)), self._window_start(step))

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, pose: Pose) -> StepRecord:
        if self._closed:
            raise RuntimeError("session is closed")
        n, fpb = self._next, self.cfg.frames_per_block
        self._poses[n] = pose
        self._poses.pop(n - 3, None)
        t0 = time.perf_counter()
        if self.mode == "on_demand" or n == self._first:
            self._prepare(n)
        stall = self.handler.wait_ready(n)
        if self.mode == "on_demand":
            stall = time.perf_counter() - t0
        if self.mode == "prefetch":
            self._prepare(n + 1)  # its reads and uploads overlap this step's compute
        memory, ids = self.handler.memory(n)
        latent, actions = block_inputs(self.cfg, n, self.seed)
        p = next(self.model.parameters())  # the inputs go where the model is (CUDA when present)
        latent, actions = latent.to(p.device, p.dtype), actions.to(p.device, p.dtype)
        t1 = time.perf_counter()
        pred, kv = self.model.generate_block(latent, actions, n * fpb, memory)
        del memory, latent, actions
        if self.outputs is not None:
            self.outputs.append(pred)
        del pred
        if self.compute_s is not None:
            sleep_until(t1 + self.compute_s)
        compute = time.perf_counter() - t1
        rss_mid = self._rss()  # the step's working set is live here
        self.handler.release(n)
        plan = self._plans.pop(n)
        misses = sum(isinstance(j, Read) for j in plan.jobs)
        hits = len(plan.slots) - misses
        del plan
        info = SegmentInfo(n, n * fpb, (n + 1) * fpb, pose)
        payload = self.layout.encode(kv)
        del kv
        if self.handler.add_segment(info, payload):
            self._infos.append(info)
        del payload
        self._next = n + 1
        self._drain_events()
        if self._trim is not None:
            self._trim()
        rss = self._rss()
        host, pm_host = self.handler.host_bytes, self.pm.host_used_bytes
        self._account(rss_mid, rss, max(host, pm_host))
        read, written = self.handler.bytes_read, self.handler.bytes_written
        rec = StepRecord(
            n, stall, compute, hits, misses, ids, read - self._last_read, written - self._last_written,
            host, pm_host, rss, (n + 1) * fpb - 1,
        )  # fmt: skip
        self._last_read, self._last_written = read, written
        self._stalls.append(stall)
        self._computes.append(compute)
        self._hits += hits
        self._misses += misses
        self._max_position = rec.max_position
        self.records.append(rec)
        if self.max_records is not None and len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]
        return rec

    def resize_lease(self, host_budget_bytes: int | None = None, gpu_budget_bytes: int | None = None) -> None:
        """Change the host and/or GPU byte budgets while the session runs (the manager's elastic
        lease): see `TransferHandler.resize`."""
        self.handler.resize(host_budget_bytes, gpu_budget_bytes)

    def run(self, poses: Sequence[Pose]) -> list[StepRecord]:
        return [self.step(p) for p in poses]

    def _rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _account(self, rss_mid: int, rss_end: int, host: int) -> None:
        """RSS bookkeeping at the end of a step (see the module docstring)."""
        self.peak_rss = max(self.peak_rss, rss_mid, rss_end)
        self.host_peak_bytes = max(self.host_peak_bytes, host)
        buffers = self.handler.buffer_bytes if self._buffers_in_ram else 0
        if self.steps_run <= self.warmup_segments:
            if self.steps_run == self.warmup_segments:
                self.rss_baseline, self._baseline_buffers = rss_end, buffers
        else:
            self._after = (
                max(self._after[0], rss_end - buffers),
                max(self._after[1], rss_end),
                max(self._after[2], rss_mid),
            )

    def _record(self, e: SessionEvent) -> None:
        name = type(e).__name__
        self._event_counts[name] = self._event_counts.get(name, 0) + 1
        if isinstance(e, _NOTABLE):
            self._notable.append(e)
        else:
            self._recent.append(e)

    def _drain_events(self) -> None:
        for e in self.handler.take_events():
            self._record(e)

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the transfer threads (after outstanding I/O), release a prefetched step, close the log,
        then save the session state (``session.json`` and the rolling window) for `resume`."""
        if self._closed:
            return
        self._closed = True
        try:
            nxt = self._next
            if nxt in self._plans:
                self.handler.wait_ready(nxt)
                self.handler.release(nxt)
                del self._plans[nxt]
            self.handler.close()
        finally:
            self.log.close()
            self._drain_events()
        self._save_state(window=self._save_window())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_window(self) -> dict[str, Any]:
        """Write the rolling window's K/V (every layer, exactly as cached) to ``window.bin``."""
        caches = self.model.kv_cache
        tokens = int(caches[0]["local_end_index"].item()) if caches else 0
        global_end = int(caches[0]["global_end_index"].item()) if caches else 0
        crc, nbytes = 0, 0
        tmp = self.log_dir / (WINDOW_FILE + ".tmp")
        with open(tmp, "wb") as f:
            for cache in caches:
                for name in ("k", "v"):
                    data = _tensor_bytes(cache[name][:, :tokens])
                    crc, nbytes = zlib.crc32(data, crc), nbytes + len(data)
                    f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.log_dir / WINDOW_FILE)
        dtype = str(self.model.head.weight.dtype).removeprefix("torch.")
        return {"tokens": tokens, "global_end": global_end, "dtype": dtype, "nbytes": nbytes, "crc32": crc}

    def _save_state(self, window: dict[str, Any] | None) -> None:
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "seed": self.seed,
            "codec": self.layout.codec,
            "config": _config_dict(self.cfg),
            "next_step": self._next,
            "poses": {str(i): dataclasses.astuple(p) for i, p in sorted(self._poses.items())},
            "window": window,
            "metadata": self.metadata,
        }
        _atomic_write(self.log_dir / SESSION_FILE, json.dumps(state).encode("utf-8"))

    # ---- resume ---------------------------------------------------------------------------------
    def _stored_segments(self) -> dict[int, tuple[int, SegmentHeader]]:
        """segment id -> (slot, header) of every readable stored segment (the latest copy of each)."""
        fpb = self.cfg.frames_per_block
        stored: dict[int, tuple[int, SegmentHeader]] = {}
        for slot in self.log.slots():
            h = self.log.header(slot)
            if self.log.find(h.segment_id) != slot:
                continue  # superseded by a later copy
            if (
                h.payload_len != self.segment_bytes
                or h.codec != self.layout.codec
                or h.position_state != "post-rope"
                or (h.frame_start, h.frame_end) != (h.segment_id * fpb, (h.segment_id + 1) * fpb)
                or len(h.pose) != 5
            ):
                raise ValueError(
                    f"{self.log_dir}: slot {slot} (segment {h.segment_id}) does not fit this session"
                )
            stored[h.segment_id] = (slot, h)
        return stored

    def _restore(self, saved: dict[str, Any] | None) -> None:
        for slot, reason in sorted(self.log.corrupt_slots().items()):
            self._record(CorruptSlot(slot, reason))
        stored = self._stored_segments()
        nxt = max(stored, default=-1) + 1
        window = self._checkpoint_window(saved, nxt)
        if window is not None:
            nxt = int(saved["next_step"]) if saved is not None else nxt
        self._register(stored)
        if window is None:
            window = self._window_from_log(stored, nxt)
            self.window_source = "log"
        else:
            self.window_source = "checkpoint"
        self._set_window(window, nxt * self.cfg.frames_per_block * self.cfg.tokens_per_frame)
        saved_poses = (saved or {}).get("poses") or {}
        for i in range(max(0, nxt - 2), nxt):
            if self.window_source == "checkpoint" and str(i) in saved_poses:
                self._poses[i] = Pose(*(float(x) for x in saved_poses[str(i)]))
            elif i in stored:
                self._poses[i] = Pose(*stored[i][1].pose)
        self._first = self._next = nxt
        self._max_position = nxt * self.cfg.frames_per_block - 1

    def _register(self, stored: dict[int, tuple[int, SegmentHeader]]) -> None:
        """Tell the PageManager about every stored segment: the newest that fit the host budget with a
        host copy read back (and verified), the others NVMe-only (registered oldest first through a
        placeholder that the newer ones evict before anything can read it)."""
        while True:  # the newest segments that fit the budget, each read back and verified
            resident: dict[int, bytes] = {}
            room, bad = self.pm.host_budget_bytes, None
            for sid in sorted(stored, reverse=True):
                if room < self.segment_bytes:
                    break
                try:
                    _, resident[sid] = self.log.read(stored[sid][0])
                except CorruptSlotError as e:
                    bad = (sid, e)
                    break
                room -= self.segment_bytes
            if bad is None:
                break
            self._record(CorruptSlot(bad[1].slot, bad[1].reason))  # never used: out of the index
            del stored[bad[0]]
        placeholder = bytes(self.segment_bytes) if len(resident) < len(stored) else b""
        for sid in sorted(stored):
            slot, h = stored[sid]
            info = SegmentInfo(sid, h.frame_start, h.frame_end, Pose(*h.pose))
            added = self.handler.add_segment(info, resident.get(sid, placeholder), on_disk_slot=slot)
            assert added, f"segment {sid}: no host room with nothing protected"
            self._infos.append(info)
        for sid in stored.keys() - resident.keys():
            loc = self.pm.lookup(sid)
            assert loc is not None and loc.state is SegState.NVME, f"segment {sid} left in host"
        self.handler.take_events()  # the registration's evictions are not the session's events

    def _checkpoint_window(self, saved: dict[str, Any] | None, nxt: int) -> list[KV] | None:
        """The rolling window from ``window.bin`` if it matches the log and the model, else None."""
        w = (saved or {}).get("window")
        if saved is None or not isinstance(w, dict) or int(saved.get("next_step", -1)) < nxt:
            return None
        cfg, p = self.cfg, self.model.head.weight
        tokens = int(w.get("tokens", -1))
        expect = int(saved["next_step"]) * cfg.frames_per_block * cfg.tokens_per_frame
        if not 0 <= tokens <= cfg.window_tokens or int(w.get("global_end", -1)) != expect:
            return None
        if w.get("dtype") != str(p.dtype).removeprefix("torch."):
            return None
        per = tokens * cfg.heads * cfg.head_dim * p.element_size()
        try:
            data = (self.log_dir / WINDOW_FILE).read_bytes()
        except OSError:
            return None
        if (
            len(data) != 2 * cfg.layers * per
            or len(data) != w.get("nbytes")
            or zlib.crc32(data) != w.get("crc32")
        ):
            return None
        flat = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        shape = (1, tokens, cfg.heads, cfg.head_dim)
        parts = [flat[i * per : (i + 1) * per].view(p.dtype).view(shape) for i in range(2 * cfg.layers)]
        return [(parts[2 * i], parts[2 * i + 1]) for i in range(cfg.layers)]

    def _window_from_log(self, stored: dict[int, tuple[int, SegmentHeader]], nxt: int) -> list[KV]:
        """The rolling window rebuilt from the last segments in the log (codec precision)."""
        cfg = self.cfg
        tokens = min(cfg.window_tokens, nxt * cfg.frames_per_block * cfg.tokens_per_frame)
        n_segs = -(-tokens // (cfg.frames_per_block * cfg.tokens_per_frame))
        per_layer: list[list[KV]] = [[] for _ in range(cfg.layers)]
        for sid in range(nxt - n_segs, nxt):
            if sid not in stored:
                raise SegmentLogError(
                    f"{self.log_dir}: cannot rebuild the rolling window: segment {sid} is not in the log "
                    f"and {WINDOW_FILE} does not match it"
                )
            slot = stored[sid][0]
            try:
                _, payload = self.log.read(slot)
            except CorruptSlotError as e:
                raise SegmentLogError(
                    f"{self.log_dir}: cannot rebuild the rolling window: segment {sid} ({e})"
                ) from e
            for i, kv in enumerate(self.layout.decode(payload)):
                per_layer[i].append(kv)
        return [
            (
                torch.cat([k for k, _ in kvs], dim=1)[:, -tokens:],
                torch.cat([v for _, v in kvs], dim=1)[:, -tokens:],
            )
            if tokens
            else (torch.empty(0), torch.empty(0))
            for kvs in per_layer
        ]

    def _set_window(self, window: Sequence[KV], global_end_tokens: int) -> None:
        self.model.reset_cache()
        for cache, (k, v) in zip(self.model.kv_cache, window, strict=True):
            n = k.shape[1] if k.dim() == 4 else 0
            if n:
                cache["k"][:, :n] = k.to(cache["k"].device, cache["k"].dtype)
                cache["v"][:, :n] = v.to(cache["v"].device, cache["v"].dtype)
            cache["global_end_index"].fill_(global_end_tokens if n else 0)
            cache["local_end_index"].fill_(n)

    # ---- summary --------------------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        """Totals over this run's steps (the `worldpager session` JSON, less the CLI's keys)."""
        fpb = self.cfg.frames_per_block
        budget = self.pm.host_budget_bytes
        base = self.rss_baseline if self.steps_run > self.warmup_segments else None
        growth = 0 if base is None else self._after[0] - (base - self._baseline_buffers)
        return {
            "segments": self.steps_run,
            "latent_frames": self.steps_run * fpb,
            "first_segment": self._first,
            "peak_rss_bytes": self.peak_rss,
            "rss_baseline_bytes": self.rss_baseline,
            "warmup_segments": self.warmup_segments,
            "rss_growth_bytes": growth,
            "rss_growth_raw_bytes": 0 if base is None else self._after[1] - base,
            "rss_step_peak_bytes": self._after[2] if base is not None else None,
            "device_buffers_in_ram": self._buffers_in_ram,
            "host_budget_bytes": budget,
            "host_peak_bytes": self.host_peak_bytes,
            "rss_bound_bytes": int(RSS_SLACK * budget),
            "rss_within_bound": None if base is None else growth <= RSS_SLACK * budget,
            "gpu_budget_bytes": self.gpu_budget_bytes,
            "nvme_bytes_written": self.handler.bytes_written,
            "nvme_bytes_read": self.handler.bytes_read,
            "positional_table_frames": self.cfg.rope_table_frames,
            "max_position_reached": self._max_position,
            "stall": stall_stats(self._stalls),
            "compute": stall_stats(self._computes),
            "segment_bytes": self.segment_bytes,
            "codec": self.layout.codec,
            "mode": self.mode,
            "nvme_reads": self.handler.reads,
            "host_hits": self._hits,
            "host_misses": self._misses,
            "peak_host_bytes": self.host_peak_bytes,
            "events": self.event_counts(),
            "resumed": self.window_source is not None,
            "window_source": self.window_source,
        }
