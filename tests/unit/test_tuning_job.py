"""The built-in weekly loop: store -> tune -> proposal + report -> hot apply only when better."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from manager.config import Config, load_config
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.store import open_store
from manager.tuning_job import due, run_tuning, tuning_step

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


class _Manager:
    """Stands in for the LiveManager (unit test only): holds a config, takes reloads."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reloaded: list[Config] = []

    def reload(self, new: Config) -> list[str]:
        self.reloaded.append(new)
        self.config = new
        return []


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Any, float, Path]:
    """A store holding a synthetic home week, as the service would have logged it."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    import json

    store.append_requests([json.loads(line) for line in trace.read_text().splitlines()])
    cfg = tmp_path / "config.yaml"
    text = HANDWRITTEN.read_text()
    cfg.write_text(text + f"tuning: {{schedule: weekly, apply: auto, out_dir: {tmp_path / 'tuning'}}}\n")
    return store, reqs[-1].t + 1.0, cfg


def test_a_tuning_run_writes_a_better_proposal_and_its_report(filled: tuple[Any, float, Path]) -> None:
    store, now, cfg = filled
    out = run_tuning(load_config(cfg), cfg, store, now)
    assert out.requests == store.count_requests()
    assert (
        out.proposal is not None
        and out.proposal.is_file()
        and out.report is not None
        and out.report.is_file()
    )
    assert out.changes and out.better  # the hand-written keep-alives leave room to improve
    assert out.holdout_after is not None and out.holdout_before is not None
    assert out.holdout_after["load_wait_s"] < out.holdout_before["load_wait_s"]
    tuned = load_config(out.proposal)  # a valid config, only tunable fields changed
    assert [m.name for m in tuned.models] == [m.name for m in load_config(cfg).models]
    store.close()


def test_the_schedule_applies_only_when_auto_and_better(filled: tuple[Any, float, Path]) -> None:
    store, now, cfg = filled
    manager = _Manager(load_config(cfg))
    assert due(manager.config, store, now)
    out = tuning_step(manager, cfg, store, now)
    assert out.better and len(manager.reloaded) == 1
    doc = store.get_doc("tuning")
    assert doc is not None and doc["applied"] and doc["last_run"] == now
    assert not due(manager.config, store, now + 3600)  # weekly: not again within the week
    propose = _Manager(
        load_config(cfg).model_copy(
            update={"tuning": manager.config.tuning.model_copy(update={"apply": "propose"})}
        )
    )
    tuning_step(propose, cfg, store, now + 8 * 86400)
    assert propose.reloaded == []
    store.close()


def test_too_little_history_is_said_not_guessed(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    store.append_requests([{"t": 1000.0, "model": "voice", "busy_s": 0.1}])
    config = load_config(HANDWRITTEN)
    config = config.model_copy(
        update={"tuning": config.tuning.model_copy(update={"out_dir": str(tmp_path / "t")})}
    )
    out = run_tuning(config, HANDWRITTEN, store, 2000.0)
    assert out.proposal is None and not out.better and "too few days" in out.reason
    store.close()
