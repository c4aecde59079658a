"""Load a script of `bench/` as a module, for tests that run a short version of a benchmark or
check with its own code (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """`bench/<name>.py`, registered as module `bench_<name>` (its dataclasses need a module); loaded
    once per process."""
    loaded = sys.modules.get(f"bench_{name}")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
