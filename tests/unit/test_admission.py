"""Admission rules of the decision engine, for every policy.

The engine's docstring promises, whatever the policy: a request never evicts a pinned model, a
busy one, or one of a higher class; a class with `may_evict: false` only takes free room and room
held by expired models; class reservations are never given away; elastic leases shrink before any
weights are evicted; a model that can never fit is rejected. Each scenario below drives an
`Engine` directly (the `drive` fixture, see tests/conftest.py) on a hand-built server:

    gpu0: 10 GiB, 1 GiB emergency reserve -> 9 GiB usable
    classes: realtime (reserve 2 GiB) > interactive > background (may_evict: false)

so an interactive or background model sees at most 7 GiB while realtime has not used its reserve.
Time is a plain float; the service starts at t = -600 (like the simulator's warm-up).

Models are `prewarm: false` (no policy preloads on a guess), but the oracle is told each
scenario's requests (`plan`) and loads what it knows is coming at start, so set-up steps accept
"hit" as well as "load"; the assertions are about the rule under test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from manager.config import Config, load_config
from manager.policy.factory import POLICY_NAMES
from manager.policy.types import ActionKind, Request, Tier
from manager.replay.sim import replay
from manager.replay.synth import synth

GiB = 1 << 30
ADMITTED = ("hit", "load")
HOME = "configs/home.yaml"


def model(
    name: str, cls: str, memory: str, *, disk: float = 4.0, host: float = 1.0, **extra: Any
) -> dict[str, Any]:
    """A model entry; `prewarm: false` unless given, so no policy preloads it on its own guess."""
    extra.setdefault("prewarm", False)
    return {
        "name": name,
        "class": cls,
        "adapter": "test",
        "device": "gpu0",
        "memory": memory,
        "load_seconds": {"disk": disk, "host": host},
        **extra,
    }


def server(*models: dict[str, Any], **policy: Any) -> Config:
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "16GiB", "reserve": "4GiB"},
            "classes": [
                {"name": "realtime", "reserve": "2GiB"},
                {"name": "interactive"},
                {"name": "background", "may_evict": False},
            ],
            "models": list(models),
            "policy": {"thrash_window": "10m", "min_residency": "1m", "default_keep_alive": "5m", **policy},
        }
    )


def plan(*reqs: tuple[str, float]) -> list[Request]:
    return [Request(t=t, model=name, busy_s=1.0) for name, t in reqs]


policies = pytest.mark.parametrize("policy", POLICY_NAMES)


@policies
class TestHigherClass:
    """(a) A request never evicts a model of a higher class."""

    def test_interactive_request_waits_rather_than_evict_realtime(self, policy, drive):
        # voice (1 GiB) and tts (2 GiB) are realtime: together 1 GiB over the realtime reserve,
        # so an interactive model sees 9 - 3 = 6 GiB; `big` needs 7 GiB. Evicting either realtime
        # model would make room; the only lower-class model (`embed`, 1 GiB) would not be enough.
        cfg = server(
            model("voice", "realtime", "1GiB"),
            model("tts", "realtime", "2GiB"),
            model("big", "interactive", "7GiB"),
            model("embed", "background", "1GiB"),
        )
        # voice and tts are used again right after: within their keep-alive for every policy (for
        # the oracle, "expired" means not needed soon, so it is told they are).
        sc = drive(
            cfg,
            policy,
            plan(
                ("voice", 0.0), ("tts", 1.0), ("embed", 2.0), ("big", 100.0), ("voice", 101.0), ("tts", 101.5)
            ),
        )
        sc.start()
        assert sc.request("voice", 0.0).status in ADMITTED  # voice on the GPU
        assert sc.request("tts", 1.0).status in ADMITTED  # tts on the GPU: realtime holds 3 GiB
        assert sc.request("embed", 2.0).status in ADMITTED  # embed in free room: 4 GiB used
        sc.clear()
        adm = sc.request("big", 100.0)  # all idle; room for big needs a realtime eviction
        assert adm.status == "wait"  # ... which is never allowed: the request waits
        assert {"voice", "tts"} <= sc.on_gpu()  # both realtime models stay
        assert sc.evicted() == []  # and nothing was evicted in vain (embed alone is not enough)

    def test_lower_class_is_evicted_instead(self, policy, drive):
        # Same server, but `big` is 6 GiB: evicting the background model is enough.
        cfg = server(
            model("voice", "realtime", "1GiB"),
            model("tts", "realtime", "2GiB"),
            model("big", "interactive", "6GiB"),
            model("embed", "background", "1GiB"),
        )
        # voice and tts are used again right after: within their keep-alive for every policy (for
        # the oracle, "expired" means not needed soon, so it is told they are).
        sc = drive(
            cfg,
            policy,
            plan(
                ("voice", 0.0), ("tts", 1.0), ("embed", 2.0), ("big", 100.0), ("voice", 101.0), ("tts", 101.5)
            ),
        )
        sc.start()
        assert sc.request("voice", 0.0).status in ADMITTED  # voice on the GPU
        assert sc.request("tts", 1.0).status in ADMITTED  # tts on the GPU
        assert sc.request("embed", 2.0).status in ADMITTED  # embed on the GPU
        adm = sc.request("big", 100.0)  # big needs 6 GiB: 9 - 3 (realtime) - 1 (embed) = 5 free
        assert adm.status in ADMITTED  # admitted ...
        assert "embed" in sc.evicted()  # ... by evicting the background model
        assert not {"voice", "tts"} & set(sc.evicted())  # never a realtime one
        assert {"voice", "tts", "big"} <= sc.on_gpu()


@policies
class TestPinned:
    """(b) A request never evicts a pinned model."""

    def cfg(self) -> Config:
        # `embed` is pinned and of the lowest class: without its pin it would be every policy's
        # first victim (lowest class, never requested, least recently used).
        return server(
            model("embed", "background", "3GiB", pin=True),
            model("chat", "interactive", "2GiB"),
            model("img", "interactive", "4GiB"),
        )

    def test_pinned_model_is_passed_over(self, policy, drive):
        sc = drive(self.cfg(), policy, plan(("chat", 0.0), ("img", 100.0)))
        sc.start()  # embed (pinned) loads at start
        assert sc.tier("embed") == Tier.GPU
        assert sc.request("chat", 0.0).status in ADMITTED  # chat: 3 + 2 = 5 GiB used, 2 GiB left
        assert sc.request("img", 100.0).status in ADMITTED  # img (4 GiB) needs room ...
        assert sc.evicted() == ["chat"]  # ... which comes from chat, never from embed
        assert sc.on_gpu() == {"embed", "img"}

    def test_request_waits_when_only_the_pinned_model_could_make_room(self, policy, drive):
        sc = drive(self.cfg(), policy, plan(("chat", 0.0), ("img", 100.0)))
        sc.start()  # embed (pinned) loads at start
        assert sc.request("chat", 0.0, busy=1000.0).status in ADMITTED  # chat busy until ~1000
        sc.clear()
        adm = sc.request("img", 100.0)  # evicting embed would make room; chat is busy
        assert adm.status == "wait"  # so img waits
        assert sc.evicted() == []  # and embed stays
        assert sc.on_gpu() == {"embed", "chat"}


@policies
class TestBusy:
    """(c) A request never evicts a busy model: it waits until the model is idle."""

    def test_busy_model_is_kept_until_its_request_ends(self, policy, drive):
        cfg = server(model("chat", "interactive", "5GiB"), model("img", "interactive", "5GiB"))
        sc = drive(cfg, policy, plan(("chat", 0.0), ("img", 100.0)))
        sc.start()
        adm = sc.request("chat", 0.0, busy=1000.0)  # chat (5 of the 7 GiB) is busy for 1000 s
        assert adm.status in ADMITTED
        busy_until = sc.m("chat").busy_until
        assert busy_until >= 1000.0
        sc.clear()
        assert sc.request("img", 100.0).status == "wait"  # img needs chat's room: wait
        assert sc.tier("chat") == Tier.GPU  # chat keeps running
        assert sc.retry("img", busy_until - 1.0).status == "wait"  # still busy a second before the end
        assert sc.evicted() == []
        assert sc.retry("img", busy_until).status == "load"  # idle now: chat makes way
        assert sc.evicted() == ["chat"]


@policies
class TestMayNotEvict:
    """(d) A class with `may_evict: false` never evicts a model whose keep-alive has not expired."""

    def test_background_waits_for_an_unexpired_model(self, policy, drive):
        # Two 4 GiB background models; background sees 7 GiB, so they cannot both be resident.
        # photos is used again 3 s after embed arrives: unexpired for every policy (the oracle
        # calls a model expired only when its next request is further away than its reload,
        # 3 s + 2 s slack here).
        cfg = server(
            model("photos", "background", "4GiB", disk=6.0, host=3.0, keep_alive="10m"),
            model("embed", "background", "4GiB", keep_alive="10m"),
        )
        sc = drive(cfg, policy, plan(("photos", 0.0), ("embed", 30.0), ("photos", 33.0), ("embed", 5000.0)))
        sc.start()
        assert sc.request("photos", 0.0).status in ADMITTED  # photos on the GPU, idle from ~t=7
        sc.clear()
        assert sc.request("embed", 30.0).status == "wait"  # no free room, photos unexpired: wait
        assert sc.tier("photos") == Tier.GPU  # photos stays
        assert sc.request("photos", 33.0).status == "hit"  # and serves its next request warm
        assert sc.evicted() == []

    def test_background_takes_the_room_of_an_expired_model(self, policy, drive):
        cfg = server(
            model("photos", "background", "4GiB", disk=6.0, host=3.0, keep_alive="10m"),
            model("embed", "background", "4GiB", keep_alive="10m"),
        )
        sc = drive(cfg, policy, plan(("photos", 0.0), ("embed", 5000.0)))
        sc.start()
        assert sc.request("photos", 0.0).status in ADMITTED  # photos on the GPU
        adm = sc.request("embed", 5000.0)  # over an hour later: photos' keep-alive (10 min) is over
        assert adm.status == "load"  # embed may take photos' room
        assert sc.evicted() == ["photos"]

    def test_a_request_classed_background_may_not_evict_either(self, policy, drive):
        # A request may carry its own class (Request.cls): img is interactive, but this batch
        # request for it is classed background, so it may neither evict nor touch chat
        # (interactive is a higher class than the request) while chat is within its keep-alive
        # (5 min by default; the oracle is told chat is needed again at 102.5).
        cfg = server(model("chat", "interactive", "5GiB"), model("img", "interactive", "5GiB"))
        sc = drive(cfg, policy, plan(("chat", 0.0), ("img", 100.0), ("chat", 102.5)))
        sc.start()
        assert sc.request("chat", 0.0).status in ADMITTED  # chat: 5 of the 7 GiB
        sc.clear()
        assert sc.request("img", 100.0, cls="background").status == "wait"  # it waits
        assert sc.evicted() == []  # chat stays
        assert sc.retry("img", 101.0).status == "load"  # as an interactive request it may evict
        assert sc.evicted() == ["chat"]

    def test_past_its_keep_alive_a_higher_class_model_gives_up_its_room(self, policy, drive):
        # Hours later chat is past its keep-alive (and, for the oracle, never needed again): it has
        # no claim on its room, so even a background request gets it - as an expiry, not an
        # eviction made "for" the request.
        cfg = server(model("chat", "interactive", "5GiB"), model("img", "interactive", "5GiB"))
        sc = drive(cfg, policy, plan(("chat", 0.0), ("img", 5000.0)))
        sc.start()
        assert sc.request("chat", 0.0).status in ADMITTED
        sc.clear()
        assert sc.request("img", 5000.0, cls="background").status in ADMITTED
        assert sc.evicted() == ["chat"]
        assert all(a.reason == "keep-alive expired" for _, a in sc.actions if a.model == "chat")


def test_a_victims_reason_is_decided_before_any_victim_goes():
    # The oracle calls a model expired when its next request is further off than its reload. Here
    # photos (9.5 GiB) is next asked for at 13; at 9 it reloads from host RAM in 1 s (+ 2 s slack):
    # expired, so the waiting background batch may take its room. But the batch's room also takes
    # voice, whose demotion fills host RAM so that photos could only be dropped (reload from disk,
    # 2 s): judged after that, photos would look unexpired and its eviction would be logged as
    # "room for 'batch'" - an eviction a background request may not cause.
    def entry(name: str, cls: str, memory: str, disk: float, host: float, **extra: Any) -> dict[str, Any]:
        return model(name, cls, memory, disk=disk, host=host, **extra)

    cfg = Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "19GiB", "reserve": 0}],
            "host": {"memory": "12GiB", "reserve": "2GiB"},  # 10 GiB: photos, or voice + most of it
            "classes": [
                {"name": "realtime"},
                {"name": "interactive"},
                {"name": "background", "may_evict": False},
            ],
            "models": [
                entry("voice", "realtime", "600MiB", 9.0, 9.0),  # loads until 9: the batch waits
                entry("batch", "background", "18.5GiB", 1.0, 1.0),  # needs voice's and photos' room
                entry("photos", "background", "9.5GiB", 2.0, 1.0, prewarm=True),
            ],
            "policy": {"thrash_window": "10m", "min_residency": 0},
        }
    )
    t0 = 1_800_000_000.0
    reqs = [Request(t=t0, model="voice", busy_s=0.0), Request(t=t0, model="batch", busy_s=0.0)]
    reqs.append(Request(t=t0 + 13.0, model="photos", busy_s=0.0))
    res = replay(cfg, reqs, "oracle", record=True)
    assert res.actions is not None
    gone = [(t - t0, a.model, a.reason) for t, a in res.actions if a.kind == ActionKind.DEMOTE]
    assert gone == [(9.0, "voice", "keep-alive expired"), (9.0, "photos", "keep-alive expired")]
    assert res.served == 3 and res.rejected == 0


@policies
class TestReservation:
    """(e) Class reservations are never given away to lower classes."""

    def test_interactive_cannot_take_the_realtime_reserve(self, policy, drive):
        cfg = server(
            model("chat", "interactive", "4GiB"),
            model("img", "interactive", "3GiB"),
            model("tiny", "interactive", "1GiB"),
            model("tts", "realtime", "2GiB"),
        )
        # tts is not in the oracle's plan: told of it, the oracle would load it at start, and the
        # point here is that its reserve stays free while nobody realtime uses it.
        sc = drive(cfg, policy, plan(("chat", 0.0), ("img", 1.0), ("tiny", 10.0)))
        sc.start()
        assert sc.request("chat", 0.0, busy=1000.0).status in ADMITTED  # chat busy: 4 GiB
        assert sc.request("img", 1.0, busy=1000.0).status in ADMITTED  # img busy: 7 GiB used
        assert sc.dev.usable - sc.dev.used == 2 * GiB  # 2 GiB are free, all realtime's reserve
        adm = sc.request("tiny", 10.0)  # tiny needs only 1 GiB ...
        assert adm.status == "wait"  # ... but may not take the reserved bytes
        assert sc.dev.usable - sc.dev.used == 2 * GiB  # the reserve is still free
        sc.clear()
        assert sc.request("tts", 20.0, surprise=True).status == "load"  # realtime gets it at once
        assert sc.evicted() == []  # without evicting anything
        assert sc.dev.used == sc.dev.usable  # the device is exactly full, never over


@policies
class TestNeverFits:
    """(f) A model that can never fit is rejected, with a reason naming it."""

    def test_rejected_with_a_reason_naming_the_model(self, policy, drive):
        # chat is pinned (3 GiB) and realtime holds 2 GiB: an interactive model can never have
        # more than 9 - 2 - 3 = 4 GiB, and img needs 5. (The config check only sees the reserve.)
        cfg = server(model("chat", "interactive", "3GiB", pin=True), model("img", "interactive", "5GiB"))
        sc = drive(cfg, policy, plan(("img", 0.0)))
        sc.start()
        sc.clear()
        adm = sc.request("img", 0.0)
        assert adm.status == "reject"  # rejected outright, not left waiting forever
        assert "'img'" in adm.reason  # the reason names the model ...
        assert "more than 4GiB" in adm.reason  # ... and the most it could ever get
        assert sc.actions == []  # nothing moved
        assert sc.tier("img") == Tier.DISK

    def test_elastic_minimum_counts(self, policy, drive):
        # world: 3 GiB of weights + a 2 GiB minimum lease = 5 GiB > 4 GiB.
        cfg = server(
            model("chat", "interactive", "3GiB", pin=True),
            model("world", "interactive", "3GiB", elastic={"min": "2GiB", "max": "4GiB"}),
        )
        sc = drive(cfg, policy, plan(("world", 0.0)))
        sc.start()
        adm = sc.request("world", 0.0)
        assert adm.status == "reject"
        assert "'world'" in adm.reason

    def test_pinned_bytes_inside_a_reservation_are_not_counted_twice(self, policy, drive):
        # voice (1 GiB, pinned) sits inside realtime's 2 GiB reserve: with it loaded, an
        # interactive model has 9 - 1 (voice) - 1 (the reserve's unused rest) = 7 GiB, so big
        # (7 GiB) fits - the config check agrees - and must not be rejected as never fitting.
        cfg = server(model("voice", "realtime", "1GiB", pin=True), model("big", "interactive", "7GiB"))
        sc = drive(cfg, policy, plan(("big", 0.0)))
        sc.start()  # voice loads
        assert sc.dev.room(1) == 7 * GiB  # 7 GiB really are there for an interactive model
        assert sc.request("big", 0.0).status in ADMITTED  # so big is admitted


@policies
class TestElasticLease:
    """(g) An elastic tenant's lease shrinks before any weights are evicted."""

    def test_lease_shrinks_and_nothing_is_evicted(self, policy, drive):
        # world: 2 GiB weights + lease 1..6 GiB. chat (3 GiB) fills the room at first, so img is
        # not loaded at start by anyone (the oracle included); then chat is unloaded (to disk) and
        # the busy world model's lease grows into all the free room, since no model is expected
        # back soon (one that is keeps its room: see TestLeaseHeadroom in test_sim.py).
        cfg = server(
            model("chat", "interactive", "3GiB"),
            model("world", "interactive", "2GiB", elastic={"min": "1GiB", "max": "6GiB"}),
            model("img", "interactive", "3GiB"),
        )
        sc = drive(cfg, policy, plan(("chat", 0.0), ("world", 10.0), ("img", 4000.0)))
        sc.start()
        assert sc.request("chat", 0.0).status in ADMITTED  # chat: 3 GiB
        assert sc.request("world", 10.0, busy=5000.0).status in ADMITTED  # world: 2 + 1 GiB, in session
        assert sc.tier("img") != Tier.GPU  # 1 GiB left: img (3 GiB) is not on the GPU
        sc.engine.evict(sc.m("chat"), 20.0, "unloaded by the user")  # 4 GiB free for interactive
        if sc.tier("chat") == Tier.HOST:
            sc.engine.drop_host(sc.m("chat"), 20.0, "unloaded by the user")
        sc.tick(30.0)  # the session wants KV: the lease grows into the free room
        assert sc.m("world").lease == 5 * GiB
        assert sc.dev.room(1) == 0  # nothing left for another interactive model
        sc.clear()
        adm = sc.request("img", 4000.0)  # img needs 3 GiB
        assert adm.status == "load"  # admitted ...
        assert sc.kinds()[0] == ActionKind.SHRINK_LEASE  # ... after the lease shrank first
        assert sc.actions[0][1].model == "world"
        assert sc.m("world").lease == 2 * GiB  # by just the 3 GiB img needs
        assert sc.evicted() == []  # and no weights were demoted or dropped
        assert {"world", "img"} <= sc.on_gpu()

    def test_background_takes_back_lent_lease_room_but_evicts_nothing(self, policy, drive):
        # The busy world session's lease grew into all free room; a background job (may not
        # evict) still gets the room it needs, because lease bytes above the minimum are lent.
        cfg = server(
            model("world", "interactive", "2GiB", elastic={"min": "1GiB", "max": "6GiB"}),
            model("batch", "background", "2GiB"),
        )
        # (batch comes after the oracle's look-ahead, so it keeps no room for it: TestLeaseHeadroom)
        sc = drive(cfg, policy, plan(("world", 0.0), ("batch", 4000.0)))
        sc.start()
        assert sc.request("world", 0.0, busy=5000.0).status in ADMITTED  # world: 2 + 1 GiB, in session
        sc.tick(30.0)  # the session wants KV: the lease grows into the free room
        assert sc.m("world").lease == 5 * GiB
        sc.clear()
        adm = sc.request("batch", 4000.0)  # batch needs 2 GiB
        assert adm.status == "load"  # admitted at once ...
        assert sc.kinds()[0] == ActionKind.SHRINK_LEASE  # ... the lease gave back 2 GiB
        assert sc.m("world").lease == 3 * GiB
        assert sc.evicted() == []  # and nothing was evicted

    def test_a_request_that_must_wait_leaves_the_lease_alone(self, policy, drive):
        # chat (2 GiB) and the world session are busy; world's lease grew to 3 GiB. img needs
        # 4 GiB: shrinking the lease to its 1 GiB minimum frees only 2, and nothing can be evicted.
        cfg = server(
            model("chat", "interactive", "2GiB"),
            model("world", "interactive", "2GiB", elastic={"min": "1GiB", "max": "6GiB"}),
            model("img", "interactive", "4GiB"),
        )
        sc = drive(cfg, policy, plan(("chat", 0.0), ("world", 1.0), ("img", 4000.0)))
        sc.start()
        assert sc.request("chat", 0.0, busy=5000.0).status in ADMITTED  # chat busy: 2 GiB
        assert sc.request("world", 1.0, busy=5000.0).status in ADMITTED  # world busy: 2 + 1 GiB
        sc.tick(20.0)  # the session's lease grows into the 2 GiB left
        assert sc.m("world").lease == 3 * GiB
        sc.clear()
        assert sc.request("img", 4000.0).status == "wait"  # img cannot be admitted ...
        assert sc.m("world").lease == 3 * GiB  # ... so the session keeps its KV
        assert sc.actions == []  # nothing changed


