"""Review 16: a damaged MG2 checkpoint is refused naming the file (safetensors' own error named none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worldpager.model import TINY, TinyCausalWan, load_mg2_checkpoint


@pytest.mark.parametrize("data", [b"garbage" * 10, b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_a_damaged_checkpoint_is_a_value_error_naming_the_file(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "mg2.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"mg2\.safetensors: not a readable safetensors checkpoint"):
        load_mg2_checkpoint(TinyCausalWan(TINY), path)


def test_a_truncated_checkpoint_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = TinyCausalWan(TINY)
    path = tmp_path / "mg2.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"mg2\.safetensors: not a readable safetensors checkpoint"):
        load_mg2_checkpoint(model, path)
