"""The replay simulator's timing model: waiting for room, class deadlines, the page cache, one load
at a time per device, and requests queueing behind busy models."""

from __future__ import annotations

from typing import Any

import pytest

from manager.config import Config
from manager.policy.types import Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00


def server(models: list[dict[str, Any]], **classes: Any) -> Config:
    bg: dict[str, Any] = {"name": "background", "may_evict": False, **classes}
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}, bg],
            "models": [
                {"adapter": "test", "device": "gpu0", "prewarm": False, "keep_alive": "10m", **m}
                for m in models
            ],
            "policy": {"min_residency": 0},
        }
    )


def m(
    name: str, cls: str, memory: str, disk: float = 4.0, cached: float = 2.0, host: float = 1.0
) -> dict[str, Any]:
    return {
        "name": name,
        "class": cls,
        "memory": memory,
        "load_seconds": {"disk": disk, "cached": cached, "host": host},
    }


def req(t: float, model: str, busy: float = 1.0) -> Request:
    return Request(t=T0 + t, model=model, busy_s=busy)


class TestWaitingForRoom:
    def test_background_waits_for_a_busy_model_then_runs(self) -> None:
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")])
        # chat is busy for 100 s and holds 6 of 9 GiB; batch (4 GiB) may not evict: it waits
        # until chat's keep-alive (10 min after its request ends) expires, then takes the room.
        r = replay(cfg, [req(0, "chat", busy=100.0), req(10, "batch")], "gdsf")
        assert r.served == 2 and r.rejected == 0
        # chat loaded (4 s) and ran until 104; it expired at 104 + 600 = 704, when batch (waiting
        # since t=10) took its room and loaded from disk (4 s).
        assert r.models["batch"].load_wait_s == pytest.approx(704 - 10 + 4.0)

    def test_a_class_deadline_rejects_what_waited_too_long(self) -> None:
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")], max_wait="1m")
        r = replay(cfg, [req(0, "chat", busy=100.0), req(10, "batch")], "gdsf")
        assert r.served == 1 and r.rejected == 1
        assert any("max_wait" in reason for reason in r.reject_reasons)


class TestLoadTiming:
    def test_loads_on_one_device_run_one_at_a_time(self) -> None:
        cfg = server([m("a", "interactive", "2GiB", disk=4.0), m("b", "interactive", "2GiB", disk=3.0)])
        r = replay(cfg, [req(0, "a"), req(0, "b")], "gdsf")
        assert r.models["a"].load_wait_s == pytest.approx(4.0)  # a loads first
        assert r.models["b"].load_wait_s == pytest.approx(7.0)  # b's load queues behind a's

    def test_a_dropped_model_comes_back_from_the_page_cache(self) -> None:
        cfg = server([m("a", "interactive", "6GiB"), m("b", "interactive", "6GiB")])
        # a loads from disk; b needs its room (gdsf drops a to disk); a's file stays in the page cache,
        # so a's second load costs `cached`, not `disk`.
        r = replay(cfg, [req(0, "a"), req(100, "b"), req(200, "a")], "gdsf")
        assert r.loads_by_source == {"disk": 2, "cached": 1, "host": 0}
        assert r.models["a"].load_wait_s == pytest.approx(4.0 + 2.0)

    def test_requests_queue_behind_a_busy_model(self) -> None:
        cfg = server([m("a", "interactive", "2GiB")])
        r = replay(cfg, [req(0, "a", busy=10.0), req(1, "a", busy=1.0)], "gdsf")
        # the second request waits for the load (until 4) and then for the first (4 + 10 = 14).
        assert r.wait_p99_s["interactive"] == pytest.approx(14.0 - 1.0)
        assert r.models["a"].cold_starts == 2  # both arrived before the model was ready


