"""Review 14 of what the service keeps across restarts, on real SQLite files and real processes: a
store file that cannot serve is refused at the start in one line naming it and the fix; the request
log's catch-up of the statistics after a restart (a clock set back between the runs, records stamped
in the future, a log of millions since a model's last use); records a store cannot keep or a trace
reader refuses; the export read back. Each class or test names the bug it caught.

Most statistics tests drive the live manager's persistence (`manager.live_persist`) directly: a
`LiveManager` with no device hosts whose requests are recorded as `LiveManager.infer` records them
(`_serve`), and whose start runs the store steps of `LiveManager.start` (`_start`); one test runs the
real start on in-process device hosts beside them."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from disk_helpers import fill
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_helpers import CONFIG

import manager.store.sqlite as sqlite_store
from manager import cli
from manager.config import Config, load_config
from manager.live import LiveManager
from manager.replay.trace import MAX_BUSY_S, MAX_LINE_CHARS, read_trace
from manager.store import StoreError, open_store
from manager.store.base import NEVER_RAN, normalize_record
from manager.store.export import export_trace
from manager.store.sqlite import SCHEMA_VERSION
from manager.workers_bridge import create_pool

MODELS = ("voice", "embed", "world")  # the models of configs/local-cpu.yaml
T0 = 1_790_000_000.0


# ---- a live manager's persistence, without device hosts ------------------------------------------


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _manager(config: Config, url: str, journal: Path, clock: _Clock) -> LiveManager:
    return LiveManager(config, None, store=open_store(url), clock=clock, journal=journal)


def _serve(lm: LiveManager, clock: _Clock, model: str, t: float, busy: float = 0.25) -> None:
    """A request for `model` arriving at `t`, taken as `LiveManager.infer` takes one: observed by the
    engine at its arrival, counted and logged at its end."""
    clock.now = t
    lm.engine.observe(lm.engine.models[model], t)
    live = lm.live[model]
    live.requests += 1
    live.last_used = t + busy
    lm._log({"t": t, "model": model, "busy_s": busy, "wait_s": 0.0, "outcome": "ok"})


async def _start(lm: LiveManager) -> None:
    """The store steps of `LiveManager.start`: the journal to the store, then the statistics."""
    assert lm.journal is not None
    lm._log_buf = lm.journal.read() + lm._log_buf
    await lm.flush_log()
    if lm.restore_stats():
        lm._catch_up_stats()


def _end(lm: LiveManager, *, killed: bool) -> None:
    """The run ends: killed (no flush, no save: the journal keeps what the store lacks) or stopped."""
    if not killed:
        asyncio.run(lm.flush_log())
        lm.save_stats()
    assert lm.journal is not None
    lm.journal.close()
    lm.store.close()


def _stats(lm: LiveManager) -> dict[str, Any]:
    """What the statistics decide with: each model's reuse histogram, requests, last use and arrival."""
    return {
        n: (m.hist.capture(), lm.live[n].requests, lm.live[n].last_used, m.last_arrival)
        for n, m in lm.engine.models.items()
    }


# ---- the statistics across a restart: a round trip -----------------------------------------------

_GAPS = st.one_of(
    st.floats(0.001, 120.0),
    st.floats(120.0, 7 * 86400.0),
    st.sampled_from([90 * 86400.0, 200 * 86400.0]),  # a restart after months idle
)
_REQUESTS = st.lists(st.tuples(st.sampled_from(MODELS), _GAPS), min_size=1, max_size=40)


@st.composite
def _runs(draw: st.DrawFn) -> dict[str, Any]:
    first = draw(_REQUESTS)
    n = len(first)
    return {
        "first": first,
        "saved_after": draw(st.none() | st.integers(0, n)),  # its last save (None: none before the kill)
        "flushed_after": draw(st.integers(0, n)),  # what reached the store (the rest: the journal only)
        "killed": draw(st.booleans()),
        "back": draw(st.sampled_from([0.0, 0.0, 30.0, 3600.0, 30 * 86400.0])),  # the clock set back (NTP)
        "down_at_start": draw(st.booleans()),
        "second": draw(st.lists(st.tuples(st.sampled_from(MODELS), _GAPS), max_size=15)),
    }


def _times(requests: list[tuple[str, float]], t: float) -> list[tuple[str, float]]:
    out = []
    for model, gap in requests:
        t += gap
        out.append((model, t))
    return out


