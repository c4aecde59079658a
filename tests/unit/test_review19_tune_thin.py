"""Review 19: tuning on thin data. `residency tune` (`--trace` or `--from-store`) and the service's
tuning job tuned every model's keep-alive and prewarm from whatever the trace held: three image
requests made `image.keep_alive = auto`, a model never requested lost its prewarm. Now a model with
fewer than `MIN_MODEL_REQUESTS` requests in the search days keeps its configured settings, and a
warning names it with its count (stderr and a `warnings` list in `--json`; the job's outcome, its
store record, its log and its event); a search shorter than a day is warned of too.
Real configs, the real simulator, the real CLI (`main`) and a real SQLite store."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from manager.cli import main
from manager.config import Config, load_config
from manager.policy.types import Request
from manager.replay.trace import write_trace
from manager.replay.tune import MIN_MODEL_REQUESTS, tune
from manager.store import open_store
from manager.tuning_job import run_tuning, scheduled_tuning

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"
STORE_LINE = 'url: "sqlite:///.residency/state.db"'
HOUR = 3600.0


def _tiny(t0: float) -> list[Request]:
    """Four hours: the chat model every 20 minutes (12 requests: enough), three image requests (too
    few); tts, world, embed and photos never asked for. On it the search used to set
    `image.keep_alive = auto` and `world.prewarm = false`."""
    reqs = [Request(t=t0 + i * 1200.0, model="llm", busy_s=5.0) for i in range(12)]
    reqs += [Request(t=t0 + 600.0 + i * 1200.0, model="image", busy_s=4.0) for i in range(3)]
    return sorted(reqs, key=lambda r: r.t)


def _every_model(config: Config, t0: float, span: float, n: int) -> list[Request]:
    """`n` requests of each model that tuning may change, spread over `span` seconds."""
    names = [m.name for m in config.models if not m.pin]
    reqs = [
        Request(t=t0 + (i * len(names) + j) * span / (n * len(names)), model=name, busy_s=1.0)
        for i in range(n)
        for j, name in enumerate(names)
    ]
    return sorted(reqs, key=lambda r: r.t)


def test_thin_models_keep_their_settings_and_are_named_with_their_counts() -> None:
    config = load_config(HANDWRITTEN)
    res = tune(config, _tiny(1764547200.0), None, min_requests=MIN_MODEL_REQUESTS)
    assert MIN_MODEL_REQUESTS == 10
    assert res.thin == {"tts": 0, "world": 0, "image": 3, "embed": 0, "photos": 0}  # config order
    assert set(res.model_updates) == {"llm"}  # the model with enough requests is still tuned
    assert all(not c.startswith(("image.", "world.", "tts.", "embed.", "photos.")) for c in res.changes)
    tuned = {m.name: m for m in res.config.models}
    for m in config.models:
        if m.name != "llm":
            assert (tuned[m.name].keep_alive, tuned[m.name].prewarm) == (m.keep_alive, m.prewarm)
    text = " ".join(res.warnings)
    assert "fewer than 10 requests" in text
    assert "image (3)" in text and "world (0)" in text and "voice" not in text  # (pinned: never tuned)
    assert "left as configured" in text
    assert any("less than a day" in w for w in res.warnings)  # 3 h 40 min of search


def test_enough_requests_over_more_than_a_day_warn_of_nothing() -> None:
    config = load_config(HANDWRITTEN)
    reqs = _every_model(config, 1764547200.0, 26 * HOUR, MIN_MODEL_REQUESTS)
    res = tune(config, reqs, None, min_requests=MIN_MODEL_REQUESTS)
    assert res.thin == {} and res.warnings == []


def test_a_search_shorter_than_a_day_is_warned_of_but_still_tuned() -> None:
    config = load_config(HANDWRITTEN)
    res = tune(
        config, _every_model(config, 1764547200.0, 4 * HOUR, 20), None, min_requests=MIN_MODEL_REQUESTS
    )
    assert res.thin == {}
    assert len(res.warnings) == 1 and "less than a day" in res.warnings[0], res.warnings
    assert res.changes  # the models were tuned all the same


def test_the_search_alone_tunes_every_model_unless_asked() -> None:
    """`tune()` without `min_requests` is the search alone (the benchmarks' and the search's own
    tests): every model that is not pinned is tuned, and only the short span is warned of."""
    res = tune(load_config(HANDWRITTEN), _tiny(1764547200.0), None)
    assert res.thin == {} and "image" in res.model_updates
    assert len(res.warnings) == 1 and "less than a day" in res.warnings[0]


def test_tune_trace_warns_on_stderr_and_in_json_and_keeps_the_thin_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "tiny.jsonl", tmp_path / "tuned.yaml"
    write_trace(trace, _tiny(1764547200.0))
    holdout = tmp_path / "holdout.jsonl"
    write_trace(holdout, _tiny(1764547200.0 + 86400.0))
    args = ["tune", "--config", str(HANDWRITTEN), "--trace", str(trace), "--holdout", str(holdout)]
    assert main([*args, "--out", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    fig = json.loads(cap.out)
    assert {"out", "evaluations", "changes", "search", "holdout"} <= set(fig)  # the contract's fields
    assert any("image (3)" in w for w in fig["warnings"]), fig["warnings"]
    assert f"{trace}: warning: " in cap.err and "image (3)" in cap.err, cap.err
    tuned = {m.name: m for m in load_config(out).models}
    assert tuned["image"].keep_alive == 300.0 and tuned["world"].prewarm  # as configured
    # the table form says it too, on stderr (stdout keeps the table alone)
    assert main([*args, "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "image (3)" in cap.err and "image (3)" not in cap.out


def test_tune_from_store_warns_of_thin_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "state.db"
    text = HANDWRITTEN.read_text(encoding="utf-8")
    assert STORE_LINE in text
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text.replace(STORE_LINE, f'url: "sqlite:///{db}"', 1), encoding="utf-8")
    t0 = time.time() - 5 * HOUR
    store = open_store(f"sqlite:///{db}")
    try:
        store.append_requests([{"t": r.t, "model": r.model, "busy_s": r.busy_s} for r in _tiny(t0)])
    finally:
        store.close()
    out = tmp_path / "tuned.yaml"
    assert main(["tune", "--config", str(cfg), "--from-store", "--out", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    fig = json.loads(cap.out)
    # the last 30 % of the span is held out: the search holds 8 chat and 3 image requests
    assert any("llm (8)" in w and "image (3)" in w for w in fig["warnings"]), fig["warnings"]
    assert "warning: " in cap.err and "image (3)" in cap.err, cap.err
    assert load_config(out).models == load_config(cfg).models  # nothing had requests enough


def _job_config(tmp_path: Path) -> Config:
    config = load_config(HANDWRITTEN)
    return config.model_copy(
        update={
            "tuning": config.tuning.model_copy(
                update={"out_dir": str(tmp_path / "t"), "schedule": "weekly", "apply": "propose"}
            )
        }
    )


class _Manager:
    """Stands in for the LiveManager (unit test only): holds a config, takes reloads."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reloaded: list[Config] = []

    def reload(self, new: Config) -> list[str]:
        self.reloaded.append(new)
        self.config = new
        return []


def test_the_tuning_job_records_and_logs_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    t0 = 1764547200.0
    reqs = _tiny(t0)
    store.append_requests([{"t": r.t, "model": r.model, "busy_s": r.busy_s} for r in reqs])
    config = _job_config(tmp_path)
    now = reqs[-1].t + 60.0
    try:
        out = run_tuning(config, HANDWRITTEN, store, now)
        assert out.proposal is not None
        assert any("image (3)" in w for w in out.warnings), out.warnings
        proposed = {m.name: m for m in load_config(out.proposal).models}
        assert proposed["image"].keep_alive == 300.0 and proposed["world"].prewarm
        manager: Any = _Manager(config)
        with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
            said = scheduled_tuning(manager, HANDWRITTEN, store, now)
        assert said is not None and "image (3)" in said, said  # the service's "tuning" event
        assert any("image (3)" in r.getMessage() for r in caplog.records)
        doc = store.get_doc("tuning")
        assert doc is not None and any("image (3)" in w for w in doc["warnings"]), doc
    finally:
        store.close()
