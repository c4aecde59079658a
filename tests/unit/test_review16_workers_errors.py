"""Review 16: what a model's own code raises on a request is a clear error, never a traceback.

* A TorchScript module that checks its input (`raise ValueError(...)` or `assert` in its scripted
  code) raises `torch.jit.Error`, which is not a RuntimeError: the request failed INTERNAL with the
  interpreter's whole traceback in its message (and one more in the log). Torch's own errors raised
  inside the interpreter (a shape mismatch) were BAD_INPUT, but carried that traceback to the client
  too. Both are BAD_INPUT now, saying the error's last line only.
* A safetensors-module whose forward asserts on its input (`assert x.shape[-1] == 4`) failed
  INTERNAL with a traceback in the log; it is BAD_INPUT with the assertion's message.
* A factory that returns a TorchScript module failed its load INTERNAL ("get_submodule is not
  supported on ScriptModules"); it is FACTORY_FAILED saying which adapter takes one.
* A module that declares its outputs (`residency_outputs`) and answers another shape was sent as it
  was, against its ModelMetadata; the request fails INTERNAL naming the output and both shapes.
"""

from __future__ import annotations

import logging
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

FACTORIES = "review16_workers_errors_factories"


class Checked(nn.Module):
    """Checks its input in its own code, as many models do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 100):
            raise ValueError("at most 100 in all")
        assert x.shape[1] == 2, "two features"
        return torch.mm(x, torch.ones(2, 3))


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == 4, f"expected 4 features, got {x.shape[-1]}"
        return self.l(x)


class WithScripted(nn.Module):
    """A plain module with a scripted part that checks its input (its raise is a torch.jit.Error)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.check = _script(Checked())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x[:, :2])
        return self.l(x)


class DeclaresSeven(Linear):
    residency_outputs: ClassVar = [("output", "FP32", (-1, 7))]


class DeclaresThree(Linear):
    residency_outputs: ClassVar = [("output", "FP32", (-1, 3))]


def _script(module: nn.Module) -> torch.jit.ScriptModule:
    """torch.jit.script without its deprecation warning (TorchScript still loads and runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(module)  # type: ignore[no-any-return]


def _save_scripted(module: nn.Module, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(_script(module), str(path))  # type: ignore[no-untyped-call]


@pytest.fixture
def factories() -> Iterator[types.ModuleType]:
    """A fake factory module for the tests' own modules (removed afterwards)."""
    mod = types.ModuleType(FACTORIES)
    mod.linear = Linear  # type: ignore[attr-defined]
    mod.seven = DeclaresSeven  # type: ignore[attr-defined]
    mod.three = DeclaresThree  # type: ignore[attr-defined]
    mod.scripted = lambda: _script(Linear())  # type: ignore[attr-defined]
    mod.with_scripted = WithScripted  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    yield mod
    del sys.modules[FACTORIES]


@pytest.fixture
def host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="test")


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "linear.safetensors"
    write_safetensors({"l.weight": torch.randn(3, 4), "l.bias": torch.randn(3)}, path)
    return path


def _module(host: DeviceHost, name: str, factory: str, path: Path) -> None:
    spec = P.ModelSpec(name, "safetensors-module", {"factory": f"{FACTORIES}:{factory}", "path": str(path)})
    r = host.apply(P.Load(spec), f"load-{name}")
    assert r.ok, r.error


