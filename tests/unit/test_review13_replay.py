"""Review of offline replay as a user meets it: a file that is not a trace (a model checkpoint, a CSV
log, a whole trace as one JSON array) given as --trace, the summary of skipped lines when they are
more than the ones printed, and `trace synth` with an unknown profile."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from manager.cli import main
from manager.replay.synth import DEFAULT_START
from manager.replay.trace import MAX_LINE_CHARS, NOT_A_TRACE_AFTER, TraceError, read_trace

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"


def _req(t: float, model: str = "llm") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 1.0}


def _jsonl(*objs: dict[str, Any]) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def test_a_binary_file_is_refused_as_not_a_trace_without_reading_it_all(tmp_path: Path) -> None:
    """Found by giving a model file as --trace (tab completion): every 'line' of a checkpoint was
    parsed and kept as a bad line, 8 s and 340 MB of memory per 200 MB of file, before 'no valid
    request line'. A 14 GB checkpoint took minutes and most of the machine's memory."""
    rng = random.Random(1)
    junk = bytes(rng.randrange(256) for _ in range(2_000_000)) + b"\n" * NOT_A_TRACE_AFTER
    path = tmp_path / "llm.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + junk + _jsonl(_req(DEFAULT_START)).encode())
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == 0
    assert f"none of its first {NOT_A_TRACE_AFTER} lines is a JSON object" in ei.value.reason
    assert "NUL bytes" in ei.value.reason  # a binary file, or text in UTF-16
    assert "\n" not in ei.value.reason


def test_a_csv_log_is_refused_by_the_cli_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = tmp_path / "requests.csv"
    csv.write_text("".join(f"{DEFAULT_START + i},llm,1.0\n" for i in range(3 * NOT_A_TRACE_AFTER)))
    assert main(["replay", "--config", str(HOME), "--trace", str(csv), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{csv}: not a request trace" in err and "Traceback" not in err
    assert "NUL" not in err  # plain text: no word of binary files
    assert err.count("skipped") == 0  # refused as a whole, not line by line


def test_a_trace_after_some_junk_or_after_many_unknown_models_is_still_read(tmp_path: Path) -> None:
    """The refusal is for files with no JSON object at their start: a trace whose first lines are
    junk (fewer than the limit) or requests for models the config lacks is read as before."""
    junk = tmp_path / "junk_first.jsonl"
    junk.write_text("x\n" * (NOT_A_TRACE_AFTER - 1) + _jsonl(_req(DEFAULT_START)), encoding="utf-8")
    got = read_trace(junk)
    assert len(got.requests) == 1 and len(got.bad_lines) == NOT_A_TRACE_AFTER - 1
    other = tmp_path / "other_home.jsonl"
    n = 2 * NOT_A_TRACE_AFTER
    other.write_text(
        _jsonl(*(_req(DEFAULT_START + i, "photos") for i in range(n)), _req(DEFAULT_START + n, "voice")),
        encoding="utf-8",
    )
    got = read_trace(other, known_models={"voice"})
    assert [r.model for r in got.requests] == ["voice"] and len(got.bad_lines) == n


def test_a_whole_trace_on_one_line_is_one_bad_line_never_held_whole(tmp_path: Path) -> None:
    """`jq -sc` turns JSON Lines into one JSON array on one line: it was read and decoded whole
    (memory in proportion to the file), then skipped as 'not a JSON object'."""
    array = json.dumps([_req(DEFAULT_START + i) for i in range(8 * MAX_LINE_CHARS // 40)])
    assert len(array) > 4 * MAX_LINE_CHARS
    path = tmp_path / "slurped.jsonl"
    path.write_text(array + "\r\n\n" + _jsonl(_req(DEFAULT_START + 1e6)), encoding="utf-8")
    tracemalloc.start()
    try:
        got = read_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_LINE_CHARS  # a few pieces' worth (72 MB before: the line, then its objects)
    assert got.bad_lines == [
        (1, f"line longer than {MAX_LINE_CHARS} characters (a trace is JSON Lines: one request per line)")
    ]
    assert [r.t for r in got.requests] == [DEFAULT_START + 1e6]  # line numbers still count right
    with pytest.raises(TraceError) as ei:
        read_trace(path, strict=True)
    assert ei.value.line == 1 and "longer than" in ei.value.reason


def test_skipped_lines_past_the_ones_printed_are_summed_up_by_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found replaying configs/home.yaml's week through configs/local-cpu.yaml: the ten lines
    printed all named 'photos', and nothing said that the 'tts', 'llm' and 'image' lines (most of
    the week) had been skipped too."""
    trace = tmp_path / "week.jsonl"
    reqs = [_req(DEFAULT_START + i, "photos") for i in range(15)]
    reqs += [_req(DEFAULT_START + 100 + i, "tts2") for i in range(7)]
    reqs += [_req(DEFAULT_START + 200, "llm")]
    trace.write_text(_jsonl(*reqs), encoding="utf-8")
    cfg_models = "(known: embed, image, llm, photos, tts, voice, world)"
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["requests"] == 16 and json.loads(out)["bad_lines"] == 7
    # 'photos' is a model of home.yaml: the 7 'tts2' lines are the only bad ones, all printed
    assert err.count("unknown model 'tts2'") == 7 and "by reason" not in err
    reqs += [_req(DEFAULT_START + 300 + i, "image2") for i in range(12)]
    trace.write_text(_jsonl(*reqs), encoding="utf-8")
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json"]) == 0
    err = capsys.readouterr().err
    assert "19 bad line(s) skipped" in err
    assert f"    12  unknown model 'image2' {cfg_models}" in err  # never among the ten printed
    assert f"     7  unknown model 'tts2' {cfg_models}" in err


