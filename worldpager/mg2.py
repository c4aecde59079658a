"""Matrix-Game 2.0 dimensions and the sizing arithmetic behind WorldPager's numbers (pure stdlib).

A WorldPager *segment* is one MG2 inference block: `frames_per_block` (3) latent frames, whose clean
self-attention KV becomes final after the block's context pass. Its KV is, over all layers,
`layers × (K + V) × tokens_per_segment × dim` values: for MG2 30 × 2 × 2640 × 1536 = 243,302,400
values = 486,604,800 bytes in bf16 (486.6 MB = 464.1 MiB). See WORLDPAGER_REFERENCE.md §1–2.

Frame rate: WorldPager uses **16 fps**, Wan2.1's native rate (`wan_shared_cfg.sample_fps = 16`) and
the rate the paper's minutes assume (one segment = 12 video frames = 0.75 s). MG2's own exporter
(`utils/visualize.py`) writes videos at 12 fps; at that rate every duration here scales by 16/12.
`dataclasses.replace(MG2, fps=12.0)` (or the CLI's `--fps 12`) gives those numbers.

The paper's host-memory figures (45 s bf16, ≈2.8 min int4 in 32 GiB) follow only with an effective
pool of ≈85 % of the host budget (`usable`) and ≈4.25 bits per value for int4 (4-bit codes plus an
fp16 scale and an fp16 zero point per group of 128 values).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

__all__ = [
    "CODEC_BITS",
    "DEFAULT_USABLE",
    "MG2",
    "MICRO",
    "PRESETS",
    "TINY",
    "ModelDims",
    "memory_seconds",
    "positional_horizon_s",
    "segment_bytes",
    "segments_in_host",
    "sizing",
]

DEFAULT_USABLE: Final = 0.85
"""Share of the host budget that holds segment KV (the rest: allocator slack, pinned staging, the
process itself). 0.85 is what the paper's 45 s / 2.8 min figures imply for 32 GiB."""

CODEC_BITS: Final[dict[str, float]] = {
    "bf16": 16.0,
    # Group-wise asymmetric quantization: an fp16 scale + an fp16 zero per 128 values = 32/128 = +0.25 bit.
    "int8": 8.25,
    "int4": 4.25,
}
"""Stored bits per KV value, per codec (payload plus per-group metadata)."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a causal video world model that decide its KV size and positional range.

    Frame counts are *latent* frames unless a name says video frames; one latent frame decodes to
    `vae_time_ratio` video frames (after the first). `rope_table_frames` is the length of the
    backbone's temporal RoPE table, `action_rope_table_frames` that of the action module's.
    """

    layers: int
    dim: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    frames_per_block: int
    window_frames: int
    rope_table_frames: int
    action_rope_table_frames: int
    vae_time_ratio: int = 4
    fps: float = 16.0

    def __post_init__(self) -> None:
        for name in (
            "layers",
            "dim",
            "heads",
            "head_dim",
            "tokens_per_frame",
            "frames_per_block",
            "window_frames",
            "rope_table_frames",
            "action_rope_table_frames",
            "vae_time_ratio",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelDims.{name} = {value!r}: expected a positive integer")
        if self.heads * self.head_dim != self.dim:
            raise ValueError(
                f"ModelDims: heads × head_dim = {self.heads} × {self.head_dim} = "
                f"{self.heads * self.head_dim}, expected it to equal dim = {self.dim}"
            )
        fps = self.fps
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"ModelDims.fps = {fps!r}: expected a finite number of frames per second > 0")

    @property
    def tokens_per_segment(self) -> int:
        """Tokens of one segment (= one inference block): 880 × 3 = 2640 for MG2."""
        return self.tokens_per_frame * self.frames_per_block

    @property
    def kv_values_per_segment(self) -> int:
        """K and V values of one segment over all layers: 30 × 2 × 2640 × 1536 = 243,302,400 for MG2."""
        return self.layers * 2 * self.tokens_per_segment * self.dim

    @property
    def video_frames_per_segment(self) -> int:
        """Video frames one segment decodes to (after the first block): 4 × 3 = 12."""
        return self.vae_time_ratio * self.frames_per_block

    @property
    def segment_seconds(self) -> float:
        """Seconds of video per segment: 12 / 16 = 0.75 s at 16 fps (1.0 s at 12 fps)."""
        return self.video_frames_per_segment / self.fps


MG2: Final = ModelDims(
    layers=30,
    dim=1536,
    heads=12,
    head_dim=128,
    tokens_per_frame=880,
    frames_per_block=3,
    window_frames=6,
    rope_table_frames=1024,
    action_rope_table_frames=7500,
    vae_time_ratio=4,
    fps=16.0,
)
"""Matrix-Game 2.0 (universal/templerun distilled configs): Wan2.1-1.3B backbone, 352×640 video →
44×80 latents → 880 tokens per latent frame; 16 fps (Wan's native rate, the paper's)."""

