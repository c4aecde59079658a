"""A world session's freed device memory goes back to the driver (2026-12-06): on CUDA the caching
allocator keeps a shrunk lease's and a closed session's blocks reserved, so neither other processes
nor the device host's free-memory probe saw them free. Failed before the fix (no such hook)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.host import DeviceHost
from workers.world import WorldSessions
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.session import SESSION_PRESETS


def _seg() -> tuple[object, int]:
    cfg = SESSION_PRESETS["micro"].on_the_fly()
    return cfg, SegmentLayout.from_config(cfg, "bf16", torch.float32).payload_nbytes


def test_a_shrink_and_a_close_give_memory_back_a_grow_does_not(tmp_path: Path) -> None:
    cfg, seg = _seg()
    calls: list[str] = []
    ws = WorldSessions(torch.device("cpu"), release=lambda: calls.append("release"))
    ws.open("world", TinyCausalWan(cfg), "a", 10 * seg, tmp_path / "a")
    assert calls == []
    assert ws.resize("a", 20 * seg) == 20 * seg
    assert calls == []  # a grow frees nothing
    assert ws.resize("a", 20 * seg) == 20 * seg
    assert calls == []  # nor does the same lease again
    assert ws.resize("a", 5 * seg) == 5 * seg
    assert calls == ["release"]
    assert ws.close("a")["closed"] is True
    assert calls == ["release", "release"]
    assert ws.close("a") == {"session_id": "a", "closed": False}
    assert calls == ["release", "release"]  # nothing closed, nothing to give back


def test_a_failing_release_is_logged_and_the_shrink_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, seg = _seg()

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    ws = WorldSessions(torch.device("cpu"), release=broken)
    ws.open("world", TinyCausalWan(cfg), "a", 10 * seg, tmp_path / "a")
    assert ws.resize("a", 4 * seg) == 4 * seg
    assert ws.open_sessions["a"].lease == 4 * seg
    assert "could not give a world session's freed device memory back" in caplog.text
    assert ws.close("a")["closed"] is True


def test_the_device_host_passes_its_probe_release_on_cuda_only() -> None:
    assert DeviceHost("cpu0", "cpu").world.release is None  # nothing cached by a device allocator
    cuda = DeviceHost("gpu0", "cuda")  # (built without CUDA: nothing of it is touched yet)
    assert cuda.world.release == cuda.probe.release
