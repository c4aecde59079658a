"""Review 21, a walkthrough of the service's built-in tuning and of hot reload:

- A read-only config: the scheduled tuning applied its better values to the running service alone
  ("the tuned values hold until a restart", the README says), but the next reload of the file (an
  edit elsewhere, `residency reload`) put the file's values back, silently. Now the service holds
  them over the file's reloads while the file holds the field as it did; a person's edit of the
  field wins.
- The next run's proposal was written from the file, so a "changes: none" proposal had the file's
  values, not the running ones: copied in place it reverted the tuning. Now it has them.
- The scheduled tuning replayed a class renamed since (the store's log has the old name) as
  rejections, and its model as never asked for, saying nothing. Now those requests are left out
  with a warning, as `tune --from-store` does.
- A setting read only at start, changed by one reload and saved again, was no longer listed as
  waiting for the restart; changed back, it was. Now each reload lists what differs from the config
  the service started with."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from live_helpers import CONFIG, run

import manager.tuning_job as job
from manager.api.admin import reload_from_file
from manager.config import load_config
from manager.live import LiveManager
from manager.reload import plan_reload
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.replay.tune import with_settings
from manager.store import open_store
from manager.tuning_job import TuningOutcome, run_tuning

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"


def _write(cfg: Path, **embed: Any) -> None:
    """configs/local-cpu.yaml with only `embed` (its fields set as given), its state beside `cfg`."""
    data = yaml.safe_load(CONFIG.read_text())
    data["models"] = [{**m, **embed} for m in data["models"] if m["name"] == "embed"]
    data["store"] = {"url": f"sqlite:///{cfg.parent}/state.db", "journal": str(cfg.parent / "j.journal")}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))


def _keep_alive(lm: LiveManager, model: str) -> Any:
    return next(m.keep_alive for m in lm.config.models if m.name == model)


def test_tuned_values_a_read_only_file_could_not_take_outlive_its_reloads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "svc.yaml"
    _write(cfg, keep_alive="2m")
    cfg.chmod(0o444)
    config = load_config(cfg)

    async def body(lm: LiveManager) -> None:
        # the tuning's in-memory apply (`_apply` when the file is not writable)
        outcome = TuningOutcome(None, None, 0, model_updates={"embed": {"keep_alive": "10m"}})
        new = with_settings(lm.config, outcome.model_updates, {})
        job._reload_holding(lm, lm.config, new, outcome)
        assert _keep_alive(lm, "embed") == 600.0
        # the file reloaded, unchanged (`residency reload`) or edited elsewhere: the tuned value stays
        with caplog.at_level(logging.INFO, logger="manager.live"):
            assert "models.embed.keep_alive" not in reload_from_file(lm, str(cfg))
        assert _keep_alive(lm, "embed") == 600.0
        assert (
            "tuned settings the config file could not take are kept: models.embed.keep_alive" in caplog.text
        )
        cfg.chmod(0o644)
        _write(cfg, keep_alive="2m", prewarm=False)
        assert reload_from_file(lm, str(cfg)) == ["models.embed.prewarm"]
        assert _keep_alive(lm, "embed") == 600.0
        # a person's edit of the field wins, and the held value is dropped for good
        _write(cfg, keep_alive="5m", prewarm=False)
        assert reload_from_file(lm, str(cfg)) == ["models.embed.keep_alive"]
        assert _keep_alive(lm, "embed") == 300.0 and lm.tuning_overrides == {}
        _write(cfg, keep_alive="2m", prewarm=False)
        reload_from_file(lm, str(cfg))
        assert _keep_alive(lm, "embed") == 120.0

    run(config, body)


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[tuple[Any, float, Path]]:
    """A store holding a synthetic home week, and a config that tunes it."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    store.append_requests(records)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        HANDWRITTEN.read_text() + f"tuning: {{schedule: weekly, out_dir: {tmp_path / 'tuning'}}}\n"
    )
    yield store, reqs[-1].t + 1.0, cfg
    store.close()


def test_the_proposal_holds_the_tuned_values_the_running_service_holds(
    filled: tuple[Any, float, Path],
) -> None:
    store, now, cfg = filled
    config = load_config(cfg)
    voice_file = next(m.keep_alive for m in config.models if m.name == "voice")
    # voice is pinned: the search does not tune it, so what the proposal says of it comes from `held`
    held = {("models", "voice", "keep_alive"): (voice_file, "17m")}
    out = run_tuning(config, cfg, store, now, held=held)
    assert out.proposal is not None
    proposed = {m.name: m.keep_alive for m in load_config(out.proposal).models}
    assert proposed["voice"] == 17 * 60.0
    assert out.model_updates["voice"] == {"keep_alive": "17m"}
    assert not any(c.startswith("voice") for c in out.changes)  # not a change of this run's


def test_requests_of_a_class_renamed_since_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    # the embedding model's requests were logged under its class's old name
    records = [{**r, "class": "bulk"} if r["model"] == "embed" else r for r in records]
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        store.append_requests(records)
        cfg = tmp_path / "config.yaml"
        cfg.write_text(HANDWRITTEN.read_text() + f"tuning: {{schedule: weekly, out_dir: {tmp_path / 't'}}}\n")
        with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
            out = run_tuning(load_config(cfg), cfg, store, reqs[-1].t + 1.0)
    finally:
        store.close()
    n = sum(1 for r in records if r["model"] == "embed")
    said = [w for w in out.warnings if "logged requests the replay cannot take" in w]
    assert len(said) == 1 and f"skipped {n} " in said[0] and "unknown class 'bulk'" in said[0], out.warnings
    assert "unknown class 'bulk'" in caplog.text
    assert out.holdout_before is not None
    assert out.holdout_before["rejected"] == 0, out.holdout_before


def test_settings_read_at_start_are_listed_against_the_config_the_service_started_with() -> None:
    started = load_config(CONFIG)
    moved = started.model_copy(update={"server": started.server.model_copy(update={"listen": "127.0.0.1:1"})})
    assert plan_reload(started, moved, started) == ["server.listen (at the next restart)"]
    # reloaded once already (the running config has the new address): still waiting for the restart
    assert plan_reload(moved, moved, started) == ["server.listen (at the next restart)"]
    # changed back to the address it listens on: nothing waits
    assert plan_reload(moved, started, started) == []
    on = started.model_copy(update={"tuning": started.tuning.model_copy(update={"schedule": "weekly"})})
    daily = started.model_copy(update={"tuning": started.tuning.model_copy(update={"schedule": "daily"})})
    assert started.tuning.schedule == "off"
    assert plan_reload(on, daily, started) == ["tuning.schedule (at the next restart)"]


def test_a_held_tuned_value_that_no_longer_fits_goes_alone() -> None:
    """One held value that no longer fits the file's other settings dropped every held value."""
    from manager.reload import entry_values, over_file

    config = load_config(ROOT / "configs" / "home.yaml")
    was = entry_values(config)
    held = {
        ("models", "llm", "keep_alive"): (was[("models", "llm", "keep_alive")], "17m"),
        ("classes", "realtime", "reserve"): (was[("classes", "realtime", "reserve")], "100GiB"),  # too big
    }
    new, kept = over_file(config, held)
    assert list(kept) == [("models", "llm", "keep_alive")]
    assert next(m.keep_alive for m in new.models if m.name == "llm") == 17 * 60.0
