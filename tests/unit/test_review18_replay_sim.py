"""Review 18 of the replay simulator: a session's lease after room comes free mid-session, as the
live manager (which ticks the engine every second) grows it. The test failed before its fix."""

from __future__ import annotations

import pytest
from test_review17_replay_sim import T0, WORLD, GiB, config

from manager.policy.factory import POLICY_NAMES
from manager.policy.types import ActionKind, Request
from manager.replay.sim import replay

LLM = {"name": "llm", "memory": "8GiB", "keep_alive": "1m", "load_seconds": {"disk": 6.0, "host": 1.0}}


EVICTING = [p for p in POLICY_NAMES if p not in ("gdsf", "oracle")]
"""The policies that take the idle LLM off the GPU within the session (its keep-alive is explicit)."""


_LEASE_TRACE = [  # the LLM asked for just before a 90-minute session, then after it
    Request(t=T0 - 30, model="llm", busy_s=2.0),
    Request(t=T0, model="world", busy_s=5400.0, kind="session"),
    Request(t=T0 + 7200, model="llm", busy_s=1.0),
]


@pytest.mark.parametrize("policy", ["gdsf", "oracle"])
def test_a_lazy_policy_keeps_the_idle_llm_through_the_session(policy: str) -> None:
    """(The next test's scenario.) `gdsf` evicts only for a request, and the oracle knows the LLM's
    next request comes after the session: nothing wants the LLM's room, so it stays."""
    r = replay(config([WORLD, LLM]), _LEASE_TRACE, policy, record=True)
    left = [
        t for t, a in r.actions or [] if a.model == "llm" and a.kind in (ActionKind.DEMOTE, ActionKind.DROP)
    ]
    assert not [t for t in left if T0 < t < T0 + 5400]
    assert r.budget_violations == 0


@pytest.mark.parametrize("policy", EVICTING)
def test_a_session_lease_grows_into_room_freed_mid_session_at_the_next_tick(policy: str) -> None:
    """The LLM (8 GiB) is asked for just before a 90-minute world session starts, so the session's
    lease grows only to 3 GiB (15 GiB usable, 4 GiB of world weights, 8 of LLM). When the LLM's
    keep-alive runs out and it leaves the GPU, the live manager's next tick (a second later at most)
    grows the lease into the freed room. The replay grew it only at the next wake-up some policy
    asked for, here never in the session: the world model is ticked before the LLM in each tick, so
    the tick that evicted the LLM had already passed the lease."""
    r = replay(config([WORLD, LLM]), _LEASE_TRACE, policy, record=True)
    acts = r.actions or []
    left = [t for t, a in acts if a.model == "llm" and a.kind in (ActionKind.DEMOTE, ActionKind.DROP)]
    left = [t for t in left if T0 < t < T0 + 5400]
    assert left, f"{policy}: the LLM never left the GPU"
    te = left[0]
    grows = [
        (t, a.bytes) for t, a in acts if a.model == "world" and a.kind is ActionKind.GROW_LEASE and t >= te
    ]
    assert grows, f"{policy}: the lease never grew after the LLM left at {te - T0:.0f} s"
    t, lease = grows[0]
    assert t <= te + 1.0, f"{policy}: grew {t - te:.0f} s after the room came free"
    assert lease == 8 * GiB
    assert r.budget_violations == 0


@pytest.mark.parametrize("policy", ["gdsf", "residency"])
def test_room_that_comes_free_goes_to_the_higher_class_first(policy: str) -> None:
    """The live manager serves the requests waiting for room highest class first, within a class in
    arrival order (`manager/live.py` `_room_pass`); the replay tried them first come first served.
    A realtime model (8 of 9 GiB) loads for 4 s, runs until 104 s and keeps its 30 s keep-alive, so
    neither a background request (arrived at 10 s) nor an interactive one (at 20 s) may take its room
    until it expires at 134 s; there is room for one of them. The interactive one loads then (4 s from disk),
    and the background one waits (its class may not evict)."""
    from test_review_engine import m, req, server

    classes = [{"name": "realtime"}, {"name": "interactive"}, {"name": "background", "may_evict": False}]
    cfg = server(
        [
            m("voice", "realtime", "8GiB", keep_alive="30s"),
            m("chat", "interactive", "5GiB"),
            m("batch", "background", "5GiB"),
        ],
        classes,
    )
    r = replay(cfg, [req(0, "voice", busy=100.0), req(10, "batch"), req(20, "chat")], policy)
    assert r.models["chat"].load_wait_s == pytest.approx(134 - 20 + 4.0)
    assert r.models["batch"].load_wait_s > 134 - 10 + 4.0  # after chat's keep-alive
    assert r.budget_violations == 0
