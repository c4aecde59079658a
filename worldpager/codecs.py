"""Codecs for WorldPager KV pages: ``bf16`` (as is), ``int8`` and ``int4`` (group-wise asymmetric).

A page is one K or V tensor of one (segment, layer), shaped ``[1, tokens, heads, 128]`` in MG2 (a full
page is ``[1, 2640, 12, 128]`` bf16 = 7.73 MiB). :func:`encode` turns it into a :class:`Packed` whose
``payload`` is one contiguous 1-D ``torch.uint8`` buffer (so it can be written to / read from a file or
a pinned host buffer as plain bytes); :func:`decode` gives back a tensor of the original shape and
dtype. :func:`to_bytes` / :func:`from_bytes` convert to and from ``bytes`` (``from_bytes`` checks the
length against :func:`packed_nbytes`, so a truncated or over-long payload is refused, never decoded).

Layout of ``payload`` (``n`` values, ``G = ceil(n / 128)`` groups)
------------------------------------------------------------------
* ``bf16``: the ``n`` values as bfloat16, native byte order: ``2·n`` bytes. Exact for bf16 input;
  other float inputs are rounded to bf16 (and cast back to their dtype on decode; for fp16 pages
  clamped to ±65504, since fp16's largest values round up to 65536 in bf16).
* ``int8``: ``n`` code bytes, then ``G`` fp16 scales, then ``G`` fp16 zeros: ``n + 4·G`` bytes
  (8.25 bits/value when ``n`` is a multiple of 128).
* ``int4``: ``ceil(n / 2)`` bytes of codes packed two per byte, value ``2i`` in the low nibble and
  value ``2i + 1`` in the high nibble, then ``G`` fp16 scales, then ``G`` fp16 zeros:
  ``ceil(n / 2) + 4·G`` bytes (4.25 bits/value when ``n`` is a multiple of 128).

Quantization
------------
A group is ``GROUP = 128`` consecutive values of the flattened (row-major) tensor, so for K/V pages
shaped ``[..., heads, 128]`` a group is exactly one (token, head) vector over head_dim. A last partial
group is padded internally by repeating the last value (this changes neither its min nor its max;
the padding is not stored). With ``L = 2^b − 1`` (15 or 255)::

    zero  = min(group)            rounded DOWN to fp16
    scale = (max(group) − zero)/L rounded UP to fp16
    q     = clamp(round((x − zero) / scale), 0, L)          (q = 0 where scale == 0)
    x̂     = q · scale + zero                                (computed in fp32)

Error bound: because ``zero`` is rounded down and ``scale`` up, every value of the group lies in
``[zero, zero + L·scale]`` and ``|x − x̂| ≤ scale / 2`` per value, with ``scale`` the *stored* fp16
scale of its group — the fp16 rounding of scale/zero is already inside that number (the stored scale
is at most one fp16 ulp above the exact ``(max − min)/L``, the stored zero at most one ulp below
``min``). On top of that come a few fp32 ulps of arithmetic and the rounding of x̂ to the output dtype
(half a bf16 ulp for bf16 pages). For fp16 pages x̂ is clamped to ±65504, so a group reaching fp16's
largest value never decodes to inf (clamping only moves x̂ closer to x). A constant group whose value
is representable in fp16 (every bf16 value in fp16's range is) gets ``scale = 0`` and decodes exactly
to the constant — no division by zero, no NaN. On Gaussian data the relative Frobenius error is
≈ 0.10 for int4 and ≈ 0.006 for int8.

Values the codecs refuse (``ValueError``, never stored silently): NaN or ±inf in any codec, and for
int8/int4 a group whose min or scale does not fit in fp16 (``|min| > 65504``).

Why asymmetric, group 128: the paper's "2.8 min of int4 KV in 32 GiB" against "45 s of bf16" is a
bf16/int4 size ratio of 168/45 ≈ 3.73, i.e. ≈ 4.29 bits per value (4.21–4.36 for 2.75–2.85 min). That
matches 4.25 bits = 4-bit codes + an fp16 scale + an fp16 zero per 128 values; group 64 (FlexGen's
default, 4.5 bits) would give 2.67 min and plain 4 bits 3.0 min. An asymmetric (min/max) grid costs
the same 32 bits per group as a symmetric one plus padding would, but uses all 2^b codes on skewed
groups; group = head_dim = 128 is per-(token, head), like KIVI's per-token value quantization.

Everything is vectorised over groups (no Python loop) and runs on the input's device; a full MG2 page
(~4M values) encodes in tens of milliseconds on a CPU.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CODECS",
    "GROUP",
    "Packed",
    "bits_per_value",
    "decode",
    "encode",
    "from_bytes",
    "packed_nbytes",
    "to_bytes",
]

CODECS: tuple[str, ...] = ("bf16", "int8", "int4")
GROUP = 128
_LEVELS = {"int8": 255, "int4": 15}
_FP16_MAX = 65504.0


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known codecs: {', '.join(CODECS)}")


def _groups(numel: int) -> int:
    return -(-numel // GROUP)


def _code_nbytes(numel: int, codec: str) -> int:
    if codec == "bf16":
        return 2 * numel
    if codec == "int8":
        return numel
    return -(-numel // 2)


def packed_nbytes(numel: int, codec: str) -> int:
    """Exact payload size in bytes for ``numel`` values: bf16 ``2n``; int8 ``n + 4G``; int4
    ``ceil(n/2) + 4G`` with ``G = ceil(n/128)`` (an fp16 scale and an fp16 zero per group)."""
    _check_codec(codec)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if codec == "bf16":
        return 2 * numel
    return _code_nbytes(numel, codec) + 4 * _groups(numel)


def bits_per_value(codec: str) -> float:
    """Stored bits per value for whole groups: bf16 16.0, int8 8.25, int4 4.25."""
    return packed_nbytes(GROUP, codec) * 8 / GROUP


def _dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        dt = name
    else:
        attr = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(attr, torch.dtype):
            raise ValueError(f"unknown dtype name {name!r}")
        dt = attr
    if not dt.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dt}")
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True)
class Packed:
    """An encoded page: ``payload`` (1-D uint8, codes then scales then zeros) plus what is needed to
    decode it. The payload length is checked against :func:`packed_nbytes` on construction."""

    codec: str
    shape: tuple[int, ...]
    dtype: str
    payload: torch.Tensor

    def __post_init__(self) -> None:
        _check_codec(self.codec)
        _dtype_from_name(self.dtype)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        if self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise ValueError(
                f"payload must be a 1-D torch.uint8 tensor, got {self.payload.dtype} "
                f"with {self.payload.dim()} dims"
            )
        expected = packed_nbytes(self.numel, self.codec)
        if self.payload.numel() != expected:
            raise ValueError(
                f"{self.codec} payload for shape {self.shape}: expected {expected} bytes, "
                f"got {self.payload.numel()}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return packed_nbytes(self.numel, self.codec)

    @property
    def device(self) -> torch.device:
        return self.payload.device


# ---- fp16 directed rounding (bit manipulation: works on every device) --------------------------


def _fp16_down(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 <= v (finite v within range; -inf below -65504; NaN stays NaN)."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    # next fp16 towards -inf: negative (sign bit set) magnitudes grow (+1), +0 -> -smallest subnormal,
    # positive magnitudes shrink (-1)
    nxt = torch.where(bits < 0, bits + 1, torch.where(bits == 0, torch.full_like(bits, -32767), bits - 1))
    return torch.where(h.float() > v, nxt.view(torch.float16), h)


def _fp16_up_nonneg(v: torch.Tensor) -> torch.Tensor:
    """fp32 v >= 0 -> the smallest fp16 >= v (+inf above 65504)."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    return torch.where(h.float() < v, (bits + 1).view(torch.float16), h)


