"""Review 17: a scheduled tuning run that failed (the search raised, the config file was moved away,
the proposal could not be written) left its folder under `tuning.out_dir` behind, with the request
log it had exported (weeks of requests: tens or hundreds of MB), and the failed run is tried again
every `RETRY_S`: a folder more each hour while the cause lasts, until the disk was full. A run that
fails now removes what it wrote, as a stopped one does. Real store, config and export; only the
search is replaced by one that fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import manager.tuning_job as job
from manager.config import Config, load_config
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.store import open_store

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


class _Manager:
    """Stands in for the LiveManager (unit test only): holds a config, takes reloads."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def reload(self, new: Config) -> list[str]:
        self.config = new
        return []


def test_a_failed_run_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    store.append_requests([json.loads(line) for line in trace.read_text().splitlines()])
    out_dir = tmp_path / "tuning"
    cfg = tmp_path / "config.yaml"
    tuning = f"tuning: {{schedule: weekly, apply: auto, out_dir: {out_dir}}}\n"
    cfg.write_text(HANDWRITTEN.read_text() + tuning)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the search failed")

    monkeypatch.setattr(job, "tune", failing)
    manager = _Manager(load_config(cfg))
    now = reqs[-1].t + 1.0
    try:
        said = [job.scheduled_tuning(manager, cfg, store, t) for t in (now, now + job.RETRY_S + 1.0)]
        doc = store.get_doc("tuning")
    finally:
        store.close()
    assert all(s is not None and s.startswith("failed (RuntimeError: the search failed)") for s in said), said
    assert doc is not None and doc["failed_at"] == now + job.RETRY_S + 1.0
    left = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) if out_dir.exists() else []
    assert left == [], f"the failed runs left {left}"
