"""The vocabulary of WorldPager's page bookkeeping (`worldpager.pages.PageManager`).

Pure Python (no torch, no I/O). What the PageManager hands out and reports, all frozen dataclasses or
enums:

* jobs (unique ``job_id``): `WriteBack` (host -> NVMe), `Read` (NVMe -> host), `Upload` (host -> GPU
  slot); `Job` is any of them, `IoJob` the two that touch NVMe; `IoPriority` orders I/O jobs;
* completions: `Failure` (why a job failed);
* events (drained by ``take_events()``): `Evicted`, `Spilled`, `ReadBack`, `Corrupt`, `DiskFull`,
  `LeaseResized`; `Event` is any of them;
* results: `Backpressure` (``add_segment`` did not add), `StepPlan` (``prepare_step``), `Location` /
  `GpuSlot` (``lookup``) with `SegState` (where a segment is);
* `ProtocolError` (the caller broke the protocol) and `SegId` (a segment id).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TypeAlias

__all__ = [
    "Backpressure",
    "Corrupt",
    "DiskFull",
    "Event",
    "Evicted",
    "Failure",
    "GpuSlot",
    "IoJob",
    "IoPriority",
    "Job",
    "LeaseResized",
    "Location",
    "ProtocolError",
    "Read",
    "ReadBack",
    "SegId",
    "SegState",
    "Spilled",
    "StepPlan",
    "Upload",
    "WriteBack",
]

SegId: TypeAlias = int


class SegState(Enum):
    HOST_CLEAN = "host_clean"  # in host and on NVMe: evictable at no cost
    HOST_DIRTY = "host_dirty"  # only in host: write-back outstanding (none in host-only mode)
    READING = "reading"  # NVMe -> host in flight; its host room is reserved
    NVME = "nvme"  # only on NVMe
    LOST = "lost"  # NVMe copy corrupt, no host copy (a Corrupt event said so)


class IoPriority(IntEnum):
    PREFETCH = 0  # a Read for an upcoming step: late means a stall
    SPILL = 1  # write-back of a segment that must leave host (backpressure, lease shrink)
    WRITE_BACK = 2  # ordinary write-behind


class Failure(Enum):
    """Why a job failed; ``ok=False`` without one means DISK_FULL for a WriteBack, CORRUPT for a Read."""

    TRANSIENT = "transient"  # retried: a new job of the same kind is issued
    DISK_FULL = "disk_full"
    CORRUPT = "corrupt"


class ProtocolError(RuntimeError):
    """The caller broke the protocol: a bug, not an expected outcome."""


@dataclass(frozen=True)
class _SegJob:
    job_id: int
    seg_id: SegId
    nbytes: int


class WriteBack(_SegJob):
    """host -> NVMe."""


class Read(_SegJob):
    """NVMe -> host (into room already reserved)."""


@dataclass(frozen=True)
class Upload:
    """host -> GPU slot ``slot`` of ``buffer`` (= step % 2)."""

    job_id: int
    seg_id: SegId
    step: int
    buffer: int
    slot: int


Job: TypeAlias = WriteBack | Read | Upload
IoJob: TypeAlias = WriteBack | Read


@dataclass(frozen=True)
class _SegEvent:
    seg_id: SegId
    nbytes: int


class Evicted(_SegEvent):
    """A clean segment left host (it stays on NVMe)."""


class Spilled(_SegEvent):
    """A segment marked to spill was written back, then left host."""


class ReadBack(_SegEvent):
    """An NVMe read landed in host."""


@dataclass(frozen=True)
class Corrupt(_SegEvent):
    """The NVMe copy failed its check: the segment is lost and never uploaded. ``slot`` and ``reason``
    (the log slot read and why it failed) are added by the transfer side; the bookkeeping leaves them
    None."""

    slot: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class DiskFull:
    """A write-back hit a full disk: host-only from now on, dirty segments stay in host."""

    seg_id: SegId
    cancelled: tuple[int, ...]  # the other outstanding write-backs, dropped


@dataclass(frozen=True)
class LeaseResized:
    host_budget_bytes: int
    slots_per_buffer: int
    pending_bytes: int  # host bytes over the new budget, until spills complete / steps release


Event: TypeAlias = Evicted | Spilled | ReadBack | Corrupt | DiskFull | LeaseResized


@dataclass(frozen=True)
class Backpressure:
    """``add_segment`` did not add the segment: host is full of dirty, reading or protected bytes.

    Host never exceeds its budget and a dirty segment is never dropped, so the caller keeps the bytes
    (staging), waits for ``spills`` (their completion evicts them) or a ``release_step``, and retries.
    ``spills`` is empty when write-backs cannot help (no dirty segment: host holds only protected or
    reading bytes; or host-only mode): then the caller decides. `TransferHandler` writes the segment
    straight to the log (``PageManager.add_on_nvme``) while the log is usable, and drops it only in
    host-only mode.
    """

    seg_id: SegId
    nbytes: int
    shortfall: int
    spills: tuple[WriteBack, ...]


@dataclass(frozen=True)
class StepPlan:
    step: int
    buffer: int
    slots: dict[SegId, int]  # placed segment -> slot index in `buffer`
    jobs: tuple[Job, ...]
    unknown: tuple[SegId, ...]  # never added
    unavailable: tuple[SegId, ...]  # lost, or no host room for its read now
    dropped: tuple[SegId, ...]  # beyond slots_per_buffer (wanted is taken in order)


@dataclass(frozen=True)
class GpuSlot:
    step: int
    buffer: int
    slot: int
    ready: bool


@dataclass(frozen=True)
class Location:
    seg_id: SegId
    state: SegState
    nbytes: int
    gpu: tuple[GpuSlot, ...]
