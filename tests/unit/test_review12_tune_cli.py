"""Review 12 of `residency tune` / `ps` / `trace synth` and the tuned config writer: a tuned reserve
that took the room its class needs, comments left speaking of replaced values, tables cut to 80
columns when piped, a seed that repeats another, flags that were silently ignored, and configs the
writer could not write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from manager.cli import main
from manager.config import load_config, write_config_with_updates
from manager.replay.synth import synth
from manager.replay.trace import write_trace

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"
WEEK1 = ROOT / "bench" / "traces" / "home-week-seed1.jsonl"


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.lstrip().startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


# --- tune: the realtime reservation --------------------------------------------------------------


def test_reserve_floor_is_what_the_class_models_need_capped_by_the_configured_reserve() -> None:
    from manager.replay.tune import reserve_floor

    config = load_config(HANDWRITTEN)
    # realtime: voice 1200 MiB (pinned) + tts 900 MiB on gpu0; 3 GiB configured
    assert reserve_floor(config, "realtime") == (1200 + 900) * 2**20
    # a class with no reservation may be given one, from nothing
    assert reserve_floor(config, "interactive") == 0


def test_tune_does_not_take_the_realtime_reserve_its_models_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tuned.yaml"
    args = ["tune", "--config", str(HANDWRITTEN), "--trace", str(WEEK1), "--out", str(out), "--json"]
    assert main(args) == 0
    fig = json.loads(capsys.readouterr().out)
    # this week once tuned `realtime.reserve = 0B`: TTS would no longer be sure of its room when the
    # LLM loads, which no week of replay shows but the config's comment promises
    assert not any(c.startswith("realtime.reserve") for c in fig["changes"])
    tuned = load_config(out)
    assert next(c for c in tuned.classes if c.name == "realtime").reserve == 3 * 2**30
    # the keep-alives it did change say, on their own line, what they were
    text = out.read_text(encoding="utf-8")
    assert "tts.keep_alive = auto" in fig["changes"]
    line = _line(text, "keep_alive: auto             # replies come in bursts")
    assert line.endswith(
        "# replies come in bursts around conversations  # residency tune: tts.keep_alive was 30m"
    )


# --- the tuned config notes what it replaced ------------------------------------------------------


def test_tuned_lines_note_the_value_they_replaced_and_keep_the_persons_first_value(tmp_path: Path) -> None:
    first, second = tmp_path / "1.yaml", tmp_path / "2.yaml"
    write_config_with_updates(
        HANDWRITTEN, first, {"llm": {"keep_alive": "auto"}, "tts": {"prewarm": False}},
        {"realtime": {"reserve": "4GiB"}, "interactive": {"reserve": "1GiB"}}, "Tuned by `residency tune` 1",
        note_changes=True,
    )  # fmt: skip
    text = first.read_text(encoding="utf-8")
    # the comment above realtime explains 3 GiB: the line itself now says the value is tuning's
    assert _line(text, "- {name: realtime").endswith(
        "- {name: realtime, reserve: 4GiB}  # residency tune: realtime.reserve was 3GiB"
    )
    assert _line(text, "- {name: interactive").endswith("# residency tune: interactive.reserve was unset")
    assert _line(text, "keep_alive: auto             # conversations").endswith(
        "# conversations pause for minutes, rarely for longer  # residency tune: llm.keep_alive was 10m"
    )
    assert _line(text, "prewarm: false").endswith("# residency tune: tts.prewarm was unset")
    assert load_config(first).model("tts").prewarm is False

    # tuned again: the note keeps the value the person chose (not the last tuning's); a field tuned
    # back to it loses its note
    write_config_with_updates(
        first, second, {"llm": {"keep_alive": "2m"}}, {"realtime": {"reserve": "3GiB"}},
        "Tuned by `residency tune` 2", note_changes=True,
    )  # fmt: skip
    text = second.read_text(encoding="utf-8")
    assert _line(text, "- {name: realtime") == "  - {name: realtime, reserve: 3GiB}"
    assert _line(text, "keep_alive: 2m").endswith("  # residency tune: llm.keep_alive was 10m")
    assert text.count("# residency tune:") == 3  # llm, tts.prewarm, interactive: kept; realtime: gone
    assert text.startswith("# Tuned by `residency tune` 2\n# Residency:")


def test_notes_on_a_flow_style_config_read_back_and_measure_writes_none(tmp_path: Path) -> None:
    src = tmp_path / "flow.yaml"
    src.write_text(
        "{devices: [{name: gpu0, kind: cuda, memory: 24GiB}], host: {memory: 32GiB},\n"
        " classes: [{name: rt, reserve: 1GiB}, {name: bg}],\n"
        " models: [{name: a, class: rt, adapter: silero-vad, device: gpu0, memory: 1GiB,\n"
        "   load_seconds: {disk: 2, host: 1}, keep_alive: 10m}]}\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.yaml"
    config = write_config_with_updates(
        src, out, {"a": {"keep_alive": "auto"}}, {"rt": {"reserve": "2GiB"}}, note_changes=True
    )
    assert config.model("a").keep_alive is None and config.classes[0].reserve == 2 * 2**30
    text = out.read_text(encoding="utf-8")
    # the writer puts a flow document on one line: one note names both fields
    assert text.rstrip().endswith("}  # residency tune: a.keep_alive was 10m, rt.reserve was 1GiB")
    assert load_config(out) == config
    # without note_changes (measure's copy), no note
    write_config_with_updates(src, out, {"a": {"memory": "2GiB"}})
    assert "residency tune" not in out.read_text(encoding="utf-8")


# --- the writer and YAML merges -------------------------------------------------------------------

MERGED = """devices: [{name: gpu0, kind: cuda, index: 0, memory: 24GiB}]
host: {memory: 32GiB}
classes: [{name: a}]
models:
  - &x {name: m1, class: a, adapter: silero-vad, device: gpu0, memory: 1GiB,
        load_seconds: {disk: 2, host: 1}, keep_alive: 10m}
  - &y
    <<: *x
    name: m2
  - <<: *y
    name: m3