def _raise_bad_values(x: torch.Tensor, codec: str) -> None:
    """The ValueError for input ``x`` (as given, before any conversion: a finite float64 or fp32
    value past the range of bf16 or fp32 is named as out of range, not as inf)."""
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    if n_nan or n_inf:
        raise ValueError(f"cannot encode non-finite values with {codec}: {n_nan} NaN, {n_inf} inf")
    big = float(x.abs().max())
    if codec == "bf16":
        limit = torch.finfo(torch.bfloat16).max
        raise ValueError(f"values out of range for bf16: |x| must be <= {limit:g}; max |x| = {big:g}")
    raise ValueError(
        f"values out of range for {codec}: a group's min/scale must fit in fp16 "
        f"(|min| <= {_FP16_MAX:g}); max |x| = {big:g}"
    )


# ---- encode / decode ------------------------------------------------------------------------------


def encode(x: torch.Tensor, codec: str) -> Packed:
    """Encode a float tensor (any shape, CPU or CUDA; the work stays on its device) with ``codec``."""
    _check_codec(codec)
    if not x.dtype.is_floating_point:
        raise TypeError(f"encode needs a floating-point tensor, got {x.dtype}")
    shape = tuple(x.shape)
    dtype = _dtype_name(x.dtype)
    n = x.numel()
    flat = x.detach().reshape(-1)
    dev = x.device
    if n == 0:
        return Packed(codec, shape, dtype, torch.empty(0, dtype=torch.uint8, device=dev))

    if codec == "bf16":
        buf = torch.empty(n, dtype=torch.bfloat16, device=dev)
        buf.copy_(flat)
        # a sum is ~5x cheaper than isfinite().all() on CPU and is non-finite whenever a value is;
        # only then (or on a rare overflow of the sum itself) look value by value
        if not bool(torch.isfinite(buf.sum())) and not bool(torch.isfinite(buf).all()):
            _raise_bad_values(flat, codec)
        return Packed(codec, shape, dtype, buf.view(torch.uint8))

    levels = _LEVELS[codec]
    g = _groups(n)
    xf = torch.empty(g * GROUP, dtype=torch.float32, device=dev)
    xf[:n].copy_(flat)
    if g * GROUP != n:
        xf[n:] = xf[n - 1]  # repeat the last value: min/max of the last group are unchanged
    xg = xf.view(g, GROUP)

    mn = xg.amin(dim=1)
    mx = xg.amax(dim=1)
    zero = _fp16_down(mn)
    zf = zero.float()
    scale = _fp16_up_nonneg((mx - zf) / levels)
    if not bool((torch.isfinite(zero) & torch.isfinite(scale)).all()):
        _raise_bad_values(flat, codec)
    sf = scale.float()
    denom = torch.where(sf > 0, sf, torch.ones_like(sf))

    q = xg.sub_(zf[:, None]).div_(denom[:, None]).round_().clamp_(0, levels).to(torch.uint8).view(-1)
    if codec == "int8":
        codes = q[:n]
    else:
        pairs = q[: 2 * _code_nbytes(n, codec)].view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    payload = torch.cat([codes, scale.view(torch.uint8), zero.view(torch.uint8)])
    return Packed(codec, shape, dtype, payload)


