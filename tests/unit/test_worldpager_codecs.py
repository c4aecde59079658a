"""worldpager.codecs: sizes, round trips, the per-value error bound, refusals, bytes round trip."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldpager.codecs import (
    CODECS,
    GROUP,
    Packed,
    bits_per_value,
    decode,
    encode,
    from_bytes,
    packed_nbytes,
    to_bytes,
)

INT_CODECS = ("int8", "int4")
FLOATS = (torch.float32, torch.bfloat16)


def randn(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def scales_zeros(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored fp16 scales and zeros (from the documented layout: codes, scales, zeros)."""
    g = math.ceil(p.numel / GROUP)
    raw = to_bytes(p)[-4 * g :]
    sz = torch.frombuffer(bytearray(raw), dtype=torch.float16).float()
    return sz[:g], sz[g:]


def per_value(t: torch.Tensor, n: int) -> torch.Tensor:
    """A per-group tensor expanded to the first n values of the flattened page."""
    return t.repeat_interleave(GROUP)[:n]


def assert_within_bound(x: torch.Tensor, p: Packed, xh: torch.Tensor) -> torch.Tensor:
    """|x − x̂| ≤ scale/2 of the value's group, plus fp32 arithmetic and output-dtype rounding."""
    n = x.numel()
    scale, zero = scales_zeros(p)
    xf = x.reshape(-1).float()
    err = (xf - xh.reshape(-1).float()).abs()
    mag = torch.maximum(xf.abs(), per_value(zero.abs(), n))
    tol = per_value(scale, n) / 2 + mag * (torch.finfo(x.dtype).eps + 1e-6) + 1e-30
    bad = err > tol
    assert not bool(bad.any()), f"{int(bad.sum())} values over the bound; worst excess {(err - tol).max()}"
    return scale


def rel_fro(x: torch.Tensor, xh: torch.Tensor) -> float:
    return float((x.float() - xh.float()).norm() / x.float().norm())


# ---- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 127, 128, 129, 255, 256, 1000, 4096, 12 * 128 * 7 + 5])
def test_packed_nbytes_formula(n: int) -> None:
    g = math.ceil(n / 128)
    assert packed_nbytes(n, "bf16") == 2 * n
    assert packed_nbytes(n, "int8") == n + 4 * g
    assert packed_nbytes(n, "int4") == math.ceil(n / 2) + 4 * g
    x = randn((n,), seed=n)
    for codec in CODECS:
        p = encode(x, codec)
        assert p.payload.dtype == torch.uint8 and p.payload.dim() == 1
        assert p.payload.numel() == p.nbytes == packed_nbytes(n, codec)
        assert len(to_bytes(p)) == p.nbytes
        assert decode(p).shape == x.shape


def test_bits_per_value() -> None:
    assert bits_per_value("bf16") == 16.0
    assert bits_per_value("int8") == 8.25
    assert bits_per_value("int4") == 4.25
    assert GROUP == 128 and CODECS == ("bf16", "int8", "int4")


def test_full_mg2_segment_int4_size_is_4_25_bits() -> None:
    n = 30 * 2 * 2640 * 1536  # layers × (K, V) × tokens × (12 heads × 128)
    assert packed_nbytes(n, "int4") == math.ceil(n * 4.25 / 8)
    assert packed_nbytes(n, "int8") == math.ceil(n * 8.25 / 8)
    assert packed_nbytes(n, "bf16") == 486_604_800


def test_unknown_codec() -> None:
    x = randn((4,))
    for call in (lambda: encode(x, "fp8"), lambda: packed_nbytes(4, "fp8"), lambda: bits_per_value("x")):
        with pytest.raises(ValueError, match="bf16, int8, int4"):
            call()
    with pytest.raises(ValueError, match="int4"):
        from_bytes("int3", (4,), "float32", b"")


def test_non_float_input_rejected() -> None:
    with pytest.raises(TypeError):
        encode(torch.arange(8), "int4")


# ---- round trips -------------------------------------------------------------------------------


def test_bf16_round_trip_exact() -> None:
    x = randn((3, 7, 2, 128), torch.bfloat16, seed=1) * 100
    p = encode(x, "bf16")
    y = decode(p)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(x, y)
    y.add_(1)  # decode returns a fresh tensor, not a view of the payload
    assert torch.equal(decode(p), x)


def test_bf16_of_float32_input_rounds_to_bf16() -> None:
    x = randn((5, 33))
    y = decode(encode(x, "bf16"))
    assert y.dtype == torch.float32
    assert torch.equal(y, x.to(torch.bfloat16).float())


def test_encode_does_not_alias_input() -> None:
    x = randn((2, 128), torch.bfloat16)
    p = encode(x, "bf16")
    x.zero_()
    assert not torch.equal(decode(p), x)


