"""Review 31 (a stock OIP client, tritonclient): a model that declares no outputs is advertised with the
default `output` FP32 [-1, -1] (ModelMetadata, ModelConfig), but its answer went out in whatever rank
its module returned: a client that sized or reshaped the answer from the metadata got a rank-1 tensor.
The default is held to now, as a declared shape is (INTERNAL, naming how to declare the real one), for
a safetensors-module (`residency_outputs`) and a TorchScript archive (`source.output_shape`).

Real components: a device host on the CPU, real torch modules, checkpoint files in tmp_path."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import write_safetensors

FACTORIES = "review31_default_output_factories"


class Pooled(nn.Module):
    """Rank 1 out of a rank-2 input: one number per row."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).sum(dim=-1)


class PooledDeclared(Pooled):
    residency_outputs: ClassVar = [("output", "FP32", (-1,))]


@pytest.fixture
def factories() -> Iterator[types.ModuleType]:
    mod = types.ModuleType(FACTORIES)
    mod.pooled = Pooled  # type: ignore[attr-defined]
    mod.pooled_declared = PooledDeclared  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    yield mod
    del sys.modules[FACTORIES]


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "pooled.safetensors"
    write_safetensors({"l.weight": torch.randn(3, 4), "l.bias": torch.randn(3)}, path)
    return path


X = {"input": np.ones((2, 4), np.float32)}


def test_an_undeclared_modules_answer_is_held_to_the_default_rank(
    factories: types.ModuleType, weights: Path
) -> None:
    host = DeviceHost("cpu0", "cpu", node="test")
    for name, factory in (("plain", "pooled"), ("declared", "pooled_declared")):
        spec = P.ModelSpec(
            name, "safetensors-module", {"factory": f"{FACTORIES}:{factory}", "path": str(weights)}
        )
        assert host.apply(P.Load(spec), f"load-{name}").ok
    got = host.infer("plain", X)
    assert (got.ok, got.error_code) == (False, P.INTERNAL)
    assert got.error == (
        "model 'plain': its module returned output 'output' of shape [2]; it declares none, and the "
        "default is [-1, -1] (rank 2): declare what it returns with the module's `residency_outputs` "
        "[(name, datatype, shape)]"
    )
    good = host.infer("declared", X)  # declared as it answers: served
    assert good.ok and good.outputs["output"][:2] == ("FP32", (2,))


def test_a_torchscript_archives_answer_is_held_to_the_default_rank(tmp_path: Path) -> None:
    path = tmp_path / "pooled.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(Pooled()), str(path))  # type: ignore[no-untyped-call]
    host = DeviceHost("cpu0", "cpu", node="test")
    assert host.apply(P.Load(P.ModelSpec("ts", "torchscript", {"path": str(path)})), "1").ok
    got = host.infer("ts", X)
    assert (got.ok, got.error_code) == (False, P.INTERNAL)
    assert got.error == (
        "model 'ts': the TorchScript module returned output of shape [2]; source.output_shape is not "
        "set, and the default is [-1, -1] (rank 2): set it to the shape the module returns"
    )
    spec = P.ModelSpec("ts1", "torchscript", {"path": str(path), "output_shape": [-1]})
    assert host.apply(P.Load(spec), "2").ok
    good = host.infer("ts1", X)
    assert good.ok and good.outputs["output"][:2] == ("FP32", (2,))
