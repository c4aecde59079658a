"""Review 19: in the replay, as in the live manager, a prewarm gives way to requests waiting for room.

The live manager stopped letting a prewarm (a guess) take room that came free ahead of a request
waiting for it (`tests/unit/test_review19_live_room.py`). The rule now lives in the pure engine
(`Engine.room_wanted`, asked by `Engine.prewarm`), and the replay's simulator tells it which devices
have requests waiting, so `residency replay` and `tune` predict what the service does.

The scenario: a device with room for one model. `x` (realtime) is asked for at 0 s (loaded at 2 s,
idle at 3 s) and keeps the room for its 60 s keep-alive; `lo` (background: may not evict) is asked
for at 10 s and waits for room. At 63 s the keep-alive ends and the room comes free; a policy that
always wants `guess` prewarmed (`_GuessPolicy`, a stand-in for a learned prediction) would take it
at that tick, and again each time its keep-alive ends, so `lo` waited until its class's max_wait and
was refused.
"""

from __future__ import annotations

import math
from pathlib import Path

from manager.config import Config, load_config
from manager.policy.baselines import LruKeepAlive
from manager.policy.state import ModelState
from manager.policy.types import GPU, Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00
MiB = 1 << 20


ROWS = (("x", "realtime", False), ("lo", "background", False), ("guess", "realtime", True))


def _config(tmp_path: Path) -> Config:
    models = "".join(
        f"  - {{name: {name}, class: {cls}, adapter: torchscript, device: gpu0, memory: 100MiB, "
        f"load_seconds: {{disk: 2.0, host: 0.5}}, prewarm: {str(pw).lower()}, source: {{path: {name}.pt}}}}\n"
        for name, cls, pw in (
            ("x", "realtime", False),
            ("lo", "background", False),
            ("guess", "realtime", True),
        )
    )
    (tmp_path / "c.yaml").write_text(
        "devices:\n  - {name: gpu0, kind: cuda, memory: 160MiB, reserve: 10MiB}\n"
        "host: {memory: 8GiB, reserve: 1GiB}\n"
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n"
        "  - {name: background, may_evict: false, max_wait: 5m}\n"
        f"models:\n{models}policy: {{name: lru-keepalive, default_keep_alive: 60s}}\n"
    )
    return load_config(tmp_path / "c.yaml")


class _GuessPolicy(LruKeepAlive):
    """Ollama's rule, plus a stand-in prediction that always names `guess` for a prewarm (the
    residency policy's learned guesses are not easy to steer in a test)."""

    def prewarm(self, now: float) -> list[ModelState]:
        g = self.engine.models["guess"]
        return [] if g.tier == GPU else [g]


REQUESTS = [Request(T0, "x", 1.0), Request(T0 + 10.0, "lo", 1.0)]


def test_the_waiting_request_gets_the_room_that_comes_free_not_the_prewarm(tmp_path: Path) -> None:
    res = replay(_config(tmp_path), REQUESTS, _GuessPolicy(), record=True)
    assert res.rejected == 0  # (was 1: `lo` refused at its max_wait, `guess` held the room)
    assert res.served == 2
    assert res.served_log is not None
    (lo,) = [row for row in res.served_log if row[1] == "lo"]
    _, _, cold, wait = lo
    assert cold and math.isclose(wait, 53.0 + 2.0, abs_tol=0.6)  # the room at 63 s, then its load


def test_with_no_request_waiting_the_prewarm_is_made(tmp_path: Path) -> None:
    """The rule holds the prewarm back only while a request waits: here none does, and `guess` is
    loaded at the first tick (its first chance: after `x`'s keep-alive frees the room)."""
    res = replay(_config(tmp_path), REQUESTS[:1], _GuessPolicy(), record=True)
    assert res.rejected == 0 and res.served == 1
    assert res.prewarm_loads >= 1
