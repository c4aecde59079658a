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

The oracle is told each scenario's requests (`plan`); it may prewarm them at start, so set-up
steps accept "hit" as well as "load", and the assertions are about the rule under test.
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


def model(name: str, cls: str, memory: str, *, disk: float = 4.0, host: float = 1.0, **extra: Any) -> dict[str, Any]:
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
        sc = drive(cfg, policy, plan(("voice", 0.0), ("tts", 1.0), ("embed", 2.0), ("big", 100.0)))
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
        sc = drive(cfg, policy, plan(("voice", 0.0), ("tts", 1.0), ("embed", 2.0), ("big", 100.0)))
        sc.start()
        assert sc.request("voice", 0.0).status in ADMITTED  # voice on the GPU
        assert sc.request("tts", 1.0).status in ADMITTED  # tts on the GPU
        assert sc.request("embed", 2.0).status in ADMITTED  # embed on the GPU
        adm = sc.request("big", 100.0)  # big needs 6 GiB: 9 - 3 (realtime) - 1 (embed) = 5 free
        assert adm.status in ADMITTED  # admitted ...
        assert "embed" in sc.evicted()  # ... by evicting the background model
        assert not {"voice", "tts"} & set(sc.evicted())  # never a realtime one
        assert {"voice", "tts", "big"} <= sc.on_gpu()
