"""The built-in weekly loop: store -> tune -> proposal + report -> hot apply only when better."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from manager.config import Config, load_config
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.store import open_store
from manager.tuning_job import RETRY_S, due, run_tuning, scheduled_tuning, tuning_step

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
    original = cfg.read_text()
    real = cfg.with_name("real.yaml")  # the config is a symlink, with its own file mode
    cfg.rename(real)
    cfg.symlink_to(real.name)
    real.chmod(0o640)
    out = tuning_step(manager, cfg, store, now)
    assert out.better and len(manager.reloaded) == 1
    assert cfg.is_symlink() and (real.stat().st_mode & 0o777) == 0o640  # rewritten where it points
    doc = store.get_doc("tuning")
    assert doc is not None and doc["applied"] and doc["last_run"] == now
    # applied into the config file itself, so that a restart keeps it; the replaced file is kept
    assert out.proposal is not None and (out.proposal.parent / "previous.yaml").read_text() == original
    # with the config's own mode (it was the default 0644 whatever the config's)
    assert ((out.proposal.parent / "previous.yaml").stat().st_mode & 0o777) == 0o640
    assert load_config(cfg) == manager.config and load_config(cfg).models == load_config(out.proposal).models
    assert manager.config.models != load_config(out.proposal.parent / "previous.yaml").models
    comments = [line.strip() for line in original.splitlines() if line.strip().startswith("#")]
    assert comments and all(c in cfg.read_text() for c in comments)  # the file's comments are kept
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


def test_a_config_file_that_cannot_be_written_is_applied_until_a_restart_and_says_so(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, now, cfg = filled
    original = cfg.read_text()

    import os

    replace = os.replace

    def read_only(src: Any, dst: Any) -> None:  # the config's folder is read-only (as root, chmod is not)
        if Path(dst) == cfg:
            raise PermissionError(13, "Permission denied", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    manager = _Manager(load_config(cfg))
    out = tuning_step(manager, cfg, store, now)
    assert out.better and len(manager.reloaded) == 1 and out.proposal is not None
    assert manager.config.models == load_config(out.proposal).models  # applied from the proposal
    assert cfg.read_text() == original and not list(cfg.parent.glob(f".{cfg.name}*"))  # no leftovers
    assert f"not written into {cfg}" in out.reason and "Permission denied" in out.reason
    assert "a restart reverts it" in out.reason
    doc = store.get_doc("tuning")
    assert doc is not None and doc["applied"] and doc["reason"] == out.reason
    store.close()


def test_a_failed_run_is_recorded_and_tried_again_later_not_at_every_check(
    filled: tuple[Any, float, Path],
) -> None:
    store, now, cfg = filled
    config = load_config(cfg)
    blocked = Path(config.tuning.out_dir)
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("a file where the output folder should be")
    manager = _Manager(config)
    said = scheduled_tuning(manager, cfg, store, now)
    assert (
        said is not None and said.startswith("failed (") and str(blocked) in said and "retried in 1 h" in said
    )
    doc = store.get_doc("tuning")
    assert doc is not None and doc["failed_at"] == now and str(blocked) in doc["error"]
    assert scheduled_tuning(manager, cfg, store, now + 60) is None  # the next check does not rerun it
    assert not due(config, store, now + RETRY_S - 1) and due(config, store, now + RETRY_S)
    blocked.unlink()  # fixed: the retry runs, and a success clears the failure
    said = scheduled_tuning(manager, cfg, store, now + RETRY_S)
    assert said is not None and "applied" in said and manager.reloaded
    doc = store.get_doc("tuning")
    assert doc is not None and "failed_at" not in doc and doc["last_run"] == now + RETRY_S
    store.close()


def test_a_store_that_is_down_does_not_stop_the_schedule(filled: tuple[Any, float, Path]) -> None:
    store, now, cfg = filled

    class Down:
        def get_doc(self, key: str) -> Any:
            raise ConnectionError("redis at 127.0.0.1:6379 is down")

        put_doc = get_doc

    said = scheduled_tuning(_Manager(load_config(cfg)), cfg, Down(), now)
    assert (
        said is not None
        and "redis at 127.0.0.1:6379 is down" in said
        and "the store could not record it" in said
    )
    store.close()


def test_the_services_tuning_thread_reloads_on_the_event_loops_thread(
    filled: tuple[Any, float, Path],
) -> None:
    import asyncio
    import threading

    from manager.api.server import _ReloadOnLoop

    store, _now, cfg = filled
    store.close()
    threads: list[int] = []

    class Recording(_Manager):
        def reload(self, new: Config) -> list[str]:
            threads.append(threading.get_ident())
            return super().reload(new)

    async def main() -> None:
        manager = Recording(load_config(cfg))
        proxy = _ReloadOnLoop(manager, asyncio.get_running_loop())  # type: ignore[arg-type]
        assert await asyncio.to_thread(lambda: proxy.config) is manager.config
        assert await asyncio.to_thread(proxy.reload, load_config(HANDWRITTEN)) == []
        assert threads == [threading.get_ident()] and manager.config == load_config(HANDWRITTEN)

    asyncio.run(main())


def test_a_run_stopped_by_the_service_stopping_writes_and_records_nothing(
    filled: tuple[Any, float, Path],
) -> None:
    """A stop waited for a whole run (minutes of replays), which then used the closed store and could
    rewrite the config after the service had stopped (found in review, 2026-12-01)."""
    store, now, cfg = filled
    manager = _Manager(load_config(cfg))
    original = cfg.read_text()
    calls = [0]

    def stop() -> bool:  # the service stops after the run's third replay
        calls[0] += 1
        return calls[0] > 3

    said = scheduled_tuning(manager, cfg, store, now, stop)
    assert said is not None and said.startswith("stopped") and calls[0] == 4
    assert manager.reloaded == [] and cfg.read_text() == original
    assert store.get_doc("tuning") is None  # not recorded as a run, nor as a failure
    store.close()


def _corrupt_record(cfg: Path, store: Any, record: str) -> None:
    """Put `record` (raw text) in the store's tuning record, as a torn write or a hand edit would."""
    import sqlite3

    store.put_doc("tuning", {"last_run": 0.0})
    db = sqlite3.connect(cfg.parent / "state.db")
    with db:
        db.execute("UPDATE docs SET value = ? WHERE key = 'tuning'", (record,))
    db.close()


