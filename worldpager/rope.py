"""RoPE for WorldPager: MG2's 3D rotary embedding, computed on the fly for any position.

MG2 (Wan2.1's `CausalWanModel`) builds its rotations once from a fixed table,
`rope_params(1024, d)`, and `causal_rope_apply` slices `freqs[0][start_frame:start_frame + f]` for the
time axis. Once `start_frame + f > 1024` the slice is short and generation crashes (~4.3 min of video);
the action module's own table (7500 latent frames) overflows the same way. RoPE attention scores depend
only on the position *difference*, so recomputing `exp(i * t * theta_j)` for any `t` (float64, exactly
the table's arithmetic) leaves in-window attention unchanged: `rope_freqs(positions)` equals
`table_rope_freqs(L)[positions]` bit for bit whenever the table is long enough.

Layout facts copied from MG2 (see docs/WORLDPAGER_REFERENCE.md §1.7):

* complex dims `c = head_dim // 2` split as `[c - 2(c//3), c//3, c//3]` (time, height, width) — for
  head_dim 128 that is `[22, 21, 21]`; each part has its own `rope_params` table of real dim `2 * part`;
* channel pairs are interleaved, `(2i, 2i + 1)` -> one complex number (`view_as_complex(x.reshape(..., -1,
  2))`), rotated in float64 and cast back to the input dtype.

Retrieved segments (post-RoPE keys written at their true frames) are moved to *virtual* positions just
before the attention window with `rerotate_time` (a delta rotation of the temporal pairs only) at the
start frames given by `virtual_positions`.
"""

from __future__ import annotations

import torch

RopeTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""MG2's `self.freqs` split into its (time, height, width) parts: complex128 `[max_len, part]` each."""

DEFAULT_THETA = 10000.0


class PositionalTableOverflow(RuntimeError):
    """A position lies outside a fixed RoPE table: MG2's crash at the end of its `rope_params` table.

    `table` names the table, `needed` is the table length the request would need, `length` the length
    it has.
    """

    def __init__(self, table: str, needed: int, length: int) -> None:
        self.table = table
        self.needed = needed
        self.length = length
        super().__init__(
            f"{table}: positions need a table of {needed} entries but it has {length} "
            "(MG2 stops here; use on-the-fly positions, table=None)"
        )


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    """`1 / theta ** (arange(0, dim, 2) / dim)` in float64, exactly as Wan's `rope_params`."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope dim must be a positive even number, got {dim}")
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))


def table_rope_freqs(max_len: int, dim: int, theta: float = DEFAULT_THETA) -> torch.Tensor:
    """MG2's `rope_params(max_len, dim, theta)`: complex128 `[max_len, dim // 2]` (the fixed table)."""
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    freqs = torch.outer(torch.arange(max_len), _inv_freq(dim, theta))
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_freqs(positions: torch.Tensor, dim: int, theta: float = DEFAULT_THETA) -> torch.Tensor:
    """Rotations for arbitrary integer `positions` (any value, negative included), computed on the fly.

    Returns complex128 `[len(positions), dim // 2]`, equal to `table_rope_freqs(L, dim)[positions]` for
    every table long enough to hold them.
    """
    if positions.dim() != 1 or positions.is_floating_point() or positions.is_complex():
        raise ValueError("positions must be a 1-D integer tensor")
    freqs = torch.outer(positions.to(torch.float64), _inv_freq(dim, theta))
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Complex dims of the (time, height, width) parts: `[c - 2(c//3), c//3, c//3]`, `c = head_dim//2`."""
    if head_dim < 6 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 6 for a 3D split, got {head_dim}")
    c = head_dim // 2
    return (c - 2 * (c // 3), c // 3, c // 3)


def mg2_rope_table(max_len: int, head_dim: int, theta: float = DEFAULT_THETA) -> RopeTable:
    """MG2's table: `cat([rope_params(L, d - 4(d//6)), rope_params(L, 2(d//6)) x 2], 1)`, kept split."""
    ct, ch, cw = rope_split(head_dim)
    return (
        table_rope_freqs(max_len, 2 * ct, theta),
        table_rope_freqs(max_len, 2 * ch, theta),
        table_rope_freqs(max_len, 2 * cw, theta),
    )


def _table_slice(table: torch.Tensor, start: int, n: int, name: str) -> torch.Tensor:
    if start < 0:
        raise ValueError(f"{name}: negative position {start} cannot index a table")
    if start + n > table.shape[0]:
        raise PositionalTableOverflow(name, start + n, table.shape[0])
    return table[start : start + n]