def test_the_summary_of_skipped_lines_lists_the_commonest_reasons_and_counts_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    reqs = [_req(DEFAULT_START + i, f"m{i % 8}") for i in range(80)]
    trace.write_text(_jsonl(_req(DEFAULT_START - 1), *reqs), encoding="utf-8")
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--policy", "gdsf"]) == 0
    err = capsys.readouterr().err
    assert err.count("    10  unknown model 'm") == 5
    assert "    30  for 3 other reasons" in err


def test_synth_with_an_unknown_profile_makes_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "week.jsonl"
    assert main(["trace", "synth", "--profile", "office", "--out", str(out)]) == 2
    assert "unknown profile 'office' (known: home, studio)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("text", ["", "\n\n", "\ufeff\r\n  \r\n"])
def test_replay_of_a_trace_without_requests_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """An empty export (a quiet hour) replayed printed a table of zeros with exit 0, and with
    'prewarm loads 5, wasted loads 5' and models resident all the time: figures that read as a
    result."""
    trace = tmp_path / "quiet.jsonl"
    trace.write_text(text, encoding="utf-8")
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{trace}: no request to replay" in err
    assert main(["replay", "--config", str(HOME), "--trace", str(trace)]) == 2
    assert "prewarm" not in capsys.readouterr().out


def test_synth_out_dash_writes_the_trace_to_standard_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out -` wrote a file named "-" in the current folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "synth", "--days", "1", "--seed", "3", "--out", "-"]) == 0
    out, err = capsys.readouterr()
    assert not (tmp_path / "-").exists()
    (tmp_path / "t.jsonl").write_text(out)
    res = read_trace(tmp_path / "t.jsonl", strict=True)
    assert len(res.requests) > 100
    assert f"wrote {len(res.requests)} requests (1 day, profile home, seed 3) to standard output" in err


def test_a_reader_that_stops_reading_ends_it_quietly(tmp_path: Path) -> None:
    """`residency trace synth --out /dev/stdout | head -1` ended with "residency: [Errno 32] Broken
    pipe" (exit 2) for a reader that had all it wanted."""
    import subprocess
    import sys

    residency = Path(sys.executable).parent / "residency"
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {residency} trace synth --days 7 --out - | head -1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert json.loads(done.stdout)["model"]
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as the shell's tools end