def _as_dtype(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copying first if its offset is misaligned)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if payload.storage_offset() % size:
        payload = payload.clone()
    return payload.view(dtype)


def decode(p: Packed, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode to a new tensor of ``p.shape`` and the original dtype, on ``device`` (default: the
    payload's device; the compressed payload is moved first, then decoded there)."""
    out_dtype = _dtype_from_name(p.dtype)
    payload = p.payload if device is None else p.payload.to(device)
    dev = payload.device
    n = p.numel
    if n == 0:
        return torch.empty(p.shape, dtype=out_dtype, device=dev)

    if p.codec == "bf16":
        x = _as_dtype(payload, torch.bfloat16).reshape(p.shape)
        if torch.finfo(out_dtype).max < torch.finfo(torch.bfloat16).max:
            # an fp16 page: its largest values round up past fp16's range in bf16 (65504 -> 65536),
            # so the cast back would give inf; clamped, as every original value lies within range
            big = torch.finfo(out_dtype).max
            return x.float().clamp_(-big, big).to(out_dtype)
        return x.to(out_dtype, copy=True)

    g = _groups(n)
    c = _code_nbytes(n, p.codec)
    codes = payload[:c]
    scale = _as_dtype(payload[c : c + 2 * g], torch.float16).float()
    zero = _as_dtype(payload[c + 2 * g :], torch.float16).float()

    q = torch.empty(g * GROUP, dtype=torch.float32, device=dev)
    if p.codec == "int8":
        q[:n].copy_(codes)
    else:
        nib = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)
        q[: nib.numel()].copy_(nib[: g * GROUP])
    if g * GROUP != n:
        q[n:] = 0
    qg = q.view(g, GROUP)
    xh = qg.mul_(scale[:, None]).add_(zero[:, None]).view(-1)
    big = torch.finfo(out_dtype).max
    if big < 1e38:  # fp16 (float8): x̂ may pass the largest value (scale is rounded up), and the cast
        xh.clamp_(-big, big)  # would give inf; clamped, as every original value lies within range
    return xh[:n].reshape(p.shape).to(out_dtype)


# ---- bytes ----------------------------------------------------------------------------------------


def to_bytes(p: Packed) -> bytes:
    """The payload as ``bytes`` (copied to host memory first if it lives on an accelerator)."""
    t = p.payload.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel())


def from_bytes(
    codec: str, shape: Sequence[int], dtype: str | torch.dtype, data: bytes | bytearray | memoryview
) -> Packed:
    """Rebuild a :class:`Packed` from its payload bytes. The length must equal
    ``packed_nbytes(prod(shape), codec)``, else ``ValueError`` naming expected and actual lengths.
    A writable buffer (bytearray, writable memoryview) is wrapped without a copy; read-only data
    (bytes) is copied once."""
    _check_codec(codec)
    shape_t = tuple(int(d) for d in shape)
    dtype_name = _dtype_name(_dtype_from_name(dtype))
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    expected = packed_nbytes(math.prod(shape_t), codec)
    if mv.nbytes != expected:
        raise ValueError(f"{codec} payload for shape {shape_t}: expected {expected} bytes, got {mv.nbytes}")
    if expected == 0:
        payload = torch.empty(0, dtype=torch.uint8)
    else:
        buf = mv if not mv.readonly else bytearray(mv)
        payload = torch.frombuffer(buf, dtype=torch.uint8)
    return Packed(codec, shape_t, dtype_name, payload)