def _grid_freqs(
    head_dim: int, f: int, h: int, w: int, start_frame: int, table: RopeTable | None, theta: float
) -> torch.Tensor:
    """Complex128 `[f*h*w, 1, head_dim//2]`: time, height and width rotations per token (MG2's
    `freqs_i`)."""
    ct, ch, cw = rope_split(head_dim)
    if table is None:
        ft = rope_freqs(torch.arange(start_frame, start_frame + f), 2 * ct, theta)
        fh = rope_freqs(torch.arange(h), 2 * ch, theta)
        fw = rope_freqs(torch.arange(w), 2 * cw, theta)
    else:
        tt, th, tw = table
        if (tt.shape[1], th.shape[1], tw.shape[1]) != (ct, ch, cw):
            raise ValueError(
                f"RoPE table parts {tt.shape[1], th.shape[1], tw.shape[1]} != split {ct, ch, cw}"
            )
        ft = _table_slice(tt, start_frame, f, "3D RoPE time table")
        fh = _table_slice(th, 0, h, "3D RoPE height table")
        fw = _table_slice(tw, 0, w, "3D RoPE width table")
    grid = torch.cat(
        [
            ft.view(f, 1, 1, -1).expand(f, h, w, -1),
            fh.view(1, h, 1, -1).expand(f, h, w, -1),
            fw.view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    )
    return grid.reshape(f * h * w, 1, -1)


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` real -> `[..., d // 2]` complex128 with interleaved pairs (2i, 2i+1)."""
    return torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2).contiguous())


def _check_tokens(x: torch.Tensor, f: int, h: int, w: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if min(f, h, w) <= 0 or x.shape[1] != f * h * w:
        raise ValueError(f"seq length {x.shape[1]} != f*h*w = {f}*{h}*{w}")


def apply_rope_3d(
    x: torch.Tensor,
    f: int,
    h: int,
    w: int,
    start_frame: int,
    table: RopeTable | None = None,
    theta: float = DEFAULT_THETA,
) -> torch.Tensor:
    """MG2's `causal_rope_apply` for `x: [b, f*h*w, heads, head_dim]` (tokens frame-major, then h, w).

    Frames are at `start_frame .. start_frame + f - 1`. With `table` (MG2's way) a frame past the table
    raises `PositionalTableOverflow`; with `table=None` the rotations are computed for any position.
    """
    _check_tokens(x, f, h, w)
    freqs = _grid_freqs(x.shape[3], f, h, w, start_frame, table, theta).to(x.device)
    return torch.view_as_real(_as_complex(x) * freqs).flatten(3).type_as(x)


def apply_rope_1d(
    x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None = None, theta: float = DEFAULT_THETA
) -> torch.Tensor:
    """1D RoPE over the whole head dim, `x: [b, s, heads, d]`, one integer position per token.

    With `table` (complex `[L, d // 2]`, as MG2's action module keeps one) a position outside it raises
    `PositionalTableOverflow`; with `table=None` rotations are computed on the fly.
    """
    if x.dim() != 4 or positions.shape != (x.shape[1],):
        raise ValueError(f"positions {tuple(positions.shape)} must be [seq] for x {tuple(x.shape)}")
    if table is None:
        freqs = rope_freqs(positions, x.shape[3], theta)
    else:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0:
            raise ValueError(f"action RoPE table: negative position {lo} cannot index a table")
        if hi >= table.shape[0]:
            raise PositionalTableOverflow("action RoPE table", hi + 1, table.shape[0])
        freqs = table[positions.to(table.device)]
    freqs = freqs.to(x.device).unsqueeze(1)
    return torch.view_as_real(_as_complex(x) * freqs).flatten(3).type_as(x)


def rerotate_time(
    k_post_rope: torch.Tensor,
    f: int,
    h: int,
    w: int,
    from_frame: int,
    to_frame: int,
    theta: float = DEFAULT_THETA,
) -> torch.Tensor:
    """Move post-RoPE keys of `f` frames from start frame `from_frame` to `to_frame`.

    Multiplies the temporal complex pairs by `exp(i * theta_j * (to_frame - from_frame))` (float64, cast
    back); the height/width channels are copied unchanged. The result equals `apply_rope_3d(k_pre, f, h,
    w, to_frame)` up to rounding of the input dtype.
    """
    _check_tokens(k_post_rope, f, h, w)
    ct = rope_split(k_post_rope.shape[3])[0]
    out = k_post_rope.clone()
    if to_frame == from_frame:
        return out
    inv = _inv_freq(2 * ct, theta)
    angle = float(to_frame - from_frame) * inv
    rot = torch.polar(torch.ones_like(angle), angle).to(k_post_rope.device)
    time_part = k_post_rope[..., : 2 * ct]
    out[..., : 2 * ct] = torch.view_as_real(_as_complex(time_part) * rot).flatten(3).type_as(k_post_rope)
    return out


def virtual_positions(
    window_start_frame: int, n_segments: int, frames_per_segment: int = 3, gap: int = 0
) -> list[int]:
    """Start frames for `n_segments` retrieved segments placed just before the attention window.

    The list is in the order the segments were given, oldest first: segment `j` of `k` (0 = oldest)
    starts at `window_start_frame - gap - frames_per_segment * (k - j)`, so the newest one ends `gap`
    frames before `window_start_frame` and true-time order is preserved. `gap` (default 0) leaves that
    many empty frames between memory and window. Results may be negative; that is fine with on-the-fly
    rotations, since attention scores depend only on position differences.
    """
    if n_segments < 0 or frames_per_segment <= 0 or gap < 0:
        raise ValueError("need n_segments >= 0, frames_per_segment > 0, gap >= 0")
    k = n_segments
    return [window_start_frame - gap - frames_per_segment * (k - j) for j in range(k)]