@pytest.mark.parametrize(
    "record",
    ['{"last_run": "yesterday"}', '{"last_run": null, "failed_at": "soon"}', "{not json", "[1, 2]"],
    ids=["text-time", "null-times", "not-json", "not-an-object"],
)
def test_a_corrupt_tuning_record_counts_as_none_and_a_failure_is_still_recorded_over_it(
    filled: tuple[Any, float, Path], record: str
) -> None:
    """Before, `due` called float() on the record's times (and a record that was not JSON made the
    store raise), so every check of the schedule failed, and no tuning ever ran again until someone
    deleted the record by hand; recording the failure failed on the same record."""
    store, now, cfg = filled
    _corrupt_record(cfg, store, record)
    config = load_config(cfg)
    assert due(config, store, now)
    blocked = Path(config.tuning.out_dir)  # the run fails at once: its output folder is a file
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("a file where the output folder should be")
    said = scheduled_tuning(_Manager(config), cfg, store, now)
    assert said is not None and said.startswith("failed (") and "retried in 1 h" in said
    doc = store.get_doc("tuning")
    assert doc is not None and doc["failed_at"] == now
    assert not due(config, store, now + 60) and due(config, store, now + RETRY_S)
    store.close()


def test_a_corrupt_tuning_record_is_rewritten_by_the_next_run(filled: tuple[Any, float, Path]) -> None:
    """The run a corrupt record lets through writes a good record, which the schedule reads again."""
    store, now, cfg = filled
    _corrupt_record(cfg, store, "{not json")
    config = load_config(cfg)
    manager = _Manager(config)
    said = scheduled_tuning(manager, cfg, store, now)
    assert said is not None and not said.startswith("failed") and "applied" in said and manager.reloaded
    doc = store.get_doc("tuning")
    assert doc is not None and doc["last_run"] == now and "failed_at" not in doc
    assert not due(config, store, now + 60)
    store.close()


