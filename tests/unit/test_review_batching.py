"""Found in the review of request batching, the request-log pipeline (journal, buffer, flush) and the
admin API (2026-12-03); each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from live_helpers import CONFIG

from manager.config import load_config
from manager.journal import RequestJournal
from manager.live import LiveManager
from manager.store import StoreError, open_store
from manager.workers_bridge import create_pool

OK = "ok"  # (the outcome of a request that ran and answered)


def _rec(t: float) -> dict[str, Any]:
    return {"t": t, "model": "voice", "busy_s": 0.01}


async def _manager(tmp_path: Path, store: Any, journal: Path | None) -> tuple[LiveManager, Any]:
    """A live manager on `store` (not started: the request log needs no device host)."""
    config = load_config(CONFIG)
    pool = create_pool(config, in_process=True)
    return LiveManager(config, pool, store=store, journal=journal), pool


class TestAFullDiskDoesNotFailServedRequests:
    """`RequestJournal.append` let the OSError of a full disk (ENOSPC) out of `_log_request`, so a
    request that had been served failed with an internal error; and a line cut short by the full
    disk had the next record glued to it, so that record was lost at the next start as well."""

    def test_a_served_request_is_logged_though_its_journal_line_cannot_be_written(
        self, tmp_path: Path
    ) -> None:
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

        async def main() -> None:
            lm, pool = await _manager(tmp_path, store, tmp_path / "requests.journal")
            try:
                assert lm.journal is not None
                lm._log_request(1.0, "voice", 0.01, None, 0.0, OK)
                full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
                os.dup2(full, lm.journal._fd)
                os.close(full)
                lm._log_request(2.0, "voice", 0.01, None, 0.0, OK)  # raised OSError
                assert lm.journal.failed == 1
                await lm.flush_log()  # the record is in memory: it still reaches the store
            finally:
                if lm.journal is not None:
                    lm.journal.close()
                pool.close()

        asyncio.run(main())
        assert [r["t"] for r in store.requests(0)] == [1.0, 2.0]
        store.close()

    def test_a_line_cut_short_does_not_swallow_the_next_record(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "requests.journal"
        j = RequestJournal(path)
        j.append(_rec(1.0))
        real_write = os.write
        calls = [0]

        def half_then_full(fd: int, data: bytes) -> int:
            calls[0] += 1
            if calls[0] == 1:
                return real_write(fd, data[: len(data) // 2])  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("manager.journal.os.write", half_then_full)
        j.append(_rec(2.0))  # raised OSError
        monkeypatch.setattr("manager.journal.os.write", real_write)  # room again
        j.append(_rec(3.0))
        j.close()
        again = RequestJournal(path)
        try:
            assert [r["t"] for r in again.read()] == [1.0, 3.0]  # 3.0 was glued to the torn line
            assert again.skipped == 1
        finally:
            again.close()


class TestAJournalThatCannotBeRewrittenSendsNothingTwice:
    """The journal's rewrite after a store write raised (no room for its temp file, a failed reopen),
    and `_write_batch`'s caller took that for the store failing: the batch the store already held
    was kept and written again at the next flush (every record twice). A rewrite whose reopen failed
    also left a closed descriptor number behind, which the next append wrote to (another file that
    reused the number)."""

    def test_a_batch_the_store_took_is_written_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        path = tmp_path / "requests.journal"

        async def main() -> None:
            lm, pool = await _manager(tmp_path, store, path)
            try:
                for t in (1.0, 2.0, 3.0):
                    lm._log_request(t, "voice", 0.01, None, 0.0, OK)
                real_open = Path.open

                def no_room_for_tmp(self: Path, *a: Any, **k: Any) -> Any:
                    if self.name.endswith(".tmp"):
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return real_open(self, *a, **k)

                monkeypatch.setattr(Path, "open", no_room_for_tmp)
                await lm.flush_log()
                monkeypatch.setattr(Path, "open", real_open)
                assert lm._log_buf == [] and not lm._log_failing
                await lm.flush_log()
            finally:
                if lm.journal is not None:
                    lm.journal.close()
                pool.close()

        asyncio.run(main())
        assert store.count_requests() == 3  # was 6
        assert path.read_text() == ""  # what the store has is not sent again at the next start
        store.close()

    def test_a_failed_reopen_leaves_no_stale_descriptor(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "requests.journal"
        j = RequestJournal(path)
        j.append(_rec(1.0))  # (served, not in the store yet: kept by the rewrite below)
        real_open = os.open

        def no_more_files(*a: Any, **k: Any) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr("manager.journal.os.open", no_more_files)
        j.rewrite([_rec(1.0)])  # raised OSError, its old descriptor closed but kept
        monkeypatch.setattr("manager.journal.os.open", real_open)
        other = tmp_path / "other"
        fd = os.open(other, os.O_WRONLY | os.O_CREAT)  # takes the lowest free number: the journal's old one
        try:
            j.append(_rec(2.0))
        finally:
            os.close(fd)
            j.close()
        assert other.read_bytes() == b""
        assert [json.loads(x)["t"] for x in path.read_text().splitlines() if x] == [1.0, 2.0]


class _GatedStore:
    """The real SQLite store; `append_requests` waits for `gate` (when set) and fails while `down`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.finished = threading.Event()
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def ping(self) -> bool:
        if self.down:
            raise StoreError(self.real.url, "down (injected)")
        return bool(self.real.ping())

    def append_requests(self, records: Any) -> None:
        gate = self.gate
        if gate is not None:
            self.entered.set()
            gate.wait(5)
        try:
            if self.down:
                raise StoreError(self.real.url, "down (injected)")
            self.real.append_requests(records)
        finally:
            if gate is not None:
                self.finished.set()


class TestACancelledFlushKeepsAFailedBatch:
    """`_flush_log` shields its store write from a cancelled caller (the reconciler, cancelled by
    `stop()`), but the write's outcome is then handled by no one: when the store fails it, the batch
    is neither put back in the buffer nor counted as dropped (silently lost; with a journal, a later
    flush's rewrite erases it there too), and the flush lock is released while the write still runs."""

    def test_a_batch_whose_write_fails_after_its_caller_was_cancelled_is_kept(self, tmp_path: Path) -> None:
        store = _GatedStore(open_store(f"sqlite:///{tmp_path / 'state.db'}"))

        async def main() -> None:
            lm, pool = await _manager(tmp_path, store, None)
            try:
                for t in (1.0, 2.0, 3.0):
                    lm._log_request(t, "voice", 0.01, None, 0.0, OK)
                store.gate = threading.Event()
                flush = asyncio.create_task(lm.flush_log())
                await asyncio.to_thread(store.entered.wait, 5)  # the batch is on its way to the store
                flush.cancel()  # stop() cancels the reconciler in its flush
                await asyncio.sleep(0)  # (the cancel reaches it)
                store.down = True
                store.gate.set()  # ... and the store fails the write
                with contextlib.suppress(asyncio.CancelledError):
                    await flush
                assert flush.cancelled()  # the cancel still goes on, once the write is handled
                await asyncio.to_thread(store.finished.wait, 5)
                for _ in range(5):
                    await asyncio.sleep(0)  # (before the fix: the write's task ends, unhandled)
                assert not lm._flush_lock.locked()
                await lm.flush_log()  # stop()'s own flush: the store is still down
                dropped = lm.metrics.registry.get_sample_value("residency_request_log_dropped_total")
                assert len(lm._log_buf) + (dropped or 0) == 3  # was 0: lost and not counted
            finally:
                pool.close()

        asyncio.run(main())
        store.real.close()
