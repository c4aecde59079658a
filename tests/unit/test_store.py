"""The embedded SQLite store, `open_store`'s url checks and `trace export` (no sockets: the Redis
backend's behaviour is in tests/integration/test_store_redis.py, against a real server)."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from manager.replay.trace import read_trace
from manager.store import Store, StoreError, open_store
from manager.store import sqlite as sqlite_store
from manager.store.base import normalize_record, redact
from manager.store.export import export_trace, parse_since
from manager.store.redis import parse_redis_url
from manager.store.sqlite import SQLiteStore

T0 = 1_764_547_200.0  # 2025-12-01 00:00 UTC


def req(t: float, model: str = "voice", busy_s: float = 0.4, **extra: Any) -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": busy_s, **extra}


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/state/residency.db"


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = open_store(url)
    yield s
    s.close()


def raw(url: str) -> sqlite3.Connection:
    """A second, plain connection to the store's file (what another process or a bad disk sees)."""
    return sqlite3.connect(url.removeprefix("sqlite:///"))


class TestRequestLog:
    def test_ranges_are_half_open_and_in_time_order(self, store: Store) -> None:
        store.append_requests([req(T0 + 2, "llm"), req(T0, "voice"), req(T0 + 1, "world")])
        store.append_requests([req(T0 + 1.5, "voice"), req(T0 + 3, "llm")])
        # Appended out of order; read back sorted by t.
        assert [r["t"] - T0 for r in store.requests(0)] == [0, 1, 1.5, 2, 3]
        # since <= t < until: T0 + 1 is in, T0 + 3 is out.
        assert [r["model"] for r in store.requests(T0 + 1, T0 + 3)] == ["world", "voice", "llm"]
        assert list(store.requests(T0 + 3.5)) == []
        assert list(store.requests(T0 + 1, T0 + 1)) == []
        assert store.count_requests() == 5

    def test_equal_times_keep_append_order(self, store: Store) -> None:
        store.append_requests([req(T0, "a"), req(T0, "b")])
        store.append_requests([req(T0, "c")])
        assert [r["model"] for r in store.requests(T0, T0 + 1)] == ["a", "b", "c"]

    def test_reads_page_through_many_rows(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(sqlite_store, "PAGE", 3)
        times = [T0 + (i * 7) % 10 for i in range(10)] + [T0 + 4] * 4  # a tie across a page edge
        store.append_requests([req(t, f"m{i}") for i, t in enumerate(times)])
        got = list(store.requests(T0, T0 + 9))
        assert [r["t"] for r in got] == sorted(t for t in times if t < T0 + 9)
        assert [r["model"] for r in got if r["t"] == T0 + 4] == ["m2", "m10", "m11", "m12", "m13"]

    def test_records_come_back_canonical(self, store: Store) -> None:
        store.append_requests(
            [
                {"t": 1, "model": "voice", "busy_s": 0, "kind": "infer", "class": None},
                req(2.0, "world", 600.0, kind="session", client="app", wait_s=1.25, outcome="ok"),
                req(3.0, **{"class": "background"}, outcome="rejected", source="grpc"),
            ]
        )
        assert list(store.requests(0)) == [
            {"t": 1.0, "model": "voice", "busy_s": 0.0},
            {
                "t": 2.0,
                "model": "world",
                "busy_s": 600.0,
                "kind": "session",
                "client": "app",
                "wait_s": 1.25,
                "outcome": "ok",
            },
            {
                "t": 3.0,
                "model": "voice",
                "busy_s": 0.4,
                "class": "background",
                "outcome": "rejected",
                "source": "grpc",
            },
        ]

    def test_unknown_key_is_rejected_and_nothing_is_written(self, store: Store) -> None:
        with pytest.raises(ValueError, match="'prompt'"):
            store.append_requests([req(T0), req(T0 + 1, prompt="hello")])
        assert store.count_requests() == 0

    @pytest.mark.parametrize(
        ("record", "named"),
        [
            ({"model": "voice", "busy_s": 1.0}, "'t'"),
            (req(-1.0), "'t'"),
            (req(float("nan")), "'t'"),
            (req(T0, ""), "'model'"),
            (req(T0, busy_s=-0.1), "'busy_s'"),
            (req(T0, kind="batch"), "'kind'"),
            (req(T0, client=7), "'client'"),
            (req(T0, wait_s=float("inf")), "'wait_s'"),
            (req(T0, wait_s=True), "'wait_s'"),
            (req(T0, outcome="maybe"), "'outcome'"),
            (req(T0, source=b"grpc"), "'source'"),
        ],
    )
    def test_bad_values_are_rejected_by_name(self, store: Store, record: dict[str, Any], named: str) -> None:
        with pytest.raises(ValueError, match=named):
            store.append_requests([record])
        assert store.count_requests() == 0

    def test_not_a_dict_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="must be a dict"):
            normalize_record(["t", 1.0])  # type: ignore[arg-type]

    def test_empty_append_is_a_no_op(self, store: Store) -> None:
        store.append_requests([])
        assert store.count_requests() == 0

    def test_appends_from_many_threads(self, store: Store) -> None:
        def work(k: int) -> None:
            for i in range(50):
                store.append_requests([req(T0 + i, f"m{k}")])
                assert store.count_requests() >= 1

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        got = list(store.requests(0))
        assert len(got) == store.count_requests() == 400
        assert [r["t"] for r in got] == sorted(r["t"] for r in got)


