"""Properties of every policy on random small servers and random traces (hypothesis).

Whatever the server and the trace:
- no budget is ever exceeded (device, host, class accounting): `budget_violations == 0`;
- a pinned model is loaded at start, never demoted or dropped, and still resident at the end;
- an eviction made as "room for 'X'" never takes a model of a higher class than X's requests;
- a request whose class may not evict (background) causes no eviction: "room for 'X'" for such an
  X comes only from a prewarm of X, within X's class;
- a load (or a lease growth) never takes bytes a higher class has reserved and not used;
- a request evicts weights only when shrinking every other lease to its minimum would not make
  its room;
- the action log is a valid history (each move starts from the tier it names, leases change only on
  the GPU and within their range), and the thrash counter can be recomputed from it.

Configs: one cuda device of 6-24 GiB, three classes (realtime with a random reserve >
interactive > background, may_evict false), 2-6 models with random sizes that fit their class,
random load times, keep-alives, elastic leases and pins; invalid combinations (pins that do not
fit with the reserves) are skipped. Traces: up to 40 requests in time order with random gaps
(simultaneous arrivals included) and busy times. `cls` is never set, so a request's class is its
model's class and the third property is well defined.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from manager.config import Config
from manager.policy.factory import POLICY_NAMES, create_policy
from manager.policy.types import Action, ActionKind, Request
from manager.replay.sim import ReplayResult, replay

MiB = 1 << 20
GiB = 1 << 30
CLASSES = ("realtime", "interactive", "background")
ROOM_FOR = re.compile(r"^room for '(.+)'$")
GAVE_WAY = re.compile(r"^gave way to '(.+)'$")
"""`residency`'s learned keep-alive's hold on a class that may not evict is over (`Policy.gives_way_at`)."""


def gave_way_rightly(cfg: Config, policy: str, a: Action) -> bool:
    """A "gave way to 'X'" eviction: only under `residency`, only for X of a class that may not evict
    or of a lower class than the model's (one that could not evict it within its keep-alive), and only
    of an unpinned model without an explicit keep-alive in the config (a learned one)."""
    match = GAVE_WAY.match(a.reason)
    if match is None:
        return False
    spec = {m.name: m for m in cfg.models}
    x, victim = spec[match.group(1)], spec[a.model]
    x_rank = cfg.class_rank(x.class_)
    return (
        policy == "residency"
        and (not cfg.classes[x_rank].may_evict or cfg.class_rank(victim.class_) < x_rank)
        and victim.keep_alive is None
        and not victim.pin
    )


LOADS = (ActionKind.LOAD, ActionKind.PROMOTE)

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    memory = draw(st.integers(6, 24)) * GiB
    reserve = draw(st.sampled_from([0, 512 * MiB, 1 * GiB]))
    usable = memory - reserve
    rt_reserve = draw(st.integers(0, 3)) * GiB
    models: list[dict[str, Any]] = []
    for i in range(draw(st.integers(2, 6))):
        rank = draw(st.integers(0, 2))
        room = usable - (rt_reserve if rank > 0 else 0)
        elastic = draw(st.booleans()) and room >= 2 * GiB
        lease_min = draw(st.integers(0, 1024)) * MiB if elastic else 0
        cap_mib = (room - lease_min) // MiB
        mem_mib = draw(st.integers(min(256, cap_mib), cap_mib))
        disk = draw(st.floats(0.5, 20.0))
        entry: dict[str, Any] = {
            "name": f"m{i}",
            "class": CLASSES[rank],
            "adapter": "test",
            "device": "gpu0",
            "memory": mem_mib * MiB,
            "load_seconds": {"disk": disk, "host": disk * draw(st.floats(0.05, 1.0))},
            "pin": draw(st.integers(0, 4)) == 0,
            "keep_alive": draw(st.sampled_from([None, 30, 60, 600, "forever"])),
            "prewarm": draw(st.booleans()),
        }
        if elastic:
            entry["elastic"] = {"min": lease_min, "max": lease_min + draw(st.integers(1, 4096)) * MiB}
        models.append(entry)
    data = {
        "devices": [{"name": "gpu0", "kind": "cuda", "memory": memory, "reserve": reserve}],
        "host": {"memory": draw(st.integers(4, 32)) * GiB, "reserve": 2 * GiB},
        "classes": [
            {"name": "realtime", "reserve": rt_reserve},
            {"name": "interactive"},
            {"name": "background", "may_evict": False},
        ],
        "models": models,
        "policy": {
            "thrash_window": 600,
            "min_residency": draw(st.sampled_from([0, 30, 60])),
            "default_keep_alive": draw(st.sampled_from([60, 300])),
        },
    }
    try:
        return Config.model_validate(data)
    except ValidationError:
        assume(False)
        raise  # unreachable: assume(False) raises


@st.composite
def traces(draw: st.DrawFn, names: list[str]) -> list[Request]:
    t = 1_800_000_000.0
    out = []
    for _ in range(draw(st.integers(1, 40))):
        t += draw(st.one_of(st.just(0.0), st.floats(0.0, 30.0), st.floats(30.0, 3000.0)))
        busy = draw(st.one_of(st.floats(0.0, 10.0), st.floats(10.0, 1200.0)))
        # a request's own keep-alive (Ollama's), now and then: the rules hold whatever it asks
        keep_alive = draw(st.sampled_from([None, None, None, None, 0.0, 30.0, 3600.0, math.inf]))
        out.append(
            Request(
                t=round(t, 3),
                model=draw(st.sampled_from(names)),
                busy_s=round(busy, 3),
                keep_alive=keep_alive,
            )
        )
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[Config, list[Request]]:
    cfg = draw(configs())
    return cfg, draw(traces([m.name for m in cfg.models]))


def gpu_evictions(res: ReplayResult) -> list[tuple[float, Action]]:
    assert res.actions is not None
    return [
        (t, a)
        for t, a in res.actions
        if a.kind in (ActionKind.DEMOTE, ActionKind.DROP) and a.device != "host"
    ]


@SETTINGS
@given(case=cases())
def test_no_policy_ever_exceeds_a_budget(case):
    cfg, trace = case
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        assert res.budget_violations == 0, policy
        assert res.requests == len(trace)
        assert res.served + res.rejected == res.requests  # every request is answered one way


@SETTINGS
@given(case=cases())
def test_pinned_models_are_never_evicted(case):
    cfg, trace = case
    pinned = {m.name for m in cfg.models if m.pin}
    assume(pinned)
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        loaded = [a.model for _, a in res.actions if a.kind == ActionKind.LOAD and a.reason == "pinned"]
        # All loaded at start (pinned models are exempt from lru-keepalive's count cap: a pin wins).
        assert set(loaded) == pinned, policy
        moved = [
            a for _, a in res.actions if a.model in pinned and a.kind in (ActionKind.DEMOTE, ActionKind.DROP)
        ]
        assert moved == [], policy  # and never moved off
        for name in loaded:  # so resident for the whole replay
            assert res.models[name].resident_fraction > 0.99, (policy, name)


@SETTINGS
@given(case=cases())
def test_room_is_never_made_from_a_higher_class(case):
    cfg, trace = case
    rank = {m.name: cfg.class_rank(m.class_) for m in cfg.models}
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        for t, a in gpu_evictions(res):
            match = ROOM_FOR.match(a.reason)
            if match is None:
                assert a.reason == "keep-alive expired" or gave_way_rightly(cfg, policy, a), (policy, a)
                continue
            beneficiary = match.group(1)
            assert rank[a.model] >= rank[beneficiary], (policy, t, a)


@SETTINGS
@given(case=cases())
def test_reservations_are_never_given_to_lower_classes(case):
    # Rebuild the device's accounting from the action log and check every step that adds bytes.
    cfg, trace = case
    dev = cfg.devices[0]
    reserves = [c.reserve for c in cfg.classes]
    rank = {m.name: cfg.class_rank(m.class_) for m in cfg.models}
    weights = {m.name: m.memory for m in cfg.models}
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        held: dict[str, int] = {}  # model -> bytes on the GPU
        for t, a in res.actions:
            if a.device == "host" or a.kind == ActionKind.LOAD_HOST:
                continue
            if a.kind in (ActionKind.DEMOTE, ActionKind.DROP):
                del held[a.model]
                continue
            if a.kind in (ActionKind.LOAD, ActionKind.PROMOTE):
                held[a.model] = a.bytes
            else:  # lease change: `bytes` is the new lease
                held[a.model] = weights[a.model] + a.bytes
            by_class = [0] * len(reserves)
            for name, b in held.items():
                by_class[rank[name]] += b
            r = rank[a.model]
            unused_above = sum(max(0, reserves[i] - by_class[i]) for i in range(r))
            if a.kind != ActionKind.SHRINK_LEASE:
                assert sum(by_class) + unused_above <= dev.usable, (policy, t, a)


@SETTINGS
@given(case=cases())
def test_a_request_that_may_not_evict_never_causes_an_eviction(case):
    # A background request (its class has `may_evict: false`) only takes free room, room lent to a
    # lease (a lease shrink, not an eviction) and room held past its keep-alive (evictions logged as
    # "keep-alive expired"). A "room for 'X'" eviction for such an X can only come from a policy's
    # prewarm of X, and then only from X's own class.
    cfg, trace = case
    rank = {m.name: cfg.class_rank(m.class_) for m in cfg.models}
    no_evict = {m.name for m in cfg.models if not cfg.classes[rank[m.name]].may_evict}
    assume(len(no_evict) >= 2 and len({r.model for r in trace} & no_evict) >= 2)  # they may compete
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        for t, a in gpu_evictions(res):
            if GAVE_WAY.match(a.reason):
                assert gave_way_rightly(cfg, policy, a), (policy, t, a)
                continue
            match = ROOM_FOR.match(a.reason)
            if match is None or match.group(1) not in no_evict:
                continue
            x = match.group(1)
            assert rank[a.model] == rank[x], (policy, t, a)
            loads = [b for u, b in res.actions if u == t and b.model == x and b.kind in LOADS]
            assert any(b.prewarm for b in loads), (policy, t, a)


@SETTINGS
@given(case=cases())
def test_the_action_log_is_a_valid_history_and_thrash_is_counted_from_it(case):
    # Replaying the log move by move: each move starts from the tier it names (a load from disk, a
    # promote from host RAM, a demote or drop from the GPU...), a lease changes only on the GPU and
    # within its range, and the thrash counter equals the loads made within `thrash_window` of the
    # same model's last departure from the GPU.
    cfg, trace = case
    spec = {m.name: m for m in cfg.models}
    window = cfg.policy.thrash_window
    for policy in POLICY_NAMES:
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        tier = dict.fromkeys(spec, "disk")
        left: dict[str, float] = {}
        thrash = 0
        for t, a in res.actions:
            where, k = tier[a.model], a.kind
            if k == ActionKind.LOAD_HOST:
                assert where == "disk", (policy, t, a)
                tier[a.model] = "host"
            elif k in LOADS:
                assert where == ("host" if k == ActionKind.PROMOTE else "disk"), (policy, t, a)
                thrash += a.model in left and t - left[a.model] <= window
                tier[a.model] = "gpu"
            elif k == ActionKind.DEMOTE:
                assert where == "gpu" and a.device != "host", (policy, t, a)
                tier[a.model], left[a.model] = "host", t
            elif k == ActionKind.DROP:
                assert where == ("host" if a.device == "host" else "gpu"), (policy, t, a)
                if where == "gpu":
                    left[a.model] = t
                tier[a.model] = "disk"
            else:  # a lease change: `bytes` is the new lease
                elastic = spec[a.model].elastic
                assert where == "gpu" and elastic is not None, (policy, t, a)
                assert elastic.min <= a.bytes <= elastic.max, (policy, t, a)
        assert res.thrash == thrash, policy


def room_with_leases_at_min(cfg: Config, held: dict[str, int], x: str) -> int:
    """From the bytes each model `held` on the GPU: the room a load of `x` could take once every other
    lease is at its minimum - free bytes less the unused reservations of higher classes (bytes a
    higher class's lease gives back refill that class's reservation first)."""
    spec = {m.name: m for m in cfg.models}
    reserves = [c.reserve for c in cfg.classes]
    by_class = [0] * len(reserves)
    for n, b in held.items():
        elastic = spec[n].elastic
        at_min = spec[n].memory + elastic.min if elastic is not None and n != x else b
        by_class[cfg.class_rank(spec[n].class_)] += at_min
    higher = range(cfg.class_rank(spec[x].class_))
    return cfg.devices[0].usable - sum(by_class) - sum(max(0, reserves[i] - by_class[i]) for i in higher)


@SETTINGS
@given(case=cases())
def test_leases_shrink_before_a_request_evicts_weights(case):
    # When a load evicts models ("room for 'X'", then X's own load at the same instant, for a
    # request or a prewarm), shrinking every other lease to its minimum would not have made the room.
    cfg, trace = case
    spec = {m.name: m for m in cfg.models}
    assume(any(m.elastic is not None and m.elastic.max > m.elastic.min for m in cfg.models))
    for policy in POLICY_NAMES:
        cap = create_policy(policy, trace).max_loaded
        res = replay(cfg, trace, policy, record=True)
        assert res.actions is not None
        held: dict[str, int] = {}  # model -> bytes on the GPU, as the log says
        before: dict[str, int] | None = None  # `held` just before the current batch of evictions
        for t, a in res.actions:
            if a.device == "host" or a.kind == ActionKind.LOAD_HOST:
                continue  # host RAM only (a victim's demotion may first drop a host resident)
            leaving = a.kind in (ActionKind.DEMOTE, ActionKind.DROP)
            if leaving and ROOM_FOR.match(a.reason):
                before = dict(held) if before is None else before
            elif a.kind in LOADS and before is not None:  # a request's load or a prewarm alike
                # (lru-keepalive may evict to stay under its count cap, whatever the bytes)
                if cap is None or sum(1 for n in before if not spec[n].pin) < cap:
                    room = room_with_leases_at_min(cfg, before, a.model)
                    x = spec[a.model]
                    assert room < x.memory + (x.elastic.min if x.elastic else 0), (policy, t, a)
                before = None
            elif not leaving:
                before = None
            if leaving:
                del held[a.model]
            elif a.kind in LOADS:
                held[a.model] = a.bytes
            else:  # a lease change: `bytes` is the new lease
                held[a.model] = spec[a.model].memory + a.bytes
