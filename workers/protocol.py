"""The command protocol between the manager and a device host (pure data: no torch, no Ray).

Order of use: the manager builds a `ModelSpec` per configured model, sends commands (`Load`,
`Promote`, `Demote`, `Drop`) with an operation id through a `WorkerPool`, polls `CommandResult`s,
and reads `WorkerStatus` to reconcile what is really resident.

Commands are declarative: each names the tier a model should end in. A command whose target
already holds is a no-op (`noop=True`), and a device host caches results by `op_id`, so a retry —
also after an actor restart, when the cache is gone but the target state is what counts — never
does the work twice.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

import numpy as np

TierName = Literal["gpu", "host", "disk"]
OpName = Literal["load", "promote", "demote", "drop"]

# Error codes of a failed command (CommandResult.error_code).
UNKNOWN_ADAPTER = "unknown_adapter"
UNKNOWN_MODEL = "unknown_model"
MISSING_CHECKPOINT = "missing_checkpoint"
BAD_CHECKPOINT = "bad_checkpoint"
FACTORY_FAILED = "factory_failed"
TOO_LARGE = "too_large"
NOT_AVAILABLE = "not_available"
BAD_TRANSITION = "bad_transition"
BAD_INPUT = "bad_input"
WORKER_DIED = "worker_died"
NO_SESSION = "no_session"
"""A world-session call for a session this host does not have open (or, on resume, has no saved state)."""
LOAD_TIMEOUT = "load_timeout"
"""A load or promote that did not finish within the host's `load_timeout_s` (a factory or read that hangs):
abandoned, so that the device's later commands run."""
DEADLINE = "deadline"
"""A call that got no answer within its deadline: its host is silent, or still runs it (a slow model);
not a death (the host's state is checked, `WORKER_DIED` is for a host that died)."""
INTERNAL = "internal"

