"""Review 17: the service's stop waits 30 s for its tuning job, which looks at the stop between its
replays and files; but the export of weeks of request log that starts each run never looked, so a
stop during it closed the store under the export. `export_trace` now asks `stop` as it goes, and the
tuning run passes its own: a run stopped in its export ends there and leaves nothing. Real SQLite
store and export."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import manager.tuning_job as job
from manager.config import load_config
from manager.replay.synth import synth
from manager.replay.trace import ExportStopped, write_trace
from manager.replay.tune import TuningStopped
from manager.store import open_store
from manager.store.export import STOP_EVERY, export_trace

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


@pytest.fixture
def week(tmp_path: Path) -> tuple[object, float]:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    store.append_requests([json.loads(line) for line in trace.read_text().splitlines()])
    assert len(reqs) > 3 * STOP_EVERY
    yield store, reqs[-1].t + 1.0
    store.close()


class _Stop:
    """Says stop from its `after`-th question on."""

    def __init__(self, after: int) -> None:
        self.after, self.asked = after, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked >= self.after


def test_an_export_asked_to_stop_ends_and_leaves_the_file_as_it_was(
    tmp_path: Path, week: tuple[object, float]
) -> None:
    store, now = week
    out = tmp_path / "out.jsonl"
    out.write_text("before\n")
    stop = _Stop(after=2)
    with pytest.raises(ExportStopped):
        export_trace(store, 7 * 86400, now, out, stop)  # type: ignore[arg-type]
    assert stop.asked == 2  # once per STOP_EVERY records, not once per record
    assert out.read_text() == "before\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no partial file
    n = export_trace(store, 7 * 86400, now, out, lambda: False)  # type: ignore[arg-type]
    assert n > 3 * STOP_EVERY and len(out.read_text().splitlines()) == n


def test_a_tuning_run_stopped_in_its_export_leaves_nothing(
    tmp_path: Path, week: tuple[object, float]
) -> None:
    store, now = week
    out_dir = tmp_path / "tuning"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(HANDWRITTEN.read_text() + f"tuning: {{schedule: weekly, out_dir: {out_dir}}}\n")
    stop = _Stop(after=2)  # (the first question is the export's first record)
    with pytest.raises(TuningStopped, match="export was stopped"):
        job.run_tuning(load_config(cfg), cfg, store, now, stop)
    assert stop.asked == 2
    assert list(out_dir.iterdir()) == []


# Review 18: `export_trace`, a general-purpose export (`residency trace export`), raised the tuning
# job's `TuningStopped` when its `stop` said so. It raises its own `ExportStopped` now; the tuning job
# still treats a stop met in its export as a stopped run (the same message and "stopped: ...").


def test_a_stopped_export_raises_its_own_exception_not_the_tuning_jobs(
    tmp_path: Path, week: tuple[object, float]
) -> None:
    store, now = week
    with pytest.raises(ExportStopped, match="export was stopped") as e:
        export_trace(store, 7 * 86400, now, tmp_path / "out.jsonl", lambda: True)  # type: ignore[arg-type]
    assert not isinstance(e.value, TuningStopped)
    assert not (tmp_path / "out.jsonl").exists()


def test_the_schedule_still_reports_a_run_stopped_in_its_export_as_stopped(
    tmp_path: Path, week: tuple[object, float]
) -> None:
    store, now = week
    out_dir = tmp_path / "tuning"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(HANDWRITTEN.read_text() + f"tuning: {{schedule: weekly, out_dir: {out_dir}}}\n")
    manager = SimpleNamespace(config=load_config(cfg))
    said = job.scheduled_tuning(manager, cfg, store, now, lambda: True)
    assert said == "stopped: the export was stopped (the service is stopping)"
    assert store.get_doc("tuning") in (None, {})  # a stopped run is not recorded as failed
    assert list(out_dir.iterdir()) == []
