"""Review 21, a walkthrough of what the service keeps (real SQLite files):

- One damaged request row in the statistics' catch-up (after a SIGKILL) stopped the whole catch-up,
  and the next save's mark put the requests it had not read out of reach for good. Now the row is
  named once and left out; the rest is caught up on.
- `trace export`, `tune --from-store` and the service's weekly tuning failed as a whole on one
  damaged row. Now it is left out and said, as a trace file's bad lines are.
- A saved document whose text is not UTF-8 (a damaged page) was read as "the store is down" for the
  whole run: the statistics and pins were never saved, set aside or rebuilt. Now it is a damaged
  document (set aside, replaced).
- One damaged intent row dropped every recorded intent at start; and after an outage the store may
  come back without what it held (a Redis restarted without its data), but only the intents that
  changed meanwhile were written again. Now the others are restored, and every intent is rewritten
  once the store answers after an outage."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

from manager.cli import main
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.replay.trace import read_trace
from manager.store import StoreError, open_store
from manager.store.base import CorruptDocument
from manager.store.export import export_trace

T0 = 1_790_000_000.0


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(tmp_path: Path) -> Config:
    base = load_config(CONFIG)
    store = base.store.model_copy(update={"url": f"sqlite:///{tmp_path}/state.db"})
    return base.model_copy(update={"store": store})


def _bad_row(db: Path, t: float) -> None:
    with closing(sqlite3.connect(db)) as c, c:
        c.execute("INSERT INTO requests(t, model, busy_s) VALUES (?, 'voice', -1)", (t,))


def _serve(lm: LiveManager, clock: _Clock, model: str, t: float) -> None:
    clock.now = t
    lm.engine.observe(lm.engine.models[model], t)
    lm.live[model].requests += 1
    lm.live[model].last_used = t + 0.25
    lm._log({"t": t, "model": model, "busy_s": 0.25, "wait_s": 0.0, "outcome": "ok"})


def test_the_catch_up_leaves_a_damaged_row_out_and_counts_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=open_store(config.store.url), clock=clock)
    for i in range(3):
        _serve(lm, clock, "voice", T0 + i)
    asyncio.run(lm.flush_log())
    lm.save_stats()
    for i in range(3, 6):  # after the last save: caught up on at the next start
        _serve(lm, clock, "voice", T0 + i)
    asyncio.run(lm.flush_log())
    lm.store.close()  # killed: no save
    _bad_row(tmp_path / "state.db", T0 + 4.5)

    clock.now = T0 + 100
    again = LiveManager(config, None, store=open_store(config.store.url), clock=clock)
    with caplog.at_level(logging.WARNING, logger="manager.live_persist"):
        assert again.restore_stats()
        again._catch_up_stats()
    try:
        assert again.live["voice"].requests == 6
        assert "is corrupt" in caplog.text and "left out of the statistics' catch-up" in caplog.text
    finally:
        again.store.close()


def test_an_export_leaves_a_damaged_row_out_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    store = open_store(config.store.url)
    store.append_requests([{"t": T0 + i, "model": "voice", "busy_s": 0.1} for i in range(5)])
    _bad_row(tmp_path / "state.db", T0 + 2.5)
    with pytest.raises(StoreError):  # (without `skipped`, the export names the row and fails)
        export_trace(store, 3600.0, T0 + 60, tmp_path / "strict.jsonl")
    skipped: list[StoreError] = []
    assert export_trace(store, 3600.0, T0 + 60, tmp_path / "x.jsonl", skipped=skipped) == 5
    assert len(skipped) == 1 and "is corrupt" in str(skipped[0])
    store.close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text() + f'store: {{url: "{config.store.url}"}}\n')
    out = tmp_path / "cli.jsonl"
    assert main(["trace", "export", "--config", str(cfg), "--since", "3650d", "--out", str(out)]) == 0
    assert len(read_trace(out, strict=True).requests) == 5
    assert "skipped 1 damaged request record(s) in the store" in capsys.readouterr().err


def test_a_document_that_is_not_utf8_is_a_damaged_document_not_a_store_down(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/state.db")
    try:
        store.put_doc("stats", {"v": 1})
        with closing(sqlite3.connect(tmp_path / "state.db")) as c, c:
            c.execute("UPDATE docs SET value = CAST(X'7B2276223AFF7D' AS TEXT) WHERE key = 'stats'")
        with pytest.raises(CorruptDocument):
            store.get_doc("stats")
        assert store.set_aside_doc("stats") is not None and store.get_doc("stats") is None
        store.put_doc("stats", {"v": 2})
        assert store.get_doc("stats") == {"v": 2}
    finally:
        store.close()


def test_one_damaged_intent_leaves_the_others_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    store = open_store(config.store.url)
    store.set_intent("embed", "host")
    store.set_intent("world", "host")
    with closing(sqlite3.connect(tmp_path / "state.db")) as c, c:
        c.execute("INSERT OR REPLACE INTO intents VALUES ('voice', 'moon')")
    said: list[StoreError] = []
    assert store.intents(on_corrupt=said.append) == {"embed": "host", "world": "host"}
    assert len(said) == 1 and "'voice'" in str(said[0])
    with pytest.raises(StoreError):
        store.intents()
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=store, clock=clock)
    with caplog.at_level(logging.WARNING, logger="manager.live_persist"):
        restored = lm.restore_intent(T0)
    try:
        assert any(r.startswith("embed") for r in restored), restored
        assert "left out at start" in caplog.text and lm._intents_stale
    finally:
        store.close()


class _FailingAppends:
    """The real store whose request-log writes fail until `up` (unit test only): an outage."""

    def __init__(self, real: Any) -> None:
        self.real, self.down = real, True
        self.url = real.url

    def append_requests(self, records: Any) -> None:
        if self.down:
            raise StoreError(self.url, "connection refused (injected)")
        self.real.append_requests(records)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_every_intent_is_rewritten_once_the_store_answers_after_an_outage(tmp_path: Path) -> None:
    config = _config(tmp_path)
    real = open_store(config.store.url)
    store = _FailingAppends(real)
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=store, clock=clock)
    try:
        _serve(lm, clock, "voice", T0)
        asyncio.run(lm.flush_log())  # the outage: the write fails
        assert lm._intents_stale
        with closing(sqlite3.connect(tmp_path / "state.db")) as c, c:
            c.execute("DELETE FROM intents")  # it came back without what it held
        store.down = False
        asyncio.run(lm.flush_log())
        assert set(real.intents()) == set(lm.engine.models)
    finally:
        real.close()


def test_a_store_folder_the_service_may_not_write_is_said_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only store folder (a read-only mount: root is refused too) said only "cannot open the
    store's lock file: ...: Read-only file system"; now what to do as well."""
    import errno

    import manager.pidlock as pidlock

    def read_only(path: Any) -> Any:
        raise OSError(errno.EROFS, f"{path}: Read-only file system")  # (as pidlock.hold says it)

    monkeypatch.setattr(pidlock, "hold", read_only)
    with pytest.raises(StoreError) as e:
        open_store(f"sqlite:///{tmp_path}/state.db", hold=True)
    said = str(e.value)
    assert "state.db.lock" in said and "Read-only file system" in said, said
    assert f"the store's folder {tmp_path} must be writable by this user" in said, said