SESSION_CODECS = ("bf16", "int8", "int4")
"""The codecs a world session's KV pages may be stored in (`worldpager.codecs.CODECS`, named here so
the manager checks a session's codec before it admits it, without importing torch)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a device host needs to know to load one model."""

    name: str
    adapter: str
    source: dict[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    """Largest footprint the model may take on its device (device memory minus its reserve)."""
    max_batch: int = 1
    """Rows one call may take when concurrent requests are stacked (dynamic batching); 1: off."""
    load_timeout_s: float | None = field(default=None, compare=False)
    """How long its load or promote may run before its device host abandons it, where that is longer
    than the host's own `load_timeout_s` (a model whose configured disk load takes minutes: a large
    checkpoint on a slow disk); None: the host's. Not compared: a new estimate does not reload it."""


@dataclass(frozen=True)
class Load:
    """Load from disk into `tier` ("gpu" or "host"). From host to gpu it is a promote."""

    model: ModelSpec
    tier: Literal["gpu", "host"] = "gpu"


@dataclass(frozen=True)
class Promote:
    """Host → gpu (the model must be in the host tier, or already on the gpu: no-op)."""

    model: str


@dataclass(frozen=True)
class Demote:
    """Gpu → host (pinned host memory on CUDA)."""

    model: str


@dataclass(frozen=True)
class Drop:
    """Free the model from every tier; done only when the memory is really back (bounded wait)."""

    model: str


Command = Load | Promote | Demote | Drop


def command_model(cmd: Command) -> str:
    return cmd.model.name if isinstance(cmd, Load) else cmd.model


def command_op(cmd: Command) -> OpName:
    if isinstance(cmd, Load):
        return "load"
    if isinstance(cmd, Promote):
        return "promote"
    if isinstance(cmd, Demote):
        return "demote"
    return "drop"


@dataclass(frozen=True)
class Timing:
    """Wall time of one transition, split by phase (seconds)."""

    read_s: float = 0.0
    """Bytes from the file into host memory."""
    deserialize_s: float = 0.0
    """Building the runnable object (module, TorchScript graph) around the tensors."""
    to_device_s: float = 0.0
    """Copies between host and device memory (including the sync that makes them final)."""
    warmup_s: float = 0.0
    """One small inference so that the first real request does not pay lazy initialisation."""
    release_s: float = 0.0
    """Waiting for freed memory to really come back (drop and demote)."""
    total_s: float = 0.0


@dataclass(frozen=True)
class Footprint:
    """Memory a model holds, measured after a transition."""

    tensor_bytes: int = 0
    """Bytes of its tensors (parameters, buffers, or the archive held in RAM)."""
    device_bytes: int = 0
    """Device memory it took: CUDA mem_get_info difference; on the CPU stand-in its gpu-tier tensor bytes."""
    host_bytes: int = 0
    """Host memory held for it in the host tier (pinned on CUDA)."""
    rss_delta_bytes: int = 0
    """Change of the worker process's resident set size over the transition (psutil)."""
    allocator_allocated_bytes: int | None = None
    """CUDA: the caching allocator's allocated bytes on the device after the transition."""
    allocator_reserved_bytes: int | None = None
    """CUDA: the caching allocator's reserved bytes on the device after the transition."""


@dataclass(frozen=True)
class CommandResult:
    """Outcome of one command, as data. `ok=False` carries an error code and a message naming the model."""

    op_id: str
    model: str
    op: OpName
    ok: bool
    from_tier: TierName = "disk"
    to_tier: TierName = "disk"
    noop: bool = False
    error_code: str | None = None
    error: str | None = None
    timing: Timing = Timing()
    bytes_moved: int = 0
    footprint: Footprint = Footprint()
    memory_released: bool | None = None
    """Drop/demote: whether the freed memory was seen back within the bounded wait."""
    source: str | None = None
    """Load: where the bytes came from ("disk", "cached" = OS page cache, "host")."""
    device: str = ""
    power_w: float | None = None
    """NVML board power after the transition, where NVML is present."""
    boot_id: str = ""
    """The device host process that ran it (`WorkerStatus.boot_id`): a new one says the host restarted
    since the manager last read its status. "" when no host answered (`worker_died`) or from an
    older host."""

    @property
    def transition(self) -> str:
        """`disk->gpu`, `host->gpu`, `gpu->host`, `disk->host`, `gpu->disk`…"""
        return f"{self.from_tier}->{self.to_tier}"


@dataclass(frozen=True)
class ModelStatus:
    name: str
    adapter: str
    tier: TierName
    tensor_bytes: int
    device_bytes: int
    host_bytes: int
    last_used: float | None
    """Unix time of its last inference on this host (None: never)."""
    inferences: int
    spec: ModelSpec | None = None
    """What the model was loaded from (its adapter, source and budget); None from an older host."""


@dataclass(frozen=True)
class SessionStatus:
    """A world session open on a device host (`workers.world.WorldSessions`)."""

    session_id: str
    model: str
    lease_bytes: int
    """The KV lease it runs with (host RAM on the CPU stand-in, device memory on CUDA)."""


@dataclass(frozen=True)
class WorkerStatus:
    """What a device host really holds, for reconciliation."""

    device: str
    kind: Literal["cuda", "cpu"]
    node: str
    pid: int
    started_at: float
    models: dict[str, ModelStatus]
    ops_done: int
    device_free_bytes: int | None = None
    device_total_bytes: int | None = None
    rss_bytes: int = 0
    sessions: tuple[SessionStatus, ...] = ()
    """Its open world sessions (holding KV memory), in no order; () from an older host."""
    boot_id: str = ""
    """Unique to this host process (a restarted host has a new one, as every `CommandResult` of it
    says); "" from an older host."""
    abandoned: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Loads and promotes given up (LOAD_TIMEOUT) whose threads still run, by model: ("load" or
    "promote", seconds running). What they allocate stays allocated on the device until they end, so
    the manager keeps that room booked meanwhile; {} from an older host."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (a status over Ray): a field that an older host's status lacks takes its default.
        A plain default falls back on its class attribute by itself; a `default_factory` one has none."""
        for f in fields(self):
            if f.name not in state and f.default_factory is not MISSING:
                state = {**state, f.name: f.default_factory()}
        self.__dict__.update(state)


OIP_DATATYPES: dict[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64",
}  # fmt: skip
"""Open Inference Protocol datatype -> numpy dtype name (BYTES is numpy's object dtype)."""
OIP_BY_NUMPY: dict[str, str] = {v: k for k, v in OIP_DATATYPES.items()} | {"object": "BYTES"}


def encode_bytes(a: np.ndarray) -> bytes:
    """OIP BYTES elements: each a 4-byte little-endian length, then the bytes (str is UTF-8)."""
    parts = []
    for item in a.reshape(-1).tolist():
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


_OIP_NAME: dict[np.dtype[Any], str | None] = {}
"""numpy dtype -> OIP datatype (None: not an OIP number type), filled as dtypes are met: `str(dtype)`
costs microseconds on every output otherwise."""
_LITTLE = sys.byteorder == "little"


CARRIERS: dict[str, str] = {"BF16": "uint16"}
"""Open Inference Protocol datatypes numpy has no dtype for -> the numpy dtype that holds their bit
patterns (a BF16 tensor is each bfloat16's 16 bits in a uint16 array). An output so held is labelled
with the datatype it stands for (`encode_output(a, "BF16")`), not its carrier's UINT16."""


def encode_output(a: np.ndarray, datatype: str | None = None) -> tuple[str, tuple[int, ...], bytes]:
    """An output as OIP wire data: its datatype, shape and raw bytes, as `raw_output_contents`
    carries them (numbers little-endian; a real dtype OIP lacks goes as FP32; strings as BYTES). A
    complex array is a ValueError (a cast would drop its imaginary part); a device host refuses one
    before, per request, with `complex_output`'s words.
    `datatype`: a datatype of `CARRIERS` that `a` holds as its carrier (BF16 in uint16): labelled so,
    the bytes as they are; ValueError when `a` is not its carrier. None: `a`'s dtype says it."""
    shape = tuple(int(d) for d in a.shape)
    dt = a.dtype
    if datatype is not None:
        carrier = CARRIERS.get(datatype)
        if carrier is None:
            raise ValueError(
                f"{datatype!r} is not a datatype numpy holds in a carrier (those are {', '.join(CARRIERS)})"
            )
        want = np.dtype(carrier)
        if dt.kind != want.kind or dt.itemsize != want.itemsize:
            raise ValueError(f"a {datatype} output is held as {carrier} (its bit patterns), not {dt}")
        return datatype, shape, np.ascontiguousarray(a, dtype=want.newbyteorder("<")).tobytes()
    if dt.kind in "OSU":
        return "BYTES", shape, encode_bytes(a)
    try:
        name = _OIP_NAME[dt]
    except KeyError:
        # by its name ('int32'), not its text: a big-endian dtype's is '>i4' (it went as FP32)
        name = _OIP_NAME[dt] = OIP_BY_NUMPY.get(dt.name)
    if name is None:
        if dt.kind == "c":  # its real part alone would go: refused, not cast (`complex_output`)
            raise ValueError(f"a {dt.name} output has no Open Inference Protocol datatype (no complex one)")
        a, name = a.astype(np.float32), "FP32"
    elif dt.isnative and _LITTLE:  # the common case: C-order bytes as they are
        return name, shape, a.tobytes()
    return name, shape, np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


def complex_output(model: str, output: str, dtype: object) -> str:
    """The error of a model that answers output `output` as a complex `dtype` (numpy's or torch's):
    the Open Inference Protocol has no complex datatype, and a cast to FP32 would drop the imaginary
    part without a word. Said per request (INTERNAL: the model's answer, not the request, is wrong)."""
    name = str(dtype).removeprefix("torch.")
    return (
        f"model {model!r}: output {output!r} has dtype {name}; the Open Inference Protocol has no complex "
        "datatype, and a cast would drop its imaginary part: answer the real and imaginary parts as "
        "outputs of their own, or as a last dimension of 2 (torch.view_as_real)"
    )


def output_array(entry: tuple[str, tuple[int, ...], bytes]) -> np.ndarray:
    """The values of a numeric `InferResult` output (the inverse of `encode_output`); a BF16 output's
    are its bit patterns, in uint16 (`CARRIERS`)."""
    datatype, shape, raw = entry
    name = OIP_DATATYPES.get(datatype) or CARRIERS.get(datatype)
    if name is None:
        raise ValueError(f"output_array reads numeric outputs, not {datatype}")
    dt = np.dtype(name).newbyteorder("<")
    return np.frombuffer(raw, dtype=dt).reshape(shape)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model in Open Inference Protocol terms."""

    name: str
    datatype: str
    """OIP datatype: FP32, INT64, BYTES…"""
    shape: tuple[int, ...]
    """-1 marks a variable dimension."""

    items: tuple[int, int] | None = None
    """The least and the most items (the first dimension's size) the model takes; None: any. Like
    the fields below, a limit of the model's own (its adapter's), checked by the manager before the
    request is admitted (a request the model refuses never loads it, nor counts as its demand) and by
    the adapter again. Not part of OIP's metadata."""
    multiple_of: int = 1
    """The first dimension's size is a multiple of this (silero-vad: chunks of 512 samples)."""
    finite: bool = False
    """Every value is a finite number: no NaN, no infinity (a number input)."""
    utf8: bool = False
    """Every item is UTF-8 text (a BYTES input)."""
    unit: str = "items"
    """What the first dimension counts, as the error messages say it ("samples")."""
    about: str = ""
    """What the values should be, added to an error about them ("PCM samples in [-1, 1]")."""

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of `shape` is one this spec declares: the same rank, and each fixed
        dimension (not -1) equal."""
        rank = len(shape) == len(self.shape)
        return rank and all(d in (-1, n) for d, n in zip(self.shape, shape, strict=True))

    def count_problem(self, shape: Sequence[int]) -> str | None:
        """What is wrong with the first dimension's size of a tensor of `shape` (one that `fits`), by
        `items` and `multiple_of`; None when nothing is. The message begins "input NAME"."""
        if not shape or (self.items is None and self.multiple_of <= 1):
            return None
        n = int(shape[0])
        low, high = self.items if self.items is not None else (0, None)
        if low <= n and (high is None or n <= high) and n % max(1, self.multiple_of) == 0:
            return None
        if self.multiple_of > 1:
            expected = f"{'a positive' if low > 0 else 'a'} multiple of {self.multiple_of}"
            expected += f", at most {high}" if high is not None else ""
        else:
            expected = f"{low}..{high}" if high is not None else f"at least {low}"
        return f"input {self.name!r} has {n} {self.unit}; expected {expected}"

    def value_problem(self, a: np.ndarray) -> str | None:
        """What is wrong with the values of `a` (this input's decoded array), by `finite` and `utf8`;
        None when nothing is. The message begins "input NAME"."""
        if self.finite and a.dtype.kind in "fc":
            bad = np.flatnonzero(~np.isfinite(a.reshape(-1)))
            if bad.size:
                what = self.unit if a.ndim == 1 else "values"
                first = int(bad[0])
                at = (
                    f"index {first}"
                    if a.ndim == 1
                    else f"index {[int(i) for i in np.unravel_index(first, a.shape)]}"
                )
                return (
                    f"input {self.name!r} has {bad.size} {what} that are not finite (NaN or inf), the first "
                    f"at {at}" + (f"; expected {self.about}" if self.about else "")
                )
        if self.utf8 and a.dtype.kind in "OS":  # (objects, as decoded; fixed-width bytes, as given)
            for i, item in enumerate(a.reshape(-1).tolist()):
                if isinstance(item, bytes | bytearray | memoryview):
                    try:
                        bytes(item).decode("utf-8")
                    except UnicodeDecodeError as e:
                        return (
                            f"input {self.name!r}[{i}] is not UTF-8 text (byte {e.start}: "
                            f"0x{bytes(item)[e.start]:02x})"
                        )
        return None


@dataclass(frozen=True)
class InferResult:
    """Outputs by name as OIP wire data: (datatype, shape, raw bytes), see `encode_output`; the
    service sends them as they are. `ok=False` names the cause."""

    model: str
    ok: bool
    outputs: dict[str, tuple[str, tuple[int, ...], bytes]] = field(default_factory=dict)
    error_code: str | None = None
    error: str | None = None
    seconds: float = 0.0
    hold_seconds: float = 0.0  # the caller's thread held: CPU time on a CPU device, wall time on CUDA
    share: float = 1.0
    """This request's part of the call that served it (`seconds` is the call's): its rows over the
    call's rows when it ran batched with others, else 1."""
    carriers_labelled: bool = False
    """Its outputs held in a carrier (`CARRIERS`) say the datatype they stand for: a BF16 output says
    BF16, not UINT16. A device host sets it on every answer; False from an older host, whose BF16
    outputs say UINT16 (the service then relabels them from the model's declared outputs)."""


@dataclass(frozen=True)
class SessionReply:
    """Outcome of a world-session call (open, step, resize, close) as plain data."""

    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    error_code: str | None = None
    error: str | None = None
