"""`residency --version` (review 15: the command line had no way to say which release it is, as
users of a service expect when they report a problem)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from manager.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_packages_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"residency {declared}"