def test_a_redis_host_with_a_space_is_refused_by_the_config_check() -> None:
    """`redis://local host:6391` passed `config check`, and the service then ran with its store down
    for good (no resolver takes such a name)."""
    from manager.store.redis_url import split_redis_url

    with pytest.raises(ValueError, match="holds a space"):
        split_redis_url("redis://local host:6391/0")
    assert split_redis_url("redis://localhost:6391/0").hostname == "localhost"


def test_pins_the_store_could_not_read_are_said_with_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    real = open_store(config.store.url)

    class _Down:
        url = real.url

        def get_doc(self, key: str) -> Any:
            raise StoreError(real.url, "connection refused (injected)")

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    lm = LiveManager(config, None, store=_Down(), clock=_Clock(T0))
    try:
        with caplog.at_level(logging.WARNING, logger="manager.live"):
            lm._restore_pins()
        assert "could not read the admin pins from the store (" in caplog.text
        assert "connection refused (injected)" in caplog.text
    finally:
        real.close()


def test_a_store_file_removed_under_the_service_fails_its_writes_and_the_journal_keeps_them(
    tmp_path: Path,
) -> None:
    """state.db deleted while the service ran: its writes went to the unlinked file, the journal let
    the requests go as stored, and the next start found an empty store. Now the store fails (the
    service keeps what it serves, in memory and in its journal), saying why."""
    db = tmp_path / "state.db"
    store = open_store(f"sqlite:///{db}", hold=True)
    try:
        store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.1}])
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        with pytest.raises(StoreError, match="was removed or replaced while the service had it open"):
            store.append_requests([{"t": T0 + 1, "model": "voice", "busy_s": 0.1}])
        assert not store.ping()
    finally:
        store.close()
    reader = open_store(f"sqlite:///{tmp_path}/other.db")  # a store not held (a command's) is not checked
    try:
        reader.append_requests([{"t": T0, "model": "voice", "busy_s": 0.1}])
    finally:
        reader.close()
