"""Review 17, the CPU fallback (manager.workers_bridge.cuda_missing_here) under RAY_ADDRESS.

With `ray.address` null, `serve` joins the cluster that RAY_ADDRESS names, where the environment sets
it (README: "`RAY_ADDRESS` in the environment is still joined"), as it does for `ray.address: auto`.
The CPU fallback took that for a local Ray all the same: on a manager machine without CUDA, a
`kind: cuda` device of a GPU cluster was turned into a CPU device (its host asked for no GPU and ran
its models on some node's CPU), and `serve` said CUDA was missing "on this machine". A cluster's GPUs
are on its nodes: as with `ray.address: auto`, no fallback (in process, the hosts still run here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from manager.config import load_config
from manager.workers_bridge import cuda_missing_here

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"


def test_a_cluster_joined_through_ray_address_keeps_its_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    home = load_config(HOME)
    assert home.ray.address is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert cuda_missing_here(home) == []  # the cluster's nodes hold the GPUs
    assert cuda_missing_here(home, in_process=True) == ["gpu0"]  # in process: this machine's
    monkeypatch.setenv("RAY_ADDRESS", "")  # set but empty: Ray takes it for unset, a local Ray
    assert cuda_missing_here(home) == ["gpu0"]
    monkeypatch.delenv("RAY_ADDRESS")
    assert cuda_missing_here(home) == ["gpu0"]
