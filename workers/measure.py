"""Real measurements of what residency costs: phase timers, memory probes, release waits, NVML.

`MemoryProbe` is the seam: `CpuProbe` reads psutil RSS (the CPU stand-in device), `CudaProbe`
reads `torch.cuda.mem_get_info` and the caching allocator. `wait_released` is the Ollama lesson:
after freeing a model, poll until the memory is really back (bounded) before reporting done.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil
import torch

RELEASE_TIMEOUT_S = 2.0
RELEASE_POLL_S = 0.01
RELEASE_FRACTION = 0.5
"""Freed memory counts as back once this share of the expected bytes shows up (allocators keep some)."""


@dataclass
class Phases:
    """Accumulates wall time per phase name."""

    seconds: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + (self.clock() - t0)

    def get(self, name: str) -> float:
        return self.seconds.get(name, 0.0)


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


_libc: Any = None


def trim_host_heap() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim), so RSS shows what is really held."""
    global _libc
    gc.collect()
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


class MemoryProbe(Protocol):
    """Reads how much memory the device has in use, in bytes (a monotone 'used' figure)."""

    def used(self) -> int: ...

    def free_total(self) -> tuple[int | None, int | None]: ...

    def release(self) -> None:
        """Hand cached free memory back (allocator caches, heap trim)."""


class CpuProbe:
    """The CPU stand-in device: its memory is this process's RSS."""

    def used(self) -> int:
        return rss_bytes()

    def free_total(self) -> tuple[int | None, int | None]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def release(self) -> None:
        trim_host_heap()


class CudaProbe:
    """A CUDA device: `mem_get_info` sees every process's use; the allocator sees ours."""

    def __init__(self, index: int) -> None:
        self.index = index

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def free_total(self) -> tuple[int | None, int | None]:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def release(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()
        self.release_host()

    def release_host(self) -> None:
        """Pinned host memory freed (a host-tier model dropped, a host copy promoted, the buffer a
        checkpoint was read into) stays in torch's pinned host cache, page-locked in this process,
        until that cache is emptied (blocks whose copies still run are kept); a CUDA build's binding,
        as `torch.cuda.graphs` calls it. Alone, it neither waits for the device's streams nor empties
        its memory cache (a load measured by that memory keeps its figure)."""
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()

    def allocator_stats(self) -> dict[str, int]:
        return {
            "allocated_bytes": int(torch.cuda.memory_allocated(self.index)),
            "reserved_bytes": int(torch.cuda.memory_reserved(self.index)),
        }


def wait_released(
    probe: MemoryProbe,
    before_used: int,
    expected_bytes: int,
    *,
    timeout_s: float = RELEASE_TIMEOUT_S,
    poll_s: float = RELEASE_POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[bool, int]:
    """Poll until `expected_bytes` (× RELEASE_FRACTION) are back below `before_used`, or time out.

    Returns (released, bytes_seen_back). Small frees (under a page or two) count as released at once:
    allocators keep them and no probe can see them.
    """
    probe.release()
    want = int(expected_bytes * RELEASE_FRACTION)
    deadline = clock() + timeout_s
    while True:
        back = before_used - probe.used()
        if back >= want or expected_bytes < (1 << 16):
            return True, max(back, 0)
        if clock() >= deadline:
            return False, max(back, 0)
        sleep(poll_s)
        probe.release()


def nvml_power_w(index: int) -> float | None:
    """Board power in watts, from NVML, of CUDA device `index` (numbered as torch numbers it); None
    where NVML (package nvidia-ml-py) is absent or cannot say.

    NVML numbers every GPU of the machine, in PCI order, and ignores CUDA_VISIBLE_DEVICES: its device
    `index` may be another GPU than CUDA's. The device is found by its UUID, as CUDA reports it."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(index).encode())
        return float(pynvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0
    except Exception:  # NVML present but unusable (no driver, no permission, no such device): no figure
        return None


def _nvml_uuid(index: int) -> str:
    """CUDA device `index`'s UUID as NVML writes it: torch gives it without NVML's "GPU-" prefix."""
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (an iterable of tensors)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        total += st.nbytes()
    return total
