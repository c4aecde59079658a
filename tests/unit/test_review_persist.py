"""Review of the live manager's persistence, hot reload and engine-vs-worker byte accounting: one
class per bug found, each test failing before its fix. The manager runs over a recording fake pool
(no device host, no Ray) and a real SQLite store; results are handed to it as a device host sends them."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from live_helpers import CONFIG

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.policy.types import Tier
from manager.store import open_store
from workers import protocol as P

T0 = 1_764_547_200.0  # a Monday, 00:00


class _Pool:
    """Records the commands sent; holds nothing, answers nothing by itself."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, str]] = []

    def devices(self) -> list[str]:
        return ["cpu0"]

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus:
        return P.WorkerStatus(device, "cpu", "test", 1, 0.0, {}, 0)

    def submit(self, device: str, cmd: Any, op_id: str | None = None) -> str:
        op = op_id or f"op{len(self.sent)}"
        self.sent.append((device, cmd, op))
        return op

    def poll(self) -> list[P.CommandResult]:
        return []

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _manager(store: Any, config: Config | None = None) -> LiveManager:
    lm = LiveManager(config or load_config(CONFIG), _Pool(), store=store, clock=lambda: T0)
    return lm


def _store(tmp_path: Path) -> Any:
    return open_store(f"sqlite:///{tmp_path / 'state.db'}")


def _corrupt(tmp_path: Path, key: str, text: str) -> None:
    db = sqlite3.connect(tmp_path / "state.db")
    with db:
        db.execute("UPDATE docs SET value = ? WHERE key = ?", (text, key))
    db.close()


def _last_op(lm: LiveManager, kind: type, model: str) -> str:
    ops = [op for _, cmd, op in lm.pool.sent if isinstance(cmd, kind) and P.command_model(cmd) == model]
    assert ops, f"no {kind.__name__} of {model} sent"
    return ops[-1]


def _failed(op: str, model: str, what: P.OpName, code: str, tier: P.TierName = "disk") -> P.CommandResult:
    return P.CommandResult(
        op, model, what, False, tier, tier, error_code=code, error=f"model {model!r}: failed", device="cpu0"
    )


class TestAnUnreadableStatisticsDocumentIsReplaced:
    """Before: a stats document the store holds but cannot parse (a torn write, a hand edit) was taken
    for a store outage: every later save first re-read it, failed, and gave up ("the store is still
    down"), so no statistics were ever saved again, across every restart."""

    def test_statistics_are_saved_again(self, tmp_path: Path) -> None:
        store = _store(tmp_path)
        store.put_doc("stats", {})
        _corrupt(tmp_path, "stats", "{not json")
        lm = _manager(store)
        assert lm.restore_stats() == 0  # fresh statistics
        lm.engine.observe(lm.engine.models["voice"], T0)
        lm.save_stats()
        assert store.get_doc("stats")["voice"]["hist"]["count"] == 1  # type: ignore[index]
        store.close()


class TestAnUnreadablePinsDocumentIsReplaced:
    """Before: an unparsable "pins" document was taken for a store outage: an admin's pin was never
    saved ("the store is down"), for good, and the document was read again every minute."""

    def test_an_admin_pin_is_saved(self, tmp_path: Path) -> None:
        store = _store(tmp_path)
        store.put_doc("pins", {})
        _corrupt(tmp_path, "pins", "[1")
        lm = _manager(store)
        lm._restore_pins()
        lm.set_pin("embed", True)
        assert store.get_doc("pins") == {"embed": True}
        store.close()


class TestAnUnreadableStatisticsEntryStartsFresh:
    """Before: a model's saved entry with load costs that are not an object raised AttributeError out
    of `restore_stats` (the service did not start); histogram lists of the wrong length were taken,
    and every later request for the model failed with IndexError in `observe`; an entry unreadable
    half-way was left half restored."""

    def _saved(self, tmp_path: Path, **voice: Any) -> Any:
        store = _store(tmp_path)
        lm = _manager(store)
        for k in range(3):
            lm.engine.observe(lm.engine.models["voice"], T0 + 60.0 * k)
        lm.save_stats()
        doc = store.get_doc("stats")
        assert doc is not None
        for key, value in voice.items():
            if key in ("arrivals_how", "how_bins"):
                doc["voice"]["hist"][key] = value
            else:
                doc["voice"][key] = value
        store.put_doc("stats", doc)
        return store

    def test_costs_of_the_wrong_type_do_not_stop_the_start(self, tmp_path: Path) -> None:
        store = self._saved(tmp_path, cost=[1.0, 2.0])
        lm = _manager(store)
        assert lm.restore_stats() == 2  # world and embed; voice starts fresh
        assert lm.engine.models["voice"].hist.count == 0
        store.close()

    def test_a_histogram_of_the_wrong_shape_does_not_fail_requests(self, tmp_path: Path) -> None:
        for bad in ({"arrivals_how": [0, 0]}, {"how_bins": [[0]] * 168}):
            store = self._saved(tmp_path, **bad)
            lm = _manager(store)
            lm.restore_stats()
            voice = lm.engine.models["voice"]
            for k in range(3):  # Wednesday afternoon: past the two saved hours of week
                lm.engine.observe(voice, T0 + 50 * 3600.0 + 100.0 * k)
            assert voice.hist.count == 3  # fresh statistics, then these three
            store.close()

    def test_an_entry_unreadable_late_is_not_half_restored(self, tmp_path: Path) -> None:
        store = self._saved(tmp_path, last_used="yesterday")
        lm = _manager(store)
        lm.restore_stats()
        assert lm.engine.models["voice"].hist.count == 0 and lm.live["voice"].requests == 0
        store.close()


