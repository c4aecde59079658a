"""Review 22, a fuzz of the engine and the replay on small random configs:

- A request refused "queue full" left the wake-up its arrival asked for (the oracle's) off the
  replay's heap until a later request: the engine was then ticked at a time it had passed, and a
  request was served before it arrived (a negative wait), a lease grown before its session began.
- A lease shrunk for room spilled its KV at the rate of its own model's host load (its weights over
  their load time): a model of small weights, whose load time is mostly fixed costs, spilled
  gigabytes of KV in minutes, holding its device's loader.
- `residency` prewarmed at start a model never asked for whose keep-alive is `forever` (not pinned):
  it held its room for good, and a lower class's model that fits the empty device was never served."""

from __future__ import annotations

from manager.config import Config
from manager.policy.factory import POLICY_NAMES
from manager.policy.types import Request
from manager.replay.sim import Simulator, replay

GiB, MiB = 1 << 30, 1 << 20
T = 1_800_000_000.0


def test_a_queue_full_refusal_keeps_time_going_forward() -> None:
    cfg = Config.model_validate({
        "devices": [{"name": "gpu0", "kind": "cuda", "memory": 16 * GiB}],
        "host": {"memory": 22 * GiB, "reserve": 2 * GiB},
        "classes": [{"name": "realtime"}, {"name": "interactive", "max_queue": 1},
                    {"name": "background", "may_evict": False}],
        "models": [
            {"name": "m0", "class": "interactive", "adapter": "t", "device": "gpu0", "memory": 15471738880,
             "load_seconds": {"disk": 1.0, "host": 0.42}, "elastic": {"min": 56623104, "max": 717225984}},
            {"name": "m1", "class": "interactive", "adapter": "t", "device": "gpu0", "memory": 11725176832,
             "load_seconds": {"disk": 5.0, "host": 1.03}, "keep_alive": 0, "prewarm": False},
        ],
        "policy": {"min_residency": 60, "default_keep_alive": 60},
    })  # fmt: skip
    trace = [
        Request(T + 28.786, "m1", 0.0),
        Request(T + 28.786, "m0", 594.794),
        Request(T + 28.786, "m1", 0.0),  # refused "queue full", after its arrival asked for a wake-up
        Request(T + 58.056, "m0", 0.0, cls="background"),
        Request(T + 58.056, "m1", 4.324),
    ]
    sim = Simulator(cfg, trace, "oracle", record=True)
    res = sim.run()
    assert res.reject_reasons == {"class 'interactive': queue full (1 requests waiting)": 2}
    assert all(w >= 0.0 for waits in sim.waits.values() for w in waits), sim.waits
    times = [t for t, _ in res.actions]
    assert times == sorted(times), "the engine's actions went back in time"
    served_m0 = [t for t, a in res.actions if a.model == "m0" and a.kind.value == "promote"]
    assert served_m0 and min(served_m0) >= T + 58.056, served_m0  # not before the request arrived


def _spill(kv_weights: int) -> float:
    cfg = Config.model_validate({
        "devices": [{"name": "gpu0", "kind": "cuda", "memory": 12 * GiB}],
        "host": {"memory": 32 * GiB},
        "classes": [{"name": "interactive"}],
        "models": [
            {"name": "kv", "class": "interactive", "adapter": "t", "device": "gpu0", "memory": kv_weights,
             "load_seconds": {"disk": 2.0, "host": 0.5}, "pin": True, "elastic": {"min": 0, "max": 8 * GiB}},
            {"name": "llm", "class": "interactive", "adapter": "t", "device": "gpu0", "memory": 6 * GiB,
             "load_seconds": {"disk": 6.0, "host": 1.0}, "prewarm": False},
        ],
    })  # fmt: skip
    trace = [Request(T, "kv", 3600.0, kind="session"), Request(T + 60, "llm", 1.0)]
    return replay(cfg, trace, "gdsf").models["llm"].load_wait_s


def test_a_kv_spill_runs_at_the_devices_host_link_rate_not_its_models() -> None:
    # the LLM's own host load (6 GiB in 1 s) says how fast the link is: 2 GiB of KV spill in about
    # 1/3 s, whatever the session model's weights (16 MiB in 0.5 s read as 32 MiB/s: 64 s)
    big, small = _spill(4 * GiB), _spill(16 * MiB)
    assert small < 8.0, small  # the LLM's disk load (6 s) and a spill of at most a second or so
    assert big < 8.0, big


def test_an_unpinned_forever_model_never_asked_for_is_not_prewarmed_at_start() -> None:
    cfg = Config.model_validate({
        "devices": [{"name": "gpu0", "kind": "cuda", "memory": 8 * GiB}],
        "host": {"memory": 16 * GiB},
        "classes": [{"name": "realtime"}, {"name": "interactive"}],
        "models": [
            {"name": "tts", "class": "realtime", "adapter": "t", "device": "gpu0", "memory": 1 * GiB,
             "load_seconds": {"disk": 2.0, "host": 0.3}, "keep_alive": "forever"},
            {"name": "llm", "class": "interactive", "adapter": "t", "device": "gpu0", "memory": 7680 * MiB,
             "load_seconds": {"disk": 7.0, "host": 1.0}},
        ],
    })  # fmt: skip
    trace = [Request(T + 3600 * i, "llm", 30.0) for i in range(5)]  # tts is never asked for
    for policy in POLICY_NAMES:
        r = replay(cfg, trace, policy, record=True)
        assert (r.served, r.rejected) == (5, 0), (policy, r.reject_reasons)
    # asked for once, it stays as its keep-alive says: then the llm waits, as the rules require
    r = replay(cfg, [Request(T, "tts", 1.0), *trace], "residency")
    assert (r.served, r.rejected) == (1, 5), r.reject_reasons