@policies
class TestThrash:
    """(h) A model reloaded within `thrash_window` of its eviction counts as thrash."""

    def test_reload_within_the_window_counts(self, policy, drive):
        # chat and img (5 GiB each) cannot share the 7 GiB interactive room.
        cfg = server(model("chat", "interactive", "5GiB"), model("img", "interactive", "5GiB"))
        sc = drive(cfg, policy, plan(("chat", 0.0), ("img", 100.0), ("chat", 200.0), ("img", 1000.0)))
        sc.start()
        thrash = sc.engine.counters
        assert sc.request("chat", 0.0).status in ADMITTED  # chat on the GPU
        assert sc.request("img", 100.0).status == "load"  # img evicts chat at t=100
        assert thrash.thrash == 0  # img was never evicted before
        assert sc.request("chat", 200.0).status == "load"  # chat back 100 s after its eviction
        assert thrash.thrash == 1  # within the 10 min window: thrash
        assert sc.request("img", 1000.0).status == "load"  # img back 800 s after its eviction
        assert thrash.thrash == 1  # outside the window: not thrash


class TestDeterminism:
    """(i) Decisions are a function of config and trace: two replays are identical."""

    @policies
    def test_two_replays_give_identical_results(self, policy):
        cfg = load_config(HOME)
        reqs = synth("home", 2, seed=7)
        first = replay(cfg, reqs, policy, record=True)
        second = replay(cfg, reqs, policy, record=True)
        assert json.dumps(first.to_json(), sort_keys=True) == json.dumps(second.to_json(), sort_keys=True)
        assert first.actions == second.actions  # every decision, in order
        assert first.served_log == second.served_log
        assert first.served > 0
