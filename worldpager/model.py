"""`TinyCausalWan`: a small, randomly initialised STAND-IN for MG2's `CausalWanModel`.

It is not MG2 and produces no video. It reproduces the parts of MG2 that WorldPager touches, with small
sizes so the runtime can be tested on a CPU:

* blocks of `frames_per_block` (3) latent frames, `passes_per_block` (4) forwards per block: denoising
  passes, then the clean "context" pass (MG2's `context_noise = 0` rerun on its own `denoised_pred`)
  whose K/V is the block's final KV — the segment WorldPager offloads;
* per layer a KV-cache dict `{"k", "v", "global_end_index", "local_end_index"}` of `window_frames` latent
  frames with MG2's roll code (evict the oldest whole frames by a `clone()` shift, keys stored
  post-RoPE); every pass writes this block's slots and later passes overwrite the same slots;
* MG2's 3D RoPE (`worldpager.rope.apply_rope_3d`) from a fixed table of `rope_table_frames` frames
  (`PositionalTableOverflow` past it, MG2's crash) or on the fly (`None`: runs indefinitely);
* an action branch whose positions come from its own table (`action_rope_table_frames`, MG2's 7500), with
  the same overflow behaviour;
* optional retrieved memory per layer: attention over `cat[memory K/V, window K/V]`.

Simplified relative to MG2 (stand-in only): input is already token embeddings `[frames, tokens, dim]`
(no patch embedding / VAE / unpatchify), no image cross-attention, no AdaLN modulation (a timestep
embedding is added to the hidden state instead), linear denoising timesteps and flow-matching
re-noising `(1 - s) x + s noise`, and the action branch is one temporal attention from tokens to this
block's per-frame action embeddings (no mouse/keyboard split, no action KV cache). Batch size is 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worldpager import rope
from worldpager.checkpoint import CheckpointMismatch, check_checkpoint_keys, load_mg2_checkpoint
from worldpager.mg2 import MG2

__all__ = [
    "KV",
    "TINY",
    "CheckpointMismatch",
    "KVCache",
    "TinyCausalWan",
    "TinyConfig",
    "check_checkpoint_keys",
    "denoising_timesteps",
    "load_mg2_checkpoint",
    "mg2_config",
    "update_kv_cache",
]

KV = tuple[torch.Tensor, torch.Tensor]
KVCache = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the stand-in. Latent `latent_h x latent_w` tokens per frame; `None` tables = on the fly."""

    layers: int = 2
    dim: int = 64
    heads: int = 4
    ffn_dim: int = 128
    freq_dim: int = 32
    latent_h: int = 4
    latent_w: int = 6
    frames_per_block: int = 3
    window_frames: int = 6
    rope_table_frames: int | None = 16
    rope_theta: float = 10000.0
    action_dim: int = 4
    action_heads: int = 2
    action_head_dim: int = 16
    action_layers: int | None = None  # the first N layers carry the action branch; None = all
    action_rope_table_frames: int | None = 40
    action_rope_theta: float = 256.0
    passes_per_block: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
        rope.rope_split(self.head_dim)  # validates head_dim
        if self.action_head_dim % 2 or self.freq_dim % 2:
            raise ValueError("action_head_dim and freq_dim must be even")
        if not 1 <= self.frames_per_block <= self.window_frames:
            raise ValueError("need 1 <= frames_per_block <= window_frames")
        if min(self.layers, self.latent_h, self.latent_w, self.passes_per_block, self.action_dim) < 1:
            raise ValueError("layers, latent_h, latent_w, passes_per_block, action_dim must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def tokens_per_frame(self) -> int:
        return self.latent_h * self.latent_w

    @property
    def window_tokens(self) -> int:
        return self.window_frames * self.tokens_per_frame

    def on_the_fly(self) -> TinyConfig:
        """The same model with both position tables replaced by on-the-fly rotations."""
        return replace(self, rope_table_frames=None, action_rope_table_frames=None)


TINY = TinyConfig()


def mg2_config(*, on_the_fly: bool = False, seed: int = 0) -> TinyConfig:
    """MG2's full dims (universal distilled): 30 layers, dim 1536, 12 heads x 128, 22x40 = 880 tokens per
    latent frame, window 6 frames, tables 1024 / 7500 frames, action branch in layers 0..14."""
    d = MG2  # the one record of MG2's dimensions (worldpager/mg2.py)
    cfg = TinyConfig(
        layers=d.layers, dim=d.dim, heads=d.heads, ffn_dim=8960, freq_dim=256, latent_h=22, latent_w=40,
        frames_per_block=d.frames_per_block, window_frames=d.window_frames,
        rope_table_frames=d.rope_table_frames, action_dim=4, action_heads=16, action_head_dim=64,
        action_layers=15, action_rope_table_frames=d.action_rope_table_frames, seed=seed,
    )  # fmt: skip
    assert cfg.tokens_per_frame == d.tokens_per_frame and cfg.head_dim == d.head_dim
    return cfg.on_the_fly() if on_the_fly else cfg


def denoising_timesteps(n: int) -> list[float]:
    """`n` linear timesteps from 1000 down (MG2: `[1000, 666, 333]` for 3; no timestep shift here)."""
    return [1000.0 * (1.0 - i / n) for i in range(n)]


def _sinusoid(t: float, dim: int) -> torch.Tensor:
    half = dim // 2
    inv = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    ang = t * inv
    return torch.cat([torch.cos(ang), torch.sin(ang)])


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[b, s, heads, d]` layout in and out, no mask unless given (MG2: keys are past or same block)."""
    qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return F.scaled_dot_product_attention(*qkv, attn_mask=mask).transpose(1, 2)


def update_kv_cache(cache: KVCache, new_k: torch.Tensor, new_v: torch.Tensor, current_start: int) -> KV:
    """MG2's roll-and-write (`CausalWanSelfAttention.forward`, kv_cache branch, sink 0), in place.

    `current_start` is the first token's global index. Returns the window slices to attend to.
    """
    cache_size, num_new = cache["k"].shape[1], new_k.shape[1]
    current_end = current_start + num_new
    global_end = int(cache["global_end_index"].item())
    local_end = int(cache["local_end_index"].item())
    if local_end == 0:  # empty cache: the first block may start at any frame (MG2 always starts at 0)
        global_end = current_start
    if num_new > cache_size:
        raise ValueError(f"{num_new} new tokens do not fit a cache of {cache_size}")
    if current_end > global_end and num_new + local_end > cache_size:
        num_evicted = num_new + local_end - cache_size
        num_rolled = local_end - num_evicted
        for name in ("k", "v"):
            cache[name][:, :num_rolled] = cache[name][:, num_evicted : num_evicted + num_rolled].clone()
        local_end = local_end + current_end - global_end - num_evicted
    else:
        local_end = local_end + current_end - global_end
    local_start = local_end - num_new
    if local_start < 0 or local_end > cache_size:
        raise ValueError(f"write at token {current_start} is not contiguous with the cached window")
    cache["k"][:, local_start:local_end] = new_k
    cache["v"][:, local_start:local_end] = new_v
    cache["global_end_index"].fill_(current_end)
    cache["local_end_index"].fill_(local_end)
    lo = max(0, local_end - cache_size)
    return cache["k"][:, lo:local_end], cache["v"][:, lo:local_end]


class _SelfAttention(nn.Module):
    def __init__(self, cfg: TinyConfig, table: rope.RopeTable | None, fk: dict[str, Any]) -> None:
        super().__init__()
        self.cfg, self.table = cfg, table
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim, **fk) for _ in range(4))
        self.norm_q = nn.RMSNorm(cfg.dim, eps=1e-6, **fk)
        self.norm_k = nn.RMSNorm(cfg.dim, eps=1e-6, **fk)

    def forward(
        self, x: torch.Tensor, start_frame: int, write: bool, cache: KVCache, memory: KV | None
    ) -> tuple[torch.Tensor, KV]:
        c, (b, s, _) = self.cfg, x.shape
        shape = (b, s, c.heads, c.head_dim)
        grid = (s // c.tokens_per_frame, c.latent_h, c.latent_w, start_frame, self.table, c.rope_theta)
        q = rope.apply_rope_3d(self.norm_q(self.q(x)).view(shape), *grid)
        k = rope.apply_rope_3d(self.norm_k(self.k(x)).view(shape), *grid)
        v = self.v(x).view(shape)
        if not write:  # attend as if written, leave the real cache untouched
            cache = {name: t.clone() for name, t in cache.items()}
        k_win, v_win = update_kv_cache(cache, k, v, start_frame * c.tokens_per_frame)
        if memory is not None:
            k_win = torch.cat([memory[0].to(k_win.dtype), k_win], dim=1)
            v_win = torch.cat([memory[1].to(v_win.dtype), v_win], dim=1)
        return self.o(_attend(q, k_win, v_win).reshape(b, s, -1)), (k, v)


class _ActionBranch(nn.Module):
    """Tokens of frame f attend to the action embeddings of this block's frames <= f, both rotated by
    their frame positions from the action RoPE table (MG2's action module keeps its own, 7500 frames)."""

    def __init__(self, cfg: TinyConfig, table: torch.Tensor | None, fk: dict[str, Any]) -> None:
        super().__init__()
        self.cfg, self.table = cfg, table
        hidden = cfg.action_heads * cfg.action_head_dim
        self.embed = nn.Linear(cfg.action_dim, hidden, **fk)
        self.q = nn.Linear(cfg.dim, hidden, **fk)
        self.k = nn.Linear(hidden, hidden, **fk)
        self.v = nn.Linear(hidden, hidden, **fk)
        self.o = nn.Linear(hidden, cfg.dim, **fk)

    def forward(self, x: torch.Tensor, actions: torch.Tensor, start_frame: int) -> torch.Tensor:
        c, (b, s, _), nf = self.cfg, x.shape, actions.shape[0]
        heads, tpf = (c.action_heads, c.action_head_dim), c.tokens_per_frame
        a = self.embed(actions.to(x.dtype)).unsqueeze(0)
        frames = torch.arange(start_frame, start_frame + nf)
        q = rope.apply_rope_1d(
            self.q(x).view(b, s, *heads), frames.repeat_interleave(tpf), self.table, c.action_rope_theta
        )
        k = rope.apply_rope_1d(self.k(a).view(1, nf, *heads), frames, self.table, c.action_rope_theta)
        v = self.v(a).view(1, nf, *heads)
        mask = (frames.view(nf, 1) >= frames.view(1, nf)).repeat_interleave(tpf, dim=0).to(x.device)
        out: torch.Tensor = self.o(_attend(q, k, v, mask).reshape(b, s, -1))
        return out


class _Block(nn.Module):
    def __init__(self, model: TinyCausalWan, with_action: bool, fk: dict[str, Any]) -> None:
        super().__init__()
        cfg = model.cfg
        self.norm1 = nn.LayerNorm(cfg.dim, eps=1e-6, elementwise_affine=False, **fk)
        self.self_attn = _SelfAttention(cfg, model.rope_table, fk)
        self.action_model = _ActionBranch(cfg, model.action_rope_table, fk) if with_action else None
        self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6, elementwise_affine=False, **fk)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim, **fk),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.ffn_dim, cfg.dim, **fk),
        )

    def forward(
        self,
        x: torch.Tensor,
        actions: torch.Tensor,
        start_frame: int,
        write: bool,
        cache: KVCache,
        memory: KV | None,
    ) -> tuple[torch.Tensor, KV]:
        attn, kv = self.self_attn(self.norm1(x), start_frame, write, cache, memory)
        x = x + attn
        if self.action_model is not None:
            x = x + self.action_model(x, actions, start_frame)
        x = x + self.ffn(self.norm2(x))
        return x, kv


class TinyCausalWan(nn.Module):
    """STAND-IN for MG2's `CausalWanModel` with random weights (seeded by `cfg.seed`); see module doc.

    `device="meta"` builds the full-size `mg2_config()` module without allocating its weights.
    """

    def __init__(
        self,
        cfg: TinyConfig = TINY,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        t_frames, a_frames = cfg.rope_table_frames, cfg.action_rope_table_frames
        self.rope_table: rope.RopeTable | None = (
            None if t_frames is None else rope.mg2_rope_table(t_frames, cfg.head_dim, cfg.rope_theta)
        )
        self.action_rope_table: torch.Tensor | None = (
            None
            if a_frames is None
            else rope.table_rope_freqs(a_frames, cfg.action_head_dim, cfg.action_rope_theta)
        )
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        n_action = cfg.layers if cfg.action_layers is None else cfg.action_layers
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.time_embedding = nn.Sequential(
                nn.Linear(cfg.freq_dim, cfg.dim, **fk), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim, **fk)
            )
            self.blocks = nn.ModuleList(_Block(self, i < n_action, fk) for i in range(cfg.layers))
            self.norm_out = nn.LayerNorm(cfg.dim, eps=1e-6, elementwise_affine=False, **fk)
            self.head = nn.Linear(cfg.dim, cfg.dim, **fk)
        self.kv_cache: list[KVCache] = []

    def reset_cache(self) -> None:
        """Allocate an empty rolling cache per layer (MG2's `_initialize_kv_cache`, batch 1)."""
        p = self.head.weight
        shape = (1, self.cfg.window_tokens, self.cfg.heads, self.cfg.head_dim)
        kv: dict[str, Any] = {"dtype": p.dtype, "device": p.device}
        idx: dict[str, Any] = {"dtype": torch.long, "device": p.device}
        self.kv_cache = [
            {"k": torch.zeros(shape, **kv), "v": torch.zeros(shape, **kv),
             "global_end_index": torch.zeros(1, **idx), "local_end_index": torch.zeros(1, **idx)}
            for _ in range(self.cfg.layers)
        ]  # fmt: skip

    def cached_frames(self) -> int:
        """Latent frames currently held in the rolling window (layer 0)."""
        if not self.kv_cache:
            return 0
        return int(self.kv_cache[0]["local_end_index"].item()) // self.cfg.tokens_per_frame

    def _forward(
        self,
        latent: torch.Tensor,
        actions: torch.Tensor,
        start_frame: int,
        write_cache: bool,
        memory: Sequence[KV] | None,
        timestep: float,
    ) -> tuple[torch.Tensor, list[KV]]:
        cfg = self.cfg
        nf = latent.shape[0]
        if latent.shape[1:] != (cfg.tokens_per_frame, cfg.dim) or not 1 <= nf <= cfg.window_frames:
            raise ValueError(f"latent {tuple(latent.shape)} is not [<= {cfg.window_frames}, tokens, dim]")
        if actions.shape != (nf, cfg.action_dim):
            raise ValueError(f"actions {tuple(actions.shape)} != ({nf}, {cfg.action_dim})")
        if memory is not None and len(memory) != cfg.layers:
            raise ValueError(f"memory has {len(memory)} layers, the model {cfg.layers}")
        if not self.kv_cache:
            self.reset_cache()
        p = self.head.weight
        x = latent.to(p.dtype).reshape(1, nf * cfg.tokens_per_frame, cfg.dim)
        x = x + self.time_embedding(_sinusoid(timestep, cfg.freq_dim).to(p.device, p.dtype)).view(1, 1, -1)
        kvs: list[KV] = []
        for i, block in enumerate(self.blocks):
            x, kv = block(
                x, actions, start_frame, write_cache, self.kv_cache[i], None if memory is None else memory[i]
            )
            kvs.append(kv)
        out: torch.Tensor = self.head(self.norm_out(x))
        return out.view(nf, cfg.tokens_per_frame, cfg.dim), kvs

    def forward_block(
        self,
        latent: torch.Tensor,
        actions: torch.Tensor,
        start_frame: int,
        write_cache: bool,
        memory: Sequence[KV] | None = None,
        *,
        timestep: float = 0.0,
    ) -> torch.Tensor:
        """One pass over a block. `latent: [frames, tokens, dim]` (embeddings), `actions: [frames,
        action_dim]`, frames at `start_frame ..`; `memory[layer] = (k, v)` `[1, m, heads, head_dim]`
        post-RoPE (already at their virtual positions) is prepended to the window. With `write_cache`
        the block's K/V is rolled into the cache as MG2 does; without, the cache is left as it was."""
        with torch.no_grad():
            return self._forward(latent, actions, start_frame, write_cache, memory, timestep)[0]

    def generate_block(
        self,
        latent: torch.Tensor,
        actions: torch.Tensor,
        start_frame: int,
        memory: Sequence[KV] | None = None,
        *,
        noise_seed: int | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """MG2's per-block loop: `passes_per_block - 1` denoising passes from `latent` (the block's noise),
        each re-noised with seeded noise, then the clean context pass on the prediction at timestep 0.

        Every pass writes this block's cache slots; the context pass overwrites them last, so the cache
        ends with the clean KV. Returns `(denoised prediction, final KV per layer)` where the KV is
        `(k, v)` of shape `[1, frames * tokens, heads, head_dim]`, keys post-RoPE at the block's frames.
        """
        seed = noise_seed if noise_seed is not None else self.cfg.seed * 1_000_003 + start_frame
        gen = torch.Generator().manual_seed(seed % 2**64)  # torch's range; any whole number seeds
        x = pred = latent
        steps = denoising_timesteps(self.cfg.passes_per_block - 1)
        with torch.no_grad():
            for i, t in enumerate(steps):
                pred = self._forward(x, actions, start_frame, True, memory, t)[0]
                if i + 1 < len(steps):
                    sigma = steps[i + 1] / 1000.0
                    noise = torch.randn(pred.shape, generator=gen).to(pred.device, pred.dtype)
                    x = (1.0 - sigma) * pred + sigma * noise
            _, final_kv = self._forward(pred, actions, start_frame, True, memory, 0.0)
        return pred, final_kv
