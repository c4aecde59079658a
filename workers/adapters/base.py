"""What an adapter is: how one kind of model moves between tiers and how it infers.

A device host drives an adapter through four primitives, always in this order for a load:
`read` (disk → `HostCopy` in host RAM; pinned on CUDA), `materialize` (`HostCopy` → a runnable on the
device), `warmup` (one small inference), then `infer` any number of times; `to_host` (runnable →
`HostCopy`) demotes. Each primitive records its wall time in the `Phases` it is given (read,
deserialize, to_device, warmup). Adapters raise `AdapterError` with a protocol error code; the host
turns it into an error result. Each adapter declares its inputs and outputs in Open Inference
Protocol terms (`TensorSpec`), and `infer` takes and returns numpy arrays by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from manager.adapter_specs import ADAPTER_SPECS
from workers import protocol as P
from workers.measure import Phases, tensor_bytes


class AdapterError(Exception):
    """A failure with a protocol error code (workers.protocol) and a message naming the cause."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class HostCopy:
    """A model's bytes held in host RAM without its runtime set up (the host tier)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    blob: torch.Tensor | None = None
    """A serialized archive (TorchScript) as a uint8 tensor, for adapters that keep one."""

    @property
    def nbytes(self) -> int:
        n = tensor_bytes(self.tensors.values())
        return n + (int(self.blob.numel()) if self.blob is not None else 0)


class Adapter(ABC):
    """One model's adapter instance, bound to a device. Subclasses set `name` and `inputs`/`outputs`."""

    name: ClassVar[str]
    batchable: ClassVar[bool] = False
    """Its `infer` takes a batch of independent rows along the first dimension of every input and
    output, so a model config's `max_batch` > 1 may stack concurrent requests (workers.batching)."""
    max_rows: ClassVar[int | None] = None
    """The most rows its `infer` takes in one call (None: no limit of its own). A model's `max_batch`
    above it is lowered to it: a stack of more rows would be one call refused, then each request
    run again alone."""

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.pin = device.type == "cuda"

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Import the libraries this adapter needs (once per process; not counted as load time)."""

    # ---- declarations
    @abstractmethod
    def inputs(self) -> list[P.TensorSpec]: ...

    @abstractmethod
    def outputs(self) -> list[P.TensorSpec]: ...

    def carried_outputs(self) -> dict[str, str]:
        """The outputs declared in a datatype numpy has no dtype for, by name: that datatype (BF16). Its
        `infer` answers each as the datatype's carrier (`P.CARRIERS`: BF16's bit patterns in uint16),
        and the host labels it with the declared datatype, not the carrier's."""
        return {t.name: t.datatype for t in self.outputs() if t.datatype in P.CARRIERS}

    def disk_paths(self) -> list[Path]:
        """Files a disk load reads (to tell a page-cache load from a disk load)."""
        return []

    # ---- the model's `source`: read only through these, each key one of the adapter's in the
    # catalogue (manager.adapter_specs), which `config check` holds a config to
    def has_source(self, key: str) -> bool:
        """Whether the model's `source` sets `key`."""
        return self._catalogued(key) in self.spec.source

    def source_value(self, key: str, default: Any = None) -> Any:
        """`source.<key>` as the config gives it (`default` when it is not set)."""
        return self.spec.source.get(self._catalogued(key), default)

    def _catalogued(self, key: str) -> str:
        """`key`, if the catalogue lists it for this adapter (INTERNAL otherwise: a key `config check`
        would refuse to a user, read by the adapter's own code)."""
        entry = ADAPTER_SPECS.get(self.name)
        if entry is not None and entry.keys is not None and entry.key(key) is None:
            raise AdapterError(
                P.INTERNAL,
                f"model {self.spec.name!r}: adapter {self.name!r} reads source.{key}, which "
                "manager.adapter_specs does not list for it",
            )
        return key

    def source_str(self, key: str) -> str:
        v = self.source_value(key)
        if not isinstance(v, str) or not v:
            raise AdapterError(
                P.BAD_CHECKPOINT, f"model {self.spec.name!r}: source.{key} must be a non-empty string"
            )
        return v

    # ---- tier moves
    @abstractmethod
    def read(self, ph: Phases) -> HostCopy: ...

    def check_host_copy(self, host: HostCopy, ph: Phases) -> None:
        """What a load into host RAM alone checks of what `read` gave (a load to the device checks it
        as it builds the runnable): AdapterError when it could never run. Nothing, by default."""
        del host, ph

    @abstractmethod
    def materialize(self, host: HostCopy, ph: Phases) -> Any: ...

    @abstractmethod
    def to_host(self, runnable: Any, ph: Phases) -> HostCopy: ...

    @abstractmethod
    def runnable_bytes(self, runnable: Any) -> int: ...

    def warmup(self, runnable: Any) -> None:  # noqa: B027 - optional hook
        """One small inference; adapters without a cheap sample input skip it."""

    @abstractmethod
    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    # ---- helpers for subclasses
    def input_array(self, inputs: dict[str, np.ndarray], spec: P.TensorSpec) -> np.ndarray:
        """The named input, checked against its declared rank and fixed dimensions, and against the kind
        of its datatype (numbers for a number input, text for BYTES; BAD_INPUT naming it otherwise). A
        BOOL array must hold bytes 0 and 1 only (OIP's BOOL is one byte, numpy's and torch's bool):
        raw bytes `\x02` or `\xff` decode to a bool array that kernels may read as 2 or 255."""
        if spec.name not in inputs:
            raise AdapterError(
                P.BAD_INPUT, f"model {self.spec.name!r}: missing input {spec.name!r} ({spec.datatype})"
            )
        a = inputs[spec.name]
        kinds = _TEXT_KINDS if spec.datatype == "BYTES" else _NUMERIC_KINDS
        if not isinstance(a, np.ndarray) or a.dtype.kind not in kinds:
            # strings for a number input (or numbers for a text one) failed deep in torch or numpy: an
            # INTERNAL error with a traceback in the log, or numbers embedded as their text
            got = type(a).__name__
            if isinstance(a, np.ndarray):
                got = P.OIP_BY_NUMPY.get(str(a.dtype), str(a.dtype))
            raise AdapterError(
                P.BAD_INPUT,
                f"model {self.spec.name!r}: input {spec.name!r} has datatype {got}, expected {spec.datatype}",
            )
        if not spec.fits(a.shape):
            raise AdapterError(
                P.BAD_INPUT,
                f"model {self.spec.name!r}: input {spec.name!r} has shape {list(a.shape)}, "
                f"expected {list(spec.shape)} (-1: any)",
            )
        problem = spec.count_problem(a.shape) or spec.value_problem(a)
        if problem is not None:  # (the manager checked them before admission; a direct call may not)
            raise AdapterError(P.BAD_INPUT, f"model {self.spec.name!r}: {problem}")
        if a.dtype.kind == "b":
            _check_bool(self.spec.name, spec.name, a)
        if not a.flags.writeable and a.dtype.kind != "O":
            # Ray hands arrays over read-only (zero-copy from its object store): torch warned on each
            # ("The given NumPy array is not writable") and its tensor could write through to them
            a = a.copy()
        return a


