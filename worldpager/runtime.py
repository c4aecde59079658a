"""WorldPager runtime: the execution side of the tiers (the `PageManager` is the bookkeeping side).

Pieces, bottom up:

* `Throttle` -- paces NVMe reads to a given bandwidth (a serial disk: each read of ``n`` bytes holds the
  disk for ``n / bytes_per_s`` seconds, starting when the previous read's time is up), so a benchmark
  can emulate a slow disk on any machine. The real read happens inside that time.
* `SegmentLayout` -- one segment's KV as one payload: layer-major pages, each page ``K`` then ``V``
  encoded with a codec (`worldpager.codecs`); `encode` / `decode` / page offsets.
* `TransferHandler` -- runs a `PageManager`'s jobs with real bytes. An I/O worker thread takes jobs in
  the PageManager's `io_queue()` order (prefetch reads > spills > write-backs, re-read at every pick so
  a write-back that became a spill moves up): `SegmentLog` reads through the `Throttle` into host
  copies, write-backs of host copies into the log. An upload stage (a thread; on CUDA it also works on
  a side stream with pinned host copies and records an event per upload) performs `Upload` jobs:
  decode the codec, re-rotate the keys' temporal dims from their true frames to virtual positions just
  before the rolling window (`rope.rerotate_time` / `rope.virtual_positions`), place the result in the
  step's retrieval buffer. Every PageManager call is made under one lock; completions go back through
  `PageManager.complete`, and a per-step `threading.Event` says the step's buffer is ready.
* `Session` -- runs `TinyCausalWan` blocks one by one with retrieval (see its docstring).
* `yaw_sweep_trajectory` -- a synthetic ``a_yaw``-like camera path (rotate in place, sweep back).

Failure handling: a corrupt slot (checksum) is reported as ``Failure.CORRUPT`` -> the PageManager takes
the segment out of every step (a `Corrupt` event) and it is never uploaded, so never attended to; a
full log (`LogFullError`) is reported as ``Failure.DISK_FULL`` -> host-only mode (a `DiskFull` event),
the session goes on. In host-only mode a new segment that finds no host room is dropped (a `Dropped`
event): it is never retrievable, generation continues.
"""

from __future__ import annotations

import math
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import psutil
import torch

from worldpager import codecs, rope
from worldpager.model import KV, TinyCausalWan, TinyConfig
from worldpager.pages import (
    DiskFull,
    Event,
    Evicted,
    Failure,
    IoJob,
    Job,
    PageManager,
    Read,
    Spilled,
    StepPlan,
    Upload,
    WriteBack,
)
from worldpager.retrieval import (
    FovOverlapRule,
    Pose,
    RetrievalRule,
    SegmentInfo,
    outside_window,
    predict_pose,
    wrap_degrees,
)
from worldpager.segment_log import HEADER_SIZE, CorruptSlotError, LogFullError, SegmentLog, slot_size_for

__all__ = [
    "Dropped",
    "Mode",
    "RuntimeEvent",
    "SegmentLayout",
    "Session",
    "StepRecord",
    "Throttle",
    "TransferHandler",
    "block_inputs",
    "stall_stats",
    "yaw_sweep_trajectory",
]

T = TypeVar("T")
Mode = Literal["prefetch", "on_demand"]
MODES: tuple[Mode, ...] = ("prefetch", "on_demand")


# ---- throttle -------------------------------------------------------------------------------------


