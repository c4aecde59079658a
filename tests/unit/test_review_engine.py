"""Found in the review of the decision engine and the replay simulator; each failed before its fix.

The server is small and hand-built: one cuda device with 9 GiB usable (10 GiB, 1 GiB reserve), an
interactive class and a background one that may not evict, 20 GiB of host RAM (24 GiB, 4 GiB
reserve) unless a test says otherwise. Models load in 4 s from disk, 2 s from the page cache, 1 s
from host RAM, and keep a 10-minute keep-alive unless a test says otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest

from manager.config import Config
from manager.policy.base import Policy
from manager.policy.baselines import GDSF
from manager.policy.engine import Engine
from manager.policy.factory import POLICY_NAMES, create_policy
from manager.policy.residency import ResidencyPolicy
from manager.policy.types import DISK, GPU, HOST, ActionKind, Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00
GiB = 1 << 30
ONLINE = [p for p in POLICY_NAMES if p != "oracle"]
TWO_CLASSES = [{"name": "interactive"}, {"name": "background", "may_evict": False}]


def server(
    models: list[dict[str, Any]],
    classes: list[dict[str, Any]] | None = None,
    host: str = "24GiB",
    host_reserve: str = "4GiB",
) -> Config:
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": host, "reserve": host_reserve},
            "classes": classes or TWO_CLASSES,
            "models": [
                {"adapter": "test", "device": "gpu0", "prewarm": False, "keep_alive": "10m", **x}
                for x in models
            ],
            "policy": {"min_residency": 0},
        }
    )


def m(name: str, cls: str, memory: str, disk: float = 4.0, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "class": cls,
        "memory": memory,
        "load_seconds": {"disk": disk, "cached": disk / 2, "host": 1.0},
        **extra,
    }


def req(t: float, model: str, busy: float = 1.0, cls: str | None = None) -> Request:
    return Request(t=T0 + t, model=model, busy_s=busy, cls=cls)


def acts(actions: list[tuple[float, Any]] | None, model: str) -> list[tuple[float, str, bool]]:
    """(seconds after T0, action kind, prewarm) of each action on `model`."""
    return [(round(t - T0, 3), a.kind.value, a.prewarm) for t, a in actions or [] if a.model == model]


class TestMaxWait:
    """A class's `max_wait` is its deadline for room: at arrival + max_wait a request still waiting
    is rejected (the live manager's words), never served later."""

    @staticmethod
    def run(chat_keep_alive: str) -> Any:
        # chat (6 of 9 GiB) is busy until 104, then kept for its keep-alive; batch (4 GiB, may not
        # evict) arrives at 90 with a one-minute max_wait: its deadline is 150.
        classes = [{"name": "interactive"}, {"name": "background", "may_evict": False, "max_wait": "1m"}]
        cfg = server(
            [m("chat", "interactive", "6GiB", keep_alive=chat_keep_alive), m("batch", "background", "4GiB")],
            classes,
        )
        return replay(cfg, [req(0, "chat", busy=100.0), req(90, "batch")], "gdsf")

    def test_a_request_without_room_by_its_deadline_is_rejected_then(self) -> None:
        """chat expires at 104 + 70 = 174, past batch's deadline. batch used to be retried only at
        chat's expiry, and served there (wait 88 s > 60 s); it is rejected at 150 instead."""
        r = self.run("70s")
        assert (r.served, r.rejected) == (1, 1)
        assert r.reject_reasons == {"model 'batch': no room within its class's max_wait (60.0 s)": 1}
        assert r.wait_p99_s["background"] == 0.0  # no background request was served late

    def test_room_that_comes_before_the_deadline_serves_the_request(self) -> None:
        """chat expires at 104 + 40 = 144, before the deadline: batch takes its room and loads."""
        r = self.run("40s")
        assert (r.served, r.rejected) == (2, 0)
        assert r.models["batch"].load_wait_s == pytest.approx(144 - 90 + 4.0)


class TestMaxQueue:
    def test_a_full_class_queue_rejects_the_extra_request(self) -> None:
        """chat holds the room; three batch requests (class queue limit 1) come for it meanwhile:
        the first waits, the two others are refused at once, as the live manager refuses them."""
        classes = [{"name": "interactive"}, {"name": "background", "may_evict": False, "max_queue": 1}]
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")], classes)
        trace = [req(0, "chat", busy=100.0), req(10, "batch"), req(11, "batch"), req(12, "batch")]
        for policy in ("gdsf", "residency"):
            r = replay(cfg, trace, policy)
            assert (r.served, r.rejected) == (2, 2), policy
            assert r.reject_reasons == {"class 'background': queue full (1 requests waiting)": 2}, policy

    def test_requests_served_at_once_do_not_count_against_the_queue(self) -> None:
        """Three batch requests for a model with room, each after its load (4 s) is over: none waits
        for its model, none is refused. (Requests that come during the load wait for it and count,
        as the live manager counts them: tests/unit/test_review15_sim_queue.py.)"""
        classes = [{"name": "interactive"}, {"name": "background", "may_evict": False, "max_queue": 1}]
        cfg = server([m("batch", "background", "4GiB")], classes)
        r = replay(cfg, [req(10, "batch"), req(15, "batch"), req(20, "batch")], "gdsf")
        assert (r.served, r.rejected) == (3, 0)


class TestRetries:
    def test_room_made_by_a_later_waiting_request_serves_an_earlier_one(self) -> None:
        """z (6 GiB, kept forever) is busy until 104; b (background, 4 GiB) and c (interactive,
        5 GiB) wait for it. At 104 b is tried first (z is within its keep-alive: no room for a class
        that may not evict), then c evicts z and loads, leaving 4 GiB free. b was not tried again:
        gdsf rejected it at the end of the trace, the others loaded it hundreds of seconds late."""
        cfg = server(
            [
                m("z", "interactive", "6GiB", keep_alive="forever"),
                m("c", "interactive", "5GiB"),
                m("b", "background", "4GiB"),
            ]
        )
        trace = [req(0, "z", busy=100.0), req(10, "b"), req(20, "c")]
        for policy in ONLINE:
            r = replay(cfg, trace, policy)
            assert (r.served, r.rejected) == (3, 0), policy
            # b loads at 104 behind c's 4 s load: ready at 112.
            assert r.models["b"].load_wait_s == pytest.approx(112 - 10), policy

    def test_a_later_higher_class_request_is_not_stuck_behind_a_waiting_one(self) -> None:
        """img (6 of 9 GiB) is idle within its keep-alive. A background request for chat (6 GiB) may
        not evict it and waits; an interactive request for chat a second later may - but it was
        queued behind the first one and waited for img's keep-alive too (509 s instead of 4)."""
        cfg = server([m("chat", "interactive", "6GiB"), m("img", "interactive", "6GiB")])
        trace = [req(0, "img"), req(100, "chat", cls="background"), req(101, "chat")]
        for policy in ONLINE:
            r = replay(cfg, trace, policy, record=True)
            assert r.wait_p99_s["interactive"] == pytest.approx(4.0), policy  # chat's load
            # the background request is served on that load, after the interactive one (busy 1 s)
            assert r.wait_p99_s["background"] == pytest.approx(6.0), policy
            assert acts(r.actions, "img")[1][:2] == (101.0, "demote" if policy == "residency" else "drop")

    def test_requests_of_one_class_for_one_model_are_served_in_arrival_order(self) -> None:
        """Two background requests for batch wait for room: the earlier is served first."""
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")])
        r = replay(
            cfg,
            [req(0, "chat", busy=100.0), req(10, "batch", busy=5.0), req(11, "batch")],
            "gdsf",
            record=True,
        )
        assert [(a - T0, name) for a, name, _, _ in r.served_log or []] == [
            (0.0, "chat"),
            (10.0, "batch"),
            (11.0, "batch"),
        ]
        # both waited for chat's expiry (704) and the load (4 s); the second also for the first's 5 s
        assert r.wait_p99_s["background"] == pytest.approx(708 + 5 - 11)


class TestEagerExpiry:
    def test_a_prewarmed_model_with_an_explicit_keep_alive_leaves_when_it_expires(self) -> None:
        """residency honours an explicit keep-alive eagerly, but only a request's end asked for a
        tick at the expiry: chat, prewarmed at boot (ready at -596) and never asked for, stayed on
        the GPU until 10805, an unrelated tick, instead of leaving at -596 + 600 = 4."""
        cfg = server(
            [
                m("chat", "interactive", "2GiB", prewarm=True),
                m("other", "interactive", "1GiB", keep_alive="3h"),
            ]
        )
        r = replay(cfg, [req(0, "other"), req(7200, "other")], "residency", record=True)
        assert acts(r.actions, "chat") == [(-600.0, "load", True), (4.0, "demote", False)]

    def test_a_restart_that_adopts_or_restores_a_model_asks_for_its_expiry(self) -> None:
        """A restarted manager adopts what its device host still holds, or loads its recorded
        intent back: both must leave when their explicit keep-alive runs out."""
        cfg = server([m("a", "interactive", "2GiB"), m("b", "interactive", "2GiB")])
        eng = Engine(cfg, ResidencyPolicy())
        eng.start(0.0)
        assert eng.adopt(eng.models["a"], GPU, 0.0)
        eng.load(eng.models["b"], 0.0, prewarm=False, reason="restart: recorded intent gpu")  # ready at 4
        assert sorted(eng.wakeups) == [600.0, 604.0]
        eng.tick(600.0)
        assert (eng.models["a"].tier, eng.models["b"].tier) == (HOST, GPU)
        eng.tick(604.0)
        assert eng.models["b"].tier == HOST


class TestTheUsersKeepAlive:
    def test_a_model_whose_keep_alive_expired_is_not_prewarmed_back_in_the_same_tick(self) -> None:
        """big (keep_alive 0: unload as soon as idle) displaced img at 10; when its request ended at
        11 it was demoted (its keep-alive) and promoted straight back by the review of what the
        displacing model's end frees (a thrash and a wasted load, every time)."""
        cfg = server(
            [
                m("img", "interactive", "4GiB", keep_alive=None),
                m("big", "interactive", "6GiB", prewarm=True, keep_alive=0),
            ]
        )
        r = replay(
            cfg,
            [req(0, "img", busy=5.0), req(10, "big", busy=0.0), req(7200, "img")],
            "residency",
            record=True,
        )
        loads = [(t, kind, pw) for t, kind, pw in acts(r.actions, "big") if kind in ("load", "promote")]
        # its request only: a `keep_alive: 0` model is not prewarmed to the GPU at boot (it would be
        # unloaded the moment its load was over); it waits in host RAM from boot
        assert loads == [(10.0, "promote", False)]
        assert r.thrash == 0

    def test_the_engine_holds_it_off_until_it_is_asked_for_again(self) -> None:
        """Any policy's prewarm is refused while the user's keep-alive holds a model off the GPU; a
        request for it lifts that."""
        cfg = server([m("a", "interactive", "2GiB", prewarm=True, keep_alive="1m")])
        eng = Engine(cfg, ResidencyPolicy())
        a = eng.models["a"]
        eng.start(0.0)  # boot prewarm: ready at 4
        eng.tick(64.0)
        assert a.tier == HOST and a.held_off
        assert not eng.prewarm(a, 100.0)
        eng.observe(a, 200.0)
        assert not a.held_off and eng.prewarm(a, 200.0)


class TestMeasuredFootprintInHostRam:
    """4 GiB of host RAM (6 GiB, 2 GiB reserve) holds a and b (1.5 GiB each); a's worker measures
    3 GiB. Host RAM went 0.5 GiB over its budget, silently."""

    @staticmethod
    def engine(policy: Policy, b_class: str = "interactive") -> Engine:
        models = [m("a", "interactive", "1536MiB"), m("b", b_class, "1536MiB")]
        eng = Engine(server(models, host="6GiB", host_reserve="2GiB"), policy)
        eng.actions = []
        eng.start(0.0)
        for name in ("a", "b"):
            assert eng.adopt(eng.models[name], HOST, 0.0)
        return eng

    def test_the_host_resident_the_policy_values_least_is_dropped(self) -> None:
        eng = self.engine(ResidencyPolicy(), b_class="background")  # b: a lower class, worth less
        eng.measured_footprint(eng.models["a"], 3 * GiB, 1.0)
        assert (eng.models["a"].tier, eng.models["b"].tier) == (HOST, DISK)
        assert eng.host.used == 3 * GiB <= eng.host.usable
        assert eng.counters.budget_violations == 0

    def test_without_a_host_tier_policy_the_longest_parked_other_goes(self) -> None:
        eng = self.engine(GDSF())
        eng.measured_footprint(eng.models["a"], 3 * GiB, 1.0)
        assert (eng.models["a"].tier, eng.models["b"].tier) == (HOST, DISK)
        assert eng.host.used <= eng.host.usable and eng.counters.budget_violations == 0

    def test_a_model_larger_than_host_ram_leaves_it_itself(self) -> None:
        eng = self.engine(ResidencyPolicy())
        eng.measured_footprint(eng.models["a"], 5 * GiB, 1.0)
        assert (eng.models["a"].tier, eng.models["b"].tier) == (DISK, HOST)
        assert eng.host.used == 1536 << 20
        assert [(a.kind, a.model) for _, a in eng.actions or []] == [(ActionKind.DROP, "a")]
        assert eng.counters.budget_violations == 0


class TestOracle:
    def test_the_oracle_warms_host_ram_at_start(self) -> None:
        """a and b (6 GiB each, 10 s from disk, 1 s from host RAM) cannot share the GPU. residency
        warms b into host RAM at boot and waited 51 s; the oracle, which "may use every action",
        never read a model into host RAM and waited 60."""
        models = [m(x, "interactive", "6GiB", disk=10.0, prewarm=True, keep_alive=None) for x in ("a", "b")]
        trace = [req(0, "a", busy=100.0), req(50, "b")]
        o = replay(server(models), trace, "oracle", record=True)
        assert ("b", -600.0) in [
            (a.model, t - T0) for t, a in o.actions or [] if a.kind == ActionKind.LOAD_HOST
        ]
        assert o.load_wait_s == pytest.approx(51.0)  # b waits for a (busy to 100), then 1 s from RAM
        for policy in ONLINE:
            assert replay(server(models), trace, policy).load_wait_s >= o.load_wait_s, policy

    def test_a_just_in_time_load_is_not_lost_to_rounding(self) -> None:
        """The wake-up for a just-in-time load is at `next_use - lead - 1 s`; at Unix seconds near
        1.8e9 the time left then can come back a hair above `lead + 1 s`, and the load that had to
        displace b was never made: a's request then waited for the whole load (about half of these
        cases)."""
        for i in range(20):
            a = m("a", "interactive", "6GiB", disk=3.0 + i * 0.173, prewarm=True)
            cfg = server([a, m("b", "interactive", "6GiB")], host="6GiB")  # 2 GiB: no host tier here
            trace = [req(0, "b"), req(5000.0 + i * 7.31, "a")]
            assert replay(cfg, trace, "oracle").models["a"].load_wait_s == 0.0, i

    def test_a_model_asked_for_at_the_same_instant_is_served_before_its_room_is_taken(self) -> None:
        """At 100, img is asked for, and in the same instant chat (on the GPU, busy 1 s). img took
        chat's room, so chat's request waited for img's load, img's run and its own reload (6 s);
        serving chat first costs img one second."""
        models = [
            m("chat", "interactive", "6GiB", prewarm=True),
            m("img", "interactive", "6GiB", prewarm=True),
        ]
        trace = [req(0, "chat"), req(100, "img"), req(100, "chat")]
        o = replay(server(models), trace, "oracle")
        assert o.models["chat"].load_wait_s == 0.0
        assert o.models["img"].load_wait_s == pytest.approx(1.0 + 1.0)  # chat's second, then from host RAM

    def test_a_long_request_at_the_same_instant_gives_way_to_the_one_before_it(self) -> None:
        """At 100, a batch (background: only room past its keep-alive) comes first, and chat for a
        300 s run in the same instant. The oracle kept chat's room for it, and the batch waited
        the whole 300 s; it takes the room now, and chat waits for the batch's load and run."""
        models = [
            m("chat", "interactive", "6GiB", prewarm=True),
            m("batch", "background", "6GiB", prewarm=True),
        ]
        trace = [req(0, "chat"), req(100, "batch", busy=1.0), req(100, "chat", busy=300.0)]
        o = replay(server(models), trace, "oracle")
        assert o.load_wait_s < 20.0
        for policy in ONLINE:
            assert replay(server(models), trace, policy).load_wait_s >= o.load_wait_s, policy


def test_the_replay_span_ends_with_the_trace_for_every_policy() -> None:
    """resident_fraction's span ended at the last wake-up drained, which differs by policy
    (lru-keepalive's expiry 5 min after the request, none for gdsf): the same residency read as
    different fractions. Now every policy's span ends with the trace's last request (10 s after
    the first, which loads the model at 0; the service started 600 s earlier)."""
    cfg = server([m("a", "interactive", "2GiB")])
    fractions = {
        p: replay(cfg, [req(0, "a", busy=10.0)], p).models["a"].resident_fraction for p in POLICY_NAMES
    }
    assert fractions == pytest.approx(dict.fromkeys(POLICY_NAMES, 10.0 / 610.0))


def test_only_a_policy_that_honours_the_configs_keep_alive_holds_a_model_off() -> None:
    """The oracle's "expiry" is its next use (its prewarms are demand loads); lru-keepalive and
    histogram keep models by their own rules, not the config's keep-alive."""
    cfg = server([m("a", "interactive", "2GiB")])
    expected = {"residency": True, "gdsf": True, "lru-keepalive": False, "histogram": False, "oracle": False}
    for policy, honours in expected.items():
        pol = create_policy(policy, [])
        assert pol.honours_keep_alive(Engine(cfg, pol).models["a"]) is honours, policy


class _DisplacingGuesses(Policy):
    """A unit-test policy (beside the real ones): its prewarms may displace any idle model, so the
    engine alone decides whether lent lease room or weights go first."""

    name = "displacing-guesses"

    def may_displace(self, c: Any, m: Any, now: float) -> bool:
        return True


class TestLeasesShrinkBeforeWeightsForPrewarmsToo:
    @staticmethod
    def session_beside_img(chat_memory: str) -> tuple[Engine, Any, Any, Any]:
        """A world session (2 GiB of weights, KV lease 1-6 GiB, busy for hours) beside an idle img
        (2 GiB); at 20 the lease has grown into the free room: 9 - 2 - 2 - 1 = 4 GiB more."""
        cfg = server(
            [
                m("world", "interactive", "2GiB", elastic={"min": "1GiB", "max": "6GiB"}, keep_alive=None),
                m("img", "interactive", "2GiB", keep_alive=None),
                m("chat", "interactive", chat_memory, prewarm=True, keep_alive=None),
            ]
        )
        eng = Engine(cfg, _DisplacingGuesses())
        world, img, chat = (eng.models[n] for n in ("world", "img", "chat"))
        eng.start(0.0)
        assert eng.admit(img, 0, 0.0).status == "load"
        eng.finish(img, 4.0, 1.0)
        assert eng.admit(world, 0, 10.0).status == "load"
        eng.finish(world, 14.0, 10_000.0)
        eng.tick(20.0)
        assert world.lease == 5 * GiB
        return eng, world, img, chat

    def test_a_prewarm_takes_back_lent_lease_room_before_it_evicts_an_idle_model(self) -> None:
        """A prewarm of chat (3 GiB) needed room: it evicted img (a request would have shrunk the
        lease, and the issue's rule is that leases shrink before any weights are evicted). Now the
        lease gives the room back and img stays."""
        eng, world, img, chat = self.session_beside_img("3GiB")
        assert eng.prewarm(chat, 30.0)
        assert chat.tier == GPU and img.tier == GPU, "the lease gives room before img's weights go"
        assert world.lease == 2 * GiB  # 9 - 2 - 2 - 3 = 2 GiB left to it
        assert eng.counters.evictions == 0

    def test_only_what_the_leases_cannot_give_is_evicted(self) -> None:
        """The same, with chat at 5 GiB: leases at their minimum still leave only 4 GiB, so img goes
        too, and the lease shrinks only by what is still missing."""
        eng, world, img, chat = self.session_beside_img("5GiB")
        assert eng.prewarm(chat, 30.0)
        assert img.tier != GPU and chat.tier == GPU
        assert world.lease == 2 * GiB  # 9 - 2 (world) - 5 (chat) = 2: it kept 1 GiB above its minimum