def test_a_torchscript_modules_own_raise_and_assert_are_bad_input_without_traceback(
    host: DeviceHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checked.pt"
    _save_scripted(Checked(), path)
    r = host.apply(P.Load(P.ModelSpec("checked", "torchscript", {"path": str(path)})), "1")
    assert r.ok, r.error
    cases = {
        "ValueError: at most 100 in all": np.full((2, 2), 50, np.float32),
        "AssertionError: two features": np.zeros((2, 3), np.float32),
    }
    with caplog.at_level(logging.ERROR):
        for said, x in cases.items():
            got = host.infer("checked", {"input": x})
            assert (got.ok, got.error_code) == (False, P.BAD_INPUT), got.error
            assert (got.error or "").startswith("model 'checked': inference failed: ")
            assert (got.error or "").endswith(said) and "\n" not in (got.error or ""), got.error
        fine = host.infer("checked", {"input": np.ones((4, 2), np.float32)})
    assert fine.ok and fine.outputs["output"][:2] == ("FP32", (4, 3))
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


def test_a_torch_error_inside_the_interpreter_is_said_in_one_line(host: DeviceHost, tmp_path: Path) -> None:
    path = tmp_path / "checked.pt"
    _save_scripted(Checked(), path)
    assert host.apply(P.Load(P.ModelSpec("checked", "torchscript", {"path": str(path)})), "1").ok
    # torch.mm of [1, 0] by [2, 3] (two features checked after the sum: an empty row passes both)
    got = host.infer("checked", {"input": np.zeros((1, 0), np.float32)})
    assert (got.ok, got.error_code) == (False, P.BAD_INPUT)
    assert "Traceback" not in (got.error or "") and "\n" not in (got.error or ""), got.error
    assert (got.error or "").startswith("model 'checked': inference failed: ")


def test_a_modules_assert_on_its_input_is_bad_input(
    host: DeviceHost, factories: types.ModuleType, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _module(host, "lin", "linear", weights)
    with caplog.at_level(logging.ERROR):
        got = host.infer("lin", {"input": np.ones((2, 5), np.float32)})
    assert (got.ok, got.error_code) == (False, P.BAD_INPUT)
    # (pytest rewrites this file's asserts: its message gains a line saying the comparison)
    assert (got.error or "").startswith("model 'lin': inference failed: expected 4 features, got 5")
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert host.infer("lin", {"input": np.ones((2, 4), np.float32)}).ok


def test_a_scripted_submodules_raise_is_bad_input_in_one_line(
    host: DeviceHost, factories: types.ModuleType, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _module(host, "part", "with_scripted", weights)
    with caplog.at_level(logging.ERROR):
        got = host.infer("part", {"input": np.full((2, 4), 50, np.float32)})
    assert (got.ok, got.error_code) == (False, P.BAD_INPUT), got.error
    assert got.error == "model 'part': inference failed: ValueError: at most 100 in all"
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert host.infer("part", {"input": np.ones((2, 4), np.float32)}).ok


def test_a_factory_returning_a_torchscript_module_fails_its_load_by_name(
    host: DeviceHost, factories: types.ModuleType, weights: Path
) -> None:
    spec = P.ModelSpec("s", "safetensors-module", {"factory": f"{FACTORIES}:scripted", "path": str(weights)})
    r = host.apply(P.Load(spec), "1")
    assert (r.ok, r.error_code) == (False, P.FACTORY_FAILED), r.error
    assert "model 's'" in (r.error or "") and "TorchScript module" in (r.error or "")
    assert "s" not in host.status().models


def test_an_answer_of_another_shape_than_declared_is_refused_by_name(
    host: DeviceHost, factories: types.ModuleType, weights: Path
) -> None:
    _module(host, "seven", "seven", weights)
    _module(host, "three", "three", weights)
    x = {"input": np.ones((2, 4), np.float32)}
    got = host.infer("seven", x)
    assert (got.ok, got.error_code) == (False, P.INTERNAL)
    assert got.error == (
        "model 'seven': its module returned output 'output' of shape [2, 3]; it declares [-1, 7] (-1: any)"
    )
    good = host.infer("three", x)  # declared and answered alike: as before
    assert good.ok and good.outputs["output"][:2] == ("FP32", (2, 3))
    # a module that declares nothing answers any shape, as before (the default `output` [-1, -1])
    _module(host, "plain", "linear", weights)
    assert host.infer("plain", x).ok
