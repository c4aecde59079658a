"""Review 16: a TorchScript model declared its input and output as `[-1, -1]`, whatever it takes, so
an image model (a photo tagger, as `configs/home.yaml`'s `photos`) could not be served: every batch of
images, `[N, 3, H, W]`, was refused for its rank. `source.input_shape` / `source.output_shape` now
declare them (-1: any dimension); not given, `[-1, -1]` as before. A real scripted network, a real
device host on the CPU."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost


class Tagger(nn.Module):
    """A small image tagger: [N, 3, 8, 8] -> [N, 5] scores."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(dim=(2, 3)))


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    p = tmp_path / "tagger.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(Tagger().eval()).save(str(p))  # type: ignore[no-untyped-call]
    return p


IMAGES = {"input": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)}


def _host_with(archive: Path, **source: object) -> tuple[DeviceHost, P.ModelSpec]:
    host = DeviceHost("cpu0", "cpu", node="review16")
    spec = P.ModelSpec("photos", "torchscript", {"path": str(archive), **source})
    return host, spec


def test_a_declared_image_shape_is_served_and_described(archive: Path) -> None:
    host, spec = _host_with(archive, input_shape=[-1, 3, 8, 8], output_shape=[-1, 5])
    inputs, outputs = host.describe(spec)
    assert [(t.name, t.shape) for t in inputs] == [("input", (-1, 3, 8, 8))]
    assert [(t.name, t.shape) for t in outputs] == [("output", (-1, 5))]
    assert host.apply(P.Load(spec), "load").ok
    r = host.infer("photos", IMAGES)
    assert r.ok, r.error
    out = P.output_array(r.outputs["output"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.jit.load(str(archive))  # type: ignore[no-untyped-call]
    ref = model(torch.from_numpy(IMAGES["input"])).detach().numpy()
    np.testing.assert_array_equal(out, ref)
    wrong = host.infer("photos", {"input": np.ones((2, 3, 4, 4), np.float32)})  # a fixed dimension differs
    assert not wrong.ok and wrong.error_code == P.BAD_INPUT, wrong.error


def test_without_a_declared_shape_it_is_a_batch_of_vectors_as_before(archive: Path) -> None:
    host, spec = _host_with(archive)
    assert [t.shape for t in host.describe(spec)[0]] == [(-1, -1)]
    assert host.apply(P.Load(spec), "load").ok
    r = host.infer("photos", IMAGES)  # the rank is refused, as it was
    assert not r.ok and r.error_code == P.BAD_INPUT, r.error


@pytest.mark.parametrize("bad", [[], [0, 3], [-2], "[-1, 3]", [1.5], [True, 3], [-1] * 9])
def test_a_bad_declared_shape_fails_the_load_naming_it(archive: Path, bad: object) -> None:
    host, spec = _host_with(archive, input_shape=bad)
    r = host.apply(P.Load(spec), "load")
    assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
    assert "model 'photos': source.input_shape must be a list of 1 to 8 dimensions" in (r.error or "")


def test_an_answer_of_another_shape_than_declared_is_named(archive: Path) -> None:
    host, spec = _host_with(archive, input_shape=[-1, 3, 8, 8], output_shape=[-1, 7])
    assert host.apply(P.Load(spec), "load").ok
    r = host.infer("photos", IMAGES)
    assert not r.ok and r.error_code == P.INTERNAL
    assert "returned output of shape [2, 5]; source.output_shape declares [-1, 7]" in (r.error or "")