def test_a_store_that_does_not_answer_is_still_a_failure_not_a_missing_record(
    filled: tuple[Any, float, Path],
) -> None:
    """A record that cannot be read counts as none only while the store answers: when the store is
    down, the check fails (and is said), rather than starting a run the store cannot serve."""
    from manager.store import StoreError

    store, now, cfg = filled

    class Down:
        def get_doc(self, key: str) -> Any:
            raise StoreError("redis://127.0.0.1:6379/0", "connection refused")

        put_doc = get_doc

    with pytest.raises(StoreError, match="connection refused"):
        due(load_config(cfg), Down(), now)
    said = scheduled_tuning(_Manager(load_config(cfg)), cfg, Down(), now)
    assert said is not None and said.startswith("failed (") and "connection refused" in said
    store.close()


def test_the_jobs_report_covers_until_the_last_request_ends_and_none_when_that_is_no_time(
    tmp_path: Path,
) -> None:
    """Found in review: the job's report ended at the last arrival (a session closing the held-out
    days fell off the plots), and held-out requests all at one instant raised instead of no report."""
    from manager.policy.types import Request
    from manager.replay.tune import tune
    from manager.tuning_job import _report

    config = load_config(ROOT / "configs" / "home.yaml")
    t = 1_800_000_000.0  # Friday 2027-01-15 08:00 UTC
    reqs = [Request(t, "world", 3 * 3600.0, "w", "session"), Request(t + 60.0, "llm", 2.0, "c")]
    res = tune(config, reqs, reqs, policy="residency")
    page = _report(tmp_path / "r", config, res, reqs)
    assert page is not None and page.is_file()
    assert "08:00 – Fri 2027-01-15 11:00" in page.read_text(encoding="utf-8")  # the session's 3 hours
    instant = [Request(t, "llm", 0.0, "c"), Request(t, "image", 0.0, "c")]
    assert _report(tmp_path / "r2", config, res, instant) is None


def test_an_edit_reloaded_while_the_run_went_on_is_kept_when_the_file_cannot_be_written(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's proposal is the config as it was when the run began, tuned. With the file not
    writable it was that proposal that was hot-reloaded: an edit an admin had reloaded meanwhile (a
    class's max_wait here) was undone in the running service while the file still held it. Now the
    tuned fields alone are applied to the running config."""
    store, now, cfg = filled
    import os

    import manager.tuning_job as job

    replace = os.replace

    def read_only(src: Any, dst: Any) -> None:
        if Path(dst) == cfg:
            raise PermissionError(13, "Permission denied", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    manager = _Manager(load_config(cfg))
    real_run = job.run_tuning

    def run_with_an_edit_meanwhile(*args: Any, **kwargs: Any) -> Any:
        out = real_run(*args, **kwargs)
        classes = [
            c.model_copy(update={"max_wait": 42.0}) if c.name == "interactive" else c
            for c in manager.config.classes
        ]
        manager.config = manager.config.model_copy(update={"classes": classes})  # reloaded meanwhile
        return out

    monkeypatch.setattr(job, "run_tuning", run_with_an_edit_meanwhile)
    out = tuning_step(manager, cfg, store, now)
    assert out.better and len(manager.reloaded) == 1 and out.proposal is not None
    assert manager.config.classes[1].max_wait == 42.0  # the edit is kept (it was undone)
    assert manager.config.models == load_config(out.proposal).models  # and the tuning applied
    assert "a restart reverts it" in out.reason
    store.close()