class TestAChangedMemoryEstimateTakesEffectAtTheRestart:
    """Before: every model's `weights` was saved and restored, also a model never loaded, whose
    weights were only the config's `memory` estimate: a restart with a changed `memory` (which a hot
    reload says takes effect "at the next restart") kept the old estimate for good, e.g. a model
    that could never fit with it stayed refused."""

    def test_the_new_estimate_holds_and_a_measured_footprint_is_kept(self, tmp_path: Path) -> None:
        store = _store(tmp_path)
        lm = _manager(store)
        measured = 2_500_000
        ok = P.CommandResult(
            "x", "voice", "load", True, "disk", "gpu", timing=P.Timing(total_s=0.05),
            footprint=P.Footprint(measured, measured), device="cpu0",
        )  # fmt: skip
        lm._on_result(ok)  # voice measured by its device host
        lm.save_stats()
        changed = tmp_path / "changed.yaml"
        changed.write_text(CONFIG.read_text().replace("memory: 90861056", "memory: 80000000"))
        lm2 = _manager(store, load_config(changed))
        lm2.restore_stats()
        assert lm2.engine.models["embed"].weights == 80_000_000  # the config's new estimate
        assert lm2.engine.models["voice"].weights == measured  # a measurement outlives a restart
        store.close()


class TestRestoredFootprintsRecheckWhatCanFit:
    """Before: footprints restored at start did not work out again which models can never fit: with
    the pinned voice measured at 3.4 GiB of the 3.5 GiB device, a request for world (it needs more
    than 64 MiB) was admitted to wait for room that never comes, instead of rejected with the reason."""

    def test_a_model_that_can_no_longer_fit_is_rejected(self, tmp_path: Path) -> None:
        store = _store(tmp_path)
        lm = _manager(store)
        lm.save_stats()
        doc = store.get_doc("stats")
        assert doc is not None
        doc["voice"] = {**doc["voice"], "weights": 3 * 2**30 + 400 * 2**20}
        doc["voice"].pop("measured", None)  # an older document: its weights count as measured
        store.put_doc("stats", doc)
        lm2 = _manager(store)
        lm2.restore_stats()
        world = lm2.engine.models["world"]
        adm = lm2.engine.admit(world, world.rank, T0)
        assert adm.status == "reject" and "can never give it" in adm.reason
        store.close()


class TestADemoteTheHostCouldNotDoFreesTheBooks:
    """Before: a demote that failed because the device host does not hold the model at all (its load
    failed while the books had already demoted it, or the host restarted empty) left the model on
    the books in host RAM, holding room there that nothing uses, until its next request."""

    def test_the_model_leaves_the_host_tier_on_the_books(self) -> None:
        lm = _manager(None)
        embed = lm.engine.models["embed"]
        assert lm.engine.make_room(embed, embed.rank, T0, may_evict=False)
        lm.engine.load(embed, T0, prewarm=False, reason="test")
        lm.engine.evict(embed, T0 + 1.0, "test")  # demoted to host RAM on the books
        lm._flush()
        assert embed.tier == Tier.HOST and lm.engine.host.used == embed.weights
        demote = _last_op(lm, P.Demote, "embed")
        lm._on_result(_failed(demote, "embed", "demote", P.BAD_TRANSITION))  # it holds no embed
        assert embed.tier == Tier.DISK and lm.engine.host.used == 0


class TestAReloadKeepsAFailedModelFromPrewarming:
    """Before: a hot reload (of any field) set `prewarm_ok` from the file again, so a model whose load
    had failed (a missing checkpoint) was prewarmed again - a doomed load that may evict others -
    although no load of it had worked since."""

    def test_no_prewarm_after_a_reload(self) -> None:
        config = load_config(CONFIG)
        lm = _manager(None, config)
        embed = lm.engine.models["embed"]
        assert lm.engine.load_host(embed, T0, "test")
        lm._flush()
        lm._on_result(_failed(_last_op(lm, P.Load, "embed"), "embed", "load", P.MISSING_CHECKPOINT))
        assert lm.live["embed"].load_error and not embed.prewarm_ok
        lm.reload(config)
        assert not embed.prewarm_ok
        assert not lm.engine.prewarm(embed, T0 + 1.0)
