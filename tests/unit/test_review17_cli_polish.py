"""Review 17 (a user's read of the README): `residency tune --out` naming the `--config` file wrote the
tuned config over the hand-written one (its help says "not the input file"); a missing subcommand was
named by its internal name (`cmd`, `config_cmd`, `trace_cmd`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_tune_out_over_its_config_is_refused_and_the_config_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "home.yaml"
    cfg.write_text((ROOT / "configs" / "home.yaml").read_text())
    before = cfg.read_text()
    trace = ROOT / "bench" / "traces" / "home-week-seed1.jsonl"
    assert main(["tune", "--config", str(cfg), "--trace", str(trace), "--out", str(cfg)]) == 2
    assert f"--out {cfg} is the --config file" in capsys.readouterr().err
    assert cfg.read_text() == before


@pytest.mark.parametrize(
    ("argv", "named"), [([], "COMMAND"), (["config"], "{schema,check}"), (["trace"], "{synth,export}")]
)
def test_a_missing_subcommand_is_named_by_its_choices(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"the following arguments are required: {named}" in err and "_cmd" not in err


def test_one_thing_is_said_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "day.jsonl"
    assert main(["trace", "synth", "--days", "1", "--seed", "3", "--out", str(out)]) == 0
    assert "(1 day, profile home, seed 3)" in capsys.readouterr().err
    cfg = tmp_path / "one.yaml"
    cfg.write_text(
        "devices: [{name: cpu0, kind: cpu, memory: 8GiB, reserve: 512MiB}]\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes: [{name: realtime}]\n"
        "models:\n"
        "  - {name: voice, class: realtime, adapter: silero-vad, device: cpu0, memory: 1GiB,\n"
        "     load_seconds: {disk: 1.0, host: 0.2}}\n"
    )
    assert main(["config", "check", str(cfg)]) == 0
    assert "ok (1 device, 1 class, 1 model)" in capsys.readouterr().out
