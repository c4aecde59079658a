"""A Python factory for an `nn.Module` plus a `.safetensors` file (`adapter: safetensors-module`).

`source: {factory: "package.module:callable", path: weights.safetensors, kwargs: {...}}`. The factory
is called with `kwargs` while parameters are on the meta device (no memory, no init), then the file's
tensors — read once into one buffer, pinned on CUDA — are assigned (strict: names and shapes must
match). One FP32 input `input` [batch, features], one FP32 output `output`; the module may set
`residency_inputs` / `residency_outputs` (lists of (name, datatype, shape)) to declare others.
A module whose float parameters all have one dtype other than an input's declared one (a bf16 or
fp16 checkpoint for a module built in fp32) gets that input, sent as declared, in its own dtype; its
outputs come back in their declared datatypes. A checkpoint mixing float dtypes (fp16 weights with
fp32 biases) for a module built in one has its float parameters put in one dtype at the load, the
one most of its weights have (`base.assign_tensors`): it failed every request BAD_INPUT before. BF16
(numpy has none) travels as its bit patterns in a uint16 array, both ways: a BF16 input reaches the
module as torch.bfloat16, bit for bit, and a BF16 output leaves it as bf16 bits, which the host
labels BF16 (`carried_outputs`), not UINT16. A forward answers a tensor, or a tuple with one tensor
per declared output (anything else is an error naming what it returned).
"""

from __future__ import annotations

import importlib
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from workers import protocol as P
from workers.adapters.base import AdapterError, ModuleAdapter, one_line, params_on_meta


def _import_from_serve_folder(name: str) -> Any:
    """Module `name`, imported as Python would, else from the folder the service runs in (the
    current one: a device host's, in process and on the local Ray alike, is the folder `serve` was
    started from). The `residency` console script puts its own folder first on `sys.path`, not the
    current one, so a `models/llm.py` beside the config was never found. That folder goes last on
    `sys.path` (an installed package, or the standard library, is never shadowed by a file there), and
    stays: what the factory imports later (a sibling module) is found too."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        top = name.partition(".")[0]
        if (
            e.name != top
            or here in sys.path
            or not (os.path.isdir(os.path.join(here, top)) or os.path.isfile(os.path.join(here, top + ".py")))
        ):
            raise
        sys.path.append(here)
        importlib.invalidate_caches()
        return importlib.import_module(name)


_FAILED_AT: dict[str, tuple[int, int] | None] = {}
"""Factory modules whose build failed: the file as it was then (its modification time and size)."""


def _file_stamp(mod: Any) -> tuple[int, int] | None:
    """The imported module's file as it is now (its modification time and size); None without one."""
    file = getattr(mod, "__file__", None)
    try:
        st = os.stat(file) if file else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st is not None else None


def _failed_build(name: str) -> None:
    """The module `name`'s factory failed to build: its file as it is now is noted, so that the next
    load reads it again once it has changed (`_fresh_import`)."""
    mod = sys.modules.get(name)
    if mod is not None:
        _FAILED_AT[name] = _file_stamp(mod)


def _fresh_import(name: str) -> None:
    """Forget the imported module `name` when its build failed and its file changed since: Python
    keeps a module (sys.modules), so a factory fixed on disk was never read again, and every load
    failed as the first did until a restart. A file unchanged (the fix was in the config's kwargs)
    is not imported again: its top-level code (a custom op it registers) runs once."""
    if name not in _FAILED_AT:
        return
    mod = sys.modules.get(name)
    if mod is None or _file_stamp(mod) != _FAILED_AT[name]:
        _FAILED_AT.pop(name, None)
        if mod is not None and getattr(mod, "__file__", None):  # (one made in code has no file to read)
            sys.modules.pop(name, None)
            importlib.invalidate_caches()


