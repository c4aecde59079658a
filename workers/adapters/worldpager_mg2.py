"""The world model's weights in tiers (`adapter: worldpager-mg2`).

`source: {preset: tiny|micro|mg2, path: weights.safetensors}` builds WorldPager's MG2-shaped
STAND-IN (`worldpager.model.TinyCausalWan`, random weights unless `path` is given) and moves its
weights between tiers like any module. Its KV memory is WorldPager's business: frames are generated
in a world session (the `WorldSession` stream, with the session's elastic lease), not by one-shot
inference — a one-shot infer call answers `not_available` and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from workers import protocol as P
from workers.adapters.base import AdapterError, HostCopy, ModuleAdapter, module_tensors
from workers.measure import Phases


class WorldPagerMG2Adapter(ModuleAdapter):
    name = "worldpager-mg2"

    def _config(self) -> Any:
        from worldpager.model import mg2_config
        from worldpager.session import SESSION_PRESETS

        preset = self.source_value("preset", "tiny")
        # positions on the fly: a session may run past MG2's 1024-frame and 7500-frame tables
        if preset == "mg2":
            return mg2_config(on_the_fly=True)
        if not isinstance(preset, str) or preset not in SESSION_PRESETS:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {self.spec.name!r}: source.preset {preset!r}; "
                f"known: mg2, {', '.join(SESSION_PRESETS)}",
            )
        return SESSION_PRESETS[preset].on_the_fly()

    def checkpoint(self) -> Path:
        return Path(self.source_str("path"))

    def disk_paths(self) -> list[Path]:
        return [self.checkpoint()] if self.has_source("path") else []

    def build(self) -> nn.Module:
        from worldpager.model import TinyCausalWan

        return TinyCausalWan(self._config())

    def read(self, ph: Phases) -> HostCopy:
        if self.has_source("path"):
            host = super().read(ph)
            self._finite(host)
            return host
        # No checkpoint: the stand-in's seeded random weights, generated on the CPU (timed as a read).
        from worldpager.model import TinyCausalWan

        with ph.phase("read"):
            tensors = {k: v.contiguous() for k, v in module_tensors(TinyCausalWan(self._config())).items()}
        return HostCopy(tensors=tensors)

    def _finite(self, host: HostCopy) -> None:
        """BAD_CHECKPOINT naming the file and tensors when a floating-point weight is NaN or infinite,
        as `worldpager.checkpoint.load_mg2_checkpoint` refuses one: the load went through, and each
        session then failed at its first step, blaming the client's pose ("cannot encode non-finite
        values"), then INTERNAL."""
        from worldpager.checkpoint import count_nonfinite

        bad = [
            f"{k} ({n} of {t.numel()} values)"
            for k, t in sorted(host.tensors.items())
            if t.is_floating_point() and (n := count_nonfinite(t)) > 0
        ]
        if bad:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {self.spec.name!r}: {self.checkpoint()}: {len(bad)} tensors hold NaN or infinite "
                f"weights: {'; '.join(bad[:5])}",
            )

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("actions", "FP32", (-1, 4))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("latents", "FP32", (-1, -1))]

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        del runnable, inputs
        raise AdapterError(  # (a call this model does not offer: the request's, not the host's)
            P.BAD_INPUT,
            f"model {self.spec.name!r}: a world model generates frames in a world session "
            "(residency.v1.WorldSession), not by one-shot inference",
        )


__all__ = ["WorldPagerMG2Adapter"]
