"""Review 26: the service's scheduled tuning checks its candidates' fit with the models' measured
sizes and pins. The tuning thread reaches the manager through the service's proxy
(`_ReloadOnLoop`), which had no `engine`: every scheduled run tuned with the config's estimates and
its `pin` fields, so a tuned reservation could leave a model that measured larger than its estimate
no room, and an admin's pins counted for nothing in the search. Real components as in
`test_review14_tuning_apply.py` (a LiveManager over in-process device hosts with the real models);
only the search is replaced, by one that keeps what it was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_review14_tuning_apply import MiB, _drive, _setup

import manager.tuning_job as job
from manager.api.server import _ReloadOnLoop
from manager.live import LiveManager
from manager.store import open_store
from manager.tuning_job import tuning_step


class _Given(Exception):
    pass


def test_the_scheduled_run_gets_the_measured_sizes_and_the_admin_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link, _real = _setup(tmp_path)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    given: list[Any] = []

    def search(*args: Any, **kwargs: Any) -> Any:
        given.append(args[-1])  # `live`
        raise _Given

    monkeypatch.setattr(job, "run_tuning", search)

    def body(lm: LiveManager, on_loop: _ReloadOnLoop) -> Any:
        on_loop.loop.call_soon_threadsafe(lm.set_pin, "voice", False)  # an admin unpins the voice model
        with pytest.raises(_Given):
            tuning_step(on_loop, link, store, 1e9)
        return given[-1]

    try:
        live = _drive(tmp_path, link, body)
    finally:
        store.close()
    assert live is not None, "the scheduled run tuned with the config's estimates"
    assert live["embed"][0] > 80 * MiB and live["embed"][1] is True  # measured (estimate: 40 MiB)
    assert live["voice"][1] is False  # the admin's unpin, not the file's `pin: true`
