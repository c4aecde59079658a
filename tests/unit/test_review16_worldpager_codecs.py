"""Review 16: codecs name a finite value past bf16's (or fp32's) range as out of range, not as inf."""

from __future__ import annotations

import pytest
import torch

from worldpager import codecs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_finite_value_past_bf16s_range_is_named_out_of_range(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, 3.4e38, 2.0], dtype=dtype)
    with pytest.raises(
        ValueError, match=r"out of range for bf16: \|x\| must be <= 3\.38953e\+38; max \|x\| = 3\.4e\+38"
    ):
        codecs.encode(x, "bf16")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_finite_float64_value_past_fp32s_range_is_named_out_of_range(codec: str) -> None:
    x = torch.tensor([1.0, -1e39, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"out of range for {codec}: .* max \|x\| = 1e\+39"):
        codecs.encode(x, codec)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_non_finite_values_are_still_counted(codec: str) -> None:
    x = torch.tensor([1.0, float("nan"), float("-inf"), float("inf")])
    with pytest.raises(ValueError, match=f"non-finite values with {codec}: 1 NaN, 2 inf"):
        codecs.encode(x, codec)
