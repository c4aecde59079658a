"""RSS measurement for a `Session` (`RssMeter`) and glibc's allocator trim (`malloc_trim`).

Bounded memory: a session keeps no per-step tensors (a block's KV becomes its payload, the prediction
is dropped unless ``keep_outputs``), per-step records are small numbers and only the last
``max_records`` are kept (the stall/compute series are arrays of floats), events are drained from the
transfer handler every step into counts, the rare notable ones (`Corrupt`, `DiskFull`, `Dropped`,
`CorruptSlot`), the last ``max_events`` `LeaseResized` (a manager may resize often) and the last
``max_events`` routine ones. What grows with the session is the segment index (the log index, the
PageManager, the retrieval candidates and the rule's cache:
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
set: both buffers, activations, the block's KV). `Session.summary` also reports ``host_peak_bytes`` (the
accounted host tier) and whether ``rss_growth_bytes <= 1.05 * host_budget_bytes`` (`RSS_SLACK`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import psutil

__all__ = ["RSS_SLACK", "RssMeter", "malloc_trim"]

RSS_SLACK = 1.05  # the contract: RSS growth over a session <= host budget x 1.05


def malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (free allocator memory back to the OS), or None elsewhere."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int

    def trim() -> None:
        fn(0)

    return trim


class RssMeter:
    """A session's RSS bookkeeping (see the module docstring); the start RSS is sampled on creation.

    ``buffers_in_ram``: the retrieval buffers (the device tier) are emulated in RAM (a CPU run), so
    `account` is given their size to take out of the corrected growth."""

    def __init__(self, warmup_segments: int, buffers_in_ram: bool) -> None:
        self.warmup_segments = warmup_segments
        self._proc = psutil.Process()
        self.rss_start = self.rss()
        self.peak_rss = self.rss_start
        self.rss_baseline: int | None = self.rss_start if warmup_segments == 0 else None
        self._baseline_buffers = 0
        # after the warm-up, at step ends: max RSS less the RAM-held retrieval buffers, max RSS; and the
        # max RSS sampled right after each block's compute
        self._after = (0, 0, 0)
        self.buffers_in_ram = buffers_in_ram
        self.host_peak_bytes = 0

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def account(self, steps_run: int, rss_mid: int, rss_end: int, host: int, buffers: int) -> None:
        """RSS bookkeeping at the end of a step (see the module docstring)."""
        self.peak_rss = max(self.peak_rss, rss_mid, rss_end)
        self.host_peak_bytes = max(self.host_peak_bytes, host)
        if steps_run <= self.warmup_segments:
            if steps_run == self.warmup_segments:
                self.rss_baseline, self._baseline_buffers = rss_end, buffers
        else:
            self._after = (
                max(self._after[0], rss_end - buffers),
                max(self._after[1], rss_end),
                max(self._after[2], rss_mid),
            )

    def summary(self, steps_run: int, budget: int) -> dict[str, object]:
        """The RSS keys of `Session.summary`, in its order (``budget``: the host budget in bytes)."""
        base = self.rss_baseline if steps_run > self.warmup_segments else None
        growth = 0 if base is None else self._after[0] - (base - self._baseline_buffers)
        return {
            "peak_rss_bytes": self.peak_rss,
            "rss_baseline_bytes": self.rss_baseline,
            "warmup_segments": self.warmup_segments,
            "rss_growth_bytes": growth,
            "rss_growth_raw_bytes": 0 if base is None else self._after[1] - base,
            "rss_step_peak_bytes": self._after[2] if base is not None else None,
            "device_buffers_in_ram": self.buffers_in_ram,
            "host_budget_bytes": budget,
            "host_peak_bytes": self.host_peak_bytes,
            "rss_bound_bytes": int(RSS_SLACK * budget),
            "rss_within_bound": None if base is None else growth <= RSS_SLACK * budget,
        }
