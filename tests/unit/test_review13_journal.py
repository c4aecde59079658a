"""Review 13 of the request journal: one class per bug found, each test failing before its fix. Real
journal files, real processes, real models on in-process device hosts (no Ray, no sockets) and a
real SQLite store; a store outage is injected by a wrapper around it."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from live_helpers import AUDIO, CONFIG, kill, lru_config, started

import manager.cli as cli
from manager.config import Config
from manager.journal import RequestJournal
from manager.live import LiveManager
from manager.policy.stats import ReuseHistogram
from manager.store import StoreError, open_store
from manager.workers_bridge import create_pool

IN_USE = r"store\.journal '{path}': another residency service \(pid {pid}\) is using this request journal"


class _FlakyStore:
    """Fault injector (tests only) around the real SQLite store: every call fails while `down`."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.down = True

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


def _in_order(times: list[float]) -> ReuseHistogram:
    h = ReuseHistogram()
    for t in sorted(times):
        h.observe(t)
    return h


def _quiet(lm: LiveManager) -> None:
    """Only what the test does: no periodic log writes or statistics saves by the reconciler."""
    lm._next_flush = lm._next_save = math.inf


def _holder(path: Path) -> subprocess.Popen[str]:
    """Another process that opens the journal at `path` (as a second service would), says so on its
    stdout, and holds it until its stdin closes (or it is killed)."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from manager.journal import RequestJournal
        j = RequestJournal(Path({str(path)!r}))
        print("open", flush=True)
        sys.stdin.read()
        j.close()
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=CONFIG.parents[1],
    )
    assert p.stdout is not None and p.stdout.readline() == "open\n"
    return p


class TestTwoServicesOnOneJournal:
    """Before: two services started from one folder shared `.residency/requests.journal` without a
    word: both appended to it and both replayed it at start (every record of the other logged again),
    and one's rewrite after a store write cut what the other had just appended. Now the journal is
    held (a lock file beside it) for as long as it is open: a second one is refused, naming the
    setting, the file and the process that holds it; the first one goes on as it was."""

    def test_a_second_open_is_refused_and_the_first_is_unaffected(self, tmp_path: Path) -> None:
        path = tmp_path / "requests.journal"
        first = RequestJournal(path)
        try:
            first.append({"t": 1.0, "model": "voice", "busy_s": 0.5})
            with pytest.raises(OSError, match=IN_USE.format(path=".*requests\\.journal", pid=os.getpid())):
                RequestJournal(path)
            first.append({"t": 2.0, "model": "voice", "busy_s": 0.5})
            first.rewrite([{"t": 2.0, "model": "voice", "busy_s": 0.5}])  # (replaces the file: still held)
            with pytest.raises(OSError, match="another residency service"):
                RequestJournal(path)
            assert [r["t"] for r in first.read()] == [2.0]
        finally:
            first.close()
        again = RequestJournal(path)  # closed: free again
        again.close()

    def test_another_process_holding_it_is_named_and_its_death_frees_it(self, tmp_path: Path) -> None:
        path = tmp_path / "requests.journal"
        other = _holder(path)
        try:
            with pytest.raises(OSError, match=IN_USE.format(path=".*requests\\.journal", pid=other.pid)):
                RequestJournal(path)
        finally:
            other.kill()  # no close: the OS lets go of it with the process
            other.wait()
            assert other.stdout is not None
            other.stdout.close()
            assert other.stdin is not None
            other.stdin.close()
        j = RequestJournal(path)
        j.close()
        other = _holder(path)  # and this process's close lets another one have it
        assert other.stdin is not None and other.stdout is not None
        other.stdin.close()
        assert other.wait(30) == 0
        other.stdout.close()

    def test_a_second_manager_is_refused_and_the_first_keeps_its_log(self, tmp_path: Path) -> None:
        config = lru_config(tmp_path)
        path = tmp_path / "requests.journal"
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")

        async def main() -> None:
            lm, pool = await started(config, store, path)
            _quiet(lm)
            try:
                await lm.infer("voice", AUDIO)
                with pytest.raises(OSError, match="another residency service"):
                    LiveManager(config, create_pool(config, in_process=True), store=store, journal=path)
                await lm.infer("voice", AUDIO)
                await lm.flush_log()
            finally:
                await lm.stop()
                pool.close()
            assert store.count_requests() == 2
            lm, pool = await started(config, store, path)  # the first one stopped: free again
            await lm.stop()
            pool.close()

        asyncio.run(main())
        assert store.count_requests() == 2
        store.close()

    def test_serve_says_so_without_a_traceback(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        monkeypatch.chdir(tmp_path)
        path = tmp_path / "requests.journal"
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"store: {{journal: {str(path)!r}}}\n" + CONFIG.read_text())

        async def served(self: LiveManager) -> None:
            raise AssertionError("serving on a journal another service holds")

        monkeypatch.setattr(LiveManager, "start", served)  # (so a start that is not refused ends)
        held = RequestJournal(path)
        try:
            rc = cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"])
        finally:
            held.close()
        err = capsys.readouterr().err
        assert rc == 2
        assert f"residency: store.journal '{path}': another residency service (pid {os.getpid()})" in err
        assert "[Errno" not in err and "Traceback" not in err

    def test_serve_is_refused_before_it_starts_ray_and_a_failed_start_lets_the_journal_go(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        """The journal was opened after the store and Ray's start (9 s of Ray for a refusal), and a
        start that failed later kept its lock in the process."""
        import manager.workers_bridge as bridge

        monkeypatch.chdir(tmp_path)
        path = tmp_path / "requests.journal"
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"store: {{journal: {str(path)!r}}}\n" + CONFIG.read_text())
        pools: list[Any] = []
        real = bridge.create_pool

        def recorded(*a: Any, **k: Any) -> Any:
            pools.append(real(*a, **k))
            return pools[-1]

        monkeypatch.setattr(bridge, "create_pool", recorded)
        held = RequestJournal(path)
        try:
            assert cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"]) == 2
        finally:
            held.close()
        assert pools == []  # refused before the device hosts (Ray) started
        assert "another residency service" in capsys.readouterr().err

        async def failed(self: LiveManager) -> None:
            raise OSError("a start that fails after the journal opened")

        monkeypatch.setattr(LiveManager, "start", failed)
        assert cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"]) == 2
        assert len(pools) == 1
        RequestJournal(path).close()  # its lock was let go


def _run_killed_after_a_store_write(
    config: Config, url: str, journal: Path, *, saved: int, batch: int
) -> None:
    """A run that serves `saved` voice requests, saves its statistics and writes its log (when
    `saved`), then serves `batch` more, and is killed just after the store took them, before the
    journal let them go (so the journal still has them: the next start sends them again)."""

    async def killed() -> None:
        store = open_store(url)
        lm, pool = await started(config, store, journal)
        _quiet(lm)
        if saved:
            for _ in range(saved):
                await lm.infer("voice", AUDIO)
            lm.save_stats()
            await lm.flush_log()
        for _ in range(batch):
            await lm.infer("voice", AUDIO)
        before = journal.read_bytes()
        assert before.count(b"\n") == batch
        await lm.flush_log()  # the store takes the batch ...
        journal.write_bytes(before)  # ... and the kill comes before the journal's rewrite
        kill(lm, pool)
        assert store.count_requests() == saved + batch
        store.close()

    asyncio.run(killed())


class TestABatchTheStoreHadIsCountedOnce:
    """Before: a batch the store took just before a kill (the journal not yet rewritten) was sent to
    the store again at the next start, and the statistics' catch-up, which reads the request log,
    counted it twice (8 requests counted for 5 served). The journal's records the store already holds
    are not sent again, and the catch-up takes a record the store has and the buffer still holds
    once."""

    def _check(self, lm: LiveManager, real: Any, served: int) -> None:
        voice = lm.engine.models["voice"]
        assert lm.live["voice"].requests == served and voice.hist.count == served
        times = [r["t"] for r in real.requests(0) if r["model"] == "voice"]
        assert len(times) == served == real.count_requests()  # the request log has it once too
        assert voice.hist.capture() == _in_order(times).capture()  # as if never interrupted

    @pytest.mark.parametrize("saved", [0, 2])
    def test_with_the_store_up_at_the_restart(self, tmp_path: Path, saved: int) -> None:
        config = lru_config(tmp_path)
        url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"
        _run_killed_after_a_store_write(config, url, journal, saved=saved, batch=3)
        real = open_store(url)

        async def restarted() -> None:
            lm, pool = await started(config, real, journal)
            _quiet(lm)
            try:
                self._check(lm, real, saved + 3)
                assert journal.read_text() == ""
                await lm.infer("voice", AUDIO)
                await lm.flush_log()
                lm.save_stats()
                self._check(lm, real, saved + 4)
                doc = real.get_doc("stats")
                assert doc is not None and doc["voice"]["requests"] == saved + 4
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(restarted())
        real.close()

    @pytest.mark.parametrize("save_first", [True, False])
    def test_with_the_store_down_at_the_restart(self, tmp_path: Path, save_first: bool) -> None:
        """The store back: the reconciler's save can come before the log's next write (the journal's
        records then still wait in the buffer) or after it (`_write_done` merges the statistics)."""
        config = lru_config(tmp_path)
        url, journal = f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "requests.journal"
        _run_killed_after_a_store_write(config, url, journal, saved=2, batch=3)
        real = open_store(url)
        store = _FlakyStore(real)

        async def restarted() -> None:
            lm, pool = await started(config, store, journal)  # the store is down at start
            _quiet(lm)
            try:
                await lm.infer("voice", AUDIO)
                store.down = False
                if save_first:
                    lm.save_stats()
                    doc = real.get_doc("stats")
                    assert doc is not None and doc["voice"]["requests"] == 6
                    assert doc["voice"]["hist"]["count"] == 6
                await lm.flush_log()
                self._check(lm, real, 6)
                lm.save_stats()
                doc = real.get_doc("stats")
                assert doc is not None and doc["voice"]["requests"] == 6
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(restarted())
        real.close()
