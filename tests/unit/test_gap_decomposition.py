"""`bench/gap_decomposition.py`: the oracle that does not foresee world-session starts, and the split
of a replay's load wait into session starts, requests during sessions and requests outside them."""

from __future__ import annotations

from typing import Any

import pytest
from integration.bench_module import load_bench

from manager.config import Config
from manager.policy.types import Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00


def server() -> Config:
    """A GPU with room for one of the two 6 GiB models; host RAM holds both."""

    def model(name: str) -> dict[str, Any]:
        return {
            "name": name, "class": "interactive", "adapter": "test", "device": "gpu0", "memory": "6GiB",
            "load_seconds": {"disk": 4.0, "cached": 2.0, "host": 1.0},
        }  # fmt: skip

    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}],
            "models": [model("chat"), model("world")],
            "policy": {"min_residency": 0},
        }
    )


def trace() -> list[Request]:
    return [
        Request(t=T0, model="chat", busy_s=5.0),
        Request(t=T0 + 1000.0, model="world", busy_s=600.0, kind="session"),
        Request(t=T0 + 1200.0, model="chat", busy_s=5.0),
        Request(t=T0 + 3000.0, model="chat", busy_s=5.0),
    ]


def test_the_blind_oracle_pays_for_a_session_it_did_not_foresee_and_nothing_else() -> None:
    gaps = load_bench("gap_decomposition")
    cfg, reqs = server(), trace()
    seeing = replay(cfg, reqs, "oracle", record=True)
    blind = replay(cfg, reqs, gaps.SessionBlindOracle(reqs), record=True)
    assert blind.policy == "oracle-session-blind"
    # The oracle loads the world model just before the session; the blind one learns of the session
    # when it starts, and promotes the world model from host RAM, where it was warmed at boot.
    assert gaps.split(seeing, reqs)["session_starts"] == 0.0
    assert gaps.split(blind, reqs)["session_starts"] == pytest.approx(1.0)
    assert blind.loads_by_source["host"] >= 1
    # Every other request it foresees like the oracle: chat after the session is back in time; chat
    # during it waits for the session's end (the GPU holds one of the two models), which comes 1 s
    # later than with the oracle since the session started 1 s later.
    waits = {(t - T0, m): w for t, m, _cold, w in blind.served_log or []}
    seen = {(t - T0, m): w for t, m, _cold, w in seeing.served_log or []}
    assert waits[(3000.0, "chat")] == 0.0
    assert seen[(1200.0, "chat")] == pytest.approx(1600.0 - 1200.0 + 1.0)  # session end, then promote
    assert waits[(1200.0, "chat")] == pytest.approx(seen[(1200.0, "chat")] + 1.0)


def test_the_split_puts_each_wait_in_its_part() -> None:
    gaps = load_bench("gap_decomposition")
    cfg, reqs = server(), trace()
    res = replay(cfg, reqs, "lru-keepalive", record=True)
    by_req = {(t - T0, m): w for t, m, _cold, w in res.served_log or []}
    parts = gaps.split(res, reqs)
    assert parts["session_starts"] == pytest.approx(by_req[(1000.0, "world")])
    assert parts["in_session"] == pytest.approx(by_req[(1200.0, "chat")])
    assert parts["other"] == pytest.approx(by_req[(0.0, "chat")] + by_req[(3000.0, "chat")])
    assert parts["session_starts"] > 0 and parts["in_session"] > 0  # cold world, then chat evicted
    assert sum(parts.values()) == pytest.approx(res.load_wait_s, abs=0.05)
