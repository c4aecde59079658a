"""Synthetic session inputs: deterministic block inputs and camera paths for the tiny stand-in.

* `block_inputs` -- one block's noise ``[frames, tokens, dim]`` and actions ``[frames, action_dim]``.
* `yaw_sweep_trajectory` -- a synthetic ``a_yaw``-like camera path (rotate in place, sweep back);
  `yaw_sweep` -- the same path, endless and lazy.
* `generator_seed` -- any whole-number seed reduced into the range `torch.Generator.manual_seed` takes.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import torch

from worldpager.model import TinyConfig
from worldpager.retrieval import Pose, wrap_degrees

__all__ = ["block_inputs", "generator_seed", "yaw_sweep", "yaw_sweep_trajectory"]


_SEED_RANGE = 2**64


def generator_seed(value: int) -> int:
    """``value`` modulo 2**64: a seed `torch.Generator.manual_seed` accepts for any whole number.
    torch itself takes [-2**63, 2**64) modulo 2**64, so every value it accepted seeds the same."""
    return value % _SEED_RANGE


def block_inputs(cfg: TinyConfig, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic block noise ``[frames, tokens, dim]`` and actions ``[frames, action_dim]``; any
    whole-number ``seed`` (see `generator_seed`)."""
    g = torch.Generator().manual_seed(generator_seed(seed * 1_000_003 + step))
    latent = torch.randn((cfg.frames_per_block, cfg.tokens_per_frame, cfg.dim), generator=g)
    actions = torch.randn((cfg.frames_per_block, cfg.action_dim), generator=g)
    return latent, actions


def yaw_sweep_trajectory(
    n: int, *, seed: int = 0, step_deg: float = 30.0, sweep_deg: float = 360.0, jitter_deg: float = 2.0
) -> list[Pose]:
    """An ``a_yaw``-like path: rotate in place ``step_deg`` per segment, reverse after ``sweep_deg``, so
    every view is revisited at growing distances. Deterministic by ``seed`` (a small yaw jitter)."""
    sweep = yaw_sweep(seed=seed, step_deg=step_deg, sweep_deg=sweep_deg, jitter_deg=jitter_deg)
    return list(itertools.islice(sweep, n))


def yaw_sweep(
    *, seed: int = 0, step_deg: float = 30.0, sweep_deg: float = 360.0, jitter_deg: float = 2.0
) -> Iterator[Pose]:
    """`yaw_sweep_trajectory`'s poses one by one, without end (for long runs: nothing is kept)."""
    rng = random.Random(seed)
    yaw, direction, turned = 0.0, 1.0, 0.0
    while True:
        yield Pose(0.0, 0.0, 0.0, 0.0, wrap_degrees(yaw + rng.uniform(-jitter_deg, jitter_deg)))
        yaw += direction * step_deg
        turned += step_deg
        if turned >= sweep_deg:
            direction, turned = -direction, 0.0
