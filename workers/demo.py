"""Tiny stand-in models for benchmarks and examples (random weights; they model nothing).

`tiny_mlp` is a `safetensors-module` factory: `source: {factory: "workers.demo:tiny_mlp", path: F,
kwargs: {width: 16}}`; `write_tiny_mlp(path, width)` writes a matching safetensors file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def tiny_mlp(width: int = 16) -> nn.Module:
    """STAND-IN: Linear(width, width) -> ReLU -> Linear(width, width); input/output FP32 [batch, width]."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def write_tiny_mlp(path: str | Path, width: int = 16, seed: int = 0) -> Path:
    from workers.st_io import write_safetensors

    torch.manual_seed(seed)
    p = Path(path)
    write_safetensors(tiny_mlp(width).state_dict(), p)
    return p
