"""The decision engine, the replay simulator and the config are pure Python: they import none of
the service stack (ray, grpc, redis) nor torch, so they run in tests, replays and CI anywhere."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ray", "grpc", "redis", "torch")
PURE_FILES = sorted(
    [
        *(ROOT / "manager" / "policy").rglob("*.py"),
        *(ROOT / "manager" / "replay").rglob("*.py"),
        *(ROOT / "manager").glob("config*.py"),  # config.py (and config_schema.py once split off)
        ROOT / "manager" / "units.py",
    ]
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement in the file, at any depth."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            # importlib.import_module("torch") / __import__("ray"): a literal name is an import too.
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                out.append((node.lineno, str(node.args[0].value)))
    return out


def is_forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN


def test_the_pure_file_list_is_what_we_think():
    names = {p.relative_to(ROOT).as_posix() for p in PURE_FILES}
    assert {
        "manager/policy/engine.py",
        "manager/replay/sim.py",
        "manager/config.py",
        "manager/units.py",
    } <= names


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_service_or_torch_imports(path):
    bad = [(line, mod) for line, mod in imported_modules(path) if is_forbidden(mod)]
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


def test_the_checker_sees_imports(tmp_path):
    # The checker itself: plain, from-, nested and dynamic imports of the forbidden names are found.
    src = tmp_path / "x.py"
    src.write_text(
        "import os\nimport torch.nn as nn\nfrom ray import remote\n"
        "def f():\n    import redis\n    return __import__('grpc')\n"
        "from . import ray\n",  # a relative import of a sibling named ray is not the ray package
        encoding="utf-8",
    )
    found = [mod for _, mod in imported_modules(src) if is_forbidden(mod)]
    assert found == ["torch.nn", "ray.remote", "redis", "grpc"]


@pytest.mark.parametrize("module", ["manager.policy.engine", "manager.replay.sim"])
def test_importing_loads_none_of_them(module):
    # A fresh interpreter: what this test process has imported does not count.
    code = (
        "import json, sys\n"
        f"import {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


# WorldPager is a library of its own (stdlib + torch): it never imports the manager, and its
# bookkeeping (what is where, what to evict, what to fetch), the NVMe log, the retrieval rules and
# the sizing math are torch-free too, so they run and are tested alone.
WORLDPAGER_FILES = sorted((ROOT / "worldpager").glob("*.py"))
WORLDPAGER_TORCH_FREE = (
    "pages.py",
    "page_types.py",
    "segment_log.py",
    "segment_header.py",
    "retrieval.py",
    "mg2.py",
    "cli.py",
    "memory.py",
)


@pytest.mark.parametrize("path", WORLDPAGER_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_worldpager_never_imports_the_manager(path: Path):
    bad = [(line, mod) for line, mod in imported_modules(path) if mod.split(".")[0] in ("manager", "workers")]
    assert bad == [], f"{path.name} imports {bad}"


@pytest.mark.parametrize("name", WORLDPAGER_TORCH_FREE)
def test_worldpager_bookkeeping_is_torch_free(name: str):
    path = ROOT / "worldpager" / name
    bad = [(line, mod) for line, mod in imported_modules(path) if is_forbidden(mod)]
    assert bad == [], f"{name} imports {bad}"