class SafetensorsModuleAdapter(ModuleAdapter):
    name = "safetensors-module"
    batchable = True

    def checkpoint(self) -> Path:
        return Path(self.source_str("path"))

    def factory(self) -> Any:
        ref = self.source_str("factory")
        mod_name, sep, attr = ref.partition(":")
        if not sep or not mod_name or not attr:
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: source.factory {ref!r}: expected 'module:callable'",
            )
        _fresh_import(mod_name)
        try:
            mod = _import_from_serve_folder(mod_name)
        except (Exception, SystemExit) as e:  # a script's module may sys.exit() at import: not the host
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: cannot import factory module {mod_name!r}: {e!r}",
            ) from None
        fn = getattr(mod, attr, None)
        if not callable(fn):
            _failed_build(mod_name)  # (a typo fixed in its file: read again once changed)
            raise AdapterError(P.FACTORY_FAILED, f"model {self.spec.name!r}: {ref!r} is not a callable")
        return fn

    def prepare(self) -> None:
        self.factory()

    def build(self) -> nn.Module:
        kwargs = self.source_value("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise AdapterError(P.FACTORY_FAILED, f"model {self.spec.name!r}: source.kwargs must be a mapping")
        fn = self.factory()
        try:
            return self._built(fn, kwargs)
        except BaseException:
            _failed_build(self.source_str("factory").partition(":")[0])  # (read again once changed)
            raise

    def _built(self, fn: Any, kwargs: dict[str, Any]) -> nn.Module:
        try:
            module = fn(**kwargs)
        except SystemExit as e:  # the host's process is not the factory's to end
            raise AdapterError(
                P.FACTORY_FAILED, f"model {self.spec.name!r}: the factory exited (SystemExit: {e})"
            ) from None
        if not isinstance(module, nn.Module):
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: factory returned {type(module).__name__}, not an nn.Module",
            )
        if isinstance(module, torch.jit.ScriptModule):
            # its parameters cannot be replaced by the file's tensors (its load failed INTERNAL with
            # "get_submodule is not supported on ScriptModules" and a traceback in the log)
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: factory returned a TorchScript module ({type(module).__name__}); "
                "this adapter takes a plain nn.Module (a TorchScript archive: adapter torchscript)",
            )
        self._declared = (
            self._declaration(module, "residency_inputs"),
            self._declaration(module, "residency_outputs"),
        )
        return module

    def _declaration(self, module: nn.Module, attr: str) -> list[P.TensorSpec] | None:
        """The module's `attr` as tensor specs; FACTORY_FAILED at the load when it is not a list of
        (name, datatype, shape) (it failed every request INTERNAL before)."""
        declared = getattr(module, attr, None)
        if not declared:
            return None
        try:
            specs = [P.TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in declared]
        except (TypeError, ValueError) as e:
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: its module's {attr} {declared!r} is not a list of "
                f"(name, datatype, shape): {e}",
            ) from None
        for t in specs:  # ModelMetadata would advertise a datatype that every request is refused
            if t.datatype not in _DECLARABLE:
                raise AdapterError(
                    P.FACTORY_FAILED,
                    f"model {self.spec.name!r}: its module's {attr} declares {t.name!r} as {t.datatype!r}; "
                    f"an Open Inference Protocol datatype is one of {', '.join(_DECLARABLE)}",
                )
        return specs

    def _specs(self, which: int, default: P.TensorSpec) -> list[P.TensorSpec]:
        if not hasattr(self, "_declared"):
            # not built yet (a model in the host or disk tier, or asked for its metadata only): build
            # it once on the meta device, which takes no memory, to read what it declares
            # (the load builds it the same way, so a factory that fails here fails its load too; the
            # error is not kept, so a module put in place later is read at the next call)
            try:
                with params_on_meta():
                    self.build()
            except AdapterError:
                raise
            except Exception as e:  # before: guessed `input`/`output` tensors, kept by the describer
                raise AdapterError(
                    P.FACTORY_FAILED, f"model {self.spec.name!r}: its factory failed: {e!r}"
                ) from None
        declared = getattr(self, "_declared", (None, None))[which]
        return declared or [default]

    def inputs(self) -> list[P.TensorSpec]:
        return self._specs(0, P.TensorSpec("input", "FP32", (-1, -1)))

    def outputs(self) -> list[P.TensorSpec]:
        return self._specs(1, P.TensorSpec("output", "FP32", (-1, -1)))

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ins = self.inputs()
        compute = _compute_dtype(runnable)
        args = []
        for s in ins:
            a = np.ascontiguousarray(self.input_array(inputs, s))
            if s.datatype == "BF16" and a.dtype == _BF16_CARRIER:  # its bit patterns: as torch's bf16
                t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(self.device)
            else:
                t = torch.as_tensor(a, device=self.device)
            if compute is not None and t.is_floating_point() and t.dtype != compute and _is_declared(s, a):
                # a module given bf16/fp16 weights (the factory built it in fp32) computes in that dtype:
                # the FP32 input it declares failed every request BAD_INPUT ("mat1 and mat2 must have
                # the same dtype"). The declared input goes in as the module's dtype, as outputs come
                # back in their declared one.
                t = t.to(compute)
            args.append(t)
        with torch.inference_mode():
            try:
                y = runnable(*args)
            except (
                RuntimeError,
                ValueError,
                TypeError,
                IndexError,
                AssertionError,
                torch.jit.Error,
            ) as e:  # IndexError: an id past a vocabulary; AssertionError: a forward's check of its input;
                # torch.jit.Error: a scripted submodule's own raise (with the interpreter's traceback)
                raise AdapterError(
                    P.BAD_INPUT, f"model {self.spec.name!r}: inference failed: {one_line(e)}"
                ) from None
        outs = self.outputs()
        ys = y if isinstance(y, tuple | list) else (y,)
        if len(ys) < len(outs) or not all(isinstance(t, torch.Tensor) for t in ys[: len(outs)]):
            # a dict, None or too few tensors failed INTERNAL with a bare AttributeError (and a
            # traceback in the log) on every request
            got = (
                type(y).__name__
                if not isinstance(y, tuple | list)
                else (f"{type(y).__name__} of {[type(t).__name__ for t in ys]}")
            )
            raise AdapterError(
                P.INTERNAL,
                f"model {self.spec.name!r}: its module returned {got}; expected a tensor for each declared "
                f"output {[s.name for s in outs]} (a tensor, or a tuple of them in that order)",
            )
        declared = getattr(self, "_declared", (None, None))[1] is not None
        for s, t in zip(outs, ys, strict=False):
            if not s.fits(t.shape):
                # an answer of another shape than its ModelMetadata says was sent as it was: the
                # declared one, and the default `output` [-1, -1] too (rank 2: an undeclared module's
                # rank-1 answer reached clients that had sized it from the metadata)
                says = (
                    f"it declares {list(s.shape)} (-1: any)"
                    if declared
                    else f"it declares none, and the default is {list(s.shape)} (rank {len(s.shape)}): "
                    "declare what it returns with the module's `residency_outputs` "
                    "[(name, datatype, shape)]"
                )
                raise AdapterError(
                    P.INTERNAL,
                    f"model {self.spec.name!r}: its module returned output {s.name!r} of shape "
                    f"{list(t.shape)}; {says}",
                )
        return {s.name: self._as_declared(s, t) for s, t in zip(outs, ys, strict=False)}

    def _as_declared(self, spec: P.TensorSpec, t: torch.Tensor) -> np.ndarray:
        """An output in its declared datatype (a bf16 or fp16 module still answers FP32 when it says
        FP32; numpy has no bf16 at all, nor fp8: a BF16 output is its bit patterns in uint16, which
        the host labels BF16)."""
        if t.is_complex():  # cast to its declared datatype, it kept its real part alone
            raise AdapterError(P.INTERNAL, P.complex_output(self.spec.name, spec.name, t.dtype))
        t = t.detach().cpu()
        if spec.datatype == "BF16":  # it was sent as FP32, against what ModelMetadata said
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(_BF16_CARRIER)
        if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
            t = t.float()  # bf16, fp8: numpy has neither (an fp8 output failed INTERNAL)
        a = t.numpy()
        want = P.OIP_DATATYPES.get(spec.datatype)
        return a.astype(want, copy=False) if want is not None and a.dtype != np.dtype(want) else a


