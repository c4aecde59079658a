"""Review 18: `export_trace` (manager/store/export.py), a general-purpose export (`residency trace
export`), raised the tuning job's `TuningStopped` when its `stop` said so. It raises its own
`ExportStopped` (manager/replay/trace.py) now; the tuning job still treats a stop met in its export as a
stopped run (TuningStopped, the same message, the same "stopped: ..." from the schedule). Real SQLite
store and export."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import manager.replay.trace as trace_mod
import manager.tuning_job as job
from manager.config import load_config
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.replay.tune import TuningStopped
from manager.store import open_store
from manager.store.export import STOP_EVERY, export_trace

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


@pytest.fixture
def store_and_now(tmp_path: Path) -> tuple[object, float]:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    t = tmp_path / "week.jsonl"
    write_trace(t, reqs)
    store.append_requests([json.loads(line) for line in t.read_text().splitlines()])
    assert len(reqs) > 2 * STOP_EVERY
    yield store, reqs[-1].t + 1.0
    store.close()


def test_a_stopped_export_raises_its_own_exception_not_the_tuning_jobs(
    tmp_path: Path, store_and_now: tuple[object, float]
) -> None:
    store, now = store_and_now
    stopped = getattr(trace_mod, "ExportStopped", None)
    assert stopped is not None, "manager.replay.trace has no ExportStopped"
    with pytest.raises(stopped, match="export was stopped") as e:
        export_trace(store, 7 * 86400, now, tmp_path / "out.jsonl", lambda: True)  # type: ignore[arg-type]
    assert not isinstance(e.value, TuningStopped)
    assert not (tmp_path / "out.jsonl").exists()


def test_the_schedule_still_reports_a_run_stopped_in_its_export_as_stopped(
    tmp_path: Path, store_and_now: tuple[object, float]
) -> None:
    store, now = store_and_now
    out_dir = tmp_path / "tuning"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(HANDWRITTEN.read_text() + f"tuning: {{schedule: weekly, out_dir: {out_dir}}}\n")
    manager = SimpleNamespace(config=load_config(cfg))
    said = job.scheduled_tuning(manager, cfg, store, now, lambda: True)
    assert said == "stopped: the export was stopped (the service is stopping)"
    assert store.get_doc("tuning") in (None, {})  # a stopped run is not recorded as failed
    assert list(out_dir.iterdir()) == []
