"""Review 20, a walkthrough of WorldPager: a step interrupted inside the model (a Ctrl-C, an error in
the KV cache's update) can leave the model's rolling window half-changed (layer 0's K shifted, its V
and end index not), and `close` saved that window as the checkpoint; the resume found it consistent
(its end index, size and CRC matched what was written) and continued from it: wrong output, silently.
A failed session now saves no window: the resume rebuilds it from the log."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import worldpager.model as wm
from worldpager.model import TinyCausalWan
from worldpager.session import SESSION_FILE, SESSION_PRESETS, Session
from worldpager.trajectory import yaw_sweep

CFG = SESSION_PRESETS["micro"].on_the_fly()


def test_a_step_interrupted_in_the_cache_update_saves_no_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poses = list(itertools.islice(yaw_sweep(seed=0), 8))
    d = tmp_path / "s"
    s = Session(TinyCausalWan(CFG), host_budget_bytes=1 << 26, log_dir=d)
    for p in poses[:5]:
        s.step(p)
    clean = [(c["k"].clone(), c["v"].clone()) for c in s.model.kv_cache]
    real = wm.update_kv_cache

    def half_update(cache: dict[str, Any], new_k: torch.Tensor, new_v: torch.Tensor, start: int) -> Any:
        # the roll of K only (the update's first statement), then the interrupt
        n, end, size = new_k.shape[1], int(cache["local_end_index"].item()), cache["k"].shape[1]
        evict = n + end - size
        if evict > 0:
            cache["k"][:, : end - evict] = cache["k"][:, evict:end].clone()
        else:
            cache["k"][:, :1] += 1.0
        raise KeyboardInterrupt

    monkeypatch.setattr(wm, "update_kv_cache", half_update)
    with pytest.raises(KeyboardInterrupt):
        s.step(poses[5])
    monkeypatch.setattr(wm, "update_kv_cache", real)
    assert not torch.equal(clean[0][0], s.model.kv_cache[0]["k"])  # the window was changed part-way
    s.close()
    saved = json.loads((d / SESSION_FILE).read_text())
    assert saved["next_step"] == 5 and saved["window"] is None

    m2 = TinyCausalWan(CFG)
    r = Session.resume(d, m2, host_budget_bytes=1 << 26)
    try:
        assert r.window_source == "log" and r.step_index == 5
        # the window rebuilt from the log is the clean one (at the codec's precision: bf16)
        for (k, v), c in zip(clean, m2.kv_cache, strict=True):
            n = int(c["local_end_index"].item())
            assert torch.allclose(c["k"][:, :n].float(), k[:, :n].float(), atol=0.05, rtol=0.02)
            assert torch.allclose(c["v"][:, :n].float(), v[:, :n].float(), atol=0.05, rtol=0.02)
        r.step(poses[5])  # and it goes on
    finally:
        r.close()


def test_a_session_that_did_not_fail_still_saves_its_window(tmp_path: Path) -> None:
    d = tmp_path / "s"
    s = Session(TinyCausalWan(CFG), host_budget_bytes=1 << 26, log_dir=d)
    for p in itertools.islice(yaw_sweep(seed=1), 4):
        s.step(p)
    s.close()
    saved = json.loads((d / SESSION_FILE).read_text())
    assert saved["window"] is not None
    r = Session.resume(d, TinyCausalWan(CFG), host_budget_bytes=1 << 26)
    try:
        assert r.window_source == "checkpoint" and r.step_index == 4
    finally:
        r.close()