class TestDocsAndIntents:
    def test_docs_round_trip_and_replace(self, store: Store) -> None:
        assert store.get_doc("stats") is None
        doc = {"models": {"voice": {"load_s": [0.4, 1.2]}}, "n": 3, "ok": True, "none": None}
        store.put_doc("stats", doc)
        assert store.get_doc("stats") == doc
        store.put_doc("stats", {"n": 4})
        assert store.get_doc("stats") == {"n": 4}

    @pytest.mark.parametrize(
        ("key", "doc", "match"),
        [("", {}, "key"), ("k", [1, 2], "'k'"), ("k", {"x": object()}, "'k'")],
    )
    def test_bad_docs_are_rejected(self, store: Store, key: str, doc: Any, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            store.put_doc(key, doc)

    def test_intents_round_trip(self, store: Store) -> None:
        assert store.intents() == {}
        store.set_intent("voice", "gpu")
        store.set_intent("llm", "host")
        store.set_intent("voice", "disk")
        assert store.intents() == {"llm": "host", "voice": "disk"}
        with pytest.raises(ValueError, match="'vram'"):
            store.set_intent("voice", "vram")
        with pytest.raises(ValueError, match="model name"):
            store.set_intent("", "gpu")


class TestDurability:
    def test_data_survives_a_restart(self, url: str) -> None:
        with closing(open_store(url)) as s:
            s.append_requests([req(T0), req(T0 + 1, "llm")])
            s.put_doc("config/v1", {"keep_alive": 600})
            s.set_intent("voice", "gpu")
        with closing(open_store(url)) as s:  # a new process would see the same
            assert [r["model"] for r in s.requests(0)] == ["voice", "llm"]
            assert s.get_doc("config/v1") == {"keep_alive": 600}
            assert s.intents() == {"voice": "gpu"}

    def test_file_is_in_wal_mode_and_parents_are_created(self, url: str, tmp_path: Path) -> None:
        with closing(open_store(url)):
            pass
        assert (tmp_path / "state" / "residency.db").is_file()
        with closing(raw(url)) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)

    def test_relative_path_is_from_the_cwd(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        with closing(open_store("sqlite:///.residency/state.db")) as s:
            assert s.ping()
        assert (tmp_path / ".residency" / "state.db").is_file()

    def test_in_memory_database(self) -> None:
        with closing(open_store("sqlite:///:memory:")) as s:
            s.append_requests([req(T0)])
            assert s.count_requests() == 1

    def test_closed_store_pings_false_and_raises(self, url: str) -> None:
        s = open_store(url)
        assert s.ping()
        s.close()
        s.close()  # idempotent
        assert not s.ping()
        with pytest.raises(StoreError, match="closed"):
            s.count_requests()


class TestCorruption:
    def test_corrupt_row_names_its_id(self, store: Store, url: str) -> None:
        store.append_requests([req(T0), req(T0 + 1), req(T0 + 2)])
        with closing(raw(url)) as db, db:
            db.execute("UPDATE requests SET busy_s = 'lots' WHERE id = 2")
        with pytest.raises(StoreError, match=r"requests row id=2 is corrupt: .*'busy_s'") as e:
            list(store.requests(0))
        assert url in str(e.value)
        assert store.count_requests() == 3

    @pytest.mark.parametrize("bad_t", ["'abc'", "X'00'"])
    def test_a_row_whose_time_is_not_a_number_is_named_not_skipped(
        self, store: Store, url: str, bad_t: str
    ) -> None:
        # SQLite sorts text and blobs after every number: no time range would ever reach this row
        store.append_requests([req(T0), req(T0 + 1), req(T0 + 2)])
        with closing(raw(url)) as db, db:
            db.execute(f"UPDATE requests SET t = {bad_t} WHERE id = 2")
        for since, until in ((0, None), (T0, T0 + 5)):
            with pytest.raises(StoreError, match=r"requests row id=2 is corrupt: 't' is"):
                list(store.requests(since, until))

    def test_corrupt_doc_and_intent_name_their_key(self, store: Store, url: str) -> None:
        store.put_doc("stats", {"n": 1})
        store.set_intent("voice", "gpu")
        with closing(raw(url)) as db, db:
            db.execute("UPDATE docs SET value = '{\"n\": ' WHERE key = 'stats'")
            db.execute("UPDATE intents SET tier = 'moon' WHERE model = 'voice'")
        with pytest.raises(StoreError, match="document 'stats' is corrupt"):
            store.get_doc("stats")
        with pytest.raises(StoreError, match="intent for 'voice' is corrupt"):
            store.intents()

    def test_a_file_that_is_not_a_database(self, tmp_path: Path) -> None:
        path = tmp_path / "junk.db"
        path.write_bytes(b"this is not sqlite" * 100)
        with pytest.raises(StoreError, match=r"junk\.db: cannot open the database"):
            open_store(f"sqlite:///{path}")

    def test_a_newer_schema_is_refused(self, url: str) -> None:
        with closing(open_store(url)), closing(raw(url)) as db:
            db.execute("PRAGMA user_version = 99")
        with pytest.raises(StoreError, match="schema version 99"):
            open_store(url)


class TestOpenStore:
    @pytest.mark.parametrize(
        ("url", "match"),
        [
            ("mysql://x", "unknown scheme 'mysql'"),
            ("state.db", "not a store url"),
            ("", "not a store url"),
            ("sqlite://", "three slashes"),
            ("sqlite:///", "no database file"),
            ("sqlite:///state/", "no database file"),
            ("sqlite://host/state.db", "three slashes"),
            ("sqlite:///state.db?mode=ro", "no \\?query"),
            ("redis://", "no host"),
            ("redis://127.0.0.1:port/0", "port"),
            ("redis://127.0.0.1:6379/zero", "database must be a number"),
            ("redis://127.0.0.1:6379/0?db=1", "unknown url parameter 'db'"),
            ("redis://127.0.0.1:6379/0?prefix=", "prefix"),
        ],
    )
    def test_bad_urls(self, url: str, match: str) -> None:
        with pytest.raises(StoreError, match=match) as e:
            open_store(url)
        assert url in str(e.value)

    def test_errors_never_show_the_password(self) -> None:
        with pytest.raises(StoreError) as e:
            open_store("redis://:s3cret@127.0.0.1:port/0")
        assert "s3cret" not in str(e.value)
        assert "redis://:***@127.0.0.1:port/0" in str(e.value)
        with pytest.raises(StoreError) as e:
            open_store("mysql://admin:s3cret@db/x")
        assert "s3cret" not in str(e.value)

    def test_redis_url_parts(self) -> None:
        u = parse_redis_url("redis://:p%40ss@10.0.0.2:6380/3?prefix=home1")
        assert (u.host, u.port, u.db, u.password, u.prefix, u.ssl) == (
            "10.0.0.2",
            6380,
            3,
            "p@ss",
            "home1",
            False,
        )
        assert u.display == "redis://:***@10.0.0.2:6380/3?prefix=home1"
        d = parse_redis_url("rediss://cache")
        assert (d.host, d.port, d.db, d.password, d.prefix, d.ssl) == (
            "cache",
            6379,
            0,
            None,
            "residency",
            True,
        )

    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            ("redis://user:p@w/d@h:1/0", "redis://user:***@h:1/0"),
            ("redis://secret@h/0", "redis://***@h/0"),
            ("redis://h:1/0", "redis://h:1/0"),
        ],
    )
    def test_redact(self, url: str, shown: str) -> None:
        assert redact(url) == shown

    def test_sqlite_store_satisfies_the_protocol(self, store: Store) -> None:
        assert isinstance(store, SQLiteStore)
        assert isinstance(store, Store)