_INTERPRETER = "The following operation failed in the TorchScript interpreter."


def one_line(e: BaseException) -> str:
    """What `e` says, without the TorchScript interpreter's traceback of the model's source (which an
    error raised inside a scripted module carries; its last line is the error itself)."""
    text = str(e)
    if not text.startswith(_INTERPRETER):
        return text
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1].removeprefix("builtins.") if len(lines) > 1 else text


def _check_bool(model: str, name: str, a: np.ndarray) -> None:
    """BAD_INPUT naming the input and the first element of the bool array `a` whose byte is not 0 or 1."""
    raw = a.view(np.uint8)
    bad = raw > 1
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AdapterError(
            P.BAD_INPUT,
            f"model {model!r}: input {name!r} (BOOL) holds byte {int(raw[at])} at {list(at)}; "
            "a BOOL element is the byte 0 (false) or 1 (true)",
        )


_NUMERIC_KINDS = frozenset("biuf")
"""numpy dtype kinds of numbers: bool, signed and unsigned integers, floats (not text, objects, dates)."""
_TEXT_KINDS = frozenset("OSU")
"""numpy dtype kinds a BYTES input comes in: objects (bytes or str items), bytes, str."""

# ---- nn.Module helpers: build without weights, then assign tensors read elsewhere

_FP8 = frozenset(
    d
    for d in (getattr(torch, n, None) for n in dir(torch) if n.startswith("float8_"))
    if isinstance(d, torch.dtype)
)
"""torch's 8-bit float dtypes: no ordinary op computes with them (a module must be built for them)."""


