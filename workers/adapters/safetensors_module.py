"""A Python factory for an `nn.Module` plus a `.safetensors` file (`adapter: safetensors-module`).

`source: {factory: "package.module:callable", path: weights.safetensors, kwargs: {...}}`. The factory
is called with `kwargs` while parameters are on the meta device (no memory, no init), then the file's
tensors — read once into one buffer, pinned on CUDA — are assigned (strict: names and shapes must
match). One FP32 input `input` [batch, features], one FP32 output `output`; the module may set
`residency_inputs` / `residency_outputs` (lists of (name, datatype, shape)) to declare others.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from workers import protocol as P
from workers.adapters.base import AdapterError, ModuleAdapter, params_on_meta


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
        try:
            mod = importlib.import_module(mod_name)
        except (Exception, SystemExit) as e:  # a script's module may sys.exit() at import: not the host
            raise AdapterError(
                P.FACTORY_FAILED,
                f"model {self.spec.name!r}: cannot import factory module {mod_name!r}: {e!r}",
            ) from None
        fn = getattr(mod, attr, None)
        if not callable(fn):
            raise AdapterError(P.FACTORY_FAILED, f"model {self.spec.name!r}: {ref!r} is not a callable")
        return fn

    def prepare(self) -> None:
        self.factory()

    def build(self) -> nn.Module:
        kwargs = self.spec.source.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise AdapterError(P.FACTORY_FAILED, f"model {self.spec.name!r}: source.kwargs must be a mapping")
        fn = self.factory()
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
        return specs

    def _specs(self, which: int, default: P.TensorSpec) -> list[P.TensorSpec]:
        if not hasattr(self, "_declared"):
            # not built yet (a model in the host or disk tier, or asked for its metadata only): build
            # it once on the meta device, which takes no memory, to read what it declares
            try:
                with params_on_meta():
                    self.build()
            except Exception:  # a factory that fails here fails its load too, with the reason
                return [default]
        declared = getattr(self, "_declared", (None, None))[which]
        return declared or [default]

    def inputs(self) -> list[P.TensorSpec]:
        return self._specs(0, P.TensorSpec("input", "FP32", (-1, -1)))

    def outputs(self) -> list[P.TensorSpec]:
        return self._specs(1, P.TensorSpec("output", "FP32", (-1, -1)))

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ins = self.inputs()
        args = [
            torch.as_tensor(np.ascontiguousarray(self.input_array(inputs, s)), device=self.device)
            for s in ins
        ]
        with torch.inference_mode():
            try:
                y = runnable(*args)
            except (
                RuntimeError,
                ValueError,
                TypeError,
                IndexError,
            ) as e:  # IndexError: an id past a vocabulary
                raise AdapterError(P.BAD_INPUT, f"model {self.spec.name!r}: inference failed: {e}") from None
        ys = y if isinstance(y, tuple | list) else (y,)
        return {s.name: self._as_declared(s, t) for s, t in zip(self.outputs(), ys, strict=False)}

    def _as_declared(self, spec: P.TensorSpec, t: torch.Tensor) -> np.ndarray:
        """An output in its declared datatype (a bf16 or fp16 module still answers FP32 when it says
        FP32; numpy has no bf16 at all)."""
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        a = t.numpy()
        want = P.OIP_DATATYPES.get(spec.datatype)
        return a.astype(want, copy=False) if want is not None and a.dtype != np.dtype(want) else a