class TestBadRequests:
    def test_unknown_models_and_classes_are_rejected_with_a_reason(self) -> None:
        cfg = server([m("a", "interactive", "2GiB")])
        r = replay(cfg, [req(0, "nope"), Request(t=T0 + 1, model="a", busy_s=1.0, cls="vip")], "residency")
        assert r.rejected == 2 and r.served == 0
        assert set(r.reject_reasons) == {"unknown model 'nope'", "unknown class 'vip'"}


def test_class_reservations_hold_on_gpu_devices_only_as_the_config_says() -> None:
    # `ClassConfig.reserve` is "bytes on each GPU (cuda) device"; the config's cross-checks ignore it
    # on cpu devices, and so does the engine: a 700 MiB interactive model fits a 1 GiB cpu device
    # beside a 512 MiB realtime reservation (it was rejected, "can never give it more than 512MiB").
    def config(kind: str) -> Config:
        return Config.model_validate(
            {
                "devices": [{"name": "dev0", "kind": kind, "memory": "1GiB"}],
                "host": {"memory": "8GiB", "reserve": "1GiB"},
                "classes": [{"name": "realtime", "reserve": "512MiB"}, {"name": "interactive"}],
                "models": [{**m("chat", "interactive", "700MiB"), "adapter": "test", "device": "dev0"}],
            }
        )

    assert config("cpu").class_reserves("dev0") == [0, 0]
    assert replay(config("cpu"), [req(0, "chat")], "residency").served == 1
    with pytest.raises(ValueError, match="can never fit"):  # on a GPU the reservation holds
        config("cuda")


def test_times_so_large_that_a_second_is_lost_in_rounding_replay_without_dividing_by_zero() -> None:
    # The trace reader refuses t > 1e11; replay itself, given such Requests directly, still finishes.
    cfg = server([m("a", "interactive", "2GiB")])
    res = replay(cfg, [Request(t=1e19, model="a", busy_s=1.0)], "residency")
    assert res.served == 1
    assert res.models["a"].resident_fraction == 0.0


class TestFoundInReview:
    """Found in the review of 2026-12-01 (seventh session); each failed before its fix."""

    @staticmethod
    def config(
        models: list[dict[str, Any]], host: str, classes: list[dict[str, Any]] | None = None
    ) -> Config:
        return Config.model_validate(
            {
                "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
                "host": {"memory": host, "reserve": "4GiB"},
                "classes": classes or [{"name": "interactive"}],
                "models": [{"adapter": "test", "device": "gpu0", **x} for x in models],
                "policy": {"min_residency": 0, "thrash_window": "10m", "default_keep_alive": "5m"},
            }
        )

    def test_the_oracle_prewarms_into_room_lent_to_a_session(self) -> None:
        """In a world session the lease grows into all free room at each tick; the oracle's
        just-in-time prewarm could not take lent room back, so the request it knew of waited."""
        world = {**m("world", "interactive", "2GiB"), "elastic": {"min": "512MiB", "max": "6GiB"}}
        cfg = self.config([world, m("chat", "interactive", "6GiB"), m("img", "interactive", "5GiB")], "10GiB")
        trace = [
            req(0, "chat", busy=5),
            Request(t=T0 + 100, model="world", busy_s=1000, kind="session"),
            req(200, "img", busy=5),
            req(500, "chat", busy=5),
        ]
        r = replay(cfg, trace, "oracle")
        assert r.models["chat"].load_wait_s == 0.0 and r.budget_violations == 0

    def test_the_oracle_prewarms_into_the_room_of_an_expired_higher_class(self) -> None:
        """A prewarm could displace only models of its own class or lower, so the oracle could not
        move a night batch's load before its first request while an idle interactive model (not
        needed for a day) held the room: the request it knew of waited for the load."""
        cfg = self.config(
            [m("chat", "interactive", "8GiB"), m("batch", "background", "3GiB")],
            "5GiB",
            [{"name": "interactive"}, {"name": "background", "may_evict": False}],
        )
        r = replay(cfg, [req(0, "chat"), req(1000, "batch"), req(100_000, "chat")], "oracle")
        assert r.models["batch"].load_wait_s == 0.0 and r.budget_violations == 0

    def test_a_promote_never_drops_its_own_host_copy_to_make_host_room(self) -> None:
        """Promoting M evicted X; X's demote asked for a host victim and got M itself (on the host
        tier that moment), which then loaded from disk (5 s instead of 2)."""
        cfg = self.config([m("M", "interactive", "5GiB"), m("X", "interactive", "5GiB")], "10GiB")
        trace = [req(0, "M"), req(10, "X", busy=100.0), req(109, "M"), req(10000, "X")]
        for policy in ("oracle", "residency"):
            r = replay(cfg, trace, policy, record=True)
            drops = [a for _, a in r.actions or [] if a.kind.value == "drop" and a.model == "M"]
            assert not any("host room for 'X'" in a.reason for a in drops), policy

    def test_a_waiting_request_is_retried_when_another_request_makes_room(self) -> None:
        """A waiting request was retried only at the event scheduled when it queued (for gdsf, Z's
        expiry, ten minutes on), not when another request's eviction left room at t=30."""
        cfg = self.config(
            [
                {**m("Z", "interactive", "8GiB"), "keep_alive": "10m", "prewarm": False},
                {**m("Y", "interactive", "3GiB"), "keep_alive": "10m", "prewarm": False},
                {**m("batch", "background", "2GiB"), "keep_alive": "10m", "prewarm": False},
            ],
            "10GiB",
            [{"name": "interactive"}, {"name": "background", "may_evict": False}],
        )
        r = replay(cfg, [req(0, "Z"), req(20, "batch"), req(30, "Y")], "gdsf")
        assert r.models["batch"].load_wait_s == pytest.approx(18.0)


