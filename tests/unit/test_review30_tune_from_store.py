"""Found in the thirtieth session's own review of what was left: `residency tune --from-store`, run by
hand on the service's request log, replayed the config's estimated sizes and load times, while the
service's own weekly tuning (since the 29th session) replays the ones its device hosts measured. The
two could tune the same week differently. The measurements are in the statistics the service saves in
its store; `tune --from-store` now reads them (`saved_measurements`), as `LiveManager.measured` gives
them to the scheduled run.

Real components: a SQLite store file, a `LiveManager` (no device hosts) saving its statistics there as
the service does at its stop, and the CLI's `main`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from test_review13_store import config_with_store  # (the shipped home on a store of the test's)

import manager.replay.tune as tune_mod
from manager.cli import main
from manager.config import load_config
from manager.live import LiveManager
from manager.live_persist import saved_measurements, spec_key
from manager.store import open_store

GIB = 2**30


def _service_measured(cfg_path: Path, db: Path) -> dict[str, tuple[int, dict[str, float]]]:
    """A service run that measured the LLM larger and slower than the config says, and saved its
    statistics at its stop; what it decided by (`LiveManager.measured`)."""
    config = load_config(cfg_path)
    with closing(open_store(f"sqlite:///{db}")) as store:
        lm = LiveManager(config, None, store=store)
        llm = lm.engine.models["llm"]
        llm.weights = 12 * GIB
        lm._measured.add("llm")
        for s in (20.0, 21.0, 19.0):
            llm.cost.measure("disk", s)
        lm.engine.models["image"].cost.measure("host", 3.0)  # load times measured, its size not yet
        lm.save_stats()
        return lm.measured()


def _log(db: Path, n: int = 400) -> None:
    now = time.time()
    recs = [
        {"t": now - 3 * 86400 + 600 * i, "model": ("llm", "image", "voice")[i % 3], "busy_s": 2.0}
        for i in range(n)
    ]
    with closing(open_store(f"sqlite:///{db}")) as s:
        s.append_requests(recs)


def test_the_saved_statistics_give_what_the_service_decided_by(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    cfg_path = config_with_store(tmp_path, db)
    expected = _service_measured(cfg_path, db)
    with closing(open_store(f"sqlite:///{db}", create=False)) as store:
        got = saved_measurements(load_config(cfg_path), store.get_doc("stats"))
    assert got == expected
    assert got["llm"][0] == 12 * GIB and got["llm"][1]["disk"] == 20.0
    config = load_config(cfg_path)
    image = next(m for m in config.models if m.name == "image")
    assert got["image"][0] == image.memory  # its size is still the config's


def test_an_entry_saved_for_another_checkpoint_is_left_out(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    cfg_path = config_with_store(tmp_path, db)
    _service_measured(cfg_path, db)
    config = load_config(cfg_path)
    with closing(open_store(f"sqlite:///{db}", create=False)) as store:
        doc = store.get_doc("stats")
    assert doc is not None
    llm = next(m for m in config.models if m.name == "llm")
    doc["llm"]["spec"] = spec_key(config, llm).replace("llm", "another-llm")
    doc["image"]["cost"] = "not a cost"  # unreadable: the config's estimates stand
    got = saved_measurements(config, doc)
    assert "llm" not in got and "image" not in got and "voice" in got
    assert saved_measurements(config, None) == {} and saved_measurements(config, []) == {}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    real: Callable[..., Any] = tune_mod.tune

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(kw.get("measured"))
        return real(*args, **kw)

    monkeypatch.setattr(tune_mod, "tune", spy)
    return seen


def test_tune_from_store_replays_the_measured_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    cfg_path = config_with_store(tmp_path, db)
    expected = _service_measured(cfg_path, db)
    _log(db)
    seen = _spy(monkeypatch)
    out = tmp_path / "tuned.yaml"
    report = tmp_path / "report"
    args = [
        "tune",
        "--config",
        str(cfg_path),
        "--from-store",
        "--out",
        str(out),
        "--json",
        "--report",
        str(report),
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert seen == [expected]
    assert "the service measured (" in captured.err and "llm" in captured.err
    assert json.loads(captured.out)["out"] == str(out)
    assert (report / "index.html").exists()
    load_config(out)  # the tuned config is valid, and holds the config's sizes, not the measured ones
    assert "12GiB" not in out.read_text(encoding="utf-8")


def test_without_saved_statistics_the_estimates_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    cfg_path = config_with_store(tmp_path, db)
    _log(db)
    seen = _spy(monkeypatch)
    out = tmp_path / "tuned.yaml"
    assert main(["tune", "--config", str(cfg_path), "--from-store", "--out", str(out), "--json"]) == 0
    assert seen == [None]
    assert "measured" not in capsys.readouterr().err


def test_a_trace_file_is_tuned_on_the_configs_estimates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace file may come from another machine: the store's measurements are not this trace's."""
    db = tmp_path / "state.db"
    cfg_path = config_with_store(tmp_path, db)
    _service_measured(cfg_path, db)
    trace = tmp_path / "week.jsonl"
    assert main(["trace", "synth", "--days", "2", "--seed", "3", "--out", str(trace)]) == 0
    seen = _spy(monkeypatch)
    assert (
        main(["tune", "--config", str(cfg_path), "--trace", str(trace), "--out", str(tmp_path / "o.yaml")])
        == 0
    )
    assert seen == [None]
