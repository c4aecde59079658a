"""A device host: several models on one device, moved between tiers by idempotent commands.

Plain Python and PyTorch (no Ray): `workers.actor` wraps it in a Ray actor; tests drive it directly.

* `apply(cmd, op_id)` → `CommandResult`. Commands are declarative (the tier a model should end in):
  one whose target already holds is a no-op; results are cached by `op_id`, so a retried command does
  nothing twice. A failure of any kind becomes an error result naming the model and the cause; the
  host keeps serving its other models.
* `infer(model, inputs)` → `InferResult` (numpy arrays by name in; out, each output as OIP wire data:
  datatype, shape and raw bytes, which the service sends as they are).
* `status()` → `WorkerStatus`: what is really resident and which world sessions are open, for the
  manager to reconcile with intent; its `boot_id` (on every `CommandResult` too) tells a restart.

Thread safety: commands run one at a time (a lock); `infer` may run beside a command on another model
(a Ray actor with max_concurrency > 1). A drop or demote waits for the model's running inference
(it takes the model's lock), so its memory comes back after it; a request still waiting for that lock
then finds the model gone from the gpu tier and is refused (bad_transition), never run on it.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from workers import batching
from workers import protocol as P
from workers.adapters import Adapter, AdapterError, HostCopy, make_adapter
from workers.bounded import SingleFlight, TimedOut, start_on_thread
from workers.measure import CpuProbe, CudaProbe, MemoryProbe, Phases, nvml_power_w, rss_bytes, wait_released
from workers.st_io import cached_fraction
from workers.world import NotResident, SessionNotOpen, WorldSessions
from worldpager.segment_log import LogFullError, LogInUse
from worldpager.transfer import TransferError

logger = logging.getLogger(__name__)
T = TypeVar("T")

OP_CACHE = 4096
LOAD_TIMEOUT_S = 900.0
"""How long a load or promote may take before it is abandoned (`DeviceHost.load_timeout_s`), unless its
model's spec allows longer (`ModelSpec.load_timeout_s`)."""
DESCRIBE_TIMEOUT_S = 60.0
"""How long a describe (a model's declared inputs and outputs, read by building its module on the meta
device: its factory runs) may take before it is answered LOAD_TIMEOUT (`DeviceHost.describe_timeout_s`)."""
CACHED_AT = 0.9
"""A disk load counts as from the page cache when at least this share of its files is cached."""


def _answer(
    model: str,
    out: dict[str, np.ndarray],
    carried: dict[str, str],
    took: float,
    held: float,
    share: float = 1.0,
) -> P.InferResult:
    """A call's outputs as an `InferResult`: each output held in a carrier (`carried`: a BF16 output's
    bit patterns in uint16) labelled with the datatype it stands for, not the carrier's. An adapter
    that answers a declared BF16 output in another dtype, or any output as a complex array (OIP has
    no complex datatype), fails the request INTERNAL, naming it."""
    outputs = {}
    for k, v in out.items():
        if v.dtype.kind == "c":  # (encode_output would send its real part alone, as FP32)
            return P.InferResult(
                model, False, error_code=P.INTERNAL, error=P.complex_output(model, k, v.dtype)
            )
        try:
            outputs[k] = P.encode_output(v, carried.get(k))
        except ValueError as e:
            return P.InferResult(
                model, False, error_code=P.INTERNAL, error=f"model {model!r}: output {k!r}: {e}"
            )
    return P.InferResult(
        model, True, outputs=outputs, seconds=took, hold_seconds=held, carriers_labelled=True, share=share
    )


def _is_file(p: Path) -> bool:
    """`p` is a file; False where its name cannot be one (too long, a NUL byte: the read says why)."""
    try:
        return p.is_file()
    except (OSError, ValueError):
        return False


def _unusable(p: Path, e: OSError | ValueError) -> str:
    """Why the file `p` cannot be read, naming it: its stat's error, or a name with a NUL byte."""
    if isinstance(e, ValueError):
        return f"{str(p)!r} is not a file name (it holds a NUL byte)"
    return f"{p}: cannot be read ({e.strerror or e})"


@dataclass
class _Resident:
    spec: P.ModelSpec
    adapter: Adapter
    tier: P.TierName
    runnable: Any = None
    host: HostCopy | None = None
    tensor_bytes: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    last_used: float | None = None
    inferences: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    """One inference at a time per model: models keep state (silero's) and modules are not thread-safe."""
    max_batch: int | None = None
    """Rows one call may take (dynamic batching); None until its first batch decides it."""
    read_bytes: int = 0
    """Bytes its load read from disk."""


@dataclass
class _Work:
    """A load's or promote's work running on a thread of its own (`DeviceHost._bounded`)."""

    what: str
    """"load" or "promote"."""
    started: float
    """When it started (time.monotonic)."""
    wake: threading.Event = field(default_factory=threading.Event)
    """Set when it ends, or when the host stops (whoever waits for it then gives it up)."""
    abandoned: bool = False
    """Given up (past its limit, or at the host's stop) while it still ran: what it makes is thrown away."""


