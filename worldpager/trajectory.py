"""Synthetic session inputs: deterministic block inputs and camera paths for the tiny stand-in.

* `block_inputs` -- one block's noise ``[frames, tokens, dim]`` and actions ``[frames, action_dim]``.
* `yaw_sweep_trajectory` -- a synthetic ``a_yaw``-like camera path (rotate in place, sweep back).
"""

from __future__ import annotations

import random

import torch

from worldpager.model import TinyConfig
from worldpager.retrieval import Pose, wrap_degrees

__all__ = ["block_inputs", "yaw_sweep_trajectory"]


def block_inputs(cfg: TinyConfig, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic block noise ``[frames, tokens, dim]`` and actions ``[frames, action_dim]``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    latent = torch.randn((cfg.frames_per_block, cfg.tokens_per_frame, cfg.dim), generator=g)
    actions = torch.randn((cfg.frames_per_block, cfg.action_dim), generator=g)
    return latent, actions


def yaw_sweep_trajectory(
    n: int, *, seed: int = 0, step_deg: float = 30.0, sweep_deg: float = 360.0, jitter_deg: float = 2.0
) -> list[Pose]:
    """An ``a_yaw``-like path: rotate in place ``step_deg`` per segment, reverse after ``sweep_deg``, so
    every view is revisited at growing distances. Deterministic by ``seed`` (a small yaw jitter)."""
    rng = random.Random(seed)
    poses: list[Pose] = []
    yaw, direction, turned = 0.0, 1.0, 0.0
    for _ in range(n):
        poses.append(Pose(0.0, 0.0, 0.0, 0.0, wrap_degrees(yaw + rng.uniform(-jitter_deg, jitter_deg))))
        yaw += direction * step_deg
        turned += step_deg
        if turned >= sweep_deg:
            direction, turned = -direction, 0.0
    return poses
