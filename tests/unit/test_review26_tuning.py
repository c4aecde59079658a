"""Review 26 of the service's scheduled tuning (`manager.tuning_job`): six faults found by driving
`scheduled_tuning` / `tuning_step` as the service's tuning thread does. The search's replays are
replaced by a stand-in that favours chosen settings (a week of replays says nothing more here); the
config files, the SQLite store, the export, the writer and the reload's own checks are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import manager.replay.tune as tune_mod
import manager.tuning_job as job
from manager.config import Config, load_config
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.reload import CheckNotAnswered, check_measured_fit, plan_reload
from manager.replay.sim import ReplayResult
from manager.store import StoreError, open_store

GiB = 2**30
T0 = 1.8e9

CONFIG = """devices: [{{name: gpu0, kind: cuda, index: 0, memory: 8GiB, reserve: 0}}]
host: {{memory: 32GiB, reserve: 4GiB}}
classes: [{{name: realtime}}, {{name: interactive}}, {{name: background, may_evict: false}}]
models:
  - {{name: voice, class: realtime, adapter: torchscript, device: gpu0, memory: {voice}, pin: true,
     keep_alive: forever, source: {{path: v.pt}}}}
  - name: chat
    class: interactive
    adapter: torchscript
    device: gpu0
    memory: 1GiB
    keep_alive: 10m
    source: {{path: c.pt}}
  - {{name: embed, class: background, adapter: torchscript, device: gpu0, memory: 512MiB, keep_alive: 10m,
     source: {{path: e.pt}}}}