class _DownAtFirst:
    """Fault injector (unit tests only) around the real store: every call fails until `up()`."""

    def __init__(self, real: Any) -> None:
        self.real, self.down = real, True
        self.url = real.url

    def up(self) -> None:
        self.down = False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise StoreError(self.real.url, "connection refused (injected)")
            return target(*args, **kwargs)

        return call


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=_runs())
def test_statistics_restored_after_a_restart_are_those_of_a_run_without_it(run: dict[str, Any]) -> None:
    """Save (or not), stop or kill, restart, restore, serve on: the statistics the policy decides with
    are those of one run that saw every request. Before: a clock set back between the runs (NTP) left
    the killed run's requests after its last save out of them (3 of 10 for 30 s back, all for an hour),
    taken for the new run's own."""
    config = load_config(CONFIG)
    first = _times(run["first"], T0)
    # the second run's clock: from the first one's last request, set back by `back`
    second = _times(run["second"], first[-1][1] + 1.0 - run["back"])
    down = run["down_at_start"] and run["back"] == 0.0  # (with the store down: a clock in order only)
    with tempfile.TemporaryDirectory() as d:
        url, journal = f"sqlite:///{d}/state.db", Path(d) / "requests.journal"
        clock = _Clock(T0)
        lm = _manager(config, url, journal, clock)
        asyncio.run(_start(lm))
        for i, (model, t) in enumerate(first, 1):
            _serve(lm, clock, model, t)
            if i == run["flushed_after"]:
                asyncio.run(lm.flush_log())
            if i == run["saved_after"]:
                lm.save_stats()
        _end(lm, killed=run["killed"])

        clock.now = first[-1][1] + 1.0 - run["back"]
        lm = _manager(config, url, journal, clock)
        if down:
            lm.store = _DownAtFirst(lm.store)
        asyncio.run(_start(lm))
        for model, t in second:
            _serve(lm, clock, model, t)
        if down:
            lm.store.up()
            asyncio.run(lm.flush_log())  # the store answers again: the saved statistics merged in
            lm.save_stats()
        got = _stats(lm)
        _end(lm, killed=True)

    clock = _Clock(T0)
    with tempfile.TemporaryDirectory() as d:  # the same requests, one run
        one = _manager(config, f"sqlite:///{d}/state.db", Path(d) / "requests.journal", clock)
        for model, t in first + second:
            _serve(one, clock, model, t)
        want = _stats(one)
        _end(one, killed=True)
    assert got == want


def test_the_last_runs_requests_count_after_a_clock_set_back_with_the_real_start(tmp_path: Path) -> None:
    """As above, with `LiveManager.start` on in-process device hosts: a run killed after its last
    save, the clock an hour back at the next start."""
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    clock = _Clock(T0)

    async def first() -> None:
        lm = LiveManager(config, None, store=open_store(url), clock=clock, journal=journal)
        for i in range(6):
            _serve(lm, clock, "voice", T0 + 10 * i)
            if i == 2:
                lm.save_stats()
        await lm.flush_log()
        lm.journal.close()  # type: ignore[union-attr]
        lm.store.close()

    asyncio.run(first())

    async def second() -> tuple[int, int]:
        store = open_store(url)
        clock.now = T0 + 50 - 3600.0
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool, store=store, clock=clock, journal=journal)
        await lm.start()
        try:
            return lm.engine.models["voice"].hist.count, lm.live["voice"].requests
        finally:
            await lm.stop()
            pool.close()
            store.close()

    assert asyncio.run(second()) == (6, 6)


def test_requests_stamped_in_the_future_of_the_restart_are_counted(tmp_path: Path) -> None:
    """A killed run's requests whose times are later than the clock at the next start (that run's
    clock was ahead) were left out of the statistics, as if the new run had served them."""
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    clock = _Clock(T0)
    lm = _manager(config, url, journal, clock)
    for i in range(4):
        _serve(lm, clock, "embed", T0 + 86400.0 + i)  # a day ahead of the next run's clock
    _end(lm, killed=True)  # in the journal only: the next start writes it to the store
    clock.now = T0
    lm = _manager(config, url, journal, clock)
    asyncio.run(_start(lm))
    assert lm.engine.models["embed"].hist.count == 4 and lm.live["embed"].requests == 4
    _end(lm, killed=False)