class TestLeaseHeadroom:
    """In a world session the KV lease grows into free room; shrinking it again spills KV pages to
    host RAM first, which delays the load that needed the room. `residency` and the oracle keep
    the room a model taking turns needs to come back (without that, the lease took 3.5 GiB and chat
    waited 1.25 s: 0.25 s of spill before its 1 s promote)."""

    @staticmethod
    def run(policy: str) -> tuple[float, list[tuple[float, str, int, str]]]:
        world = {**m("world", "interactive", "2GiB"), "elastic": {"min": "512MiB", "max": "6GiB"}}
        img = m("img", "interactive", "3584MiB", host=0.8)
        cfg = TestFoundInReview.config([world, m("chat", "interactive", "4GiB"), img], "16GiB")
        # 9 GiB usable: the world model (2 GiB + 0.5 GiB lease) leaves room for chat or img, not both.
        trace = [
            *(req(t, "chat", busy=3) for t in (0, 60, 120, 180)),
            Request(t=T0 + 200, model="world", busy_s=2000, kind="session"),
            req(300, "img", busy=5),  # chat goes to host RAM, and is likely back soon
            req(330, "img", busy=5),
            req(400, "chat", busy=3),
        ]
        r = replay(cfg, trace, policy, record=True)
        assert r.budget_violations == 0
        leases = [(t - T0, a.kind.value, a.bytes, a.reason) for t, a in r.actions or [] if a.model == "world"]
        return r.models["chat"].load_wait_s, leases

    def test_residency_leaves_room_for_the_model_taking_turns(self) -> None:
        wait, leases = self.run("residency")
        grown = max(b for _, kind, b, _ in leases if kind == "grow_lease")
        assert grown == 3 << 30  # 9 - 2 - 3.5 = 3.5 GiB free, less 0.5 GiB chat needs beyond img's room
        assert not [x for x in leases if x[3] == "room for 'chat'"]
        assert wait == pytest.approx(1.0)  # its promote from host RAM, no spill before it

    def test_the_oracle_leaves_room_for_the_next_model(self) -> None:
        wait, leases = self.run("oracle")
        assert not [x for x in leases if x[3] == "room for 'chat'"]
        assert wait == 0.0
