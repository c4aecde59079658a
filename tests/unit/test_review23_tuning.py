"""Found in review (2026-12-06, twenty-third session): the scheduled tuning's `apply: auto`, a broken
config file found only after the search, and `residency tune` writing --out from a config saved
during its search."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from live_helpers import CONFIG, in_time, run
from test_tuning_job import _Manager, filled  # noqa: F401 (a fixture)

import manager.replay.tune as tune_module
import manager.tuning_job as job
from manager.cli import main
from manager.config import load_config
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.tuning_job import TuningOutcome

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"


def test_a_field_written_into_the_file_drops_the_value_held_over_it(tmp_path: Path) -> None:
    """A run whose tuned value the read-only file could not take held it over the file; once the file
    could be written, a later run that found the file's value better wrote it and said "applied", but
    the service kept the held value (the file still held what it did when the value was held) until
    a restart, and each later run "applied" the same change again."""
    cfg = tmp_path / "svc.yaml"
    data = yaml.safe_load(CONFIG.read_text())
    data["models"] = [{**m, "keep_alive": "2m"} for m in data["models"] if m["name"] == "embed"]
    data["store"] = {"url": f"sqlite:///{tmp_path}/state.db", "journal": str(tmp_path / "j.journal")}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg.chmod(0o444)

    def keep_alive(config: Any) -> float:
        return float(next(m.keep_alive for m in config.models if m.name == "embed"))

    async def body(lm: Any) -> None:
        first = TuningOutcome(
            tmp_path / "p1.yaml", None, 0, model_updates={"embed": {"keep_alive": "10m"}}, better=True
        )
        assert job._apply(lm, cfg, first, cfg.read_bytes())
        assert "read-only" in first.reason and keep_alive(lm.config) == 600.0  # held over the file
        cfg.chmod(0o644)  # the user lets the service write its file
        updates = job._under(lm.tuning_overrides, "models", {"embed": {"keep_alive": "2m"}})
        second = TuningOutcome(
            tmp_path / "p2.yaml",
            None,
            0,
            changes=["embed.keep_alive = 2m"],
            model_updates=updates,
            better=True,
        )
        assert job._apply(lm, cfg, second, cfg.read_bytes())
        assert keep_alive(load_config(cfg)) == 120.0
        assert keep_alive(lm.config) == 120.0 and not lm.tuning_overrides  # the file and the service agree

    run(load_config(cfg), body)


def test_tune_writes_nothing_when_its_config_was_saved_during_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`residency tune` measured the config as loaded, then wrote --out from the file as it was at
    the end: an edit saved meanwhile (a person, or the service's own `apply: auto`) went into --out
    unmeasured, and its "was" notes spoke of the edit."""
    src = tmp_path / "home.yaml"
    shutil.copy(EXAMPLE, src)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synth("home", days=2, seed=5))
    real = tune_module.tune

    def tune_then_saved(*args: Any, **kw: Any) -> Any:
        res = real(*args, **kw)
        src.write_text(src.read_text() + "\n# saved meanwhile\n")
        return res

    monkeypatch.setattr(tune_module, "tune", tune_then_saved)
    out = tmp_path / "tuned.yaml"
    assert main(["tune", "--config", str(src), "--trace", str(trace), "--out", str(out)]) == 2
    assert "changed while tune ran" in capsys.readouterr().err
    assert not out.exists()


def test_a_config_file_that_does_not_load_fails_the_run_before_its_search(
    filled: tuple[Any, float, Path],  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proposal is written from the file: a file saved broken (its reload refused) failed the run
    only after the export and the whole search, again each hour while it lasted."""
    store, now, cfg = filled
    manager = _Manager(load_config(cfg))
    cfg.write_text(cfg.read_text() + "models: [\n")
    searched: list[int] = []
    monkeypatch.setattr(job, "tune", lambda *a, **k: searched.append(1))
    try:
        said = job.scheduled_tuning(manager, cfg, store, now)
    finally:
        store.close()
    assert said is not None and said.startswith("failed (ConfigError") and "YAML" in said
    assert searched == []


def test_tune_refuses_a_config_that_is_a_fifo_as_load_config_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: the bytes the search measures were read before `load_config`, with none of
    its guards: `tune --config FIFO` hung (a device: read until memory ran out)."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synth("home", days=1, seed=5))
    code = in_time(
        lambda: main(
            ["tune", "--config", str(fifo), "--trace", str(trace), "--out", str(tmp_path / "o.yaml")]
        )
    )
    assert code == 2 and "not a regular file (a FIFO)" in capsys.readouterr().err
