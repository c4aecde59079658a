"""Found in the second review of the decision engine and the replay simulator; each failed before its fix.

The server is small and hand-built: one cuda device with 10 GiB usable, one interactive class,
20 GiB of host RAM (24 GiB, 4 GiB reserve). Models load in 4 s from disk, 1 s from host RAM.
"""

from __future__ import annotations

from typing import Any

from manager.config import Config
from manager.policy.baselines import LruKeepAlive
from manager.policy.engine import Engine
from manager.policy.residency import ResidencyPolicy
from manager.policy.types import DISK, GPU, HOST, ActionKind, Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00
GiB = 1 << 30


def server(models: list[dict[str, Any]]) -> Config:
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": 0}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}],
            "models": [
                {
                    "class": "interactive",
                    "adapter": "test",
                    "device": "gpu0",
                    "prewarm": False,
                    "load_seconds": {"disk": 4.0, "host": 1.0},
                    **x,
                }
                for x in models
            ],
            "policy": {"min_residency": 0},
        }
    )


def serve(eng: Engine, name: str, now: float, busy: float) -> None:
    m = eng.models[name]
    eng.observe(m, now)
    adm = eng.admit(m, 0, now)
    assert adm.status in ("hit", "load"), adm
    eng.finish(m, max(now, adm.ready_at), busy)


class TestLeasesShrinkBeforeWeightsAtTheModelCap:
    """lru-keepalive holds at most 3 unpinned models per GPU (Ollama's cap). At the cap its
    room-making ignored room lent to a session's KV lease: it evicted weights for bytes the lease
    could give back, or - when the idle models' bytes were not enough - made the request wait for
    the session (the studio week's LLM waited 20 minutes beside a world session's 6 GiB lease)."""

    @staticmethod
    def engine() -> Engine:
        cfg = server(
            [
                {"name": "world", "memory": "1GiB", "elastic": {"min": 0, "max": "6GiB"}},
                {"name": "a", "memory": "1GiB"},
                {"name": "b", "memory": "1GiB"},
                {"name": "c", "memory": "3GiB"},
                {"name": "d", "memory": "4GiB"},
            ]
        )
        eng = Engine(cfg, LruKeepAlive())
        eng.actions = []
        eng.start(0.0)
        serve(eng, "a", 0.0, 1.0)
        serve(eng, "b", 1.0, 1.0)
        serve(eng, "world", 2.0, 600.0)  # a session: its lease grows into the free room
        eng.tick(20.0)
        assert eng.models["world"].lease == 6 * GiB and eng.state.devices["gpu0"].free == 1 * GiB
        return eng

    def test_one_model_goes_for_the_cap_and_the_lease_gives_the_rest(self) -> None:
        eng = self.engine()
        serve(eng, "c", 30.0, 1.0)  # 3 GiB: a goes (the cap), 1 GiB free, 1 GiB from the lease
        assert eng.actions is not None
        assert [(a.kind, a.model, a.bytes) for t, a in eng.actions if t == 30.0] == [
            (ActionKind.DROP, "a", 1 * GiB),
            (ActionKind.SHRINK_LEASE, "world", 5 * GiB),
            (ActionKind.LOAD, "c", 3 * GiB),
        ]
        assert eng.models["b"].tier == GPU  # it used to be dropped too

    def test_a_request_the_idle_models_cannot_make_room_for_is_served_from_the_lease(self) -> None:
        eng = self.engine()
        m = eng.models["d"]  # 4 GiB: a and b give 3 GiB with the 1 GiB free; the lease the rest
        eng.observe(m, 30.0)
        assert eng.admit(m, 0, 30.0).status == "load"  # it was "wait" (until the session ended)
        # a goes for the cap; b stays: the lease gives the 2 GiB still missing
        assert (eng.models["a"].tier, eng.models["b"].tier) == (DISK, GPU)
        assert eng.models["world"].lease == 4 * GiB
        assert eng.counters.budget_violations == 0


