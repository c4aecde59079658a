"""Segment layout: one segment's KV as one payload.

* `SegmentLayout` -- the shape of one segment's KV (``layers`` x (K, V)) and its payload: layer-major
  pages, each page ``K`` then ``V`` encoded with a codec (`worldpager.codecs`); `encode` / `decode` /
  page offsets, and `rerotate` (the keys' temporal dims moved to new start frames, `rope.rerotate_time`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worldpager import codecs, rope
from worldpager.model import KV, TinyConfig

__all__ = ["SegmentLayout"]


@dataclass(frozen=True)
class SegmentLayout:
    """Shape of one segment's KV: ``layers`` x (K, V) of ``[1, frames*latent_h*latent_w, heads, head_dim]``,
    stored as one payload of layer-major pages (page = K bytes then V bytes) under ``codec``."""

    layers: int
    heads: int
    head_dim: int
    frames: int
    latent_h: int
    latent_w: int
    codec: str = "bf16"
    dtype: torch.dtype = torch.float32
    rope_theta: float = rope.DEFAULT_THETA

    def __post_init__(self) -> None:
        if self.codec not in codecs.CODECS:
            raise ValueError(f"unknown codec {self.codec!r}: expected one of {', '.join(codecs.CODECS)}")
        if min(self.layers, self.heads, self.frames, self.latent_h, self.latent_w) < 1:
            raise ValueError("layers, heads, frames, latent_h and latent_w must be >= 1")
        rope.rope_split(self.head_dim)

    @classmethod
    def from_config(cls, cfg: TinyConfig, codec: str, dtype: torch.dtype = torch.float32) -> SegmentLayout:
        return cls(
            cfg.layers, cfg.heads, cfg.head_dim, cfg.frames_per_block, cfg.latent_h, cfg.latent_w,
            codec, dtype, cfg.rope_theta,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.frames * self.latent_h * self.latent_w

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (1, self.tokens, self.heads, self.head_dim)

    @property
    def _tensor_nbytes(self) -> int:
        return codecs.packed_nbytes(math.prod(self.kv_shape), self.codec)

    @property
    def page_nbytes(self) -> int:
        return 2 * self._tensor_nbytes

    @property
    def payload_nbytes(self) -> int:
        return self.layers * self.page_nbytes

    @property
    def page_offsets(self) -> tuple[int, ...]:
        return tuple(i * self.page_nbytes for i in range(self.layers))

    @property
    def decoded_nbytes(self) -> int:
        """Bytes of one segment ready for attention (all layers, K and V, in ``dtype``)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.layers * 2 * math.prod(self.kv_shape) * elem

    def encode(self, kv: Sequence[KV]) -> bytes:
        if len(kv) != self.layers:
            raise ValueError(f"{len(kv)} layers of KV, the layout has {self.layers}")
        parts: list[bytes] = []
        for k, v in kv:
            for t in (k, v):
                if tuple(t.shape) != self.kv_shape:
                    raise ValueError(f"KV shape {tuple(t.shape)} != {self.kv_shape}")
                parts.append(codecs.to_bytes(codecs.encode(t.to(self.dtype), self.codec)))
        return b"".join(parts)

    def decode(self, payload: bytes | torch.Tensor, device: torch.device | str | None = None) -> list[KV]:
        """Per-layer ``(K, V)`` from a payload (``bytes`` or a 1-D uint8 tensor on any device; the
        codec runs where the tensor is, then the result moves to ``device``)."""
        buf = (
            payload
            if isinstance(payload, torch.Tensor)
            else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        )
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.payload_nbytes:
            raise ValueError(f"payload of {buf.numel()} bytes, the layout needs {self.payload_nbytes}")
        n, dtype = self._tensor_nbytes, str(self.dtype).removeprefix("torch.")
        out: list[KV] = []
        for off in self.page_offsets:
            k, v = (
                codecs.decode(codecs.Packed(self.codec, self.kv_shape, dtype, buf[a : a + n]), device)
                for a in (off, off + n)
            )
            out.append((k, v))
        return out

    def decode_page(self, page: torch.Tensor, device: torch.device | str | None = None) -> KV:
        """One layer's ``(K, V)`` from its page (a 1-D uint8 tensor of ``page_nbytes``, on any device:
        the codec runs where it is, then the result moves to ``device``): `decode` one layer at a
        time, for a caller that must not hold a whole segment's decoded KV at once."""
        if page.dtype != torch.uint8 or page.dim() != 1 or page.numel() != self.page_nbytes:
            raise ValueError(f"page of {page.numel()} bytes, the layout needs {self.page_nbytes}")
        n, dtype = self._tensor_nbytes, str(self.dtype).removeprefix("torch.")
        k, v = (
            codecs.decode(codecs.Packed(self.codec, self.kv_shape, dtype, page[a : a + n]), device)
            for a in (0, n)
        )
        return k, v

    def rerotate(self, kv: Sequence[KV], from_frame: int, to_frame: int) -> list[KV]:
        """Keys moved from start frame ``from_frame`` to ``to_frame`` (temporal dims only); V as is."""
        h, w = self.latent_h, self.latent_w
        return [
            (rope.rerotate_time(k, self.frames, h, w, from_frame, to_frame, self.rope_theta), v)
            for k, v in kv
        ]