class DeviceHost:
    """Holds the models of one device ("gpu0", a CUDA device or the CPU stand-in)."""

    def __init__(
        self,
        device: str,
        kind: str = "cpu",
        *,
        index: int = 0,
        node: str | None = None,
        probe: MemoryProbe | None = None,
        adapter_factory: Callable[[P.ModelSpec, torch.device], Adapter] = make_adapter,
        release_timeout_s: float = 2.0,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        describe_timeout_s: float = DESCRIBE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: kind must be cpu or cuda, not {kind!r}")
        self.name = device
        self.kind: Literal["cuda", "cpu"] = "cuda" if kind == "cuda" else "cpu"
        self.index = index
        self.node = node or socket.gethostname()
        self.torch_device = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
        self.probe: MemoryProbe = probe or (CudaProbe(index) if kind == "cuda" else CpuProbe())
        self.adapter_factory = adapter_factory
        self.release_timeout_s = release_timeout_s
        self.load_timeout_s = load_timeout_s
        self.describe_timeout_s = describe_timeout_s
        self.clock = clock
        self.started_at = clock()
        self.boot_id = uuid.uuid4().hex  # this process's (its results carry it: a restart is seen)
        self.models: dict[str, _Resident] = {}
        self.results: OrderedDict[str, P.CommandResult] = OrderedDict()
        self.ops_done = 0
        self._lock = threading.Lock()
        self.world = WorldSessions(self.torch_device, self.probe.release if self.kind == "cuda" else None)
        self._describing: SingleFlight[tuple[list[P.TensorSpec], list[P.TensorSpec]]] = SingleFlight(
            describe_timeout_s, listed=False
        )
        """Describes by model name: one running a name (a later one of its spec joins it), a successful
        answer kept for the spec it was for. Not listed in `workers.bounded.running_builds`: those
        still running are said by `describing` (`workers.pool.left_running`, once its pool closed)."""
        self.session_root = Path(tempfile.gettempdir()) / f"residency-sessions-{device}-{os.getpid()}"
        self._stopping = False
        self._work_lock = threading.Lock()
        self._work: dict[str, _Work] = {}
        """Loads and promotes running by model name: the one a command waits for, and those abandoned
        that still run (they may still take memory: no other of that model starts until they end)."""
        self._said_missing: str | None = None
        """Why the device cannot be used, as `status` last logged it (logged once, not at every read)."""

    # ---- commands

    def apply(self, cmd: P.Command, op_id: str) -> P.CommandResult:
        """Run one command (or return the cached result of this `op_id`). Never raises."""
        with self._lock:
            cached = self.results.get(op_id)
            if cached is not None:
                return cached
            name, op = P.command_model(cmd), P.command_op(cmd)
            before = self.models[name].tier if name in self.models else "disk"
            try:
                self._check_device(name)
                result = self._run(cmd, op_id)
            except AdapterError as e:
                result = P.CommandResult(
                    op_id, name, op, False, before, before, error_code=e.code, error=e.message
                )
            except torch.cuda.OutOfMemoryError as e:
                result = P.CommandResult(
                    op_id, name, op, False, before, before, error_code=P.TOO_LARGE,
                    error=f"model {name!r}: out of device memory on {self.name}: {e}",
                )  # fmt: skip
            except Exception as e:  # one failed command never kills the host
                logger.exception("device %s: %s of %s failed", self.name, op, name)
                result = P.CommandResult(
                    op_id, name, op, False, before, before, error_code=P.INTERNAL,
                    error=f"model {name!r}: {op} failed: {e!r}",
                )  # fmt: skip
            if not result.ok:
                self._forget_partial(name, before)
                if op in ("load", "promote") and result.error_code not in (P.LOAD_TIMEOUT, P.NOT_AVAILABLE):
                    # (not one given up or refused: a work still running may hold the device meanwhile)
                    self._release(f"the failed {op} of {name}")
                # where it really is now: a failed reload (changed spec) or roll-back may have dropped it
                after = self.models[name].tier if name in self.models else "disk"
                result = replace(result, to_tier=after)
            result = replace(result, device=self.name, boot_id=self.boot_id)
            self.results[op_id] = result
            while len(self.results) > OP_CACHE:
                self.results.popitem(last=False)
            self.ops_done += 1
            return result

    def _run(self, cmd: P.Command, op_id: str) -> P.CommandResult:
        name = P.command_model(cmd)
        if self._stopping:
            raise AdapterError(
                P.NOT_AVAILABLE,
                f"model {name!r}: the device host {self.name} is stopping; {P.command_op(cmd)} not run",
            )
        r = self.models.get(name)
        if isinstance(cmd, P.Load):
            if r is not None and r.spec != cmd.model:
                # another checkpoint, adapter or budget under the same name (a config changed across a
                # manager restart, while this host kept running): the old weights go, the new ones load
                logger.info("device %s: model %s changed its spec; reloading it", self.name, name)
                self._drop(r, op_id)
                r = None
            if r is None:
                return self._load(cmd, op_id)
            if r.tier == cmd.tier:
                return self._noop(r, "load", op_id)
            return self._promote(r, op_id, "load") if cmd.tier == "gpu" else self._demote(r, op_id, "load")
        if isinstance(cmd, P.Drop):
            if r is None:
                return P.CommandResult(
                    op_id, name, "drop", True, "disk", "disk", noop=True, memory_released=True
                )
            return self._drop(r, op_id)
        if r is None:
            raise AdapterError(
                P.BAD_TRANSITION,
                f"model {name!r}: not resident on {self.name}; {P.command_op(cmd)} needs it in a tier "
                "(load it first)",
            )
        if isinstance(cmd, P.Promote):
            return self._noop(r, "promote", op_id) if r.tier == "gpu" else self._promote(r, op_id, "promote")
        return self._noop(r, "demote", op_id) if r.tier == "host" else self._demote(r, op_id, "demote")

    def _check_device(self, model: str) -> None:
        missing = self._cuda_missing()
        if missing is not None:
            raise AdapterError(P.NOT_AVAILABLE, f"model {model!r}: {missing}")

    def _cuda_missing(self) -> str | None:
        """Why this CUDA device cannot be used here (CUDA not available, or its index past the GPUs
        this process sees: every CUDA call on it would fail "invalid device ordinal"); None when it
        can, and for a CPU device."""
        if self.kind != "cuda":
            return None
        if not torch.cuda.is_available():
            return (
                f"device {self.name!r} is a CUDA device but CUDA is not available on node {self.node!r} "
                f"(torch {torch.__version__}, cuda={torch.version.cuda})"
            )
        visible = torch.cuda.device_count()
        # (none visible while CUDA is said available is torch contradicting itself, as only a fake of
        # is_available does: the count is not trusted then)
        if visible and self.index >= visible:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            return (
                f"device {self.name!r} is CUDA device index {self.index} but this process sees "
                f"{visible} GPU{'' if visible == 1 else 's'} on node {self.node!r} (indexes 0 to "
                f"{visible - 1}; "
                + ("CUDA_VISIBLE_DEVICES is not set" if cvd is None else f"CUDA_VISIBLE_DEVICES={cvd!r}")
                + "): fix the device's index in the config, or the GPUs made visible to it"
            )
        return None

    def _noop(self, r: _Resident, op: P.OpName, op_id: str) -> P.CommandResult:
        return P.CommandResult(op_id, r.spec.name, op, True, r.tier, r.tier, noop=True, footprint=self._fp(r))

    def _forget_partial(self, name: str, before: P.TierName) -> None:
        r = self.models.get(name)
        if r is not None and (before == "disk" or (r.runnable is None and r.host is None)):
            del self.models[name]

    def _release(self, after: str) -> None:
        """Memory freed just now handed back (`MemoryProbe.release`), `after` naming what freed it:
        after a failed load or promote, the memory it took (freed with what it built: CUDA's caching
        allocator kept it, so every later measurement of a footprint against the device's memory in
        use, and its free memory in `status`, would have been off by it); after a CUDA promote, the
        pinned host copy it let go of (torch's pinned host cache kept it page-locked in the process
        until some later drop or demote). A failure is logged, not raised: the command's result holds
        (a CUDA that is gone is said by the next command's own error)."""
        try:
            self.probe.release()
        except Exception as e:
            logger.debug("device %s: after %s, no release: %r", self.name, after, e)

    def _adapter(self, spec: P.ModelSpec) -> Adapter:
        adapter = self.adapter_factory(spec, self.torch_device)
        adapter.prepare()
        return adapter

    def _check_size(self, spec: P.ModelSpec, adapter: Adapter) -> None:
        if spec.budget_bytes is None:
            return
        size = 0
        for p in adapter.disk_paths():
            try:
                size += p.stat().st_size
            except FileNotFoundError:
                raise AdapterError(P.MISSING_CHECKPOINT, f"model {spec.name!r}: {p}: no such file") from None
            except (OSError, ValueError) as e:  # a name too long, a NUL byte in it (INTERNAL before)
                raise AdapterError(P.BAD_CHECKPOINT, f"model {spec.name!r}: {_unusable(p, e)}") from None
        if size > spec.budget_bytes:
            raise AdapterError(
                P.TOO_LARGE,
                f"model {spec.name!r}: its checkpoint is {size} bytes, more than its device budget "
                f"({spec.budget_bytes} bytes on {self.name})",
            )

    def _source(self, adapter: Adapter) -> str:
        fracs = [cached_fraction(p) for p in adapter.disk_paths() if _is_file(p)]
        if not fracs or any(f is None for f in fracs):
            return "disk"
        return "cached" if min(f for f in fracs if f is not None) >= CACHED_AT else "disk"

    def _bounded(self, what: str, spec: P.ModelSpec, fn: Callable[[], T]) -> T:
        """`fn()` (a load's or promote's work, which runs the model's own code: its factory, its
        reads) on a thread of its own, waited for at most `load_timeout_s` (or the longer time the
        model's spec allows), or until the host stops.
        One that hangs fails its command (LOAD_TIMEOUT; NOT_AVAILABLE at a stop) instead of holding
        the device's commands, or the process's stop, for good; what it makes, if it ever ends, is
        thrown away (until then, what it holds stays held, so no other load or promote of that model
        starts meanwhile: it is refused at once, naming the one still running)."""
        model = spec.name
        with self._work_lock:
            if self._stopping:
                raise AdapterError(
                    P.NOT_AVAILABLE,
                    f"model {model!r}: the device host {self.name} is stopping; {what} not run",
                )
            running = self._work.get(model)
            if running is not None:
                raise AdapterError(
                    P.LOAD_TIMEOUT,
                    f"model {model!r}: its abandoned {running.what} on {self.name} is still running "
                    f"({time.monotonic() - running.started:.0f} s, a factory or a read that hangs?) and may "
                    f"still hold memory; no other {what} of it starts until that one ends",
                )
            work = self._work[model] = _Work(what, time.monotonic())
        box: list[tuple[bool, Any]] = []

        def done(ok: bool, value: Any) -> None:  # (on the work's thread)
            with self._work_lock:
                if self._work.get(model) is work:
                    del self._work[model]
                late = work.abandoned
                if not late:
                    box.append((ok, value))
            work.wake.set()
            if late:  # nobody takes what it made: it goes with this frame
                logger.warning(
                    "device %s: the abandoned %s of %s ended after %.1f s (%s); what it made is thrown away",
                    self.name, what, model, time.monotonic() - work.started,
                    "done" if ok else f"failed: {value!r}",
                )  # fmt: skip

        start_on_thread(fn, f"residency-{what}-{self.name}-{model}", done)
        limit = max(self.load_timeout_s, spec.load_timeout_s or 0.0)
        work.wake.wait(limit)
        with self._work_lock:  # under the lock: it either ended in time, or its end finds it abandoned
            work.abandoned = gave_up = not box
            stopping = self._stopping
        if gave_up:
            if stopping:  # said by `stop`, naming the model and the device
                raise AdapterError(
                    P.NOT_AVAILABLE,
                    f"model {model!r}: {what} abandoned on {self.name}: the device host is stopping",
                )
            logger.error("device %s: %s of %s did not finish within %g s; abandoned", self.name, what,
                         model, limit)  # fmt: skip
            raise AdapterError(
                P.LOAD_TIMEOUT,
                f"model {model!r}: {what} did not finish within {limit:g} s on {self.name} "
                "(a factory or a read that hangs?); abandoned, the device's other commands go on",
            )
        ok, value = box.pop()
        if ok:
            return value  # type: ignore[no-any-return]
        # what the failed work built (a module half-way to the device) goes now: its frames' locals
        # were kept by the error's traceback, which its thread's frame holds in a reference cycle (freed
        # only by a garbage collection, the device memory with it)
        traceback.clear_frames(value.__traceback__)
        try:
            raise value
        finally:
            del value  # no cycle through this frame: what the failed work held goes with the error

    def abandoned(self) -> dict[str, tuple[str, float]]:
        """Loads and promotes given up that still run, by model: (load or promote, seconds running).
        Their threads cannot be killed: what they hold stays held until they end, or the process."""
        now = time.monotonic()
        with self._work_lock:
            return {m: (w.what, now - w.started) for m, w in self._work.items() if w.abandoned}

    def describing(self) -> list[tuple[str, float]]:
        """The describes whose threads still run (a factory that hangs, past its limit or not): the
        model and the seconds each has run, oldest first. Like an abandoned load, a thread that cannot
        be killed: it ends by itself, or with the process."""
        return [(str(model), secs) for model, secs in self._describing.running()]

    def stop(self, grace_s: float = 0.0) -> None:
        """The host stops taking commands (each is answered NOT_AVAILABLE, "stopping"); the load or
        promote a command waits for is given `grace_s` to end (most take a second: one cut short
        would leave its thread inside the model's native code while the process exits, which can
        abort it), then given up (its command answers at once), not waited for: its thread is left
        to the process's end. What is abandoned so is logged, naming the model, and so is a describe
        still running (not waited for: nothing waits for its answer at a stop)."""
        deadline = time.monotonic() + grace_s
        with self._work_lock:
            self._stopping = True
            works = list(self._work.items())
        for model, secs in self.describing():
            logger.warning(
                "device %s: stopping with the describe of %s still running (%.0f s); it is left to the "
                "process's end", self.name, model, secs,
            )  # fmt: skip
        for model, w in works:
            if w.abandoned:
                logger.warning(
                    "device %s: stopping with the abandoned %s of %s still running (%.0f s); it is left "
                    "to the process's end", self.name, w.what, model, time.monotonic() - w.started,
                )  # fmt: skip
                continue
            w.wake.wait(max(0.0, deadline - time.monotonic()))  # (set when it ends)
            with self._work_lock:
                running = self._work.get(model) is w
            if running:
                logger.warning(
                    "device %s: stopping: the %s of %s (running %.1f s) is abandoned, not waited for; "
                    "its thread is left to the process's end", self.name, w.what, model,
                    time.monotonic() - w.started,
                )  # fmt: skip
            w.wake.set()

    def _load(self, cmd: P.Load, op_id: str) -> P.CommandResult:
        r, source, ph, t0, used0, rss0 = self._bounded("load", cmd.model, lambda: self._build(cmd))
        self.models[r.spec.name] = r
        # its own build now says what it declares (a kept answer may be stale)
        self._describing.forget(r.spec.name)
        result = self._result(
            r, op_id, "load", "disk", ph, t0, used0, rss0, moved=r.read_bytes, source=source
        )
        if self.kind == "cuda" and r.tier == "gpu":  # the pinned host buffer its checkpoint was read
            self._release_host(f"the load of {r.spec.name}")  # into, let go of: handed back
        return result

    def _release_host(self, after: str) -> None:
        """The probe's pinned host cache handed back (`CudaProbe.release_host`), alone: not a whole
        `release`, which would wait for every stream of the device (other models' forwards) and empty
        its memory cache after the load was measured by it. Logged, not raised, as `_release`."""
        release_host = getattr(self.probe, "release_host", None)
        if release_host is None:
            return
        try:
            release_host()
        except Exception as e:
            logger.debug("device %s: after %s, no release of pinned host memory: %r", self.name, after, e)

    def _build(self, cmd: P.Load) -> tuple[_Resident, str, Phases, float, int, int]:
        """A load's work, apart from the host's books: the model in its tier, with how it was measured."""
        spec = cmd.model
        adapter = self._adapter(spec)
        self._check_size(spec, adapter)
        source = self._source(adapter)
        ph, t0, used0, rss0 = Phases(), time.perf_counter(), self.probe.used(), rss_bytes()
        host = adapter.read(ph)
        if cmd.tier != "gpu":  # (a load to the device checks it as it builds the runnable)
            adapter.check_host_copy(host, ph)
        r = _Resident(spec, adapter, "host", host=host, tensor_bytes=host.nbytes, host_bytes=host.nbytes)
        r.read_bytes = host.nbytes
        del host
        if cmd.tier == "gpu":
            self._place(r, self._materialize(r, ph))
        try:
            self._check_budget(r, used0)
        except AdapterError:
            r.runnable = None  # unloaded: its memory goes now, not when the error is let go
            raise
        return r, source, ph, t0, used0, rss0

    def _materialize(self, r: _Resident, ph: Phases) -> Any:
        """The host copy built on the device and warmed up (the model itself does not change)."""
        if r.host is None:
            raise AdapterError(P.INTERNAL, f"model {r.spec.name!r}: no host copy to promote on {self.name}")
        runnable = r.adapter.materialize(r.host, ph)
        with ph.phase("warmup"):
            r.adapter.warmup(runnable)
        return runnable

    def _place(self, r: _Resident, runnable: Any) -> None:
        """The model in the gpu tier as `runnable` (built and warmed up by `_materialize`)."""
        r.runnable = runnable
        r.host = None  # the host copy goes: on CUDA its pinned memory is freed, on CPU the module owns it
        r.tier = "gpu"
        r.tensor_bytes = r.adapter.runnable_bytes(r.runnable)
        r.host_bytes = 0

    def _check_budget(self, r: _Resident, used0: int) -> None:
        budget = r.spec.budget_bytes
        if budget is None:
            return
        took = self.probe.used() - used0 if self.kind == "cuda" else r.tensor_bytes
        if r.tier == "gpu" and max(took, r.tensor_bytes) > budget:
            raise AdapterError(
                P.TOO_LARGE,
                f"model {r.spec.name!r}: takes {max(took, r.tensor_bytes)} bytes on {self.name}, more than "
                f"its device budget ({budget} bytes); unloaded",
            )

    def _promote(self, r: _Resident, op_id: str, op: P.OpName) -> P.CommandResult:
        ph, t0, used0, rss0 = Phases(), time.perf_counter(), self.probe.used(), rss_bytes()
        moved, held = r.host_bytes, r.host
        # built on a thread of its own (bounded): a promote abandoned there never changes the model
        self._place(r, self._bounded("promote", r.spec, lambda: self._materialize(r, ph)))
        try:
            self._check_budget(r, used0)
        except AdapterError:
            # too large on the device: back to the host tier, as the model was before the promote,
            # with the host copy it had (a copy of the built module would hold its computed buffers)
            with r.lock:  # an inference that started on it ends first; none starts after
                r.runnable = None
            r.host, r.tier, r.host_bytes, r.tensor_bytes, r.device_bytes = held, "host", moved, moved, 0
            raise
        del held  # the host copy goes (on CUDA its pinned memory is freed, on CPU the module owns it)
        result = self._result(r, op_id, op, "host", ph, t0, used0, rss0, moved=moved, source="host")
        if self.kind == "cuda":  # (after its measurement, which stays as a load's to the gpu tier is)
            self._release(f"the {op} of {r.spec.name}")
        return result

    def _demote(self, r: _Resident, op_id: str, op: P.OpName) -> P.CommandResult:
        with self.world.closing(r.spec.name), r.lock:  # its sessions end, its running inference too
            ph, t0, used0, rss0 = Phases(), time.perf_counter(), self.probe.used(), rss_bytes()
            # the bytes its demote gives back to the device: its tensors' at most (`device_bytes` of a
            # first CUDA load also counts one-off runtime memory, cuBLAS workspaces and kernels loaded
            # lazily, which no demote gives back: its demote waited the whole release wait for them,
            # said unreleased); its measure where that is less (what the device was seen to take)
            freed = min(r.device_bytes, r.tensor_bytes)
            r.host = r.adapter.to_host(r.runnable, ph)
            r.runnable = None
            r.tier = "host"
            r.host_bytes = r.host.nbytes
            r.tensor_bytes = r.host_bytes
        released: bool | None = None
        if self.kind == "cuda":
            with ph.phase("release"):
                released, _ = wait_released(self.probe, used0, freed, timeout_s=self.release_timeout_s)
        return self._result(r, op_id, op, "gpu", ph, t0, used0, rss0, moved=r.host_bytes, released=released)

    def _drop(self, r: _Resident, op_id: str) -> P.CommandResult:
        ph, t0, used0, rss0 = Phases(), time.perf_counter(), self.probe.used(), rss_bytes()
        name, before = r.spec.name, r.tier
        # the bytes its drop gives back to the device: on CUDA a host-tier model's are pinned host
        # memory, not the device's (its drop waited the whole release wait for them, said unreleased)
        expected = 0 if self.kind == "cuda" and before != "gpu" else r.tensor_bytes
        # its sessions end, and none opens, while its weights go; its running inference ends first
        with self.world.closing(name), r.lock:
            del self.models[name]
            r.runnable = r.host = None
        del r
        with ph.phase("release"):
            released, _ = wait_released(self.probe, used0, expected, timeout_s=self.release_timeout_s)
        return P.CommandResult(
            op_id, name, "drop", True, before, "disk",
            timing=self._timing(ph, t0), memory_released=released,
            footprint=P.Footprint(rss_delta_bytes=rss_bytes() - rss0),
        )  # fmt: skip

    def _allocator(self) -> tuple[int | None, int | None]:
        if isinstance(self.probe, CudaProbe):
            stats = self.probe.allocator_stats()
            return stats["allocated_bytes"], stats["reserved_bytes"]
        return None, None

    def _fp(self, r: _Resident) -> P.Footprint:
        return P.Footprint(r.tensor_bytes, r.device_bytes, r.host_bytes, 0)

    def _timing(self, ph: Phases, t0: float) -> P.Timing:
        return P.Timing(
            read_s=ph.get("read"),
            deserialize_s=ph.get("deserialize"),
            to_device_s=ph.get("to_device"),
            warmup_s=ph.get("warmup"),
            release_s=ph.get("release"),
            total_s=time.perf_counter() - t0,
        )

    def _result(
        self, r: _Resident, op_id: str, op: P.OpName, frm: P.TierName, ph: Phases, t0: float,
        used0: int, rss0: int, *, moved: int, source: str | None = None, released: bool | None = None,
    ) -> P.CommandResult:  # fmt: skip
        timing = self._timing(ph, t0)
        if r.tier == "gpu":
            # on CUDA, what the device's memory in use grew by, and never less than its tensors: memory
            # freed meanwhile (another process's, a session's cache emptied on another thread) would
            # have it booked smaller than it is
            r.device_bytes = (
                max(self.probe.used() - used0, r.tensor_bytes) if self.kind == "cuda" else r.tensor_bytes
            )
        else:
            r.device_bytes = 0
        return P.CommandResult(
            op_id, r.spec.name, op, True, frm, r.tier, timing=timing, bytes_moved=moved,
            footprint=P.Footprint(
                r.tensor_bytes, r.device_bytes, r.host_bytes, rss_bytes() - rss0, *self._allocator()
            ),
            memory_released=released, source=source,
            power_w=nvml_power_w(self.index) if self.kind == "cuda" else None,
        )  # fmt: skip

    # ---- data plane

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> P.InferResult:
        """Run one inference on a model in the gpu tier. Never raises."""
        got = self._call(model, inputs)
        if isinstance(got, P.InferResult):
            return got
        out, took, held, carried = got
        return _answer(model, out, carried, took, held)

    def infer_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> list[P.InferResult]:
        """Run several requests (a batch that queued together), results in their order. For a model
        with dynamic batching on (`max_batch` > 1), the requests that fit together run as one call
        (`workers.batching`); the others, and every other model's, one by one. Never raises."""
        results: list[P.InferResult | None] = [None] * len(items)
        by_model: dict[str, list[int]] = {}
        for i, (model, _) in enumerate(items):
            by_model.setdefault(model, []).append(i)
        for model, idx in by_model.items():
            limit = self._max_batch(model) if len(idx) > 1 else 1
            for group in batching.plan([items[i][1] for i in idx], limit):
                ids = [idx[g] for g in group]
                if len(ids) == 1:
                    results[ids[0]] = self.infer(model, items[ids[0]][1])
                    continue
                for i, res in zip(ids, self._infer_batch(model, [items[i][1] for i in ids]), strict=True):
                    results[i] = res
        return [r for r in results if r is not None]

    def _max_batch(self, model: str) -> int:
        """Rows one call of `model` may take: its config's `max_batch` when its adapter batches and its
        declared inputs and outputs all have a variable first dimension, at most the rows its adapter
        takes in one call (`Adapter.max_rows`: a bigger stack was one call refused, then each request
        run again alone); else 1 (said once)."""
        r = self.models.get(model)
        if r is None or r.runnable is None:
            return 1
        if r.max_batch is None:
            r.max_batch = 1
            want = r.spec.max_batch
            if want > 1:
                specs = [*r.adapter.inputs(), *r.adapter.outputs()]
                if not r.adapter.batchable:
                    why = f"its adapter {r.adapter.name!r} does not batch requests"
                elif any(not t.shape or t.shape[0] != -1 for t in specs):
                    why = "not every declared input and output has a variable first (batch) dimension"
                else:
                    r.max_batch, why = want, ""
                    most = r.adapter.max_rows
                    if most is not None and want > most:
                        r.max_batch = max(most, 1)
                        logger.warning(
                            "model %s: max_batch %d lowered to %d: its adapter %r takes at most %d rows "
                            "a call", model, want, r.max_batch, r.adapter.name, most,
                        )  # fmt: skip
                if why:
                    logger.warning(
                        "model %s: max_batch %d ignored: %s; one request per call", model, want, why
                    )
        return r.max_batch

    def _infer_batch(self, model: str, inputs: list[dict[str, np.ndarray]]) -> list[P.InferResult]:
        """`inputs` (one signature) stacked into one call and split again. When the call fails or its
        outputs do not split by rows, each request runs alone, so each gets its own answer."""
        stacked, rows = batching.stack(inputs)
        got = self._call(model, stacked)
        if isinstance(got, P.InferResult):
            return [self.infer(model, x) for x in inputs]
        parts = batching.split(got[0], rows)
        r = self.models.get(model)
        if parts is None:
            if r is not None:
                r.max_batch = 1
            logger.warning(
                "model %s: its outputs do not have one row per input row; dynamic batching off", model
            )
            return [self.infer(model, x) for x in inputs]
        _, took, held, carried = got
        total = sum(rows)
        if r is not None:
            r.inferences += len(inputs) - 1  # one per request, not one per call
        return [
            _answer(model, part, carried, took, held * n / total, n / total)
            for part, n in zip(parts, rows, strict=True)
        ]

    def _call(
        self, model: str, inputs: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float, float, dict[str, str]] | P.InferResult:
        """One call of a model in the gpu tier: (outputs, wall seconds, seconds held, the datatypes its
        outputs held in a carrier stand for: `Adapter.carried_outputs`), or an error."""
        r = self.models.get(model)
        if r is None or r.tier != "gpu" or r.runnable is None:
            where = "not resident" if r is None else f"in the {r.tier} tier"
            return P.InferResult(
                model, False, error_code=P.BAD_TRANSITION,
                error=f"model {model!r} is {where} on {self.name}; it must be in the gpu tier to infer",
            )  # fmt: skip
        runnable, adapter = r.runnable, r.adapter
        try:
            with r.lock:
                if r.runnable is not runnable:  # dropped or demoted while this request waited
                    return P.InferResult(
                        model, False, error_code=P.BAD_TRANSITION,
                        error=f"model {model!r} left the gpu tier on {self.name} before it could infer",
                    )  # fmt: skip
                t0 = time.perf_counter()  # the model's own time, not the wait for the lock
                c0 = time.thread_time()
                out = adapter.infer(runnable, inputs)
                t1 = time.perf_counter()
                c1 = time.thread_time()
                carried = adapter.carried_outputs()
        except AdapterError as e:
            return P.InferResult(model, False, error_code=e.code, error=e.message)
        except Exception as e:
            logger.exception("device %s: inference of %s failed", self.name, model)
            return P.InferResult(model, False, error_code=P.INTERNAL, error=f"model {model!r}: {e!r}")
        r.last_used = self.clock()
        r.inferences += 1
        # what the call held its caller's thread for, free of GIL waits behind other threads: its
        # CPU time on a CPU device; on CUDA the wall time (it may wait on the GPU)
        return out, t1 - t0, ((c1 - c0) if self.kind == "cpu" else t1 - t0), carried

    # ---- world sessions (workers.world)

    def session_open(
        self,
        model: str,
        session_id: str,
        kv_bytes: int,
        codec: str | None = "bf16",
        log_dir: str | None = None,
        resume: bool = False,
        resume_at: int | None = None,
    ) -> P.SessionReply:
        """Open (or, ``resume``, reopen from its saved state) a world session in ``log_dir`` (default: a
        directory of this host process's own, which a restarted host cannot find again)."""
        r = self.models.get(model)
        if r is None or r.tier != "gpu" or r.adapter.name != "worldpager-mg2":
            why = (
                "not a world model"
                if r is not None and r.adapter.name != "worldpager-mg2"
                else "not in the gpu tier"
            )
            return P.SessionReply(
                False, error_code=P.BAD_TRANSITION, error=f"model {model!r} is {why} on {self.name}"
            )
        path = Path(log_dir) if log_dir else self.session_root / session_id
        module = r.runnable

        def resident() -> bool:  # still this module in the gpu tier (a drop or demote may have run)
            return (
                module is not None
                and self.models.get(model) is r
                and r.tier == "gpu"
                and r.runnable is module
            )

        return self._session_call(
            lambda: self.world.open(
                model,
                module,
                session_id,
                kv_bytes,
                path,
                codec,
                resume=resume,
                resume_at=resume_at,
                resident=resident,
            )
        )

    def session_step(self, session_id: str, pose: tuple[float, float, float, float, float]) -> P.SessionReply:
        return self._session_call(lambda: self.world.step(session_id, pose))

    def session_resize(self, session_id: str, kv_bytes: int) -> P.SessionReply:
        return self._session_call(lambda: {"lease_bytes": self.world.resize(session_id, kv_bytes)})

    def session_close(self, session_id: str) -> P.SessionReply:
        return self._session_call(lambda: self.world.close(session_id))

    def _session_call(self, fn: Callable[[], dict[str, Any]]) -> P.SessionReply:
        try:
            return P.SessionReply(True, fn())
        except SessionNotOpen as e:
            return P.SessionReply(False, error_code=P.NO_SESSION, error=str(e.args[0] if e.args else e))
        except NotResident as e:
            return P.SessionReply(False, error_code=P.BAD_TRANSITION, error=str(e))
        except (KeyError, ValueError) as e:
            return P.SessionReply(False, error_code=P.BAD_INPUT, error=str(e.args[0] if e.args else e))
        except (LogFullError, LogInUse) as e:  # a full disk, a log another process has open: the
            # server's state, not the request's (UNAVAILABLE: it may pass)
            logger.warning("device %s: world session call refused: %s", self.name, e)
            return P.SessionReply(False, error_code=P.NOT_AVAILABLE, error=f"world session: {e}")
        except TransferError as e:  # the disk failed under the session (EIO, EFBIG): the path is logged,
            # not told to the client (where the server keeps its sessions)
            logger.error("device %s: world session call failed: %s", self.name, e)
            why = getattr(e.__cause__, "strerror", None) or str(e.__cause__ or e)
            return P.SessionReply(
                False,
                error_code=P.INTERNAL,
                error=f"world session: its log could not be written or read ({why})",
            )
        except Exception as e:  # a failed session call never kills the host
            logger.exception("device %s: world session call failed", self.name)
            return P.SessionReply(False, error_code=P.INTERNAL, error=f"world session: {e!r}")

    def describe(self, spec: P.ModelSpec) -> tuple[list[P.TensorSpec], list[P.TensorSpec]]:
        """A model's declared inputs and outputs (AdapterError for an unknown adapter).

        Reading them may build the module on the meta device, which runs the model's own factory: that
        runs on a thread of its own, waited for at most `describe_timeout_s`, so a factory that hangs
        answers LOAD_TIMEOUT naming the model instead of holding the caller (a Ray data thread) for
        good. One build a spec at a time: a describe of a spec whose build still runs waits for that one
        (within the limit counted from its start; past it, it fails at once) rather than start another.
        A successful answer is kept for its spec."""
        name = f"residency-describe-{self.name}-{spec.name}"
        work = self._describing.begin(spec.name, spec, lambda: self._describe_build(spec), name)
        try:
            work.wait()
        except TimedOut as e:
            if e.waited:
                logger.error("device %s: describe of %s did not finish within %g s; abandoned", self.name,
                             spec.name, self.describe_timeout_s)  # fmt: skip
            raise AdapterError(
                P.LOAD_TIMEOUT,
                f"model {spec.name!r}: reading its inputs and outputs (its factory, built on the meta "
                f"device) did not finish within {self.describe_timeout_s:g} s on {self.name} (a factory "
                "that hangs?); "
                + ("abandoned" if e.waited else "that build is still running, so no other is started"),
            ) from None
        if isinstance(work.error, AdapterError):
            raise AdapterError(
                work.error.code, work.error.message
            )  # a fresh one for each caller: the error is shared
        if work.error is not None:
            raise AdapterError(P.INTERNAL, f"model {spec.name!r}: describe failed: {work.error!r}")
        assert work.answer is not None
        return list(work.answer[0]), list(work.answer[1])  # copies: every caller gets lists of its own

    def _describe_build(self, spec: P.ModelSpec) -> tuple[list[P.TensorSpec], list[P.TensorSpec]]:
        """A describe's work (on its own thread): the resident model's adapter when it is this spec's."""
        r = self.models.get(spec.name)
        adapter = (
            r.adapter if r is not None and r.spec == spec else self.adapter_factory(spec, self.torch_device)
        )
        return adapter.inputs(), adapter.outputs()

    # ---- status

    def status(self) -> P.WorkerStatus:
        """What is resident, and the device's free and total memory: None where the device cannot be
        used here (CUDA missing, an index past the visible GPUs: said once in the log, since the
        status is read every few seconds; its commands say why, each)."""
        missing = self._cuda_missing()
        if missing is not None and missing != self._said_missing:
            logger.warning("device %s: %s; its status has no memory figures", self.name, missing)
        self._said_missing = missing
        free, total = (None, None) if missing is not None else self.probe.free_total()
        return P.WorkerStatus(
            device=self.name, kind=self.kind, node=self.node, pid=os.getpid(), started_at=self.started_at,
            models={
                n: P.ModelStatus(
                    n, r.spec.adapter, r.tier, r.tensor_bytes, r.device_bytes, r.host_bytes, r.last_used,
                    r.inferences, spec=r.spec,
                )
                for n, r in self.models.copy().items()  # a copy, in one C call: commands change it
            },
            ops_done=self.ops_done, device_free_bytes=free, device_total_bytes=total, rss_bytes=rss_bytes(),
            sessions=self.world.status(), boot_id=self.boot_id, abandoned=self.abandoned(),
        )  # fmt: skip
