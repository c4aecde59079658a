"""The bench scripts' own small rules: `replay_speed.py` refuses counts below 1 (0 repeats printed
`Infinity` seconds, which is not JSON), and `results_tables.py` writes a tuned config that waits
longer on the unseen week as a rise, not as "−-5.0 %"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from integration.bench_module import load_bench


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--weeks", "0"], ["--repeat", "-2"], ["--weeks", "x"]])
def test_replay_speed_refuses_counts_below_one(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    speed = load_bench("replay_speed")
    with pytest.raises(SystemExit) as e:
        speed.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert argv[0] in captured.err
    assert "Traceback" not in captured.err


def test_the_tuning_table_writes_a_rise_as_a_rise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tables = load_bench("results_tables")
    rows = [
        {"week2_load_wait_before_s": 88.21, "week2_load_wait_after_s": 24.04, "reduction": 0.727},
        {"week2_load_wait_before_s": 6.4, "week2_load_wait_after_s": 6.4, "reduction": 0.0},
        {"week2_load_wait_before_s": 40.0, "week2_load_wait_after_s": 42.0, "reduction": -0.05},
    ]
    (tmp_path / "tune_gain.json").write_text(json.dumps({"configs/x.yaml": rows}))
    monkeypatch.setattr(tables, "HERE", tmp_path)
    tables.tune()
    out = capsys.readouterr().out
    assert "88.21 → 24.04 s (−72.7 %)" in out
    assert "6.4 → 6.4 s (−0.0 %)" in out
    assert "40.0 → 42.0 s (+5.0 %)" in out
    assert "−-" not in out


def test_the_auth_timing_bench_writes_a_config_that_loads(tmp_path: Path) -> None:
    """`python bench/auth_timing.py` prepended its own `server:` mapping to grpc_overhead's config,
    which has had one (`server.frontends`) since the front ends: the server refused the file
    (duplicate key "server") and the bench died before its first call."""
    # in a process of its own: the bench imports tritonclient's stubs, which cannot share a process
    # with residency_proto's (both register protobuf package `inference`), as a whole test run does
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "from bench_module import load_bench\n"
        "from manager.config import load_config\n"
        "auth = load_bench('auth_timing')\n"
        "cfg = load_config(auth.write_config(__import__('pathlib').Path(sys.argv[3])))\n"
        "print(cfg.server.auth_token_env == auth.ENV, cfg.server.frontends)\n"
    )
    here = Path(__file__).resolve()
    paths = [str(here.parents[1] / "integration"), str(here.parents[2]), str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0"], done.stdout
