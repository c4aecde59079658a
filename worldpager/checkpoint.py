"""Checkpoint loading for the MG2-shaped stand-in (`worldpager.model`).

* `load_mg2_checkpoint` -- a strict safetensors load (names, shapes and kinds of number must all
  match, and every floating-point weight must be finite; needs the optional `safetensors` package).
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
    `CheckpointMismatch`. So does a tensor of another kind of number than the model's (an integer
    or boolean tensor where the model has a floating-point one, or the other way round: loading
    would cast it silently); a floating-point precision that differs (bf16 for float32) is cast, as
    `load_state_dict` does. A floating-point tensor holding NaN or infinity raises a `ValueError`
    naming the file and the tensor; nothing is loaded then.
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
    kinds = [
        f"{k} is {_dtype_name(state[k].dtype)} where the model has {_dtype_name(v.dtype)}"
        for k, v in sorted(own.items())
        if _kind(state[k].dtype) != _kind(v.dtype)
    ]
    if kinds:
        raise CheckpointMismatch(f"{p}: {len(kinds)} tensors of the wrong kind: {'; '.join(kinds[:5])}")
    nonfinite = [
        f"{k} ({n} of {t.numel()} values)"
        for k, t in sorted(state.items())
        if t.is_floating_point() and (n := count_nonfinite(t)) > 0
    ]
    if nonfinite:
        raise ValueError(
            f"{p}: {len(nonfinite)} tensors hold NaN or infinite weights: {'; '.join(nonfinite[:5])}"
        )
    model.load_state_dict(state)


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and infinite values in floating-point ``t`` (one-byte floats are widened: torch has no
    `isfinite` for some of them)."""
    return int((~torch.isfinite(t.float() if t.element_size() == 1 else t)).sum())


def _kind(dtype: torch.dtype) -> str:
    """The kind of number a dtype holds: floating point, complex, boolean or integer."""
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def _dtype_name(dtype: torch.dtype) -> str:
    return f"{_kind(dtype)} ({str(dtype).removeprefix('torch.')})"