MICRO: Final = ModelDims(
    layers=2,
    dim=64,
    heads=4,
    head_dim=16,
    tokens_per_frame=24,
    frames_per_block=3,
    window_frames=6,
    rope_table_frames=16,
    action_rope_table_frames=40,
    vae_time_ratio=4,
    fps=16.0,
)
"""The unit tests' CPU-sized stand-in (`worldpager session --preset micro`): MG2's KV structure
(same block/window shape) with tiny tables, so that the positional limits are reached within a
short test session."""

TINY: Final = dataclasses.replace(MICRO, layers=32, dim=256, head_dim=64, tokens_per_frame=36)
"""The stand-in `worldpager session` runs by default (`--preset tiny`): MICRO's structure, deeper and
wider (32 layers, dim 256, 6 x 6 latent tokens per frame: 3.375 MiB per bf16 segment)."""

PRESETS: Final[dict[str, ModelDims]] = {"mg2": MG2, "tiny": TINY, "micro": MICRO}
"""`worldpager sizing --model`: MG2, and the stand-ins `worldpager session --preset` runs."""


def _codec_bits(codec: str) -> float:
    try:
        return CODEC_BITS[codec]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {codec!r}: expected one of {', '.join(CODEC_BITS)}") from None


def _check_usable(usable: float) -> None:
    if (
        isinstance(usable, bool)
        or not isinstance(usable, int | float)
        or not math.isfinite(usable)
        or not 0 < usable <= 1
    ):
        raise ValueError(f"usable = {usable!r}: expected a fraction of the host budget in (0, 1]")


def _check_host_bytes(host_bytes: int) -> None:
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int):
        raise ValueError(f"host memory = {host_bytes!r}: expected a whole number of bytes")
    if host_bytes <= 0:
        raise ValueError(f"host memory = {host_bytes} bytes: expected a positive number of bytes")


def segment_bytes(dims: ModelDims, codec: str) -> int:
    """Bytes one segment's KV takes under `codec`: ceil(kv_values × bits / 8).

    MG2: bf16 486,604,800; int8 250,905,600; int4 129,254,400.
    """
    bits = _codec_bits(codec)
    return math.ceil(Fraction(dims.kv_values_per_segment) * Fraction(bits) / 8)


def _host_budget_bytes(host_bytes: int, usable: float) -> int:
    _check_host_bytes(host_bytes)
    _check_usable(usable)
    # str() gives the shortest decimal of the float, so 0.85 counts as exactly 17/20.
    return math.floor(host_bytes * Fraction(str(usable)))


def segments_in_host(dims: ModelDims, host_bytes: int, codec: str, usable: float = DEFAULT_USABLE) -> int:
    """Whole segments that fit in `usable` of `host_bytes`: floor(host_bytes × usable / segment_bytes).

    32 GiB at 0.85: bf16 60, int8 116, int4 225 (the paper's "≈226").
    """
    seg = segment_bytes(dims, codec)
    return _host_budget_bytes(host_bytes, usable) // seg


def memory_seconds(dims: ModelDims, segments: int) -> float:
    """Seconds of video that `segments` segments hold: segments × segment_seconds (0.75 s at 16 fps)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 0:
        raise ValueError(f"segments = {segments!r}: expected a non-negative integer")
    return segments * dims.segment_seconds


def positional_horizon_s(dims: ModelDims, table_frames: int | None = None) -> float:
    """Seconds of video a temporal RoPE table of `table_frames` latent frames covers:
    (1 + vae_time_ratio × (table_frames − 1)) / fps.

    Defaults to the backbone's table (MG2: 1024 → 4093 frames / 16 fps = 255.8 s ≈ 4.3 min; in
    practice generation fails a block earlier, at ≈255.6 s, when the 3-frame slice runs off the table).
    Pass `dims.action_rope_table_frames` for the action module (MG2: 7500 → 1874.8 s ≈ 31.2 min).
    """
    frames = dims.rope_table_frames if table_frames is None else table_frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"table_frames = {frames!r}: expected a positive number of latent frames")
    return (1 + dims.vae_time_ratio * (frames - 1)) / dims.fps


def sizing(dims: ModelDims, host_bytes: int, codec: str, usable: float = DEFAULT_USABLE) -> dict[str, Any]:
    """Everything `worldpager sizing` reports, as one JSON-ready dict.

    Keys: the CLI contract's `segment_bytes, segments_in_host, memory_seconds, positional_horizon_s,
    fps`, plus `codec, bits_per_value, host_budget_bytes, usable, action_positional_horizon_s,
    segment_seconds`.
    """
    bits = _codec_bits(codec)
    seg = segment_bytes(dims, codec)
    budget = _host_budget_bytes(host_bytes, usable)
    segments = budget // seg
    return {
        "segment_bytes": seg,
        "segments_in_host": segments,
        "memory_seconds": memory_seconds(dims, segments),
        "positional_horizon_s": positional_horizon_s(dims),
        "fps": float(dims.fps),
        "codec": codec,
        "bits_per_value": bits,
        "host_budget_bytes": budget,
        "usable": float(usable),
        "action_positional_horizon_s": positional_horizon_s(dims, dims.action_rope_table_frames),
        "segment_seconds": dims.segment_seconds,
    }