_FLOAT_COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_COMPUTE: weakref.WeakKeyDictionary[nn.Module, torch.dtype | None] = weakref.WeakKeyDictionary()
"""Each materialized module's compute dtype, found once (weakly held: never keeps a module's memory)."""


def _compute_dtype(module: Any) -> torch.dtype | None:
    """The one float dtype all of a module's float parameters have (fp16, bf16, fp32 or fp64), or None
    (mixed dtypes, fp8, no float parameters: the module's forward decides what it takes)."""
    if not isinstance(module, nn.Module):
        return None
    if module in _COMPUTE:
        return _COMPUTE[module]
    found = {p.dtype for p in module.parameters() if p.is_floating_point()}
    d = next(iter(found)) if len(found) == 1 else None
    _COMPUTE[module] = d if d in _FLOAT_COMPUTE else None
    return _COMPUTE[module]


def _is_declared(spec: P.TensorSpec, a: np.ndarray) -> bool:
    """`a` has exactly the datatype `spec` declares (another float width is the caller's mistake, said
    as it was: not converted here)."""
    if spec.datatype == "BF16":
        return a.dtype == _BF16_CARRIER
    want = P.OIP_DATATYPES.get(spec.datatype)
    return want is not None and a.dtype == np.dtype(want)


_BF16_CARRIER = np.dtype(P.CARRIERS["BF16"])
"""A BF16 tensor in numpy, which has no bfloat16: its bit patterns (as manager.api.convert decodes
BF16 raw bytes; a declared BF16 output's uint16 answer is labelled BF16 by the host: P.CARRIERS)."""
_DECLARABLE = (*P.OIP_DATATYPES, *P.CARRIERS, "BYTES")
"""The datatypes a module may declare: those the service decodes and sends."""
