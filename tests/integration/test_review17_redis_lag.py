"""Review 17 of the Redis store on a private, real redis-server: the lateness of late records (ids
placed ahead of their t) widens only the reads that can hold them, and a corrupt entry can be named and
passed over by a reader that asks for it (the journal's replay at a restart).

Bug (lag): only the largest lateness ever was kept (`<prefix>:requests:lag`, member late_ms), and every
read of a time range widened its XRANGE by it: one record appended hours after its t (a journal
replayed at a restart) made every later range read scan hours of entries past its end, for good."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.config import load_config
from manager.live import LiveManager
from manager.store import StoreError, open_store
from manager.store.redis import RedisStore

T0 = 1_790_000_000.0
HOUR = 3600.0
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


def _rec(t: float, model: str = "voice") -> dict[str, Any]:
    return {"t": t, "model": model, "busy_s": 0.5}


def _ms(t: float) -> int:
    return math.floor(t * 1000)


class _Reads:
    """Spy (on the real client) of the XRANGE calls a store makes: each call's bounds, and how many
    entries Redis gave back in all."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: RedisStore) -> None:
        client = store._client
        real = client.xrange
        self.calls: list[tuple[str, str]] = []
        self.entries = 0

        def xrange(name: Any, min: Any = "-", max: Any = "+", count: Any = None) -> Any:
            out = real(name, min=min, max=max, count=count)
            self.calls.append((str(min), str(max)))
            self.entries += len(out)
            return out

        monkeypatch.setattr(client, "xrange", xrange)


def _very_late_log(rstore: RedisStore) -> None:
    """300 records a second apart, then one whose t is 3 hours before them (appended now), then 300
    more."""
    rstore.append_requests([_rec(T0 + i) for i in range(300)])
    rstore.append_requests([_rec(T0 - 3 * HOUR, "late")])
    rstore.append_requests([_rec(T0 + 300 + i) for i in range(300)])


def test_a_very_late_record_is_read_by_a_range_that_covers_its_t(rstore: RedisStore) -> None:
    _very_late_log(rstore)
    assert [r["model"] for r in rstore.requests(T0 - 3 * HOUR - 1, T0 - 3 * HOUR + 1)] == ["late"]
    assert [r["model"] for r in rstore.requests(T0 - 3 * HOUR, T0 - 3 * HOUR + 0.0005)] == ["late"]
    assert list(rstore.requests(T0 - 3 * HOUR + 0.001, T0 - 3 * HOUR + 60)) == []
    everything = [r["t"] for r in rstore.requests(0)]
    assert everything == [T0 - 3 * HOUR] + [T0 + i for i in range(600)]  # in time order
    assert [r["t"] for r in rstore.requests(T0 - 3 * HOUR, T0 + 2)] == [T0 - 3 * HOUR, T0, T0 + 1]