def test_a_model_pinned_at_run_time_takes_free_room_only() -> None:
    """`load_pinned` asks for a model's room as a class that may not evict (free room, or room held
    past its keep-alive), but the engine treated it as a prewarm, where that is not checked: under
    `residency` an admin's pin of b displaced a, idle well within its explicit 1 h keep-alive,
    because the policy valued b more."""
    slow = {"disk": 30.0, "host": 10.0}
    cfg = server(
        [
            {"name": "a", "memory": "6GiB", "keep_alive": "1h"},
            {"name": "b", "memory": "6GiB", "keep_alive": "1h", "load_seconds": slow},
        ]
    )
    eng = Engine(cfg, ResidencyPolicy())
    eng.actions = []
    eng.start(0.0)
    for i in range(20):  # b is asked for every minute, then a once: b goes to host RAM
        serve(eng, "b", i * 60.0, 1.0)
    serve(eng, "a", 1300.0, 1.0)
    a, b = eng.models["a"], eng.models["b"]
    assert (a.tier, b.tier) == (GPU, HOST)
    b.pinned = True
    eng.recheck_fit()
    eng.load_pinned(1320.0)
    assert (a.tier, b.tier) == (GPU, HOST)  # no free room: b waits for it
    eng.load_pinned(1300.0 + 4.0 + 1.0 + 3600.0)  # a's keep-alive is over: its room is free to take
    assert (a.tier, b.tier) == (HOST, GPU)


def test_the_oracle_does_not_count_a_refused_request_as_its_models_next_use() -> None:
    """A request for a known model with an unknown class is refused before the engine sees it, but
    the oracle kept it as that model's next use (in the past, then one request behind for the rest
    of the run): a, never evictable for a use that would not come, left b waiting until the trace's
    end, and b's request was rejected."""
    cfg = server([{"name": n, "memory": "6GiB", "prewarm": True} for n in ("a", "b")])
    trace = [
        Request(T0, "a", 1.0, cls="nope"),
        Request(T0 + 100.0, "b", 1.0),
        Request(T0 + 200.0, "a", 1.0),
    ]
    r = replay(cfg, trace, "oracle", record=True)
    assert (r.served, r.rejected) == (2, 1)
    assert r.reject_reasons == {"unknown class 'nope'": 1}
    assert r.load_wait_s == 0.0  # b and then a each prewarmed just in time
    assert [(round(t - T0), n) for t, n, _, _ in r.served_log or []] == [(100, "b"), (200, "a")]


def test_the_oracles_just_in_time_load_follows_a_lead_that_got_shorter() -> None:
    """The oracle sets a wake-up for each model it evicts at its next use less its lead then. x,
    evicted at 92 for y, looked bound for disk (host RAM was full: lead 20 + 2 s, wake-up at 977),
    but the demotion dropped z from host RAM and x went there (lead 5 + 2 s). At 977 x was not due
    yet, and nothing woke the oracle again before x's request at 1000: a 5 s promote it had every
    means to make just in time (at 992)."""
    cfg = Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "4GiB", "reserve": 0}],
            "host": {"memory": "9GiB", "reserve": "2GiB"},
            "classes": [{"name": "interactive"}],
            "models": [
                {
                    "name": n,
                    "class": "interactive",
                    "adapter": "test",
                    "device": "gpu0",
                    "memory": mem,
                    "load_seconds": {"disk": 20.0, "host": 5.0},
                }
                for n, mem in (("x", "3GiB"), ("y", "3GiB"), ("z", "2GiB"))
            ],
            "policy": {"min_residency": 0},
        }
    )
    trace = [Request(T0 + t, n, 1.0) for t, n in ((0.0, "x"), (100.0, "y"), (1000.0, "x"), (5000.0, "z"))]
    r = replay(cfg, trace, "oracle", record=True)
    moves = [(round(t - T0), a.kind, a.model, a.device) for t, a in r.actions or [] if 0 < t - T0 < 1000]
    assert (92, ActionKind.DEMOTE, "x", "gpu0") in moves  # to host RAM, z dropped for it
    assert moves[-1] == (992, ActionKind.PROMOTE, "x", "gpu0")  # was at 1000, for the request
    assert r.load_wait_s == 0.0


def test_a_model_pinned_at_run_time_is_not_held_back_by_the_model_cap() -> None:
    """lru-keepalive's cap of 3 models per GPU does not count pinned models (a pin always wins), but
    a pinned model's own load was held to it: with 3 models loaded and 7 GiB free, an admin's pin
    of p loaded nothing (no model was past its keep-alive to make way for the count)."""
    cfg = server([{"name": n, "memory": "1GiB"} for n in "abcp"])
    eng = Engine(cfg, LruKeepAlive())
    eng.start(0.0)
    for i, name in enumerate("abc"):
        serve(eng, name, float(i), 1.0)
    p = eng.models["p"]
    p.pinned = True
    eng.recheck_fit()
    eng.load_pinned(20.0)
    assert [m.tier for m in eng.models.values()] == [GPU, GPU, GPU, GPU]