class _Counting:
    """Fault injector's sibling (unit tests only) around the real store: counts the request records
    its `requests` yields."""

    def __init__(self, real: Any) -> None:
        self.real, self.url, self.read = real, real.url, 0

    def requests(
        self, since: float, until: float | None = None, *, on_corrupt: Any = None
    ) -> Iterator[dict[str, Any]]:
        for rec in self.real.requests(since, until, on_corrupt=on_corrupt):
            self.read += 1
            yield rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class TestARestartReadsTheLogSinceTheLastSaveNotSinceAModelsLastUse:
    """The catch-up read the request log from the oldest last arrival of any model, into a list: a
    model used once months ago made every start read (and hold) every record since (1 million: 10 s
    and 1.1 GB at start, to find none missed)."""

    def _store_with_history(self, tmp_path: Path, n: int) -> tuple[Config, str, Path, _Clock]:
        config = load_config(CONFIG)
        url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
        clock = _Clock(T0)
        lm = _manager(config, url, journal, clock)
        _serve(lm, clock, "embed", T0)  # once, long ago
        for i in range(n):
            _serve(lm, clock, "voice", T0 + 3600.0 + i)
        asyncio.run(lm.flush_log())
        lm.save_stats()
        _serve(lm, clock, "voice", T0 + 3600.0 + n + 5)  # after the save: in the log only
        _end(lm, killed=True)
        clock.now = T0 + 3600.0 + n + 60
        return config, url, journal, clock

    def test_only_the_records_after_the_save_are_read(self, tmp_path: Path) -> None:
        config, url, journal, clock = self._store_with_history(tmp_path, 3000)
        lm = _manager(config, url, journal, clock)
        lm.store = counting = _Counting(lm.store)
        asyncio.run(_start(lm))
        # the last record before the save (at its time) and the one after it; before: all 3001
        assert counting.read <= 2
        assert lm.engine.models["voice"].hist.count == 3001 and lm.live["voice"].requests == 3001
        assert lm.engine.models["embed"].hist.count == 1
        _end(lm, killed=False)

    def test_an_older_snapshot_is_caught_up_without_holding_the_log(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A statistics document saved before `seen_until` (or one unreadable) is caught up from the
        log as it is read, not from a list of all of it."""
        n = 30_000
        config, url, journal, clock = self._store_with_history(tmp_path, n)
        with closing(open_store(url)) as store:
            doc = store.get_doc("stats")
            assert doc is not None
            for entry in doc.values():
                entry.pop("seen_until", None)
            store.put_doc("stats", doc)
        lm = _manager(config, url, journal, clock)
        records = list(lm.store.requests(0))
        tracemalloc.start()
        held = tracemalloc.get_traced_memory()[0]
        copies = [dict(r) for r in records]  # what holding them takes
        holding = tracemalloc.get_traced_memory()[0] - held
        del copies, records
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            asyncio.run(_start(lm))
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert lm.engine.models["voice"].hist.count == n + 1
        assert peak < holding / 3, (peak, holding)  # (before: 4 times `holding`)
        _end(lm, killed=False)


def test_a_log_read_that_fails_half_way_takes_none_of_it(tmp_path: Path) -> None:
    """The catch-up streams the log now: a store failing part-way leaves the statistics as saved
    (none of the log taken), not with its first records counted."""
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    clock = _Clock(T0)
    lm = _manager(config, url, journal, clock)
    lm.save_stats()
    for i in range(5):
        _serve(lm, clock, "voice", T0 + 1 + i)
    asyncio.run(lm.flush_log())
    _end(lm, killed=True)

    class _Breaks:
        """Fault injector (unit tests only) around the real store: its log read fails at the third."""

        def __init__(self, real: Any) -> None:
            self.real, self.url = real, real.url

        def requests(
            self, since: float, until: float | None = None, *, on_corrupt: Any = None
        ) -> Iterator[dict[str, Any]]:
            for i, rec in enumerate(self.real.requests(since, until, on_corrupt=on_corrupt)):
                if i == 2:
                    raise StoreError(self.url, "read requests: disk I/O error (injected)")
                yield rec

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    lm = _manager(config, url, journal, clock)
    lm.store = _Breaks(lm.store)
    asyncio.run(_start(lm))
    assert lm.engine.models["voice"].hist.count == 0 and lm.live["voice"].requests == 0
    _end(lm, killed=True)


# ---- records a store cannot keep, or a trace reader refuses --------------------------------------


def test_a_record_a_store_cannot_keep_does_not_hold_back_the_log(tmp_path: Path) -> None:
    """A lone surrogate (what `json.loads` makes of a "\\ud800" escape in a damaged journal line)
    passed the record check, then failed every SQLite (and Redis) write as UnicodeEncodeError: taken
    for a store outage, the batch holding it was retried for good and no request was logged again."""
    config = load_config(CONFIG)
    url, journal = f"sqlite:///{tmp_path}/state.db", tmp_path / "requests.journal"
    with pytest.raises(ValueError, match="'client' is not valid text"):
        normalize_record({"t": T0, "model": "voice", "busy_s": 0.1, "client": "app\ud800"})
    clock = _Clock(T0)
    lm = _manager(config, url, journal, clock)
    _serve(lm, clock, "voice", T0)
    lm._log({"t": T0 + 1, "model": "voice", "busy_s": 0.1, "client": "app\ud800"})
    _serve(lm, clock, "voice", T0 + 2)
    asyncio.run(lm.flush_log())
    _serve(lm, clock, "voice", T0 + 3)
    asyncio.run(lm.flush_log())
    assert [r["t"] for r in lm.store.requests(0)] == [T0, T0 + 2, T0 + 3]
    assert lm.metrics.registry.get_sample_value("residency_request_log_dropped_total") == 1
    _end(lm, killed=False)


def test_a_record_whose_trace_line_is_too_long_to_read_back_is_refused(tmp_path: Path) -> None:
    """The store took a record whose exported line a trace reader then refuses (over MAX_LINE_CHARS):
    `tune --from-store` lost it, `--strict` stopped at it."""
    with closing(open_store(f"sqlite:///{tmp_path}/state.db")) as store:
        longest = MAX_LINE_CHARS - len('{"t":1.0,"model":"","busy_s":0.1}\n')
        store.append_requests([{"t": 1.0, "model": "m" * longest, "busy_s": 0.1}])
        with pytest.raises(ValueError, match="trace line would be longer"):
            store.append_requests([{"t": 2.0, "model": "m" * (longest + 1), "busy_s": 0.1}])
        out = tmp_path / "trace.jsonl"
        assert export_trace(store, 10.0, 3.0, out) == 1
        assert len(read_trace(out, strict=True).requests) == 1


_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
_RECORD = st.fixed_dictionaries(
    {
        "t": st.floats(0.0, 1e11) | st.integers(0, 10**11),
        "model": _TEXT,
        "busy_s": st.floats(0.0, MAX_BUSY_S),
    },
    optional={
        "class": _TEXT,
        "kind": st.sampled_from(["infer", "session"]),
        "client": _TEXT | st.text(max_size=4),  # (surrogates too: refused, never half-written)
        "wait_s": st.floats(0.0, 1e6),
        "outcome": st.sampled_from(["ok", "rejected", "error", "unserved"]),
        "source": _TEXT,
    },
)


@settings(max_examples=80, deadline=None)
@given(records=st.lists(_RECORD, max_size=30), page=st.integers(1, 7))
def test_what_the_store_takes_exports_to_a_trace_read_back_whole_and_in_order(
    records: list[dict[str, Any]], page: int
) -> None:
    """Any record the store takes of a request that ran is exported in time order (equal times: in
    the order appended), on a line `read_trace --strict` reads back as it was (t and busy_s to the
    millisecond); one of a request that never ran (`rejected`, `unserved`: review 31) is not."""
    kept = []
    with tempfile.TemporaryDirectory() as d, closing(open_store(f"sqlite:///{d}/s.db")) as store:
        for rec in records:
            try:
                store.append_requests([rec])
            except ValueError:
                continue  # refused whole: nothing of it written
            kept.append(normalize_record(rec))
        assert store.count_requests() == len(kept)
        kept = [r for r in kept if r.get("outcome") not in NEVER_RAN]
        old, sqlite_store.PAGE = sqlite_store.PAGE, page  # (pages of a few rows: their seams too)
        try:
            out = Path(d) / "t.jsonl"
            assert export_trace(store, 2e11, 1e11 + 1, out) == len(kept)
        finally:
            sqlite_store.PAGE = old
        back = read_trace(out, strict=True).requests
    want = sorted(kept, key=lambda r: r["t"])
    assert [(r.t, r.model, r.busy_s, r.cls, r.kind, r.client) for r in back] == [
        (round(r["t"], 3), r["model"], round(r["busy_s"], 3), r.get("class"), r.get("kind", "infer"),
         r.get("client"))
        for r in want
    ]  # fmt: skip


# ---- a store file that cannot serve: refused at the start, in one line ---------------------------


def _serve_cli(tmp_path: Path, db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> str:
    """`residency serve` on a config whose store is `db`: the one line it ends with (exit 2)."""

    async def served(self: LiveManager) -> None:
        raise AssertionError("served on a store that cannot keep what it serves")

    monkeypatch.setattr(LiveManager, "start", served)
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    journal = tmp_path / "requests.journal"
    cfg.write_text(f"store: {{url: 'sqlite:///{db}', journal: '{journal}'}}\n" + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("residency: ")]
    assert len(lines) == 1, err
    return lines[0]


def _good_store(path: Path, n: int = 5000) -> None:
    with closing(open_store(f"sqlite:///{path}")) as s:
        s.append_requests([{"t": T0 + i, "model": "voice", "busy_s": 0.1} for i in range(n)])
        s.put_doc("stats", {"voice": {"note": "x" * 5000}})
        s.set_intent("voice", "gpu")


def _damage(kind: str, path: Path) -> None:
    if kind == "garbage":
        path.write_bytes(os.urandom(64 * 1024))
        return
    _good_store(path)
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "a damaged page":  # the header and the first pages good: it opens, then fails
        data[3 * 4096 : 4 * 4096] = bytes(range(256)) * 16
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["garbage", "truncated", "a damaged page"])
def test_a_damaged_store_is_refused_at_the_start_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A damaged file: `serve` said SQLite's words alone ("file is not a database"), or (a damaged
    page) started and failed reads of its statistics all day, never saving them."""
    db = tmp_path / "state.db"
    _damage(kind, db)
    line = _serve_cli(tmp_path, db, capsys, monkeypatch)
    assert str(db) in line and "move it aside" in line, line


def test_another_programs_database_is_refused_by_serve_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store.url` naming another program's SQLite file: `serve` added the store's three tables to it
    and set its user_version (which such programs read for their migrations)."""
    db = tmp_path / "webui.db"
    with closing(sqlite3.connect(db)) as other, other:
        other.execute("CREATE TABLE chat (id INTEGER PRIMARY KEY, title TEXT)")
        other.execute("INSERT INTO chat (title) VALUES ('hello')")
    before = db.read_bytes()
    line = _serve_cli(tmp_path, db, capsys, monkeypatch)
    assert f"{db} is not a residency store (table chat of its own" in line
    assert "point store.url at a file of its own" in line
    assert db.read_bytes() == before


@pytest.mark.parametrize(
    ("make", "said"),
    [
        ("CREATE TABLE chat (id INTEGER); PRAGMA user_version = 1", "table chat of its own"),
        ("CREATE TABLE requests (a, b)", "its requests table has no column busy_s"),
        ("CREATE TABLE docs (key TEXT, value TEXT); PRAGMA user_version = 1", "no intents, requests tables"),
    ],
)
def test_a_file_without_the_stores_tables_is_refused_not_served_failing(
    tmp_path: Path, make: str, said: str
) -> None:
    """A file at this schema version without its tables was opened, and then every write failed
    ("no such table: requests") while the service served, its log kept in memory until dropped."""
    db = tmp_path / "state.db"
    with closing(sqlite3.connect(db)) as c:
        c.executescript(make)
    with pytest.raises(StoreError, match="is not a residency store") as e:
        open_store(f"sqlite:///{db}")
    assert said in str(e.value)


def test_a_newer_schema_is_refused_naming_the_fix(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    _good_store(db, 1)
    with closing(sqlite3.connect(db)) as c:
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="written by a newer residency; run that version, or point"):
        open_store(f"sqlite:///{db}")


def _as_nobody(fn: Callable[[], Any]) -> Any:
    """`fn()` as a user file permissions stop (root: a forked child that became `nobody`); what it
    returned, or the text of what it raised."""

    def call() -> Any:
        try:
            return fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    if os.geteuid() != 0:
        return call()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: this call alone, then out without pytest's clean-up
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with os.fdopen(w, "w") as f:
                json.dump(call(), f)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text
    return json.loads(text)


def test_a_store_the_service_may_not_write_is_refused_at_the_start() -> None:
    """A store file the service's user may read but not write (its folder writable): SQLite opened it
    read-only without a word; the service started and failed every write while it served."""
    with tempfile.TemporaryDirectory(prefix="residency-ro-") as d:
        folder = Path(d)
        folder.chmod(0o777)  # (writable by anyone: only the file is read-only)
        db = folder / "state.db"
        _good_store(db, 3)
        db.chmod(0o444)

        def serve_open() -> str:
            with closing(open_store(f"sqlite:///{db}")):
                return "opened"

        got = _as_nobody(serve_open)
        assert got.startswith("StoreError") and "attempt to write a readonly database" in got, got
        assert f"this user may not write {db}" in got
        # a read-only command still reads it
        assert _as_nobody(lambda: open_store(f"sqlite:///{db}", create=False).count_requests()) == 3


_HOLD = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
c.execute("INSERT INTO requests (t, model, busy_s) VALUES (5.0, 'voice', 0.1)")
print("held", flush=True)
sys.stdin.read()
c.execute("COMMIT")
"""


def test_a_store_another_process_holds_locked_is_refused_at_the_start_and_waited_for_when_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's write transaction: the service opened the store and started, then failed
    every write; now the start names the lock. A lock taken while it serves costs a failed write:
    the records are kept and written once the lock is gone."""
    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", 0.3)
    db = tmp_path / "state.db"
    url = f"sqlite:///{db}"
    _good_store(db, 1)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StoreError, match="database is locked; another process has held a lock on"):
            open_store(url)
    finally:
        holder.communicate("", timeout=30)

    config = load_config(CONFIG)
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=open_store(url), clock=clock, journal=tmp_path / "j")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        _serve(lm, clock, "voice", T0 + 10)
        asyncio.run(lm.flush_log())  # fails: kept
        assert len(lm._log_buf) == 1
    finally:
        holder.communicate("", timeout=30)
    asyncio.run(lm.flush_log())
    assert [r["t"] for r in lm.store.requests(T0 + 1)] == [T0 + 10] and lm._log_buf == []
    _end(lm, killed=False)


def test_a_store_open_while_a_read_only_command_reads_it(tmp_path: Path) -> None:
    """Beside a serving store, `trace export` (a read-only open) reads what the service wrote, and the
    service's next start still opens it (no lock of the reader's left)."""
    db = tmp_path / "state.db"
    _good_store(db, 10)
    with closing(open_store(f"sqlite:///{db}")) as service:
        service.append_requests([{"t": T0 + 100, "model": "voice", "busy_s": 0.1}])
        with closing(open_store(f"sqlite:///{db}", create=False)) as reader:
            assert reader.count_requests() == 11
    with closing(open_store(f"sqlite:///{db}")) as again:
        assert again.count_requests() == 11


_SERVE_STORE = """
import sys
from manager.store.sqlite import open_sqlite
store = open_sqlite(sys.argv[1], hold=True)
print("serving", flush=True)
sys.stdin.read()
"""


def test_a_second_service_on_one_store_is_refused_naming_the_first(tmp_path: Path) -> None:
    """Two services on one SQLite store (an absolute store.url, journals of their own) both ran: each
    save of the statistics overwrote the other's, and a restart counted the other's requests again
    (10 counted for 8 served). Held for serving (`hold`, which `serve` is to ask for), a second one
    is refused naming the first; read-only commands still read it; the lock goes with its process."""
    url = f"sqlite:///{tmp_path}/state.db"
    first = subprocess.Popen(
        [sys.executable, "-c", _SERVE_STORE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "serving\n"
        with pytest.raises(StoreError, match=rf"another residency service \(pid {first.pid}\) is serving"):
            sqlite_store.open_sqlite(url, hold=True)
        with closing(open_store(url, create=False)) as reader:
            assert reader.count_requests() == 0
    finally:
        first.kill()  # killed: the OS lets its lock go
        first.communicate(timeout=30)
    with closing(sqlite_store.open_sqlite(url, hold=True)) as again:
        assert again.count_requests() == 0
    with closing(sqlite_store.open_sqlite(url, hold=True)):  # (closed: let go)
        pass


def test_a_full_disk_is_named_at_the_start_and_waited_out_while_serving(small_disk: Path) -> None:
    """A full disk under a store file that exists: the start said "disk I/O error" alone (SQLite
    cannot map the -shm file); now it names the full disk. Filling while serving costs failed
    writes, the records kept in memory and written once there is room again."""
    db = small_disk / "state.db"
    url = f"sqlite:///{db}"
    _good_store(db, 1)
    filler = fill(small_disk)
    with pytest.raises(StoreError, match=rf"the disk holding {db} is full: free some space"):
        open_store(url)
    filler.unlink()

    config = load_config(CONFIG)
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=open_store(url), clock=clock, journal=None)
    filler = fill(small_disk)
    for i in range(50):
        _serve(lm, clock, "voice", T0 + 10 + i)
    asyncio.run(lm.flush_log())
    assert len(lm._log_buf) == 50  # (the store failed: kept)
    filler.unlink()
    asyncio.run(lm.flush_log())
    assert lm._log_buf == [] and lm.store.count_requests() == 51
    lm.store.close()


def test_a_store_failing_while_serving_is_said_with_its_reason_and_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk (a read-only file, a lock) while serving: the log said "could not write N requests
    to the store" without why, and every save of the statistics (each minute) printed a traceback."""
    config = load_config(CONFIG)
    clock = _Clock(T0)
    lm = LiveManager(config, None, store=open_store(f"sqlite:///{tmp_path}/s.db"), clock=clock)

    class _Full:
        """Fault injector (unit tests only) around the real store: its writes fail as on a full disk."""

        def __init__(self, real: Any) -> None:
            self.real, self.url = real, real.url

        def _full(self, *args: Any) -> None:
            raise StoreError(self.url, "append requests: database or disk is full")

        append_requests = put_doc = _full

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    real = lm.store
    lm.store = _Full(real)
    _serve(lm, clock, "voice", T0)
    caplog.clear()
    asyncio.run(lm.flush_log())
    lm.save_stats()
    said = [r for r in caplog.records if r.name == "manager.live"]
    assert len(said) == 2 and all(r.exc_info is None for r in said), [r.getMessage() for r in said]
    assert all("database or disk is full" in r.getMessage() for r in said)
    assert len(lm._log_buf) == 1  # kept
    real.close()


def test_serve_holds_its_sqlite_store_so_a_second_service_is_refused(tmp_path: Path) -> None:
    """`serve` opens its store held (`open_store(..., hold=True)` in `_journal_and_store`): a second
    service on the same store, with a journal of its own, is refused at its start naming the first;
    the first's stop lets it go."""
    from manager.api.server import _journal_and_store

    base = load_config(CONFIG)
    url = f"sqlite:///{tmp_path}/state.db"

    def cfg(journal: str) -> Config:
        store = base.store.model_copy(update={"url": url, "journal": str(tmp_path / journal)})
        return base.model_copy(update={"store": store})

    journal, store = _journal_and_store(cfg("a.journal"))
    try:
        with pytest.raises(StoreError, match=r"another residency service \(pid \d+\) is serving"):
            _journal_and_store(cfg("b.journal"))
    finally:
        store.close()
        if journal is not None:
            journal.close()
    journal, store = _journal_and_store(cfg("b.journal"))  # the first stopped: served
    store.close()
    if journal is not None:
        journal.close()


def test_tune_from_store_leaves_out_models_no_longer_configured_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tune --from-store --strict` on a log holding requests of a model since removed from the
    config failed, naming a temporary file already deleted (`/tmp/residency-tune-…/requests.jsonl:
    1442: unknown model 'retired'`); without --strict it printed 'skipped' lines naming that file.
    The service's own tuning job leaves such requests out; the CLI now does the same, and says how
    many."""
    import time as _time

    from test_review13_store import config_with_store

    db = tmp_path / "state.db"
    now = _time.time()
    recs = [
        {"t": now - 3 * 86400 + 600 * i, "model": "retired" if i % 7 == 0 else "llm", "busy_s": 2.0}
        for i in range(400)
    ]
    with closing(open_store(f"sqlite:///{db}")) as s:
        s.append_requests(recs)
    cfg = config_with_store(tmp_path, db)
    out = tmp_path / "tuned.yaml"
    args = ["tune", "--config", str(cfg), "--from-store", "--since", "7d", "--strict", "--out", str(out)]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "left out 58 logged requests of models no longer in the config: retired" in err
    assert "residency-tune-" not in err and out.exists()