class TestExport:
    @pytest.mark.parametrize(
        ("text", "seconds"),
        [("7d", 604800.0), ("36h", 129600.0), ("90m", 5400.0), ("45s", 45.0), ("3600", 3600.0), ("1.5", 1.5)],
    )
    def test_parse_since(self, text: str, seconds: float) -> None:
        assert parse_since(text) == seconds

    @pytest.mark.parametrize("text", ["", "7x", "d7", "-5", "soon"])
    def test_parse_since_names_bad_text(self, text: str) -> None:
        with pytest.raises(ValueError, match=repr(text)):
            parse_since(text)

    def test_export_round_trips_through_read_trace(self, store: Store, tmp_path: Path) -> None:
        now = T0 + 86400
        store.append_requests(
            [
                req(T0 - 1, "old"),  # before the window
                req(T0, "voice", 0.4, wait_s=0.0, outcome="ok", source="grpc"),
                req(T0 + 60.0004, "world", 5400.0, kind="session", client="world-app"),
                req(T0 + 120, "llm", 2.5, **{"class": "background"}, outcome="error"),
                req(T0 + 130, "llm", 0.0, **{"class": "background"}, outcome="rejected"),  # never ran
                req(now, "late"),  # t == now is outside [now - since, now)
            ]
        )
        out = tmp_path / "out" / "week.jsonl"
        n = export_trace(store, parse_since("1d"), now, out)
        assert n == 3  # (the refused one left out: review 31)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert lines == [
            {"t": T0, "model": "voice", "busy_s": 0.4},
            {"t": T0 + 60.0, "model": "world", "busy_s": 5400.0, "kind": "session", "client": "world-app"},
            {"t": T0 + 120, "model": "llm", "busy_s": 2.5, "class": "background"},
        ]
        back = read_trace(out, strict=True)
        assert [(r.model, r.cls, r.kind, r.client) for r in back.requests] == [
            ("voice", None, "infer", None),
            ("world", None, "session", "world-app"),
            ("llm", "background", "infer", None),
        ]
        assert back.bad_lines == []
        assert [p.name for p in out.parent.iterdir()] == ["week.jsonl"]

    def test_failed_export_leaves_no_file(self, store: Store, url: str, tmp_path: Path) -> None:
        store.append_requests([req(T0), req(T0 + 1)])
        with closing(raw(url)) as db, db:
            db.execute("UPDATE requests SET model = '' WHERE id = 2")
        out = tmp_path / "week.jsonl"
        with pytest.raises(StoreError, match="id=2"):
            export_trace(store, 3600, T0 + 10, out)
        assert list(tmp_path.glob("*week*")) == []


