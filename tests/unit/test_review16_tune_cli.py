"""Review 16 of `residency tune` and `replay` on the command line (found by the replay review):
- `--out` naming the `--trace` (or `--holdout`) file wrote the tuned config over the trace: the week
  of requests was lost. It is refused before anything is read or written.
- a `--report` folder whose `index.html` (or a PNG) could not be written failed only after the tuned
  config was written, naming no flag. It is refused before the search.
- Ctrl-C during a replay or a tune printed a Python traceback; now one line, exit 130.
Real files, the real CLI (`main`)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

import manager.cli as cli
from manager.cli import main

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
WEEK1 = ROOT / "bench" / "traces" / "home-week-seed1.jsonl"


def _trace_copy(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    trace = tmp_path / "week.jsonl"
    trace.write_bytes(WEEK1.read_bytes())
    return trace


@pytest.mark.parametrize("flag", ["--trace", "--holdout"])
def test_out_naming_a_trace_is_refused_and_the_trace_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    trace = _trace_copy(tmp_path)
    link = tmp_path / "link.yaml"
    link.symlink_to(trace.name)  # the same file by another name
    before = trace.read_bytes()
    other = _trace_copy(tmp_path / "other") if flag == "--holdout" else None
    for out in (trace, link):
        if flag == "--trace":
            args = ["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(out)]
        else:
            args = ["tune", "--config", str(HOME), "--trace", str(other), "--holdout", str(trace)]
            args += ["--out", str(out)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is the {flag} file; give another path for the tuned config" in err, err
        assert trace.read_bytes() == before


def test_a_report_file_that_cannot_be_written_is_refused_before_the_config_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report"
    (report / "index.html").mkdir(parents=True)
    out = tmp_path / "tuned.yaml"
    args = ["tune", "--config", str(HOME), "--trace", str(WEEK1), "--out", str(out), "--report", str(report)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--report {report}: {report / 'index.html'} is a directory" in err, err
    assert not out.exists()  # was: written, then the report refused


def test_ctrl_c_in_a_replay_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # what Python's SIGINT handler raises at a Ctrl-C

    monkeypatch.setattr(cli, "_load_trace", interrupted)
    rc = main(["replay", "--config", str(HOME), "--trace", str(WEEK1)])
    assert rc == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert err.strip() == "residency: interrupted" and "Traceback" not in err


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Standard input holding `data` (a byte stream under a TextIOWrapper, as the interpreter's own)."""
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_replay_reads_a_trace_from_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trace synth --out -` wrote to stdout, but `--trace -` was the file `./-` (not found)."""
    _stdin(monkeypatch, WEEK1.read_bytes())
    assert main(["replay", "--config", str(HOME), "--trace", "-", "--policy", "residency", "--json"]) == 0
    import json

    fig = json.loads(capsys.readouterr().out)
    assert fig["requests"] == sum(1 for line in WEEK1.read_text().splitlines() if line.strip())


def test_bad_lines_from_standard_input_are_named_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, b'{"t": 1, "model": "voice", "busy_s": 0.5}\nbad\n')
    assert main(["replay", "--config", str(HOME), "--trace", "-", "--policy", "residency"]) == 0
    err = capsys.readouterr().err
    assert "skipped <stdin>:2: not valid JSON" in err and "<stdin>: 1 bad line(s) skipped" in err, err


def test_trace_and_holdout_both_from_standard_input_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.yaml"
    assert main(["tune", "--config", str(HOME), "--trace", "-", "--holdout", "-", "--out", str(out)]) == 2
    assert "--trace - and --holdout -: both read standard input" in capsys.readouterr().err
    assert not out.exists()
