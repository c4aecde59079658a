"""Adapters by name (`adapter:` in the config), and the one factory that makes them."""

from __future__ import annotations

import torch

from manager import adapter_specs
from workers import protocol as P
from workers.adapters.base import Adapter, AdapterError, HostCopy
from workers.adapters.minilm import SentenceEmbeddingAdapter
from workers.adapters.safetensors_module import SafetensorsModuleAdapter
from workers.adapters.torchscript import SileroVadAdapter, TorchScriptAdapter
from workers.adapters.worldpager_mg2 import WorldPagerMG2Adapter


class _Registry(dict[str, type[Adapter]]):
    """Adapters by name. One put in at run time (a plugin's, a test's stand-in) is registered in the
    manager's catalogue too (`manager.adapter_specs.register`), so a config naming it loads in this
    process; its `source` is not checked there. The built-in ones are the catalogue's own (a test
    keeps the two in step)."""

    def __setitem__(self, name: str, cls: type[Adapter]) -> None:
        super().__setitem__(name, cls)
        adapter_specs.register(name)

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        adapter_specs.unregister(name)


ADAPTERS: dict[str, type[Adapter]] = _Registry(
    (a.name, a)
    for a in (
        SileroVadAdapter,
        SentenceEmbeddingAdapter,
        TorchScriptAdapter,
        SafetensorsModuleAdapter,
        WorldPagerMG2Adapter,
    )
)


def make_adapter(spec: P.ModelSpec, device: torch.device) -> Adapter:
    """The adapter for `spec`; AdapterError(unknown_adapter) names the model and the known adapters."""
    cls = ADAPTERS.get(spec.adapter)
    if cls is None:
        raise AdapterError(
            P.UNKNOWN_ADAPTER,
            f"model {spec.name!r}: unknown adapter {spec.adapter!r}; known: {', '.join(sorted(ADAPTERS))}",
        )
    return cls(spec, device)


__all__ = ["ADAPTERS", "Adapter", "AdapterError", "HostCopy", "make_adapter"]
