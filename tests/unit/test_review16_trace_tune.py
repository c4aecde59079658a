"""Review 16: `residency replay` / `tune` on odd but valid inputs, and what tuning says it changed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

import manager.replay.tune as tune_mod
from manager.cli import main
from manager.config import Config, load_config
from manager.policy.types import Request
from manager.replay.sim import ReplayResult
from manager.replay.synth import DEFAULT_START
from manager.replay.trace import TraceError, read_trace

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


def _utf16_trace(path: Path, n: int = 5) -> Path:
    """A short trace saved as UTF-16 (with its BOM), as Windows PowerShell's `>` writes one."""
    lines = "".join(
        json.dumps({"t": DEFAULT_START + i, "model": "llm", "busy_s": 1.0}) + "\n" for i in range(n)
    )
    path.write_text(lines, encoding="utf-16")
    return path


def test_a_short_utf16_trace_is_refused_as_a_whole_naming_utf16(tmp_path: Path) -> None:
    """A UTF-16 trace of fewer than NOT_A_TRACE_AFTER lines was read line by line: 'not valid JSON
    (Expecting value at column 1)' on each, then 'no valid request line', never saying why; a
    longer one was named a binary or UTF-16 file."""
    path = _utf16_trace(tmp_path / "week.jsonl")
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == 0
    assert "not a request trace" in ei.value.reason and "UTF-16" in ei.value.reason
    with pytest.raises(TraceError) as ei:
        read_trace(path, strict=True)
    assert ei.value.line == 1 and "UTF-16" in ei.value.reason


def test_the_cli_names_a_short_utf16_trace_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _utf16_trace(tmp_path / "week.jsonl")
    assert main(["replay", "--config", str(HOME), "--trace", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert f"--trace {path}: not a request trace" in err and "UTF-16" in err
    assert "skipped" not in err  # refused as a whole, not line by line


def test_a_short_text_file_with_no_request_is_still_read_line_by_line(tmp_path: Path) -> None:
    """Only NUL bytes make a short file 'not a trace': a broken line of plain text is a bad line."""
    path = tmp_path / "typo.jsonl"
    path.write_text('{"t": 1, "model": "llm", "busy_s": 1\n', encoding="utf-8")
    got = read_trace(path)
    assert got.requests == [] and [n for n, _ in got.bad_lines] == [1]


FAKE_SCORES = {(None, 600.0): 90.0, (None, None): 80.0, (1800.0, None): 70.0}
"""FakeReplay's objective by (tts.keep_alive, llm.keep_alive); 100 for any other pair."""


class FakeReplay:
    """A stand-in for the simulator (test only): the objective depends on tts's and llm's
    keep-alives alone, so that the second pass changes tts back to its configured 30m after llm's
    change in the first pass."""

    def __call__(self, config: Config, requests: Sequence[Request], policy: str) -> ReplayResult:
        key = (config.model("tts").keep_alive, config.model("llm").keep_alive)
        return ReplayResult(policy=policy, load_wait_s=FAKE_SCORES.get(key, 100.0))


def test_a_setting_changed_back_is_not_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The changes were the search's history: `tts.keep_alive = auto; llm.keep_alive = auto;
    tts.keep_alive = 30m` (3 changes in the tuned config's header, a note 'was 30m' on tts's
    unchanged line) for a config whose one change is llm's keep-alive."""
    config = load_config(HANDWRITTEN)
    assert config.model("tts").keep_alive == 1800.0 and config.model("llm").keep_alive == 600.0
    monkeypatch.setattr(tune_mod, "replay", FakeReplay())
    res = tune_mod.tune(config, [Request(t=DEFAULT_START, model="llm", busy_s=1.0)], None)
    assert res.config.model("tts").keep_alive == 1800.0 and res.config.model("llm").keep_alive is None
    assert res.changes == ["llm.keep_alive = auto"]
    assert res.model_updates == {"llm": {"keep_alive": "auto"}}
    assert res.class_updates == {}


def test_a_switch_is_named_as_yaml_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`world.prewarm = False` (Python's spelling) in the header of a YAML file that says `false`."""

    def fake_replay(config: Config, requests: Sequence[Request], policy: str) -> ReplayResult:  # test only
        return ReplayResult(policy=policy, load_wait_s=50.0 if not config.model("world").prewarm else 100.0)

    monkeypatch.setattr(tune_mod, "replay", fake_replay)
    res = tune_mod.tune(load_config(HOME), [Request(t=DEFAULT_START, model="llm", busy_s=1.0)], None)
    assert res.changes == ["world.prewarm = false"]
    assert res.model_updates == {"world": {"prewarm": False}}


def test_a_long_report_period_is_labelled_with_dates_not_days_since_start() -> None:
    """Over more than a month the report's x ticks are dates (`Dec 2026`, or years such as `2000`
    for a holdout line at t=0); the axis said "days since start", so `2000` read as day 2000."""
    from manager.replay.report import DAY, MAX_DAY_MARKS, _xlabel

    assert _xlabel(DEFAULT_START, DEFAULT_START + (MAX_DAY_MARKS + 1) * DAY) == "date (UTC)"
    assert _xlabel(0.0, 1e11) == "date (UTC)"
    assert _xlabel(DEFAULT_START, DEFAULT_START + 7 * DAY) == "days since start (UTC)"


def test_a_setting_improved_twice_in_one_pass_is_one_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each better keep-alive in the candidates' order was a change of its own: `llm.keep_alive =
    auto; llm.keep_alive = 2m; llm.keep_alive = 1h`, "3 change(s)", for one setting."""
    scores = {None: 90.0, 120.0: 80.0, 3600.0: 70.0}

    def fake_replay(config: Config, requests: Sequence[Request], policy: str) -> ReplayResult:  # test only
        return ReplayResult(policy=policy, load_wait_s=scores.get(config.model("llm").keep_alive, 100.0))

    monkeypatch.setattr(tune_mod, "replay", fake_replay)
    res = tune_mod.tune(load_config(HANDWRITTEN), [Request(t=DEFAULT_START, model="llm", busy_s=1.0)], None)
    assert res.changes == ["llm.keep_alive = 1h"]
    assert res.model_updates == {"llm": {"keep_alive": "1h"}}