@pytest.mark.parametrize("codec", INT_CODECS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_int_round_trip_error(codec: str, dtype: torch.dtype) -> None:
    x = randn((4, 96, 12, 128), dtype, seed=7)
    p = encode(x, codec)
    xh = decode(p)
    assert xh.shape == x.shape and xh.dtype == dtype
    scale = assert_within_bound(x, p, xh)
    assert bool((scale > 0).all())
    err = rel_fro(x, xh)
    if codec == "int4":
        assert 0.05 < err < 0.15
    else:
        assert err < 0.01


@pytest.mark.parametrize("codec", INT_CODECS)
def test_non_multiple_of_group(codec: str) -> None:
    x = randn((3, 5, 67), seed=3)  # 1005 values: 7 full groups + 109
    p = encode(x, codec)
    xh = decode(p)
    assert xh.shape == x.shape
    assert_within_bound(x, p, xh)


@pytest.mark.parametrize("codec", INT_CODECS)
def test_int4_nibble_order_and_codes(codec: str) -> None:
    # one group spanning 0..L exactly: codes are the values themselves
    levels = 15 if codec == "int4" else 255
    x = torch.arange(GROUP, dtype=torch.float32) % (levels + 1)
    x[-1] = levels  # make sure the max is hit
    p = encode(x, codec)
    scale, zero = scales_zeros(p)
    assert scale.tolist() == [1.0] and zero.tolist() == [0.0]
    assert torch.equal(decode(p), x)
    if codec == "int4":
        first = p.payload[0].item()
        assert first == (0 | (1 << 4))  # value 0 in the low nibble, value 1 in the high nibble


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_constant_groups_and_zeros_exact(codec: str, dtype: torch.dtype) -> None:
    x = torch.zeros(3, 4, 128, dtype=dtype)
    assert torch.equal(decode(encode(x, codec)), x)
    x[0] = 1.5
    x[1, 0] = -3.25
    x[1, 1] = 1e-3  # not representable in fp16: decoded within the (tiny) bound
    x[2] = torch.linspace(-2, 2, 128, dtype=dtype)
    p = encode(x, codec)
    xh = decode(p)
    assert not bool(torch.isnan(xh).any())
    assert torch.equal(xh[0], x[0]) and torch.equal(xh[1, 0], x[1, 0]) and torch.equal(xh[1, 2:], x[1, 2:])
    if codec != "bf16":
        scale = assert_within_bound(x, p, xh)
        assert scale[0] == 0 and scale[4] == 0
        assert float(scale[5]) < 1e-6


@pytest.mark.parametrize("codec", CODECS)
def test_extreme_values(codec: str) -> None:
    x = randn((8, 128), seed=5) * 1e4
    x[0, 0], x[1, 5] = 1e4, -1e4
    p = encode(x, codec)
    xh = decode(p)
    assert bool(torch.isfinite(xh).all())
    if codec == "bf16":
        assert torch.equal(xh, x.to(torch.bfloat16).float())
    else:
        assert_within_bound(x, p, xh)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected(codec: str, bad: float) -> None:
    x = randn((3, 128))
    x[1, 17] = bad
    with pytest.raises(ValueError, match="non-finite"):
        encode(x, codec)


@pytest.mark.parametrize("codec", INT_CODECS)
def test_out_of_fp16_range_rejected(codec: str) -> None:
    x = torch.full((128,), -1e6)
    with pytest.raises(ValueError, match="fp16"):
        encode(x, codec)


def test_empty_tensor() -> None:
    for codec in CODECS:
        x = torch.empty(0, 12, 128, dtype=torch.bfloat16)
        p = encode(x, codec)
        assert p.nbytes == 0 and to_bytes(p) == b""
        y = decode(from_bytes(codec, p.shape, p.dtype, to_bytes(p)))
        assert y.shape == x.shape and y.dtype == x.dtype


# ---- bytes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_round_trip(codec: str) -> None:
    x = randn((2, 9, 12, 128), torch.bfloat16, seed=11)[..., :77]  # non-contiguous, odd group tail
    p = encode(x, codec)
    assert p.dtype == "bfloat16" and p.shape == (2, 9, 12, 77)
    data = to_bytes(p)
    for buf in (data, bytearray(data), memoryview(bytearray(data)), memoryview(data)):
        q = from_bytes(codec, list(p.shape), "bfloat16", buf)
        assert q.codec == codec and q.shape == p.shape and q.dtype == "bfloat16"
        assert torch.equal(q.payload, p.payload)
        assert torch.equal(decode(q), decode(p))


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_wrong_length_rejected(codec: str) -> None:
    p = encode(randn((4, 128 + 3)), codec)
    data = to_bytes(p)
    exp = len(data)
    for bad in (data[:-1], data[: exp // 2], data + b"\0", b""):
        with pytest.raises(ValueError, match=rf"expected {exp} bytes, got {len(bad)}"):
            from_bytes(codec, p.shape, p.dtype, bad)


def test_packed_validates_payload() -> None:
    with pytest.raises(ValueError, match="expected 136 bytes, got 199"):
        Packed("int4", (2, 128), "float32", torch.zeros(199, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        Packed("bf16", (2,), "float32", torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="dtype"):
        Packed("bf16", (2,), "int64", torch.zeros(4, dtype=torch.uint8))


def test_decode_to_device() -> None:
    x = randn((2, 128))
    y = decode(encode(x, "int8"), device="cpu")
    assert y.device.type == "cpu"


# ---- realistic page and properties ---------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_tenth_of_mg2_page(codec: str) -> None:
    x = randn((1, 264, 12, 128), torch.bfloat16, seed=42)
    p = encode(x, codec)
    assert p.nbytes == packed_nbytes(264 * 12 * 128, codec)
    xh = decode(p)
    assert xh.shape == x.shape and xh.dtype == torch.bfloat16
    if codec == "bf16":
        assert torch.equal(xh, x)
    else:
        assert_within_bound(x, p, xh)
        assert rel_fro(x, xh) < (0.15 if codec == "int4" else 0.01)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 16), min_size=1, max_size=4).filter(lambda s: math.prod(s) <= 4096),
    codec=st.sampled_from(CODECS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
    amp=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_property_shape_and_bound(
    shape: list[int], codec: str, dtype: torch.dtype, seed: int, amp: float
) -> None:
    x = randn(tuple(shape), torch.float32, seed=seed).mul(amp).to(dtype)
    p = encode(x, codec)
    assert p.nbytes == packed_nbytes(x.numel(), codec)
    xh = decode(p)
    assert xh.shape == x.shape and xh.dtype == x.dtype
    if codec == "bf16":
        assert torch.equal(xh, x.to(torch.bfloat16).to(dtype))
    else:
        assert_within_bound(x, p, xh)