class Throttle:
    """Paces reads to ``bytes_per_s`` (None: no pacing). Thread-safe; readers queue like on one disk."""

    def __init__(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
            raise ValueError(f"bytes_per_s must be a positive finite number or None, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T], nbytes: int) -> T:
        """Call ``fn`` (the real read of ``nbytes``) and return when the paced transfer is done."""
        if self.bytes_per_s is None:
            return fn()
        with self._lock:
            start = max(time.perf_counter(), self._busy_until)
            end = self._busy_until = start + nbytes / self.bytes_per_s
        _sleep_until(start)
        result = fn()
        _sleep_until(end)
        return result


def _sleep_until(t: float) -> None:
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


# ---- segment layout ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentLayout:
    """Shape of one segment's KV: ``layers`` x (K, V) of ``[1, frames*latent_h*latent_w, heads, head_dim]``,
    stored as one payload of layer-major pages (page = K bytes then V bytes) under ``codec``."""

    layers: int
    heads: int
    head_dim: int
    frames: int
    latent_h: int
    latent_w: int
    codec: str = "bf16"
    dtype: torch.dtype = torch.float32
    rope_theta: float = rope.DEFAULT_THETA

    def __post_init__(self) -> None:
        if self.codec not in codecs.CODECS:
            raise ValueError(f"unknown codec {self.codec!r}: expected one of {', '.join(codecs.CODECS)}")
        if min(self.layers, self.heads, self.frames, self.latent_h, self.latent_w) < 1:
            raise ValueError("layers, heads, frames, latent_h and latent_w must be >= 1")
        rope.rope_split(self.head_dim)

    @classmethod
    def from_config(cls, cfg: TinyConfig, codec: str, dtype: torch.dtype = torch.float32) -> SegmentLayout:
        return cls(
            cfg.layers, cfg.heads, cfg.head_dim, cfg.frames_per_block, cfg.latent_h, cfg.latent_w,
            codec, dtype, cfg.rope_theta,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.frames * self.latent_h * self.latent_w

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (1, self.tokens, self.heads, self.head_dim)

    @property
    def _tensor_nbytes(self) -> int:
        return codecs.packed_nbytes(math.prod(self.kv_shape), self.codec)

    @property
    def page_nbytes(self) -> int:
        return 2 * self._tensor_nbytes

    @property
    def payload_nbytes(self) -> int:
        return self.layers * self.page_nbytes

    @property
    def page_offsets(self) -> tuple[int, ...]:
        return tuple(i * self.page_nbytes for i in range(self.layers))

    @property
    def decoded_nbytes(self) -> int:
        """Bytes of one segment ready for attention (all layers, K and V, in ``dtype``)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.layers * 2 * math.prod(self.kv_shape) * elem

    def encode(self, kv: Sequence[KV]) -> bytes:
        if len(kv) != self.layers:
            raise ValueError(f"{len(kv)} layers of KV, the layout has {self.layers}")
        parts: list[bytes] = []
        for k, v in kv:
            for t in (k, v):
                if tuple(t.shape) != self.kv_shape:
                    raise ValueError(f"KV shape {tuple(t.shape)} != {self.kv_shape}")
                parts.append(codecs.to_bytes(codecs.encode(t.to(self.dtype), self.codec)))
        return b"".join(parts)

    def decode(self, payload: bytes | torch.Tensor, device: torch.device | str | None = None) -> list[KV]:
        """Per-layer ``(K, V)`` from a payload (``bytes`` or a 1-D uint8 tensor on any device; the
        codec runs where the tensor is, then the result moves to ``device``)."""
        buf = (
            payload
            if isinstance(payload, torch.Tensor)
            else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        )
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.payload_nbytes:
            raise ValueError(f"payload of {buf.numel()} bytes, the layout needs {self.payload_nbytes}")
        n, dtype = self._tensor_nbytes, str(self.dtype).removeprefix("torch.")
        out: list[KV] = []
        for off in self.page_offsets:
            k, v = (
                codecs.decode(codecs.Packed(self.codec, self.kv_shape, dtype, buf[a : a + n]), device)
                for a in (off, off + n)
            )
            out.append((k, v))
        return out

    def rerotate(self, kv: Sequence[KV], from_frame: int, to_frame: int) -> list[KV]:
        """Keys moved from start frame ``from_frame`` to ``to_frame`` (temporal dims only); V as is."""
        h, w = self.latent_h, self.latent_w
        return [
            (rope.rerotate_time(k, self.frames, h, w, from_frame, to_frame, self.rope_theta), v)
            for k, v in kv
        ]


# ---- transfer handler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dropped:
    """Host-only mode and no host room: the new segment was not kept (never retrievable)."""

    seg_id: int
    nbytes: int


RuntimeEvent = Event | Dropped


@dataclass
class _StepBuf:
    slot_seg: dict[int, int]  # slot -> segment
    targets: dict[int, int]  # slot -> virtual start frame
    kv: dict[int, list[KV]] = field(default_factory=dict)  # slot -> uploaded KV
    ready: threading.Event = field(default_factory=threading.Event)
    cuda_events: list[torch.cuda.Event] = field(default_factory=list)


class TransferHandler:
    """Executes a `PageManager`'s jobs with real bytes (see the module docstring).

    ``log`` is shared, not owned (``close()`` leaves it open). ``host_bytes`` is what the host copies
    take; it follows the PageManager's accounting (copies leave on `Evicted`/`Spilled`).
    """

    def __init__(
        self,
        pm: PageManager,
        log: SegmentLog,
        layout: SegmentLayout,
        *,
        throttle: Throttle | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.pm, self.log, self.layout = pm, log, layout
        self.throttle = throttle or Throttle(None)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._cond = threading.Condition()  # serialises every PageManager call
        self._host: dict[int, bytes] = {}
        self._info: dict[int, SegmentInfo] = {}
        self._slot_of: dict[int, int] = {}  # segment -> log slot
        self._io_pending: dict[int, IoJob] = {}  # handed to the worker, not started
        self._outstanding: set[int] = set()  # I/O jobs handed out, not completed
        self._uploads: queue.Queue[Upload | None] = queue.Queue()
        self._steps: dict[int, _StepBuf] = {}
        self._closing = False
        self.events: list[RuntimeEvent] = []
        self.bytes_read = 0  # NVMe bytes read (header + payload)
        self.bytes_written = 0
        self.reads = 0
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._guard(self._io_loop), name="wp-io", daemon=True),
            threading.Thread(target=self._guard(self._upload_loop), name="wp-upload", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the runtime's calls ----------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        with self._cond:
            return sum(len(p) for p in self._host.values())

    def log_slot(self, seg_id: int) -> int | None:
        with self._cond:
            return self._slot_of.get(seg_id)

    def add_segment(self, info: SegmentInfo, payload: bytes, *, on_disk_slot: int | None = None) -> bool:
        """Register a finished segment (host copy + write-behind). ``on_disk_slot``: it is already in
        the log there (no write). Waits for spills under backpressure; False if it was dropped."""
        sid = info.segment_id
        with self._cond:
            while True:
                self._raise_error()
                res = self.pm.add_segment(sid, len(payload))
                self._drain_events()
                if isinstance(res, list):
                    self._host[sid], self._info[sid] = payload, info
                    if on_disk_slot is None:
                        self._submit(res)
                    else:
                        self._slot_of[sid] = on_disk_slot
                        for job in res:
                            self._submit(self.pm.complete(job.job_id, True))
                        self._drain_events()
                    return True
                if not res.spills:
                    self.events.append(Dropped(sid, len(payload)))
                    return False
                self._wait_jobs({j.job_id for j in res.spills})

    def _wait_jobs(self, ids: set[int]) -> None:
        self._cond.wait_for(lambda: not ids & self._outstanding or self.error is not None, 5.0)

    def prepare(self, step: int, wanted: Iterable[int], window_start_frame: int) -> StepPlan:
        """Plan ``step``'s retrieval buffer and start its transfers; memory lands at virtual frames just
        before ``window_start_frame`` (slot order = ``wanted`` order = oldest-to-newest placement)."""
        with self._cond:
            self._raise_error()
            plan = self.pm.prepare_step(step, wanted)
            starts = rope.virtual_positions(window_start_frame, len(plan.slots), self.layout.frames)
            slot_seg = {slot: sid for sid, slot in plan.slots.items()}
            self._steps[step] = _StepBuf(slot_seg, {slot: starts[slot] for slot in slot_seg})
            self._drain_events()
            self._submit(plan.jobs)
            self._check_ready()
            return plan

    def wait_ready(self, step: int, timeout: float = 120.0) -> float:
        """Block until ``step``'s buffer is ready; the seconds blocked (the stall)."""
        with self._cond:
            buf = self._steps[step]
        t0 = time.perf_counter()
        if not buf.ready.wait(timeout):
            raise TimeoutError(f"step {step}: retrieval buffer not ready after {timeout} s")
        if self._cuda:
            for ev in buf.cuda_events:
                torch.cuda.current_stream(self.device).wait_event(ev)
        stall = time.perf_counter() - t0
        self._raise_error()
        return stall

    def memory(self, step: int) -> tuple[list[KV] | None, tuple[int, ...]]:
        """Per-layer ``(K, V)`` of the segments uploaded for ``step`` (slot order) and their ids;
        ``(None, ())`` when there are none. Lost (corrupt) segments are never in it."""
        with self._cond:
            buf = self._steps[step]
            slots = sorted(s for s in buf.kv if s in buf.slot_seg)
            kvs = [buf.kv[s] for s in slots]
            ids = tuple(buf.slot_seg[s] for s in slots)
        if not kvs:
            return None, ()
        layers = len(kvs[0])
        mem = [
            (torch.cat([kv[i][0] for kv in kvs], dim=1), torch.cat([kv[i][1] for kv in kvs], dim=1))
            for i in range(layers)
        ]
        return mem, ids

    def release(self, step: int) -> None:
        with self._cond:
            self.pm.release_step(step)
            self._steps.pop(step, None)
            self._drain_events()

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every I/O job handed out so far has completed."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._outstanding or self.error is not None, timeout):
                raise TimeoutError("I/O jobs still outstanding")
        self._raise_error()

    def close(self) -> None:
        """Finish outstanding I/O, stop the threads (the log stays open)."""
        try:
            if self.error is None:
                self.drain()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._uploads.put(None)
            for t in self._threads:
                t.join(timeout=10.0)

    # ---- internals (the caller holds self._cond unless said otherwise) -----------------------
    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"transfer thread failed: {self.error!r}") from self.error

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # surfaced to the runtime's thread by _raise_error
                with self._cond:
                    self.error = e
                    for buf in self._steps.values():
                        buf.ready.set()
                    self._cond.notify_all()

        return run

    def _submit(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            if isinstance(job, Upload):
                self._uploads.put(job)
            else:
                self._io_pending[job.job_id] = job
                self._outstanding.add(job.job_id)
        self._cond.notify_all()

    def _complete(self, job_id: int, ok: bool, failure: Failure | None = None) -> None:
        follow = self.pm.complete(job_id, ok, failure)
        self._outstanding.discard(job_id)
        self._drain_events()
        self._submit(follow)
        self._check_ready()

    def _drain_events(self) -> None:
        for e in self.pm.take_events():
            if isinstance(e, Evicted | Spilled):
                self._host.pop(e.seg_id, None)
            elif isinstance(e, DiskFull):
                for jid in e.cancelled:
                    self._io_pending.pop(jid, None)
                    self._outstanding.discard(jid)
            self.events.append(e)

    def _check_ready(self) -> None:
        for step, buf in self._steps.items():
            if not buf.ready.is_set() and self.pm.buffer_ready(step):
                buf.ready.set()

    def _next_io(self) -> IoJob | None:
        """The next job to start in PageManager order, or None when closing with nothing left."""
        while True:
            for j in self.pm.io_queue():
                job = self._io_pending.pop(j.job_id, None)
                if job is not None:
                    return job
            if self._closing:
                return None
            self._cond.wait()

    def _io_loop(self) -> None:  # no lock held on entry
        while True:
            with self._cond:
                job = self._next_io()
                if job is None:
                    return
                slot = self._slot_of.get(job.seg_id)
                payload = self._host.get(job.seg_id)
                info = self._info[job.seg_id]
            if isinstance(job, Read):
                self._do_read(job, slot)
            else:
                self._do_write(job, info, payload)

    def _do_read(self, job: Read, slot: int | None) -> None:
        data: bytes | None = None
        if slot is not None:
            try:
                h, data = self.throttle.run(lambda: self.log.read(slot), HEADER_SIZE + job.nbytes)
                if h.segment_id != job.seg_id or len(data) != job.nbytes:
                    data = None
            except (CorruptSlotError, OSError):
                data = None
        with self._cond:
            self.reads += 1
            if data is None:
                self._complete(job.job_id, False, Failure.CORRUPT)
                return
            self.bytes_read += HEADER_SIZE + len(data)
            self._host[job.seg_id] = data
            self._complete(job.job_id, True)

    def _do_write(self, job: WriteBack, info: SegmentInfo, payload: bytes | None) -> None:
        assert payload is not None, f"write-back of segment {job.seg_id} without a host copy"
        p = info.pose
        try:
            slot: int | None = self.log.append(
                segment_id=info.segment_id,
                frame_start=info.frame_start,
                frame_end=info.frame_end,
                pose=(p.x, p.y, p.z, p.pitch, p.yaw),
                codec=self.layout.codec,
                position_state="post-rope",
                position=info.frame_start,
                payload=payload,
                page_offsets=self.layout.page_offsets,
            )
        except LogFullError:
            slot = None
        with self._cond:
            if slot is None:
                self._complete(job.job_id, False, Failure.DISK_FULL)
                return
            self._slot_of[job.seg_id] = slot
            self.bytes_written += HEADER_SIZE + len(payload)
            self._complete(job.job_id, True)

    def _upload_loop(self) -> None:
        while (job := self._uploads.get()) is not None:
            with self._cond:
                buf = self._steps.get(job.step)
                payload = self._host[job.seg_id]
                from_frame = self._info[job.seg_id].frame_start
            kv: list[KV] | None = None
            ev: torch.cuda.Event | None = None
            if buf is not None:  # else: released while queued, nothing to place
                kv, ev = self._upload(payload, from_frame, buf.targets[job.slot])
            with self._cond:
                if buf is not None and kv is not None:
                    buf.kv[job.slot] = kv
                    if ev is not None:
                        buf.cuda_events.append(ev)
                self._complete(job.job_id, True)

    def _upload(
        self, payload: bytes, from_frame: int, to_frame: int
    ) -> tuple[list[KV], torch.cuda.Event | None]:
        if not self._cuda:
            return self.layout.rerotate(self.layout.decode(payload), from_frame, to_frame), None
        assert self._stream is not None
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8).pin_memory()
        with torch.cuda.stream(self._stream):  # H2D of the compressed bytes, then decode on the device
            dev = host.to(self.device, non_blocking=True)
            kv = self.layout.rerotate(self.layout.decode(dev), from_frame, to_frame)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        return kv, ev


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


def block_inputs(cfg: TinyConfig, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic block noise ``[frames, tokens, dim]`` and actions ``[frames, action_dim]``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    latent = torch.randn((cfg.frames_per_block, cfg.tokens_per_frame, cfg.dim), generator=g)
    actions = torch.randn((cfg.frames_per_block, cfg.action_dim), generator=g)
    return latent, actions


def yaw_sweep_trajectory(
    n: int, *, seed: int = 0, step_deg: float = 30.0, sweep_deg: float = 360.0, jitter_deg: float = 2.0
) -> list[Pose]:
    """An ``a_yaw``-like path: rotate in place ``step_deg`` per segment, reverse after ``sweep_deg``, so
    every view is revisited at growing distances. Deterministic by ``seed`` (a small yaw jitter)."""
    rng = random.Random(seed)
    poses: list[Pose] = []
    yaw, direction, turned = 0.0, 1.0, 0.0
    for _ in range(n):
        poses.append(Pose(0.0, 0.0, 0.0, 0.0, wrap_degrees(yaw + rng.uniform(-jitter_deg, jitter_deg))))
        yaw += direction * step_deg
        turned += step_deg
        if turned >= sweep_deg:
            direction, turned = -direction, 0.0
    return poses


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
            _sleep_until(t1 + self.compute_s)
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
