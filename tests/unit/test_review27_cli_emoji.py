"""Review 27: rich turned the place of an error into an emoji. `residency` prints through rich with
markup off, but rich's emoji codes were still on, so `home.yaml:100:` read `home.yaml💯` and a trace's
`week.jsonl:1234:` read `week.jsonl🔢`: the one thing the message is for, where to look, was gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "manager.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("line", [100, 1234])
def test_a_config_errors_line_is_printed_as_a_number(tmp_path: Path, line: int) -> None:
    lines = (ROOT / "configs" / "home.yaml").read_text().splitlines()
    at = next(i for i, s in enumerate(lines) if s.strip().startswith("default_keep_alive:"))
    key = lines[at].split(":")[0]
    bad = [*lines[:at], *["# ."] * (line - 1 - at), f"{key}: inf", *lines[at + 1 :]]
    (tmp_path / "c.yaml").write_text("\n".join(bad) + "\n")
    assert bad[line - 1] == f"{key}: inf"
    done = _run("config", "check", str(tmp_path / "c.yaml"))
    assert done.returncode == 2, done.stderr
    assert f"c.yaml:{line}:" in done.stderr, done.stderr
    assert "\U0001f4af" not in done.stderr and "\U0001f522" not in done.stderr


def test_a_trace_lines_number_is_printed_as_a_number(tmp_path: Path) -> None:
    trace = tmp_path / "week.jsonl"
    good = '{"t":1000.0,"model":"voice","busy_s":0.5}\n'
    trace.write_text(good * 1233 + '{"t":-1,"model":"voice","busy_s":0.5}\n')
    config = str(ROOT / "configs" / "home.yaml")
    done = _run("replay", "--config", config, "--trace", str(trace), "--strict", "--policy", "lru-keepalive")
    assert done.returncode == 2, done.stderr
    assert "week.jsonl:1234:" in done.stderr, done.stderr
    assert "\U0001f522" not in done.stderr
