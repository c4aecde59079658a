"""Replay quality: every policy on the shipped weeks and on held-out weeks (never used in design).

usage: python bench/replay_quality.py [--config configs/home.yaml] [--heldout N] [--heldout-start S]
       [--no-shipped] > out.json
Prints one JSON object: per trace, per policy the key figures, and the checks of the issue
(residency load wait <= 1.5x the oracle's and below every baseline's, realtime p99 <= oracle's
+ 0.1 s, thrash <= the oracle's, 0 budget violations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from manager.config import load_config
from manager.policy.factory import POLICY_NAMES
from manager.policy.types import Request
from manager.replay.sim import replay
from manager.replay.synth import synth
from manager.replay.trace import read_trace

SHIPPED = ["home-week-seed1", "home-week-seed2", "home-week-seed3", "studio-week-seed1"]
BASELINES = ["lru-keepalive", "histogram", "gdsf"]


def judge(rows: dict[str, dict[str, float]]) -> dict[str, bool | float | None]:
    res, orc = rows["residency"], rows["oracle"]
    ratio = res["load_wait_s"] / orc["load_wait_s"] if orc["load_wait_s"] > 0 else None
    return {
        "ratio_to_oracle": None if ratio is None else round(ratio, 3),
        "within_1.5x_oracle": ratio is not None and ratio <= 1.5,
        "below_every_baseline": all(res["load_wait_s"] < rows[b]["load_wait_s"] for b in BASELINES),
        "realtime_p99_ok": res["p99_realtime_s"] <= orc["p99_realtime_s"] + 0.1,
        "thrash_le_oracle": res["thrash"] <= orc["thrash"],
        "no_budget_violations": all(r["budget_violations"] == 0 for r in rows.values()),
        "oracle_not_beaten": all(r["load_wait_s"] >= orc["load_wait_s"] - 1e-9 for r in rows.values()),
    }


def run(config_path: str, traces: dict[str, list[Request]]) -> dict[str, object]:
    cfg = load_config(config_path)
    out: dict[str, object] = {}
    for name, reqs in traces.items():
        rows = {}
        for p in POLICY_NAMES:
            r = replay(cfg, reqs, p)
            rows[p] = {
                "load_wait_s": round(r.load_wait_s, 2),
                "cold_starts": r.cold_starts,
                "p99_realtime_s": round(r.wait_p99_s.get("realtime", 0.0), 3),
                "thrash": r.thrash,
                "evictions": r.evictions,
                "budget_violations": r.budget_violations,
                "rejected": r.rejected,
            }
        out[name] = {"requests": len(reqs), "policies": rows, "checks": judge(rows)}
    return out


def selected_traces(description: str) -> tuple[str, dict[str, list[Request]]]:
    """The command line's config path and traces: the shipped weeks (unless --no-shipped) and
    --heldout synthetic weeks of each profile from seed --heldout-start."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default="configs/home.yaml")
    ap.add_argument("--heldout", type=int, default=5, help="held-out weeks per profile")
    ap.add_argument("--heldout-start", type=int, default=301, help="first held-out seed")
    ap.add_argument("--no-shipped", action="store_true", help="only the held-out weeks")
    a = ap.parse_args()
    here = Path(__file__).parent / "traces"
    shipped = [] if a.no_shipped else SHIPPED
    traces = {n: read_trace(here / f"{n}.jsonl", strict=True).requests for n in shipped}
    for prof in ("home", "studio"):
        for s in range(a.heldout_start, a.heldout_start + a.heldout):
            traces[f"heldout-{prof}-seed{s}"] = synth(prof, 7, s)
    return a.config, traces


def main() -> int:
    config, traces = selected_traces("replay quality of every policy")
    json.dump({"config": config, "traces": run(config, traces)}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
