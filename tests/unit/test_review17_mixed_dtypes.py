"""Review 17: a safetensors checkpoint that mixes float dtypes (an fp64 weight with an fp32 bias, fp16
weights with fp32 biases) for a module built in one dtype loaded, then failed every request BAD_INPUT
("self and mat2 must have the same dtype"): no input dtype suits a layer whose weight and bias differ.
Its float parameters now go in as one dtype at the load, the one most of its weights have (the wider
where two tie), and its FP32 input goes in as that dtype, as for a checkpoint in one other dtype. A
value that does not fit that dtype fails the load BAD_CHECKPOINT naming the tensor. Real checkpoints
written with safetensors, a real device host on the CPU."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

X = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)


class _Mixed(nn.Module):
    """Built in two dtypes on purpose (an fp16 layer, an fp32 scale), its forward casting between them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2, dtype=torch.float16)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.lin(x.half()).float() * self.scale
        return y


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories importable as `residency_review17_factories:NAME`."""
    mod = types.ModuleType("residency_review17_factories")
    mod.mlp = lambda: nn.Linear(4, 2)  # type: ignore[attr-defined]
    mod.narrow = lambda: nn.Linear(1, 2)  # type: ignore[attr-defined]  # as many weights as biases
    mod.mixed = _Mixed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    yield mod.__name__


def _load(tmp_path: Path, factories: str, fn: str, tensors: dict[str, torch.Tensor]) -> DeviceHost:
    path = tmp_path / "mixed.safetensors"
    write_safetensors(tensors, path)
    host = DeviceHost("cpu0", "cpu", node="review17")
    spec = P.ModelSpec("m", "safetensors-module", {"factory": f"{factories}:{fn}", "path": str(path)})
    r = host.apply(P.Load(spec), "load")
    assert r.ok, r.error
    return host


def _answer(host: DeviceHost, x: np.ndarray) -> np.ndarray:
    r = host.infer("m", {"input": x})
    assert r.ok, (r.error_code, r.error)
    datatype, shape, raw = r.outputs["output"]
    assert datatype == "FP32"
    return np.frombuffer(raw, np.float32).reshape(shape)


@pytest.mark.parametrize(
    ("fn", "weight", "bias", "compute"),
    [
        ("mlp", torch.float64, torch.float32, torch.float64),  # most elements: the weight's dtype
        ("mlp", torch.float16, torch.float32, torch.float16),
        ("mlp", torch.float32, torch.bfloat16, torch.float32),
        ("mlp", torch.bfloat16, torch.float16, torch.bfloat16),
        ("narrow", torch.float32, torch.float64, torch.float64),  # a tie: the wider
        ("narrow", torch.bfloat16, torch.float16, torch.float32),  # a tie of one width: both fit fp32
    ],
)
def test_a_checkpoint_mixing_float_dtypes_is_served_in_one(
    tmp_path: Path,
    factories: str,
    fn: str,
    weight: torch.dtype,
    bias: torch.dtype,
    compute: torch.dtype,
) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4 if fn == "mlp" else 1, 2)
    w, b = lin.weight.detach().to(weight), lin.bias.detach().to(bias)
    host = _load(tmp_path, factories, fn, {"weight": w, "bias": b})
    x = X if fn == "mlp" else X[:, :1].copy()
    got = _answer(host, x)  # failed BAD_INPUT: "self and mat2 must have the same dtype"
    with torch.inference_mode():
        want = F.linear(torch.from_numpy(x).to(compute), w.to(compute), b.to(compute)).float().numpy()
    assert got.tobytes() == want.tobytes()


def test_a_value_beyond_the_common_dtype_fails_the_load_naming_it(tmp_path: Path, factories: str) -> None:
    path = tmp_path / "big.safetensors"
    write_safetensors(
        {"weight": torch.ones(2, 4, dtype=torch.float16), "bias": torch.tensor([1e6, 0.0])}, path
    )
    host = DeviceHost("cpu0", "cpu", node="review17")
    spec = P.ModelSpec("m", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(path)})
    r = host.apply(P.Load(spec), "load")  # loaded, then answered inf (or failed every request)
    assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
    assert "'bias'" in (r.error or "") and "float32" in (r.error or "") and "float16" in (r.error or "")
    assert "Traceback" not in (r.error or "")


def test_a_module_built_in_several_dtypes_keeps_them(tmp_path: Path, factories: str) -> None:
    torch.manual_seed(0)
    ref = _Mixed()
    with torch.no_grad():
        ref.scale.copy_(torch.tensor([0.1, 3.3]))  # not fp16 values
    host = _load(tmp_path, factories, "mixed", {k: v.detach() for k, v in ref.state_dict().items()})
    with torch.inference_mode():
        want = ref(torch.from_numpy(X)).numpy()  # its fp16 layer in fp16, its scale in fp32, as built
    assert _answer(host, X).tobytes() == want.tobytes()
