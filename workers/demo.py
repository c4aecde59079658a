"""Tiny stand-in models for benchmarks and examples (random weights; they model nothing).

`tiny_mlp` is a `safetensors-module` factory: `source: {factory: "workers.demo:tiny_mlp", path: F,
kwargs: {width: 16}}`; `write_tiny_mlp(path, width)` writes a matching safetensors file. `slow_mlp`
is the same model taking `load_s` to build and `infer_s` per inference (fault drills: a device host
killed under a load or a request); it reads the same file.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn


def tiny_mlp(width: int = 16) -> nn.Module:
    """STAND-IN: Linear(width, width) -> ReLU -> Linear(width, width); input/output FP32 [batch, width]."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


class _Slow(nn.Sequential):
    def __init__(self, width: int, infer_s: float) -> None:
        super().__init__(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))  # tiny_mlp's
        self.infer_s = infer_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.infer_s)
        for layer in self:
            x = layer(x)
        return x


def slow_mlp(width: int = 16, load_s: float = 1.0, infer_s: float = 1.0) -> nn.Module:
    """STAND-IN: `tiny_mlp` that takes `load_s` to build and `infer_s` per inference (it sleeps)."""
    time.sleep(load_s)
    return _Slow(width, infer_s)


def write_tiny_mlp(path: str | Path, width: int = 16, seed: int = 0) -> Path:
    from workers.st_io import write_safetensors

    torch.manual_seed(seed)
    p = Path(path)
    write_safetensors(tiny_mlp(width).state_dict(), p)
    return p