policy: {{name: residency}}
tuning: {{schedule: weekly, apply: {apply}, out_dir: {out}}}
"""


@pytest.fixture
def home(tmp_path: Path) -> Any:
    """(config path, store, now): ~10 days of requests in the store, 100 per model."""

    def make(apply: str = "auto", voice: str = "1GiB") -> tuple[Path, Any, float]:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(CONFIG.format(apply=apply, voice=voice, out=tmp_path / "tuning"), encoding="utf-8")
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        n, step = 300, 3000.0
        store.append_requests(
            [
                {"t": T0 + i * step, "model": ("voice", "chat", "embed")[i % 3], "busy_s": 1.0}
                for i in range(n)
            ]
        )
        return cfg, store, T0 + n * step

    return make


def _favour(monkeypatch: pytest.MonkeyPatch, background_reserve: int | None = None) -> None:
    """Replays that favour chat.keep_alive = 1h (and a background reservation, when given)."""

    def replay(c: Config, reqs: Any, policy: Any, record: bool = False) -> ReplayResult:
        r = ReplayResult(policy=str(policy))
        r.load_wait_s = 100.0 - (40.0 if c.model("chat").keep_alive == 3600 else 0.0)
        if background_reserve is not None and c.classes[2].reserve == background_reserve:
            r.load_wait_s -= 30.0
        return r

    monkeypatch.setattr(tune_mod, "replay", replay)
    monkeypatch.setattr(job, "_report", lambda *a, **k: None)


class _Manager:
    """The running service as its tuning thread sees it (`_ReloadOnLoop`'s calls): the reload's own
    checks (its plan, and the pinned models at their measured sizes), an engine holding the sizes."""

    def __init__(self, config: Config, measured: dict[str, int] | None = None) -> None:
        self.config = config
        self.measured = measured or {}
        self.engine = Engine(config, create_policy("residency"))
        for name, weights in self.measured.items():
            self.engine.models[name].weights = weights
        self.engine.recheck_fit()
        self.reloaded: list[Config] = []

    def live_sizes(self) -> dict[str, tuple[int, bool]]:
        return {n: (m.weights, m.pinned) for n, m in self.engine.models.items()}

    def check_reload(self, new: Config) -> list[str]:
        changes = plan_reload(self.config, new)
        check_measured_fit(self.engine, new, {m.name: m.pin for m in new.models}, set(self.measured))
        return changes

    def reload(self, new: Config, hold: Any = None) -> list[str]:
        self.check_reload(new)
        self.reloaded.append(new)
        self.config = new
        return []


def test_a_store_that_reads_but_does_not_write_is_not_tuned_again_at_every_check(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the run's record failed, the failure's record too, and the next check (a minute on)
    found no record of either: a whole run (export, search, a folder) every minute."""
    cfg, real, now = home(apply="propose")
    runs: list[float] = []

    def run(
        config: Config, path: Path, store: Any, at: float, *args: Any, **kwargs: Any
    ) -> job.TuningOutcome:
        runs.append(at)
        return job.TuningOutcome(None, None, 300, reason="no improvement on the held-out days")

    monkeypatch.setattr(job, "run_tuning", run)

    class FullStore:
        def get_doc(self, key: str) -> Any:
            return real.get_doc(key)

        def put_doc(self, key: str, doc: Any) -> None:
            raise StoreError(real.url, "OOM command not allowed when used memory > 'maxmemory'")

    memo = job.ScheduleMemo()
    manager = _Manager(load_config(cfg))
    said = [job.scheduled_tuning(manager, cfg, FullStore(), now + 60.0 * i, None, memo) for i in range(5)]
    assert runs == [now] and said[1:] == [None] * 4
    assert said[0] is not None and "could not record it: retried in 1 h" in said[0] and "maxmemory" in said[0]
    job.scheduled_tuning(manager, cfg, FullStore(), now + job.RETRY_S, None, memo)
    assert runs == [now, now + job.RETRY_S]
    real.close()


def test_a_reservation_the_reload_would_refuse_is_no_candidate(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pinned voice model measured 4.5 GiB (estimate 3.5 GiB) of the 8 GiB: a background
    reservation of 4 GiB passed the search's fit rule (it counts the higher classes' reservations
    only), the reload refused the run, and the chat keep-alive it found went with it, every week."""
    cfg, store, now = home(apply="auto", voice="3584MiB")
    _favour(monkeypatch, background_reserve=4 * GiB)
    manager = _Manager(load_config(cfg), measured={"voice": 4608 * 2**20})
    out = job.tuning_step(manager, cfg, store, now)
    assert out.changes == ["chat.keep_alive = 1h"] and out.better
    assert out.reason.endswith("; applied") and len(manager.reloaded) == 1
    assert "keep_alive: 1h" in cfg.read_text() and store.get_doc("tuning")["applied"] is True
    # the candidate itself: refused at the measured sizes, a candidate at the config's estimates
    config, trial = load_config(cfg), {"background": {"reserve": 4 * GiB}}
    live = manager.live_sizes()
    running = tune_mod._running(config, live)
    assert not tune_mod._reservable(config, {}, trial, live, tune_mod.never_fit(config, live), running)
    assert tune_mod._reservable(config, {}, trial, None, set(), tune_mod._running(config, None))
    store.close()


def test_an_edit_saved_during_the_search_fails_the_run_instead_of_going_into_the_proposal(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, store, now = home(apply="propose")
    _favour(monkeypatch)
    search = job.tune

    def tune_while_edited(*args: Any, **kwargs: Any) -> Any:
        res = search(*args, **kwargs)
        cfg.write_text(cfg.read_text().replace("keep_alive: 10m\n    source: {path: c.pt}", "keep_alive: 2h\n"
                                               "    source: {path: c.pt}"))  # fmt: skip
        return res

    monkeypatch.setattr(job, "tune", tune_while_edited)
    said = job.scheduled_tuning(_Manager(load_config(cfg)), cfg, store, now)
    assert said is not None and said.startswith("failed (ConfigChanged:") and "retried in 1 h" in said
    assert not list((cfg.parent / "tuning").glob("*/proposed.yaml"))  # no proposal of an unmeasured edit
    assert "keep_alive: 2h" in cfg.read_text()  # the edit itself stands
    doc = store.get_doc("tuning")
    assert doc is not None and doc["failed_at"] == now and not job.due(load_config(cfg), store, now + 60.0)
    assert job.due(load_config(cfg), store, now + job.RETRY_S)
    store.close()


def test_a_check_the_service_did_not_answer_is_tried_again_in_an_hour_not_a_week(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, store, now = home(apply="auto")
    _favour(monkeypatch)

    class Busy(_Manager):
        def check_reload(self, new: Config) -> list[str]:
            raise CheckNotAnswered("the service did not answer the check of the tuned config in 60 s")

    manager = Busy(load_config(cfg))
    said = job.scheduled_tuning(manager, cfg, store, now)
    assert said is not None and said.startswith("failed (CheckNotAnswered:") and "retried in 1 h" in said
    assert "keep_alive: 10m" in cfg.read_text() and not manager.reloaded
    assert job.due(manager.config, store, now + job.RETRY_S)
    store.close()


def test_a_reload_that_did_not_answer_is_recorded_as_this_runs_with_the_file_written(
    home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "failed (TimeoutError: )", and the record kept the previous run's proposal and
    changes, though the config file held this run's values."""
    cfg, store, now = home(apply="auto")
    _favour(monkeypatch)
    store.put_doc("tuning", {"last_run": now - 8 * 86400, "proposal": "/old/proposed.yaml", "changes": []})

    class SlowLoop(_Manager):
        def reload(self, new: Config, hold: Any = None) -> list[str]:
            raise TimeoutError  # (`_ReloadOnLoop.reload` on an event loop that did not answer)

    said = job.scheduled_tuning(SlowLoop(load_config(cfg)), cfg, store, now)
    assert said is not None and not said.startswith("failed")
    assert f"written into {cfg}, but the service did not answer its reload in time" in said
    assert "keep_alive: 1h" in cfg.read_text()
    doc = store.get_doc("tuning")
    assert doc is not None and doc["last_run"] == now and doc["changes"] == ["chat.keep_alive = 1h"]
    assert doc["proposal"] != "/old/proposed.yaml" and doc["applied"] is False and "failed_at" not in doc
    store.close()


def test_a_run_keeps_no_copy_of_the_request_log(home: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run left `requests.jsonl` (the whole exported log) in its folder for good: unbounded, and
    past the store's `request_log_retention`."""
    cfg, store, now = home(apply="propose")
    _favour(monkeypatch)
    earlier = cfg.parent / "tuning" / "20261130-000000" / "requests.jsonl"  # an earlier release's copy
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"t": 1, "model": "chat", "busy_s": 1}\n')
    out = job.tuning_step(_Manager(load_config(cfg)), cfg, store, now)
    assert out.proposal is not None and out.proposal.is_file()
    assert sorted(p.name for p in out.proposal.parent.iterdir()) == ["proposed.yaml"]
    assert not earlier.exists()
    store.close()


def test_a_reload_answered_late_says_how_it_ended(caplog: pytest.LogCaptureFixture) -> None:
    """`_ReloadOnLoop.reload` stops waiting after RELOAD_S; the reload goes on on the event loop, and
    its refusal was never seen by anyone (the file holding values the service refused)."""
    import asyncio
    import threading
    import time

    from manager.api.server import _ReloadOnLoop
    from manager.config import ConfigError

    class Refusing:
        config = None

        def reload(self, new: Any) -> list[str]:
            time.sleep(0.3)  # the event loop busy past the wait
            raise ConfigError("config.yaml", [("devices[0]", "the pinned models no longer fit")])

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        proxy = _ReloadOnLoop(Refusing(), loop)  # type: ignore[arg-type]
        proxy.RELOAD_S = 0.05
        with caplog.at_level("WARNING", logger="manager.api.server"), pytest.raises(TimeoutError):
            proxy.reload(object())  # type: ignore[arg-type]
        deadline = time.monotonic() + 10.0
        while "late reload" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        loop.close()
    assert "the late reload of the tuned config was refused" in caplog.text
    assert "the pinned models no longer fit" in caplog.text
