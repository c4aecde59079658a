"""Review 26: a class's reservation is held on every GPU (a request may ask for any class), so on a
GPU where no model of the class runs it only keeps room from the lower classes' models there.
`config check` says so, naming the class and the devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager.cli import main

TWO_GPUS = """
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 12GiB, reserve: 1GiB}
  - {name: gpu1, kind: cuda, index: 1, memory: 12GiB, reserve: 1GiB}
  - {name: cpu, kind: cpu, memory: 8GiB}
host: {memory: 32GiB, reserve: 4GiB}
classes:
  - {name: realtime, reserve: 3GiB}
  - {name: interactive, reserve: 1GiB}
  - {name: background, reserve: 2GiB}
models:
  - {name: voice, class: realtime, adapter: silero-vad, device: gpu0, memory: 1GiB}
  - {name: llm, class: interactive, adapter: torchscript, device: gpu1, memory: 6GiB, source: {path: llm.pt}}
  - {name: tagger, class: interactive, adapter: torchscript, device: gpu0, memory: 1GiB, source: {path: t.pt}}
"""


def test_config_check_names_a_reservation_held_where_its_class_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "two-gpus.yaml"
    f.write_text(TWO_GPUS, encoding="utf-8")
    assert main(["config", "check", str(f)]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "reserve of" in line]
    # realtime on gpu1; interactive runs on both GPUs; a cpu device holds none; background is the
    # lowest class: its reserve holds nothing back from anyone, where no background model runs too
    assert len(said) == 1, err
    assert (
        "classes[0] (realtime): its reserve of 3GiB is held on 'gpu1' too, where no realtime model runs"
        in said[0]
    )
    f.write_text(TWO_GPUS.replace("device: gpu1", "device: gpu0"), encoding="utf-8")
    assert main(["config", "check", str(f)]) == 0
    err = capsys.readouterr().err
    assert "classes[0] (realtime): its reserve of 3GiB is held on 'gpu1' too" in err
    assert "classes[1] (interactive): its reserve of 1GiB is held on 'gpu1' too" in err
    assert "only requests of class interactive or higher can" in err
    assert "classes[2]" not in err
