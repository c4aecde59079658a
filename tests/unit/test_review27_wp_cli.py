"""Review 27, a walkthrough of `worldpager` with odd input: standard output that cannot be written
(`> /dev/full`, a full disk) ended in a traceback; `--multipliers 1e-300` in a traceback from a sleep
past time_t and `1e-4` in a sweep of hours; a `--plot` name without a suffix was said as written while
matplotlib wrote NAME.png, and a plot that failed after the run took the results with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worldpager import stall
from worldpager.cli import main

WP = [sys.executable, "-m", "worldpager.cli"]


@pytest.mark.parametrize(
    "argv",
    [
        ["sizing", "--host-memory", "1GiB", "--codec", "int4"],
        ["sizing", "--host-memory", "1GiB", "--codec", "int8", "--json"],
    ],
    ids=["text", "json"],
)
def test_standard_output_that_cannot_be_written_is_one_line_not_a_traceback(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as
    # a user's is: what it holds failed at the interpreter's exit, after main (exit 120)
    for unbuffered in ({}, {"PYTHONUNBUFFERED": "1"}):
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [*WP, *argv],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
                env=env | unbuffered,
            )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
        said = done.stderr.strip().splitlines()
        assert said == ["worldpager: cannot write standard output: [Errno 28] No space left on device"], said


def test_another_os_error_of_a_command_is_not_taken_for_standard_outputs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import worldpager.cli as cli

    def broken(args: Any) -> int:
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(cli, "cmd_sizing", broken)
    with pytest.raises(OSError, match="libcudnn"):  # a failure of the machine: not exit 2 as bad input
        main(["sizing", "--host-memory", "1GiB", "--codec", "int4"])
    assert "standard output" not in capsys.readouterr().err


@pytest.mark.parametrize("m", ["1e-300", "1e-4", "0.049"])
def test_a_bandwidth_far_below_the_limit_is_refused_before_it_runs(
    m: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench-stall", "--quick", "--multipliers", f"0.5,{m}"]) == 2
    err = capsys.readouterr().err
    assert f"--multipliers '{m}'" in err and ">= 0.05" in err, err


def test_a_plot_without_a_suffix_is_said_where_it_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench-stall", "--quick", "--json", "--plot", str(tmp_path / "stalls")]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["plot"] == str(tmp_path / "stalls.png")
    assert (tmp_path / "stalls.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "stalls").exists()


def test_a_plot_that_fails_after_the_run_keeps_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(result: dict[str, Any], path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stall, "plot", full_disk)
    assert main(["bench-stall", "--quick", "--json", "--plot", str(tmp_path / "p.png")]) == 1
    out, err = capsys.readouterr()
    rows = json.loads(out)["rows"]
    assert len(rows) == len(stall.DEFAULT_MULTIPLIERS) and "plot" not in json.loads(out)
    assert "--plot" in err and "No space left on device" in err and "the results are above" in err


def test_a_plot_file_that_cannot_be_written_is_said_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(stall, "run_bench", lambda **k: ran.append(k))
    (tmp_path / "p.png").mkdir()  # the file a name without a suffix is written to is a folder
    assert main(["bench-stall", "--quick", "--plot", str(tmp_path / "p")]) == 2
    assert "is a folder" in capsys.readouterr().err and ran == []


def test_the_plots_check_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Read-through: the first check opened the file to see it could be written, and removed it when
    it had made it: a link to a file not there yet was replaced by nothing, its target made.)"""
    link = tmp_path / "p.png"
    link.symlink_to(tmp_path / "elsewhere" / "real.png")
    seen: list[bool] = []

    def no_run(**k: Any) -> Any:
        seen.append(link.is_symlink() and not (tmp_path / "elsewhere").exists())
        raise ValueError("stopped here: the check is what is looked at")

    monkeypatch.setattr(stall, "run_bench", no_run)
    assert main(["bench-stall", "--quick", "--plot", str(link)]) == 2
    assert seen == [True] and link.is_symlink()