def test_a_very_late_record_does_not_widen_reads_of_other_hours(
    rstore: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the read of 10 s scanned every entry from its start to the stream's end (500), its
    XRANGE widened by the 3 hours of the late record."""
    _very_late_log(rstore)
    reads = _Reads(monkeypatch, rstore)
    assert [r["t"] for r in rstore.requests(T0 + 100, T0 + 110)] == [T0 + i for i in range(100, 110)]
    assert reads.calls == [(str(_ms(T0 + 100)), str(_ms(T0 + 110)))]
    assert reads.entries == 11  # (the entry at until's own ms is read, and left out by its t)


def test_a_lag_written_before_this_version_is_honoured_then_outgrown(
    rstore: RedisStore, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store an earlier version wrote: its late entries are known by late_ms alone. Reads widen by
    it as before for the entries written then, and not for the ones written since."""
    for i in range(100):
        client.xadd("residency:requests", {"data": json.dumps(_rec(T0 + i))}, id=f"{_ms(T0 + i)}-0")
    client.xadd("residency:requests", {"data": json.dumps(_rec(T0 - HOUR, "late"))}, id=f"{_ms(T0 + 99)}-1")
    client.zadd("residency:requests:lag", {"late_ms": _ms(T0 + 99) - _ms(T0 - HOUR)})
    assert [r["model"] for r in rstore.requests(T0 - HOUR - 1, T0 - HOUR + 1)] == ["late"]

    rstore.append_requests([_rec(T0 + 100 + i) for i in range(300)])  # this version's first write
    assert [r["model"] for r in rstore.requests(T0 - HOUR - 1, T0 - HOUR + 1)] == ["late"]
    assert client.zscore("residency:requests:lag", "late_ms") == _ms(T0 + 99) - _ms(T0 - HOUR)  # (as before)
    reads = _Reads(monkeypatch, rstore)
    assert len(list(rstore.requests(T0 + 200, T0 + 210))) == 10
    assert reads.entries == 11  # before: every entry up to the stream's end (200)
    assert len(list(rstore.requests(T0 + 50, T0 + 60))) == 10  # an old range: widened to the upgrade
    assert reads.calls[-1] == (str(_ms(T0 + 50)), str(_ms(T0 + 99)))


def test_the_lateness_of_trimmed_hours_goes_with_them(
    rstore: RedisStore, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the retention has deleted a late record (and everything of its hour), reads of that hour
    are no longer widened by its lateness. Before: the lag stayed, whatever was trimmed."""
    rstore.append_requests([_rec(T0 - 3 * HOUR + 10 + i) for i in range(20)])
    _very_late_log(rstore)
    assert rstore.trim_requests(T0 - HOUR) == 21
    assert [r["t"] for r in rstore.requests(0, T0 + 2)] == [T0, T0 + 1]
    reads = _Reads(monkeypatch, rstore)
    assert list(rstore.requests(T0 - 3 * HOUR, T0 - 3 * HOUR + 60)) == []
    assert reads.calls == [(str(_ms(T0 - 3 * HOUR)), str(_ms(T0 - 3 * HOUR + 60)))]
    assert reads.entries == 0  # before: every entry of the log (600)


def test_late_records_within_one_batch_and_across_batches_read_in_order(rstore: RedisStore) -> None:
    """Several late records in one hour and across hours: each read of a range returns exactly its
    records, in time order."""
    rstore.append_requests([_rec(T0 + 2 * HOUR)])
    rstore.append_requests([_rec(T0 + 5), _rec(T0 + HOUR + 5), _rec(T0 + 1), _rec(T0 + 2 * HOUR + 1)])
    rstore.append_requests([_rec(T0 + 3)])
    assert [r["t"] for r in rstore.requests(T0, T0 + 4)] == [T0 + 1, T0 + 3]
    assert [r["t"] for r in rstore.requests(T0 + 2, T0 + HOUR + 6)] == [T0 + 3, T0 + 5, T0 + HOUR + 5]
    assert [r["t"] for r in rstore.requests(T0)] == [
        T0 + 1, T0 + 3, T0 + 5, T0 + HOUR + 5, T0 + 2 * HOUR, T0 + 2 * HOUR + 1,
    ]  # fmt: skip


def test_a_damaged_lateness_member_is_named(rstore: RedisStore, client: redis.Redis) -> None:
    rstore.append_requests([_rec(T0 + 10)])
    rstore.append_requests([_rec(T0)])
    client.zadd("residency:requests:late", {"junk": _ms(T0) // 3_600_000})
    with pytest.raises(StoreError, match=r"residency:requests:late is corrupt: member 'junk'"):
        list(rstore.requests(T0 - 1, T0 + 1))


def test_a_wrong_type_at_the_lateness_key_is_named(rstore: RedisStore, client: redis.Redis) -> None:
    rstore.append_requests([_rec(T0 + 10)])
    client.set("residency:requests:late", "not a sorted set")
    with pytest.raises(StoreError, match=r"residency:requests:late holds a string, not a zset"):
        rstore.append_requests([_rec(T0)])  # a late record: nothing of the batch is written
    assert rstore.count_requests() == 1
    with pytest.raises(StoreError, match=r"residency:requests:late holds a string, not a zset"):
        list(rstore.requests(T0 - 1, T0 + 1))


# ---- a corrupt entry, passed over by a reader that asks (the journal's replay) -------------------


def test_a_corrupt_entry_is_told_and_skipped_given_on_corrupt(
    rstore: RedisStore, client: redis.Redis
) -> None:
    rstore.append_requests([_rec(T0 + 1), _rec(T0 + 3)])
    bad = client.xadd("residency:requests", {"data": "{not json"}, id=f"{_ms(T0 + 4)}-0").decode()
    rstore.append_requests([_rec(T0 + 2)])  # late: read back before the corrupt entry's id
    with pytest.raises(StoreError, match=f"entry {bad} of residency:requests is corrupt"):
        list(rstore.requests(T0))
    said: list[StoreError] = []
    assert [r["t"] for r in rstore.requests(T0, on_corrupt=said.append)] == [T0 + 1, T0 + 2, T0 + 3]
    assert [f"entry {bad} of residency:requests is corrupt" in str(e) for e in said] == [True]


def test_a_corrupt_entry_does_not_hold_the_journal_back(
    redis_clean: str, client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The replay at a restart: records the store holds, one it lacks, and a corrupt entry in their
    window. Before: every flush failed on the corrupt entry, kept for a retry for ever."""
    stored = [_rec(T0 + 1), _rec(T0 + 3)]
    store = open_store(redis_clean)
    store.append_requests(stored)
    store.close()
    bad = client.xadd("residency:requests", {"data": "[]"}, id=f"{_ms(T0 + 3)}-1").decode()
    journal = tmp_path / "requests.journal"
    journal.write_text("".join(json.dumps(r) + "\n" for r in [*stored, _rec(T0 + 2.5, "embed")]))
    lm = LiveManager(
        load_config(CONFIG), None, store=open_store(redis_clean), clock=lambda: T0 + 60, journal=journal
    )
    assert lm.journal is not None
    lm._log_buf = lm.journal.read() + lm._log_buf
    caplog.set_level(logging.WARNING)
    asyncio.run(lm.flush_log())
    try:
        assert lm._log_buf == []
        stored_data = [json.loads(f[b"data"]) for _, f in client.xrange("residency:requests")]
        models = [d.get("model") if isinstance(d, dict) else None for d in stored_data]
        assert models == ["voice", "voice", None, "embed"]  # the new one written, none again
        named = [
            r.getMessage() for r in caplog.records if f"entry {bad} of residency:requests" in r.getMessage()
        ]
        assert len(named) == 1, caplog.text
    finally:
        lm.journal.close()
        lm.store.close()


@pytest.mark.parametrize("seed", range(6))
def test_every_range_reads_exactly_its_records_whatever_their_lateness(
    rstore: RedisStore, client: redis.Redis, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Batches of records over a few hours, some minutes or hours late, some trimmed: every range read
    (in small pages, so the heap lets records go part-way) gives exactly the records of the range, in
    time order (equal times in the order appended)."""
    import random

    import manager.store.redis as redis_mod

    monkeypatch.setattr(redis_mod, "PAGE", 7)
    rng = random.Random(seed)
    kept: list[tuple[float, int]] = []  # (t, order appended)
    newest = T0
    for n in range(40):
        batch = []
        for _ in range(rng.randint(1, 6)):
            newest += rng.choice([0.0, 0.0005, 0.3, 40.0, 1500.0])
            back = rng.choice([0.0, 0.0, 0.0, 0.002, 5.0, 900.0, 2 * HOUR, 5 * HOUR])
            batch.append(round(newest - back, 4))
        rstore.append_requests([_rec(t, f"m{len(kept) + i}") for i, t in enumerate(batch)])
        kept += [(t, len(kept) + i) for i, t in enumerate(batch)]
        if n % 13 == 12:
            before = rng.uniform(T0 - 5 * HOUR, newest)
            assert rstore.trim_requests(before) == sum(1 for t, _ in kept if t < before)
            kept = [k for k in kept if k[0] >= before]
    want = sorted(kept)
    lo, hi = min(t for t, _ in kept) - 1, newest + 1
    for _ in range(60):
        a, b = sorted(rng.uniform(lo, hi) for _ in range(2))
        until = None if rng.random() < 0.2 else b
        got = [(r["t"], int(r["model"][1:])) for r in rstore.requests(a, until)]
        assert got == [k for k in want if a <= k[0] and (until is None or k[0] < until)], (a, until)
