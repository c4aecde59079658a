"""Review 16: a TorchScript archive saved in half precision (or bf16, fp64) can be served.

The torchscript adapter declares one FP32 input and casts whatever it is sent to float32; an archive
whose weights are fp16 (`model.half()` before `torch.jit.trace`, a common way to halve a model) then
failed every request BAD_INPUT ("mat1 and mat2 must have the same dtype, but got Float and Half"):
no request could succeed. Its input goes in as its weights' dtype now (as a safetensors-module's
does), and its output comes back FP32, equal to the archive's own answer.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_an_archive_in_another_float_dtype_answers_fp32(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(dtype).eval()
    path = tmp_path / "half.pt"
    with warnings.catch_warnings():  # torch marks TorchScript deprecated; it still traces and loads
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, torch.ones(1, 4, dtype=dtype))  # type: ignore[no-untyped-call]
        torch.jit.save(traced, str(path))  # type: ignore[no-untyped-call]
    host = DeviceHost("cpu0", "cpu", node="test")
    r = host.apply(P.Load(P.ModelSpec("half", "torchscript", {"path": str(path)})), "1")
    assert r.ok, r.error
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    got = host.infer("half", {"input": x})
    assert got.ok, got.error
    datatype, shape, raw = got.outputs["output"]
    assert (datatype, shape) == ("FP32", (5, 2))
    with torch.inference_mode():
        want = module(torch.from_numpy(x).to(dtype)).float().numpy()
    assert np.frombuffer(raw, np.float32).reshape(shape).tobytes() == want.tobytes()
