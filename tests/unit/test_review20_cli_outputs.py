"""Review 20, a walkthrough of the offline commands (the real CLI, `main`):

- An `--out` ending in "/" (a folder's name) wrote, or replaced, a file of that name: `trace synth
  --out keep.jsonl/` replaced a week's trace with one day. Now refused, exit 2.
- `trace synth --out FILE` wrote in place: a full disk left the earlier file cut off mid-line, and
  `replay` then read the cut-off trace with one bad line. Now whole or not at all (as `trace export`).
- `tune --report`: a report that failed part way (a full disk) said only "[Errno 28] No space left
  on device", after --out had been written, and left the folder's earlier report mixed with the new
  files. Now the report goes first, whole or not at all, and the message names --report, the file and
  that --out was not written.
- `tune --out rep/index.html --report rep` wrote the report over the tuned config; `--out rep
  --report rep` failed only after the whole search. Both are refused first now.
- `tune --json` said `bad_lines: 0` though lines of the trace were skipped."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

import manager.cli as cli
import manager.replay.report as report_mod
from manager.cli import main

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = str(ROOT / "configs" / "examples" / "home-handwritten.yaml")
WEEK = str(ROOT / "bench" / "traces" / "home-week-seed1.jsonl")


def _synth(out: str, days: int = 1) -> int:
    return main(["trace", "synth", "--profile", "home", "--days", str(days), "--seed", "3", "--out", out])


def test_an_out_ending_in_a_slash_is_refused_and_no_file_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "keep.jsonl"
    keep.write_text("a week\n")
    assert _synth(f"{keep}/") == 2
    assert "names a folder (it ends in / or .)" in capsys.readouterr().err
    assert keep.read_text() == "a week\n"
    assert _synth(f"{tmp_path / 'newdir'}/") == 2
    assert not (tmp_path / "newdir").exists()
    assert _synth(f"{tmp_path / 'nd'}/.") == 2  # (Path("nd/.") is "nd" too)
    assert not (tmp_path / "nd").exists()
    code = main(["tune", "--config", HANDWRITTEN, "--trace", WEEK, "--out", f"{tmp_path / 'tdir'}/"])
    assert code == 2 and not (tmp_path / "tdir").exists()
    assert "names a folder" in capsys.readouterr().err
    code = main(["trace", "export", "--config", HANDWRITTEN, "--out", f"{tmp_path / 'ex'}/"])
    assert code == 2 and not (tmp_path / "ex").exists()
    assert "names a folder" in capsys.readouterr().err


class _FullDiskAfter(list[Any]):
    """The week's requests; iterating them fails part way as a full disk fails the write."""

    def __iter__(self) -> Any:
        for i, r in enumerate(super().__iter__()):
            if i == 50:
                raise OSError(errno.ENOSPC, "No space left on device")
            yield r


def test_a_synth_whose_write_fails_leaves_the_earlier_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert _synth(str(out)) == 0
    before = out.read_bytes()
    real = cli.synth
    monkeypatch.setattr(cli, "synth", lambda *a, **k: _FullDiskAfter(real(*a, **k)))
    assert _synth(str(out), days=2) == 2
    err = capsys.readouterr().err
    assert "No space left on device; the file is unchanged" in err, err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no partial file left
    new = tmp_path / "new.jsonl"
    assert _synth(str(new), days=2) == 2
    assert not new.exists() and "nothing was written" in capsys.readouterr().err


def _short_trace(tmp_path: Path, bad: int = 0) -> str:
    trace = tmp_path / "d.jsonl"
    assert (
        main(["trace", "synth", "--profile", "home", "--days", "2", "--seed", "5", "--out", str(trace)]) == 0
    )
    if bad:
        with trace.open("a") as f:
            f.write("garbage\n" + '{"t": 1, "model": "nope", "busy_s": 1}\n' * (bad - 1))
    return str(trace)


def test_a_report_that_fails_part_way_names_itself_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _short_trace(tmp_path)
    rep = tmp_path / "rep"
    rep.mkdir()
    for name in report_mod.REPORT_FILES:
        (rep / name).write_text(f"the earlier {name}")

    def full(path: Path, *a: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(report_mod, "_plot_memory", full)
    out = tmp_path / "tuned.yaml"
    code = main(["tune", "--config", HANDWRITTEN, "--trace", trace, "--out", str(out), "--report", str(rep)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--report {rep}: No space left on device ({rep / 'memory.png'})" in err, err
    assert f"nor --out {out}" in err and not out.exists()
    assert sorted(os.listdir(rep)) == sorted(report_mod.REPORT_FILES)  # no partial file left
    assert all((rep / n).read_text() == f"the earlier {n}" for n in report_mod.REPORT_FILES)


@pytest.mark.parametrize("out_in", ["index.html", "timeline.png", "."])
def test_an_out_that_the_report_would_write_over_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], out_in: str
) -> None:
    """(`--out rep --report rep` with no folder rep yet: the folder was made for the report, the whole
    search run, and only then --out refused, "not written: not written (Is a directory)".)"""
    rep = tmp_path / "rep"
    if out_in != ".":
        rep.mkdir()
    searched: list[Any] = []
    monkeypatch.setattr("manager.replay.tune.tune", lambda *a, **k: searched.append(a))
    out = str(rep / out_in) if out_in != "." else str(rep)
    code = main(["tune", "--config", HANDWRITTEN, "--trace", WEEK, "--out", out, "--report", str(rep)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--report" in err and "give another path for the tuned config" in err, err
    assert searched == []
    assert not rep.exists() or list(rep.iterdir()) == []


def test_an_out_beside_the_report_in_its_folder_is_fine(tmp_path: Path) -> None:
    trace = _short_trace(tmp_path)
    rep = tmp_path / "rep"
    out = rep / "tuned.yaml"
    code = main(["tune", "--config", HANDWRITTEN, "--trace", trace, "--out", str(out), "--report", str(rep)])
    assert code == 0
    assert out.is_file() and (rep / "index.html").is_file()
    assert not [p for p in rep.iterdir() if p.name.startswith(".partial-")]


def test_tune_json_counts_the_lines_it_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _short_trace(tmp_path, bad=2)
    code = main(
        ["tune", "--config", HANDWRITTEN, "--trace", trace, "--out", str(tmp_path / "o.yaml"), "--json"]
    )
    assert code == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["search"]["before"]["bad_lines"] == 2 and fig["search"]["after"]["bad_lines"] == 2
    assert fig["holdout"]["before"]["bad_lines"] == 2  # (split from the same trace)
    # the holdout: the next two days (one of the same days would be left out of the search)
    held = [json.loads(x) for x in Path(_short_trace(tmp_path / "h")).read_text().splitlines()]
    holdout = tmp_path / "h" / "next.jsonl"
    holdout.write_text("".join(json.dumps({**x, "t": x["t"] + 2 * 86400}) + "\n" for x in held))
    code = main([
        "tune", "--config", HANDWRITTEN, "--trace", trace, "--holdout", str(holdout),
        "--out", str(tmp_path / "o2.yaml"), "--json",
    ])  # fmt: skip
    assert code == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["search"]["before"]["bad_lines"] == 2 and fig["holdout"]["after"]["bad_lines"] == 0
