"""The MG2 stand-in (`worldpager.model`) and on-the-fly RoPE (`worldpager.rope`).

The model has random weights; these tests pin MG2's mechanics, not video quality: the positional
tables stop generation where MG2 crashes, on-the-fly rotations run far past them without changing
in-window attention, delta re-rotation moves keys exactly, and the rolling cache ends each block with
the clean context pass's KV.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from worldpager.model import (
    KV,
    TINY,
    CheckpointMismatch,
    TinyCausalWan,
    TinyConfig,
    check_checkpoint_keys,
    load_mg2_checkpoint,
    mg2_config,
)
from worldpager.rope import (
    PositionalTableOverflow,
    apply_rope_1d,
    apply_rope_3d,
    mg2_rope_table,
    rerotate_time,
    rope_freqs,
    rope_split,
    table_rope_freqs,
    virtual_positions,
)

T = TINY.tokens_per_frame
FPB = TINY.frames_per_block


def block_inputs(n: int, seed: int = 1, cfg: TinyConfig = TINY) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(cfg.frames_per_block, cfg.tokens_per_frame, cfg.dim, generator=g),
            torch.randn(cfg.frames_per_block, cfg.action_dim, generator=g),
        )
        for _ in range(n)
    ]


def run(model: TinyCausalWan, n: int, seed: int = 1) -> list[tuple[torch.Tensor, list[KV]]]:
    return [model.generate_block(lat, act, FPB * i) for i, (lat, act) in enumerate(block_inputs(n, seed))]


# ---- 1. the fixed tables stop generation where MG2 does ---------------------------------------------


def test_self_attention_table_overflows_like_mg2() -> None:
    model = TinyCausalWan(replace(TINY, rope_table_frames=16, action_rope_table_frames=None))
    inputs = block_inputs(6)
    for i, (lat, act) in enumerate(inputs[:5]):  # frames 0..14 fit a 16-frame table
        model.generate_block(lat, act, FPB * i)
    with pytest.raises(PositionalTableOverflow, match="3D RoPE time table") as err:
        model.generate_block(*inputs[5], 15)  # needs frames 15..17
    assert (err.value.needed, err.value.length) == (18, 16)


def test_action_table_overflows_like_mg2() -> None:
    model = TinyCausalWan(replace(TINY, rope_table_frames=None, action_rope_table_frames=12))
    inputs = block_inputs(5)
    for i, (lat, act) in enumerate(inputs[:4]):  # frames 0..11 fit a 12-frame action table
        model.generate_block(lat, act, FPB * i)
    with pytest.raises(PositionalTableOverflow, match="action RoPE table") as err:
        model.generate_block(*inputs[4], 12)
    assert (err.value.needed, err.value.length) == (15, 12)


def test_rope_functions_raise_past_their_tables() -> None:
    x = torch.randn(1, 2 * 2 * 3, 2, 16)
    table = mg2_rope_table(8, 16)
    apply_rope_3d(x, 2, 2, 3, 6, table)  # frames 6, 7: the last that fit
    with pytest.raises(PositionalTableOverflow):
        apply_rope_3d(x, 2, 2, 3, 7, table)
    assert torch.isfinite(apply_rope_3d(x, 2, 2, 3, 10_000, None)).all()
    with pytest.raises(PositionalTableOverflow):
        apply_rope_1d(x, torch.arange(12) + 30, table_rope_freqs(40, 16))


# ---- 2. on-the-fly positions run indefinitely and leave in-window attention unchanged ---------------


def test_on_the_fly_runs_12x_past_the_table_and_matches_a_large_table() -> None:
    n = 64  # 192 frames: 12x the 16-frame self-attention table, 4.8x the 40-frame action table
    fly = TinyCausalWan(TINY.on_the_fly())
    big = TinyCausalWan(replace(TINY, rope_table_frames=n * FPB, action_rope_table_frames=n * FPB))
    for i, ((out_f, kv_f), (out_b, kv_b)) in enumerate(zip(run(fly, n), run(big, n), strict=True)):
        assert torch.allclose(out_f, out_b, rtol=0, atol=1e-5), f"block {i}"
        assert all(torch.allclose(a[0], b[0], rtol=0, atol=1e-5) for a, b in zip(kv_f, kv_b, strict=True))
    assert fly.cached_frames() == TINY.window_frames


def test_on_the_fly_equals_the_table_model_inside_the_table() -> None:
    fly, table = TinyCausalWan(TINY.on_the_fly()), TinyCausalWan(TINY)
    for (out_f, _), (out_t, _) in zip(run(fly, 5), run(table, 5), strict=True):
        assert torch.equal(out_f, out_t)


def test_no_memory_and_empty_memory_equal_the_reference() -> None:
    plain, empty = TinyCausalWan(TINY.on_the_fly()), TinyCausalWan(TINY.on_the_fly())
    hd = (TINY.heads, TINY.head_dim)
    nothing = [(torch.zeros(1, 0, *hd), torch.zeros(1, 0, *hd)) for _ in range(TINY.layers)]
    for i, (lat, act) in enumerate(block_inputs(4)):
        out_p, kv_p = plain.generate_block(lat, act, FPB * i)
        out_e, kv_e = empty.generate_block(lat, act, FPB * i, memory=nothing)
        assert torch.equal(out_p, out_e)
        assert all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv_p, kv_e, strict=True)
        )


def test_outputs_depend_only_on_relative_positions() -> None:
    near, far = TinyCausalWan(TINY.on_the_fly()), TinyCausalWan(TINY.on_the_fly())
    for i, (lat, act) in enumerate(block_inputs(6)):
        out_n, _ = near.generate_block(lat, act, FPB * i, noise_seed=i)
        out_f, _ = far.generate_block(lat, act, 100_000 + FPB * i, noise_seed=i)
        assert torch.allclose(out_n, out_f, rtol=0, atol=1e-5)


def test_retrieved_memory_at_virtual_positions_is_attended() -> None:
    model = TinyCausalWan(TINY.on_the_fly())
    results = run(model, 8)
    seg_kv, seg_start = results[0][1], 0
    start = 8 * FPB
    (v_start,) = virtual_positions(start - FPB, 1)  # window holds frames start-3 .. start+2
    assert v_start == start - 2 * FPB
    memory = [(rerotate_time(k, FPB, TINY.latent_h, TINY.latent_w, seg_start, v_start), v) for k, v in seg_kv]
    (lat, act) = block_inputs(1, seed=9)[0]
    without = model.forward_block(lat, act, start, write_cache=False)
    with_mem = model.forward_block(lat, act, start, write_cache=False, memory=memory)
    assert torch.isfinite(with_mem).all()
    assert not torch.allclose(without, with_mem)
    with pytest.raises(ValueError, match="layers"):
        model.forward_block(lat, act, start, write_cache=False, memory=memory[:1])


# ---- 3. RoPE pieces ----------------------------------------------------------------------------------


def mg2_causal_rope_apply(
    x: torch.Tensor, f: int, h: int, w: int, freqs: torch.Tensor, start: int
) -> torch.Tensor:
    """A literal port of MG2's `causal_rope_apply` (one sample, concatenated freq table)."""
    n, c = x.size(2), x.size(3) // 2
    parts = torch.split(freqs, [c - 2 * (c // 3), c // 3, c // 3], dim=1)
    seq_len = f * h * w
    x_i = torch.view_as_complex(x[0, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
    freqs_i = torch.cat(
        [
            parts[0][start : start + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq_len, 1, -1)
    return torch.view_as_real(x_i * freqs_i).flatten(2).unsqueeze(0).type_as(x)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_rope_matches_mg2_table_and_code(head_dim: int) -> None:
    d = head_dim
    mg2_freqs = torch.cat(
        [
            table_rope_freqs(64, d - 4 * (d // 6)),
            table_rope_freqs(64, 2 * (d // 6)),
            table_rope_freqs(64, 2 * (d // 6)),
        ],
        dim=1,
    )
    x = torch.randn(1, 3 * 2 * 4, 2, d)
    expected = mg2_causal_rope_apply(x, 3, 2, 4, mg2_freqs, 40)
    assert torch.equal(apply_rope_3d(x, 3, 2, 4, 40, mg2_rope_table(64, d)), expected)
    assert torch.equal(apply_rope_3d(x, 3, 2, 4, 40, None), expected)
    idx = torch.tensor([0, 5, 63, 17])
    assert torch.equal(rope_freqs(idx, 44), table_rope_freqs(64, 44)[idx])


def test_mg2_split_is_22_21_21() -> None:
    assert rope_split(128) == (22, 21, 21)
    assert rope_split(16) == (4, 2, 2)


@pytest.mark.parametrize(("t_old", "t_new"), [(2500, 17), (5, 4000), (12, -9), (100_000, 3)])
def test_rerotate_time_equals_rope_at_the_new_position(t_old: int, t_new: int) -> None:
    f, h, w, d = 3, 4, 6, 16
    k_pre = torch.randn(1, f * h * w, 4, d, generator=torch.Generator().manual_seed(t_old))
    k_old = apply_rope_3d(k_pre, f, h, w, t_old)
    moved = rerotate_time(k_old, f, h, w, t_old, t_new)
    assert torch.allclose(moved, apply_rope_3d(k_pre, f, h, w, t_new), rtol=0, atol=1e-6)
    ct = rope_split(d)[0]
    assert torch.equal(moved[..., 2 * ct :], k_old[..., 2 * ct :])  # height/width pairs untouched
    assert not torch.allclose(moved[..., : 2 * ct], k_old[..., : 2 * ct])


def test_virtual_positions_order_and_placement() -> None:
    assert virtual_positions(30, 3) == [21, 24, 27]  # oldest first, the newest ends at frame 29
    assert virtual_positions(30, 3, gap=2) == [19, 22, 25]
    assert virtual_positions(30, 2, frames_per_segment=4) == [22, 26]
    assert virtual_positions(4, 3) == [-5, -2, 1]
    assert virtual_positions(30, 0) == []
    with pytest.raises(ValueError):
        virtual_positions(30, 1, gap=-1)


# ---- 4. the rolling cache ----------------------------------------------------------------------------


def test_cache_holds_the_window_and_the_clean_pass_kv() -> None:
    model = TinyCausalWan(TINY.on_the_fly())
    results = []
    for i, (lat, act) in enumerate(block_inputs(5)):
        results.append(model.generate_block(lat, act, FPB * i))
        assert model.cached_frames() == min(FPB * (i + 1), TINY.window_frames)
    n_new = FPB * T
    for layer, cache in enumerate(model.kv_cache):
        assert cache["k"].shape[1] == TINY.window_frames * T
        assert int(cache["global_end_index"].item()) == 5 * n_new
        for slot, block in ((slice(0, n_new), 3), (slice(n_new, 2 * n_new), 4)):
            k, v = results[block][1][layer]
            assert k.shape == (1, n_new, TINY.heads, TINY.head_dim)
            assert torch.equal(cache["k"][:, slot], k) and torch.equal(cache["v"][:, slot], v)


def test_denoising_passes_leave_no_kv_behind() -> None:
    a, b = TinyCausalWan(TINY.on_the_fly()), TinyCausalWan(TINY.on_the_fly())
    inputs = block_inputs(4)
    for i, (lat, act) in enumerate(inputs[:3]):
        a.generate_block(lat, act, FPB * i)
        b.generate_block(lat, act, FPB * i)
    lat, act = inputs[3]
    b.forward_block(lat, act, 9, write_cache=True, timestep=1000.0)  # a first (noisy) pass alone
    noisy_k = b.kv_cache[0]["k"][:, FPB * T :].clone()
    _, final = a.generate_block(lat, act, 9)
    assert torch.equal(a.kv_cache[0]["k"][:, FPB * T :], final[0][0])
    assert not torch.allclose(noisy_k, final[0][0])


def test_forward_without_write_leaves_the_cache_alone() -> None:
    model = TinyCausalWan(TINY.on_the_fly())
    run(model, 3)
    before = [{name: t.clone() for name, t in c.items()} for c in model.kv_cache]
    lat, act = block_inputs(1, seed=5)[0]
    out = model.forward_block(lat, act, 9, write_cache=False)
    for old, new in zip(before, model.kv_cache, strict=True):
        assert all(torch.equal(old[name], new[name]) for name in old)
    assert torch.equal(out, model.forward_block(lat, act, 9, write_cache=True))


# ---- 5. determinism, full-size build, checkpoints ---------------------------------------------------


def test_fixed_seed_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    first, second = TinyCausalWan(TINY), TinyCausalWan(TINY)
    assert torch.equal(state, torch.random.get_rng_state())
    for (o1, kv1), (o2, kv2) in zip(run(first, 3), run(second, 3), strict=True):
        assert torch.equal(o1, o2) and torch.equal(kv1[-1][0], kv2[-1][0])
    other = TinyCausalWan(replace(TINY, seed=1))
    assert not torch.equal(run(other, 1)[0][0], run(TinyCausalWan(TINY), 1)[0][0])


def test_full_size_mg2_module_builds_on_meta() -> None:
    cfg = mg2_config()
    assert (cfg.head_dim, cfg.tokens_per_frame, cfg.window_tokens) == (128, 880, 5280)
    model = TinyCausalWan(cfg, device="meta")
    assert model.rope_table is not None and [t.shape[1] for t in model.rope_table] == [22, 21, 21]
    assert model.rope_table[0].shape[0] == 1024
    assert model.action_rope_table is not None and model.action_rope_table.shape[0] == 7500
    assert sum(b.action_model is not None for b in model.blocks) == 15
    assert model.state_dict()["blocks.0.self_attn.q.weight"].shape == (1536, 1536)
    assert mg2_config(on_the_fly=True).rope_table_frames is None


def write_safetensors(path: Path, tensors: dict[str, list[float]]) -> None:
    """A minimal float32 safetensors file, written by hand (no torch.save)."""
    header: dict[str, object] = {}
    data, offset = b"", 0
    for name, values in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    model = TinyCausalWan(TINY)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_mg2_checkpoint(model, tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointMismatch, match=r"1 missing keys \[a\], 2 unexpected keys \[b, c\]"):
        check_checkpoint_keys(["a", "d"], ["d", "b", "c"])
    path = tmp_path / "wrong.safetensors"
    write_safetensors(path, {"patch_embedding.weight": [1.0, 2.0]})
    if importlib.util.find_spec("safetensors") is None:
        with pytest.raises(RuntimeError, match="needs the 'safetensors' package"):
            load_mg2_checkpoint(model, path)
    else:
        n_missing = len(model.state_dict())
        with pytest.raises(CheckpointMismatch, match=f"{n_missing} missing keys .* 1 unexpected keys"):
            load_mg2_checkpoint(model, path)