_meta = threading.local()
"""This thread's depth of `params_on_meta` blocks (other threads build real modules meanwhile)."""
_register_parameter = nn.Module.register_parameter


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _register_parameter(module, name, param)
    if getattr(_meta, "depth", 0) and param is not None and param.device.type != "meta":
        module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device (no memory, no init); buffers stay real.

    Buffers are small and often computed (position ids, rotary tables) and not in checkpoints.
    Only this thread's builds are affected: `nn.Module.register_parameter` is wrapped once, for good,
    by a wrapper that checks a thread-local flag (swapping the class attribute per build, as
    before, gave meta weights to modules another thread built meanwhile, and two overlapping builds
    could leave the swap in place for the whole process).
    """
    if nn.Module.register_parameter is not _register_on_meta:
        nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign,assignment]
    _meta.depth = getattr(_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _meta.depth -= 1


def check_tensors(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    model: str,
    ignore_prefixes: tuple[str, ...] = (),
    where: str = "",
) -> tuple[dict[str, list[str]], dict[str, torch.Tensor], dict[str, torch.dtype]]:
    """BAD_CHECKPOINT unless `tensors` fit `module` (built on meta: nothing is assigned): every
    parameter given (under one of its names), no tensor it does not have (but those ignored by
    prefix), each of its shape, and a dtype it can take. `where`: the checkpoint, named in the error.
    Returns what it read of the module: each parameter name's aliases (every name of a tied one),
    its buffers, and its parameters' dtypes."""
    head = f"model {model!r}: " + (f"{where}: " if where else "")
    aliases: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    params = {n: names for names in aliases.values() for n in names}
    buffers = dict(module.named_buffers())
    missing = sorted(names[0] for names in aliases.values() if not any(n in tensors for n in names))
    unexpected = sorted(
        n for n in tensors if n not in params and n not in buffers and not n.startswith(ignore_prefixes)
    )
    if missing or unexpected:
        raise AdapterError(
            P.BAD_CHECKPOINT,
            f"{head}checkpoint does not match the module: {len(missing)} missing "
            f"{missing[:4]}, {len(unexpected)} unexpected {unexpected[:4]}",
        )
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=False)}
    dtypes = {n: p.dtype for n, p in module.named_parameters(remove_duplicate=False)}
    shapes.update({n: tuple(b.shape) for n, b in buffers.items()})
    for name, t in tensors.items():
        if name not in params and name not in buffers:
            continue
        if shapes[name] != tuple(t.shape):
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"{head}tensor {name!r} has shape {list(t.shape)} in the checkpoint, "
                f"{list(shapes[name])} in the module",
            )
        if name in params and (dtypes[name] in _FP8 or t.dtype in _FP8) and dtypes[name] != t.dtype:
            # fp8 weights for a module built in another dtype loaded, then failed every request
            # BAD_INPUT ("mat1 and mat2 must have the same dtype ... Float8_e4m3fn"): no op here
            # computes in fp8 unless the module was written for it (scales, a scaled matmul)
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"{head}tensor {name!r} has dtype {t.dtype} in the checkpoint, "
                f"{dtypes[name]} in the module (8-bit float weights need a module built for them)",
            )
        if name in params and dtypes[name].is_floating_point != t.dtype.is_floating_point:
            # the tensor is assigned, not copied into the parameter: integer weights for a float module
            # (or the reverse) would load, then fail every request. Another float width is allowed: a
            # module built in fp32 may take an fp16/bf16 checkpoint (its inputs declared to match)
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"{head}tensor {name!r} has dtype {t.dtype} in the checkpoint, {dtypes[name]} in the module",
            )
    return params, buffers, dtypes


