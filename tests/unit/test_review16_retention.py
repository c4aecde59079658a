"""Review 16: the request log's retention (`store.request_log_retention`). The log was never trimmed,
so a home server's SQLite file (and Redis stream: tests/integration/test_review16_retention_redis.py)
grew for as long as it ran. Now the config says how long records are kept (8w by default, at least
`tuning.since`, null: for ever), the stores delete older ones (`trim_requests`) and the live manager
does so about once an hour from its statistics save, off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from live_helpers import local_config

import manager.store.sqlite as sqlite_mod
from manager.config import ConfigError, load_config
from manager.config_schema import DEFAULT_REQUEST_LOG_RETENTION_S, Config
from manager.live import LiveManager
from manager.live_persist import TRIM_EVERY_S
from manager.store import StoreError, open_store
from manager.units import parse_duration
from manager.workers_bridge import create_pool

DAY = 86400.0
T0 = 1_790_000_000.0

BASE = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB}]
host: {memory: 8GiB}
classes: [{name: interactive}]
models: []
"""


def _load(tmp_path: Path, extra: str) -> Config:
    path = tmp_path / "c.yaml"
    path.write_text(BASE + extra)
    return load_config(path)


# ---- config ---------------------------------------------------------------------------------------


def test_the_default_keeps_eight_weeks_more_than_the_tuning_reads(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "")
    assert cfg.store.request_log_retention == DEFAULT_REQUEST_LOG_RETENTION_S == 56 * DAY
    assert cfg.store.request_log_retention >= cfg.tuning.since
    from manager.cli import DEFAULT_SINCE  # what `tune --from-store` reads unless told

    assert cfg.store.request_log_retention >= parse_duration(DEFAULT_SINCE)


def test_null_keeps_every_record_and_a_duration_reads_as_seconds(tmp_path: Path) -> None:
    assert _load(tmp_path, "store: {request_log_retention: null}").store.request_log_retention is None
    assert _load(tmp_path, "store: {request_log_retention: 13w}").store.request_log_retention == 91 * DAY


def test_a_retention_shorter_than_the_tuning_window_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "store: {request_log_retention: 3d}\ntuning: {since: 7d}")
    msg = str(e.value)
    assert "store.request_log_retention" in msg and "tuning.since" in msg
    assert "3d is shorter than tuning.since (7d)" in msg
    # as long as the window, or a shorter window, is fine
    assert _load(tmp_path, "store: {request_log_retention: 7d}").store.request_log_retention == 7 * DAY
    cfg = _load(tmp_path, "store: {request_log_retention: 2d}\ntuning: {since: 36h}")
    assert cfg.store.request_log_retention == 2 * DAY
    with pytest.raises(ConfigError, match=r"tuning\.since \(10w\)|tuning\.since \(70d\)"):
        _load(tmp_path, "tuning: {since: 10w}")  # the default retention (8w) is too short for it


def test_zero_is_refused_in_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"request_log_retention: expected a duration above 0"):
        _load(tmp_path, "store: {request_log_retention: 0s}")


def test_the_json_schema_documents_the_field() -> None:
    from manager.config import config_json_schema

    prop = config_json_schema()["$defs"]["StoreConfig"]["properties"]["request_log_retention"]
    assert prop["default"] == 56 * DAY
    assert "tuning.since" in prop["description"]
    assert {"type": "null"} in prop["anyOf"]


# ---- the SQLite store ------------------------------------------------------------------------------


def _rec(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.5}


def test_sqlite_trims_what_is_older_than_before_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_mod, "TRIM_CHUNK", 3)  # several chunks, one transaction each
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        store.append_requests([_rec(T0 + i) for i in range(10)])
        store.append_requests([_rec(T0 + 2.5, "late")])  # appended after later ones
        assert store.trim_requests(T0 + 7) == 8  # 0..6 and the late 2.5
        assert [r["t"] for r in store.requests(0)] == [T0 + 7, T0 + 8, T0 + 9]
        assert store.trim_requests(T0 + 7) == 0  # nothing more to go; t == before stays
        assert store.count_requests() == 3
        with pytest.raises(ValueError, match="before must be a number"):
            store.trim_requests(math.nan)
    finally:
        store.close()
    reopened = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:  # the deletes were committed
        assert reopened.count_requests() == 3
    finally:
        reopened.close()


def test_sqlite_trim_of_a_closed_store_is_a_store_error(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.close()
    with pytest.raises(StoreError, match="trim requests: the store is closed"):
        store.trim_requests(T0)


# ---- the live manager ------------------------------------------------------------------------------


def test_the_live_manager_trims_old_records_hourly_and_keeps_recent_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: nothing ever deleted a request record; the log grew for as long as the service ran."""
    config = local_config(tmp_path, ("voice",))
    keep = config.store.request_log_retention
    assert keep is not None
    now = [T0]
    store = open_store(config.store.url)
    old = [_rec(T0 - keep - 3 * DAY), _rec(T0 - keep - 1.0)]
    recent = [_rec(T0 - keep + 2 * TRIM_EVERY_S), _rec(T0 - DAY)]  # (recent an hour on too)
    store.append_requests(old + recent)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=lambda: now[0])
        await lm.start()
        try:
            await lm.save_stats_async()  # (the reconciler's first save may have trimmed already)
            assert [r["t"] for r in store.requests(0)] == [r["t"] for r in recent]
            store.append_requests([_rec(T0 - keep - 10.0)])  # old, and within the hour of the trim
            await lm.save_stats_async()
            assert store.count_requests() == 3  # at most one trim an hour
            now[0] += TRIM_EVERY_S
            await lm.save_stats_async()
            assert [r["t"] for r in store.requests(0)] == [r["t"] for r in recent]
        finally:
            await lm.stop()
            pool.close()

    with caplog.at_level(logging.INFO, logger="manager.live"):
        asyncio.run(main())
    store.close()
    assert "request log: 2 record(s) older than 56d (store.request_log_retention) deleted" in caplog.text
    assert "request log: 1 record(s) older than 56d" in caplog.text


def test_null_retention_deletes_nothing(tmp_path: Path) -> None:
    base = local_config(tmp_path, ("voice",))
    config = base.model_copy(update={"store": base.store.model_copy(update={"request_log_retention": None})})
    store = open_store(config.store.url)
    store.append_requests([_rec(1_000_000.0), _rec(T0 - DAY)])

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=lambda: T0)
        await lm.start()
        try:
            await lm.save_stats_async()
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())
    assert store.count_requests() == 2
    store.close()


class _TrimFailsStore:
    """Fault injector (tests only) around the real SQLite store: `trim_requests` fails."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.trims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def trim_requests(self, before: float) -> int:
        self.trims += 1
        raise StoreError(self.real.url, "database is locked (injected)")


def test_a_failed_trim_is_one_line_and_the_saves_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = local_config(tmp_path, ("voice",))
    real = open_store(config.store.url)
    store = _TrimFailsStore(real)

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=lambda: T0)
        await lm.start()
        try:
            await lm.save_stats_async()
            await lm.save_stats_async()
        finally:
            await lm.stop()
            pool.close()

    with caplog.at_level(logging.WARNING, logger="manager.live"):
        asyncio.run(main())
    assert store.trims == 1  # tried again in an hour, not at each save
    assert "could not trim the request log in the store" in caplog.text and "Traceback" not in caplog.text
    assert json.loads(json.dumps(real.get_doc("stats")))  # the statistics were saved all the same
    real.close()