"""


def test_a_tuned_entry_that_another_merges_is_written_without_changing_that_other(tmp_path: Path) -> None:
    src = tmp_path / "merged.yaml"
    src.write_text(MERGED, encoding="utf-8")
    out = tmp_path / "out.yaml"
    # m2 gets `prewarm` (a field it did not have): m3, which merges m2, must not inherit it. This
    # raised ValueError ("give that entry its own copy ... by hand") after the whole search
    config = write_config_with_updates(src, out, {"m2": {"keep_alive": "auto", "prewarm": False}}, {})
    got = {m.name: (m.keep_alive, m.prewarm) for m in config.models}
    assert got == {"m1": (600.0, True), "m2": (None, False), "m3": (600.0, True)}
    assert load_config(out) == config


def test_tune_says_plainly_when_the_tuned_config_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise ValueError("x.yaml: the update would also change entries that share a YAML anchor")

    monkeypatch.setattr("manager.cli.write_config_with_updates", refuse)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synth("home", 2, 1))
    out = tmp_path / "o.yaml"
    assert main(["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"residency: --out {out}: not written: x.yaml: the update would also change" in err
    assert "Traceback" not in err


def test_tune_writes_a_valid_config_whatever_the_trace_file_is_called(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a file name that is not UTF-8 (Latin-1 bytes) reaches Python as a lone surrogate; a control
    # character is legal in a file name: neither may go into the YAML comment as it is
    for name in ("w\udcffk.jsonl", "a\x1bb.jsonl"):
        trace = tmp_path / name
        write_trace(trace, synth("home", 2, 1))
        out = tmp_path / "o.yaml"
        assert main(["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(out), "--json"]) == 0
        capsys.readouterr()
        head = out.read_text(encoding="utf-8").splitlines()[0]
        assert head.startswith("# Tuned by `residency tune` from ")
        assert ascii(name[1])[1:-1] in head
        load_config(out)


# --- tune: flags that were silently ignored --------------------------------------------------------


def test_tune_refuses_trace_and_from_store_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.yaml"
    args = ["tune", "--config", str(HOME), "--out", str(out)]
    assert main([*args, "--trace", str(WEEK1), "--from-store"]) == 2
    assert "--from-store: give one of them, not both" in capsys.readouterr().err
    # --since only means something with --from-store: with --trace it was dropped without a word
    assert main([*args, "--trace", str(WEEK1), "--since", "3d"]) == 2
    assert "--since 3d: only with --from-store" in capsys.readouterr().err
    assert not out.exists()


# --- trace synth --seed -----------------------------------------------------------------------------


def test_synth_refuses_a_negative_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    # random.Random(-1) is random.Random(1): the "other" week was the same week
    assert main(["trace", "synth", "--days", "1", "--seed", "-1", "--out", str(out)]) == 2
    assert "--seed must be 0 or more, got -1" in capsys.readouterr().err
    assert not out.exists()
    assert main(["trace", "synth", "--days", "1", "--seed", "0", "--out", str(out)]) == 0


# --- tables on stdout are not cut at 80 columns when piped ----------------------------------------


def test_ps_table_and_errors_are_whole_when_piped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from residency_proto.v1 import residency_pb2

    name = "a-very-long-model-name.with.dots-v2.1-instruct-q4_k_m"
    error = (
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total) " + "x" * 60
    )
    resp = residency_pb2.ListResponse(
        models=[
            residency_pb2.ModelStatus(
                name=name, tier="gpu", device="gpu0", class_name="interactive-household", bytes=2**30,
                keep_alive_left_s=1234, load_seconds=residency_pb2.LoadSeconds(disk=3, cached=1, host=0.4),
                last_error=error,
            )
        ]
    )  # fmt: skip
    monkeypatch.setattr("manager.api.client.list_models", lambda *a, **k: resp)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["ps", "--target", "127.0.0.1:50051"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if name in line)
    assert "interactive-household" in row and "3.000/1.000/0.400" in row and "keep-alive left" in out
    assert f"{name}: last load failed: {error}" in out.splitlines()
    assert "…" not in out


def test_replay_table_is_whole_when_piped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "interactive-for-everyone-in-the-household"
    config = tmp_path / "c.yaml"
    config.write_text(
        HOME.read_text(encoding="utf-8")
        .replace("{name: interactive}", "{name: " + long + "}")
        .replace("class: interactive", "class: " + long),
        encoding="utf-8",
    )
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synth("home", 1, 1))
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["replay", "--config", str(config), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert any(f"p99 {long} s" in line and "lru-keepalive" not in line for line in out.splitlines())
    assert "lru-keepalive" in out and "…" not in out


# --- the service's write-back -----------------------------------------------------------------------


def test_write_back_says_why_when_the_config_file_was_broken_meanwhile(tmp_path: Path) -> None:
    from manager.tuning_job import TuningOutcome, write_back

    proposal_dir = tmp_path / "tuning" / "20261201-000000"
    proposal_dir.mkdir(parents=True)
    proposal = proposal_dir / "proposed.yaml"
    proposal.write_text(HANDWRITTEN.read_text(encoding="utf-8"), encoding="utf-8")
    config = tmp_path / "config.yaml"
    config.write_text("devices: [\n", encoding="utf-8")  # edited by hand since the run began
    outcome = TuningOutcome(proposal, None, 10, model_updates={"llm": {"keep_alive": "auto"}})
    # a ConfigError (not a ValueError) escaped, and the run was recorded as failed instead of
    # applying the proposal in memory with the reason it was not written
    why = write_back(config, outcome)
    assert why.startswith(f"not written into {config}: ")
    assert "YAML syntax error" in why
    assert config.read_text(encoding="utf-8") == "devices: [\n"
    assert not list(tmp_path.glob(".config.yaml.tuned"))

    config.write_text(HANDWRITTEN.read_text(encoding="utf-8"), encoding="utf-8")
    assert write_back(config, outcome) == ""
    assert "keep_alive: auto             # conversations pause for minutes, rarely for longer  " in (
        config.read_text(encoding="utf-8")
    )
    assert load_config(config).model("llm").keep_alive is None