def test_the_request_journal_skips_every_unreadable_line_and_keeps_the_rest(tmp_path: Path) -> None:
    from manager.journal import RequestJournal

    path = tmp_path / "requests.journal"
    bad = ["[" * 100_000, '{"t": ' + "9" * 5000 + "}", "[1, 2]", '{"t": 1, "mod', "\x00\x01"]
    good = [{"t": 1.0, "model": "voice", "busy_s": 0.5}, {"t": 2.0, "model": "llm", "busy_s": 1.0}]
    path.write_text("\n".join([json.dumps(good[0]), *bad, json.dumps(good[1])]) + "\n", encoding="utf-8")
    j = RequestJournal(path)
    try:
        assert j.read() == good
        assert j.skipped == len(bad)
    finally:
        j.close()


def test_a_journal_line_that_is_not_utf8_is_skipped_not_fatal(tmp_path: Path) -> None:
    from manager.journal import RequestJournal

    path = tmp_path / "requests.journal"
    good = {"t": 1.0, "model": "voice", "busy_s": 0.5}
    path.write_bytes(json.dumps(good).encode() + b"\n\xff\xfe garbage\n" + json.dumps(good).encode() + b"\n")
    j = RequestJournal(path)
    try:
        assert j.read() == [good, good]
        assert j.skipped == 1
    finally:
        j.close()


def test_a_journal_record_the_store_would_refuse_is_skipped_so_the_rest_reach_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from manager.journal import RequestJournal

    path = tmp_path / "requests.journal"
    good = {"t": 2.0, "model": "voice", "busy_s": 0.5, "outcome": "ok"}
    lines = ['{"t": 1, "model": "voice"}', '{"t": 1, "model": "voice", "busy_s": 1, "payload": "x"}']
    path.write_text("\n".join([*lines, json.dumps(good)]) + "\n", encoding="utf-8")
    j = RequestJournal(path)
    try:
        recs = j.read()
        assert recs == [good] and j.skipped == 2
        assert "requests.journal:1:" in caplog.text and "busy_s" in caplog.text
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        try:
            store.append_requests(recs)  # the batch goes through whole
            assert store.count_requests() == 1
        finally:
            store.close()
    finally:
        j.close()


def test_a_torn_last_journal_line_does_not_swallow_the_next_runs_first_record(tmp_path: Path) -> None:
    from manager.journal import RequestJournal

    path = tmp_path / "requests.journal"
    first = {"t": 1.0, "model": "voice", "busy_s": 0.5}
    path.write_text(json.dumps(first) + "\n" + json.dumps(first)[:15], encoding="utf-8")  # killed mid-write
    j = RequestJournal(path)
    try:
        j.append({"t": 2.0, "model": "voice", "busy_s": 0.25})
        assert [r["t"] for r in j.read()] == [1.0, 2.0]
        assert j.skipped == 1
    finally:
        j.close()
