"""Where `residency`'s load wait above the oracle's comes from (an analysis, not a policy).

usage: python bench/gap_decomposition.py [--config configs/home.yaml] [--heldout N]
       [--heldout-start S] [--no-shipped] > out.json

Per trace (the shipped weeks and held-out seeds, as `replay_quality.py` picks them) it replays:
- `residency` and `oracle`, as everywhere else;
- `oracle-session-blind`: the same oracle, except that it does not know when world sessions start
  (it learns of a session when its request arrives; every other request it knows in advance). Like
  any online policy it warms every model into host RAM at boot, so a session it did not foresee
  costs the world model's host->GPU promote, not a cold disk load.
It splits each policy's load wait by request: world-session starts, the other requests during a
world session (there the GPU cannot hold the LLM, the image model and the world model together, so
the LLM and the image model take turns), and the requests outside sessions. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from manager.config import Config, load_config
from manager.policy.oracle import OraclePolicy
from manager.policy.state import ModelState
from manager.policy.types import DISK, Request
from manager.replay.sim import ReplayResult, replay

PARTS = ("session_starts", "in_session", "other")


class SessionBlindOracle(OraclePolicy):
    """The oracle without foresight of world-session starts (a reference for the analysis only)."""

    name = "oracle-session-blind"

    def __init__(self, requests: Sequence[Request]) -> None:
        super().__init__([r for r in requests if r.kind != "session"])

    def start(self, now: float) -> None:
        super().start(now)
        for m in self.engine.models.values():  # what an online policy does at boot (`residency` too)
            if m.tier == DISK and m.prewarm_ok:
                self.engine.load_host(m, now, "boot: warm in host RAM")

    def on_request(self, m: ModelState, now: float) -> None:
        # A session's start was never in the list: step past a request only when it was there.
        ts = self._times.get(m.name)
        i = self._ptr[m.name]
        if ts is not None and i < len(ts) and ts[i] <= now:
            self._ptr[m.name] = i + 1
        self._wake_for(m, now)


def split(res: ReplayResult, reqs: Sequence[Request]) -> dict[str, float]:
    """`res`'s load wait by part (see the module's docstring); `res` must be recorded."""
    sessions = sorted((r.t, r.t + r.busy_s) for r in reqs if r.kind == "session")
    starts = {(r.t, r.model) for r in reqs if r.kind == "session"}
    out = dict.fromkeys(PARTS, 0.0)
    for t, model, _cold, wait in res.served_log or []:
        if (t, model) in starts:
            out["session_starts"] += wait
        elif any(a <= t < b for a, b in sessions):
            out["in_session"] += wait
        else:
            out["other"] += wait
    return {k: round(v, 2) for k, v in out.items()}


def one(cfg: Config, reqs: list[Request]) -> dict[str, object]:
    runs = {
        "residency": replay(cfg, reqs, "residency", record=True),
        "oracle": replay(cfg, reqs, "oracle", record=True),
        "oracle-session-blind": replay(cfg, reqs, SessionBlindOracle(reqs), record=True),
    }
    rows = {
        name: {"load_wait_s": round(r.load_wait_s, 2), "thrash": r.thrash, "by_part": split(r, reqs)}
        for name, r in runs.items()
    }
    res = runs["residency"].load_wait_s
    ratios = {}
    for ref in ("oracle", "oracle-session-blind"):
        w = runs[ref].load_wait_s
        ratios[ref] = round(res / w, 3) if w > 0 else None
    return {
        "sessions": sum(1 for r in reqs if r.kind == "session"),
        "policies": rows,
        "residency_ratio_to": ratios,
    }


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts of bench/
    from replay_quality import selected_traces

    config, traces = selected_traces("where residency's load wait above the oracle's comes from")
    cfg = load_config(config)
    out = {name: one(cfg, reqs) for name, reqs in traces.items()}
    json.dump({"config": config, "traces": out}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
