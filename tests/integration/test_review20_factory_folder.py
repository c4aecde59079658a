"""Review 20, a walkthrough: the README has a `safetensors-module` model's factory "importable from the
folder you serve from" (`source.factory: "models.llm:build"`, a `models/llm.py` beside the config),
but the `residency` console script puts its own folder first on `sys.path`, not the current one: every
load answered `cannot import factory module 'models.llm': ModuleNotFoundError("No module named
'models'")`, in `serve` and `measure` alike. The real console script, in a folder holding the factory
and its checkpoint (a tiny linear layer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RESIDENCY = Path(sys.executable).parent / "residency"
FACTORY = """
from torch import nn


def build():
    return nn.Linear(8, 4)
"""
CONFIG = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 4GiB, reserve: 512MiB}
classes: [{name: interactive}]
models:
  - {name: llm, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {disk: 0.1, host: 0.05},
     source: {factory: "PKG.llm:build", path: PKG/llm.safetensors}}
"""


def _home(tmp_path: Path, pkg: str) -> Path:
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "llm.py").write_text(FACTORY)
    save_file({"weight": torch.zeros(4, 8), "bias": torch.zeros(4)}, str(tmp_path / pkg / "llm.safetensors"))
    (tmp_path / "home.yaml").write_text(CONFIG.replace("PKG", pkg))
    return tmp_path / "home.yaml"


def _measure(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(RESIDENCY), "measure", "--config", "home.yaml", "--repeats", "1", "--json"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_factory_in_the_folder_served_from_is_imported(tmp_path: Path) -> None:
    _home(tmp_path, "models_r20")
    done = _measure(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "cannot import factory module" not in done.stderr, done.stderr
    measured = json.loads(done.stdout)
    assert [(m["name"], m["ok"], m["error"]) for m in measured["models"]] == [("llm", True, None)], measured


def test_a_module_in_no_folder_is_still_said_to_be_missing(tmp_path: Path) -> None:
    config = _home(tmp_path, "models_r20b")
    config.write_text(config.read_text().replace("models_r20b.llm:build", "nowhere_r20.llm:build"))
    done = _measure(tmp_path)
    assert done.returncode != 0
    assert "cannot import factory module 'nowhere_r20.llm'" in done.stdout + done.stderr
