"""Checkpoint loading for the MG2-shaped stand-in (`worldpager.model`).

* `load_mg2_checkpoint` -- a strict safetensors load (names and shapes must all match; needs the
  optional `safetensors` package).
* `check_checkpoint_keys` / `CheckpointMismatch` -- the name check and the error that lists what
  differs (counts and the first few names).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

__all__ = ["CheckpointMismatch", "check_checkpoint_keys", "load_mg2_checkpoint"]


class CheckpointMismatch(ValueError):
    """A checkpoint's tensor names or shapes do not match the model's."""


def _first(names: Iterable[str], n: int = 5) -> str:
    items = sorted(names)
    more = f", ... (+{len(items) - n})" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_checkpoint_keys(expected: Iterable[str], found: Iterable[str], source: str = "checkpoint") -> None:
    """Raise `CheckpointMismatch` listing missing/unexpected counts and the first few names of each."""
    exp, got = set(expected), set(found)
    missing, unexpected = exp - got, got - exp
    if missing or unexpected:
        raise CheckpointMismatch(
            f"{source}: {len(missing)} missing keys [{_first(missing)}], "
            f"{len(unexpected)} unexpected keys [{_first(unexpected)}]"
        )


def load_mg2_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a safetensors state dict into `model` (strict: names and shapes must all match).

    Needs the optional `safetensors` package (not a project dependency): without it a `RuntimeError`
    says so. A missing file raises `FileNotFoundError`; a file that is no safetensors checkpoint
    (damaged, truncated, another format) a `ValueError` naming it; mismatched names or shapes
    `CheckpointMismatch`.
    A real MG2 checkpoint holds parts the stand-in lacks (cross-attention, modulation, patch embedding,
    mouse/keyboard modules) and is therefore reported as a mismatch.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"MG2 checkpoint not found: {p}")
    try:
        st = importlib.import_module("safetensors.torch")
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"loading {p} needs the 'safetensors' package, which is not installed (pip install safetensors)"
        ) from exc
    try:
        state: dict[str, torch.Tensor] = st.load_file(str(p))
    except Exception as e:  # (safetensors raises its own SafetensorError, naming no file)
        raise ValueError(f"{p}: not a readable safetensors checkpoint: {e}") from None
    own = model.state_dict()
    check_checkpoint_keys(own.keys(), state.keys(), str(p))
    bad = [
        f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in own.items()
        if state[k].shape != v.shape
    ]
    if bad:
        raise CheckpointMismatch(f"{p}: {len(bad)} shape mismatches: {'; '.join(bad[:5])}")
    model.load_state_dict(state)
