"""Review 17 of the replay simulator and the decision engine: what the replay does against what
the live manager does (README "What it decides, and how"). Each test failed before its fix."""

from __future__ import annotations

from typing import Any

import pytest

from manager.config import Config
from manager.policy.factory import POLICY_NAMES
from manager.policy.types import ActionKind, Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00
GiB = 1 << 30


def config(models: list[dict[str, Any]]) -> Config:
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "16GiB", "reserve": "1GiB"}],
            "host": {"memory": "32GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}],
            "models": [{"adapter": "test", "device": "gpu0", "class": "interactive", **x} for x in models],
            "policy": {"min_residency": 0},
        }
    )


WORLD = {
    "name": "world",
    "memory": "4GiB",
    "elastic": {"min": "1GiB", "max": "8GiB"},
    "load_seconds": {"disk": 4.0, "host": 0.6},
}


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_session_grows_its_lease_when_it_starts_not_at_the_next_unrelated_tick(policy: str) -> None:
    """The live manager ticks every second, so a world session's KV lease grows into free room as
    the session starts. The replay ticked only at the wake-ups some policy asked for: under
    `residency`, `gdsf` and the oracle a 90-minute session alone on the GPU never grew its lease
    at all (under `lru-keepalive` it grew 5 minutes in, at an unrelated keep-alive expiry), so the
    room the session holds, and the KV spills a later load pays for, differed by policy."""
    cfg = config([WORLD])
    session = Request(t=T0, model="world", busy_s=5400.0, kind="session")
    r = replay(cfg, [session, Request(t=T0 + 7200, model="world", busy_s=1.0)], policy, record=True)
    grows = [
        (t, a.bytes) for t, a in r.actions or [] if a.model == "world" and a.kind is ActionKind.GROW_LEASE
    ]
    assert grows, f"{policy}: the session's lease never grew"
    t, lease = grows[0]
    # at the session's start: at once (prewarmed) or when its load from disk is over
    assert T0 <= t <= T0 + 4.0, policy
    assert lease == 8 * GiB  # 15 GiB usable: all the lease wants
    assert r.budget_violations == 0