def assign_tensors(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    model: str,
    device: torch.device,
    ignore_prefixes: tuple[str, ...] = (),
    where: str = "",
) -> None:
    """Put `tensors` into `module` without copying (strict on parameters; shapes must match:
    `check_tensors`, first). Parameters missing from `tensors` are an error; buffers missing from it
    keep their computed values and move to `device`; tensors the module does not have are an error
    unless ignored by prefix."""
    # every name of each parameter: a tied one (an LM head sharing the embedding's weight) has several,
    # and a checkpoint holds it under one of them (safetensors' save_model keeps one)
    params, buffers, dtypes = check_tensors(
        module, tensors, model=model, ignore_prefixes=ignore_prefixes, where=where
    )
    done: set[str] = set()
    for name, t in tensors.items():
        if (name not in params and name not in buffers) or name in done:
            continue
        if name in params:
            shared = nn.Parameter(t, requires_grad=False)
            for alias in params[name]:  # one Parameter for every name of a tied one
                owner_name, _, attr = alias.rpartition(".")
                module.get_submodule(owner_name)._parameters[attr] = shared
                done.add(alias)
        else:
            owner_name, _, attr = name.rpartition(".")
            module.get_submodule(owner_name)._buffers[attr] = t
    for name, b in buffers.items():  # (one on meta has no values to move: said below)
        if name not in tensors and b.device != device and b.device.type != "meta":
            owner_name, _, attr = name.rpartition(".")
            module.get_submodule(owner_name)._buffers[attr] = b.to(device)
    empty = [n for n, p in module.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    empty += [n for n, b in module.named_buffers() if b.device.type == "meta"]
    head = f"model {model!r}: " + (f"{where}: " if where else "")
    if empty:  # a module that would compute on no weights at all
        raise AdapterError(P.BAD_CHECKPOINT, f"{head}no weights in the checkpoint for {sorted(empty)[:4]}")
    _unify_float_params(module, {d for d in dtypes.values() if d.is_floating_point}, head=head)


_UNIFIABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _unify_float_params(module: nn.Module, built: set[torch.dtype], *, head: str) -> None:
    """A module built in one float dtype, given a checkpoint that mixes float dtypes (fp16 weights with
    fp32 biases, an fp64 weight with an fp32 bias), gets all its float parameters in one dtype: the
    one most of its parameter elements have in the checkpoint (where two tie, the one both fit in).
    It loaded as it was and failed every request BAD_INPUT ("self and mat2 must have the same
    dtype"): no input dtype suits a layer whose weight and bias differ. Its declared inputs then go
    in as that dtype, as for a checkpoint in one other dtype. BAD_CHECKPOINT naming the tensor when
    a value does not fit that dtype (an fp32 value past fp16's range); a module built in several
    dtypes is left as it is (its forward is written for them). `head` begins an error's message
    (the model, and the checkpoint's file)."""
    if len(built) != 1:
        return
    groups: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if p.is_floating_point():
            groups.setdefault(id(p), []).append(n)
            params[id(p)] = p
    elements: dict[torch.dtype, int] = {}
    for p in params.values():
        elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    if len(elements) < 2 or not all(d in _UNIFIABLE for d in elements):
        return
    most = max(elements.values())
    target = functools.reduce(torch.promote_types, [d for d, n in elements.items() if n == most])
    mixed = ", ".join(
        f"{n} {str(d).removeprefix('torch.')} elements"
        for d, n in sorted(elements.items(), key=lambda kv: -kv[1])
    )
    for key, p in params.items():
        if p.dtype == target:
            continue
        names = groups[key]
        t = p.detach().to(target)
        if int(torch.isfinite(t).sum()) != int(torch.isfinite(p.detach()).sum()):
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"{head}the checkpoint mixes float dtypes ({mixed}); its parameters go in as "
                f"{str(target).removeprefix('torch.')}, the dtype of most of them, but tensor {names[0]!r} "
                f"({str(p.dtype).removeprefix('torch.')}) holds values beyond its range: save the "
                "checkpoint in one float dtype",
            )
        shared = nn.Parameter(t, requires_grad=False)
        for alias in names:  # one Parameter for every name of a tied one
            owner_name, _, attr = alias.rpartition(".")
            module.get_submodule(owner_name)._parameters[attr] = shared


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by name (detached; the tensors, not copies)."""
    out = {n: p.detach() for n, p in module.named_parameters()}
    out.update({n: b.detach() for n, b in module.named_buffers()})
    return out


def copy_tensors(
    tensors: dict[str, torch.Tensor], device: torch.device, *, pin: bool
) -> dict[str, torch.Tensor]:
    """Copy tensors to `device` (non-blocking from pinned memory) and wait until the copies are done."""
    if device.type == "cpu" and not pin:
        return dict(tensors)
    out = {}
    cuda = {device} if device.type == "cuda" else set()
    for n, t in tensors.items():
        if t.device.type == "cuda":
            cuda.add(t.device)
        if device.type == "cpu":
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            dst.copy_(t, non_blocking=True)
            out[n] = dst
        else:
            out[n] = t.to(device, non_blocking=True)
    # wait on each device the copies ran on: a bare synchronize() waits on the current device only
    # (cuda:0), so a model on cuda:1 was timed (and its demote handed back) before its copies ended
    for d in cuda:
        torch.cuda.synchronize(d)
    return out


class ModuleAdapter(Adapter):
    """An `nn.Module` whose weights come from one safetensors file (read with `workers.st_io`)."""

    ignore_prefixes: tuple[str, ...] = ()

    @abstractmethod
    def checkpoint(self) -> Path: ...

    @abstractmethod
    def build(self) -> nn.Module:
        """The module with parameters on meta (called inside `params_on_meta`)."""

    def disk_paths(self) -> list[Path]:
        return [self.checkpoint()]

    def read(self, ph: Phases) -> HostCopy:
        from workers.st_io import CheckpointError, read_safetensors

        path = self.checkpoint()
        with ph.phase("read"):
            try:
                tensors, _ = read_safetensors(path, pin=self.pin)
            except CheckpointError as e:
                code = P.MISSING_CHECKPOINT if _missing(path) else P.BAD_CHECKPOINT
                raise AdapterError(code, f"model {self.spec.name!r}: {e}") from None
        return HostCopy(tensors=tensors)

    def check_host_copy(self, host: HostCopy, ph: Phases) -> None:
        """The tensors read for the host tier put into the module (built on meta; they are shared, not
        copied) as a load to the device puts them (`assign_tensors`: names, shapes, dtypes, weights
        for every parameter, a mix of float dtypes within range), then the module is let go: a read
        into host RAM took a checkpoint that could never run (another module's names or shapes),
        held its bytes, and said the model's earlier failure was over."""
        with ph.phase("deserialize"):
            wanted = {n: t for n, t in host.tensors.items() if not n.startswith(self.ignore_prefixes)}
            assign_tensors(
                self._built_on_meta(), wanted, model=self.spec.name, device=torch.device("cpu"),
                ignore_prefixes=self.ignore_prefixes, where=self._where(),
            )  # fmt: skip

    def _where(self) -> str:
        """The checkpoint, as errors name it ("" for weights made, not read: the world stand-in's)."""
        files = self.disk_paths()
        return str(files[0]) if files else ""

    def _built_on_meta(self) -> nn.Module:
        """The module on meta (no memory); FACTORY_FAILED naming why when its factory fails."""
        try:
            with params_on_meta():
                return self.build()
        except AdapterError:
            raise
        except Exception as e:
            raise AdapterError(
                P.FACTORY_FAILED, f"model {self.spec.name!r}: building the module failed: {e!r}"
            ) from None

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        # tensors the module does not take (ignored by prefix: a pooler) are not copied to the device:
        # on CUDA they took device memory for nothing, and the allocator's cache kept it counted
        wanted = {n: t for n, t in host.tensors.items() if not n.startswith(self.ignore_prefixes)}
        with ph.phase("to_device"):
            dev = copy_tensors(wanted, self.device, pin=False)
        with ph.phase("deserialize"):
            module = self._built_on_meta()
            assign_tensors(
                module, dev, model=self.spec.name, device=self.device, ignore_prefixes=self.ignore_prefixes,
                where=self._where(),
            )  # fmt: skip
            module.eval()
        return module

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        with ph.phase("to_device"):
            tensors = copy_tensors(module_tensors(runnable), torch.device("cpu"), pin=self.pin)
        return HostCopy(tensors=tensors)

    def runnable_bytes(self, runnable: Any) -> int:
        return tensor_bytes(module_tensors(runnable).values())


def _missing(path: Path) -> bool:
    """No file at `path` (not one that cannot be named: a name too long or with a NUL byte is not
    missing but unusable, and asking `exists` raised for a name too long: an INTERNAL load error)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return False
