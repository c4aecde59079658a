"""Tuning gain: tune on week 1, judge on week 2 (a different seed, never seen by the search).

usage: python bench/tune_gain.py [--pairs 3]
For each starting config (the hand-written one, and the shipped home.yaml) and each pair of weeks:
load wait on week 2 with the starting config vs the tuned config. Models with too few requests in
week 1 are left as configured, as `residency tune` leaves them (`MIN_MODEL_REQUESTS`, `warnings`).
"""

from __future__ import annotations

import argparse
import json
import sys

from manager.config import load_config
from manager.replay.synth import synth
from manager.replay.tune import MIN_MODEL_REQUESTS, tune

CONFIGS = ["configs/examples/home-handwritten.yaml", "configs/home.yaml"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    a = ap.parse_args()
    out: dict[str, list[dict[str, object]]] = {}
    for path in CONFIGS:
        cfg = load_config(path)
        rows = []
        for k in range(a.pairs):
            w1, w2 = synth("home", 7, 200 + 2 * k), synth("home", 7, 201 + 2 * k)
            res = tune(cfg, w1, w2, min_requests=MIN_MODEL_REQUESTS)  # as `residency tune` does
            assert res.holdout_before is not None and res.holdout_after is not None
            b, t = res.holdout_before.load_wait_s, res.holdout_after.load_wait_s
            rows.append(
                {
                    "week1_seed": 200 + 2 * k,
                    "week2_seed": 201 + 2 * k,
                    "week2_load_wait_before_s": round(b, 2),
                    "week2_load_wait_after_s": round(t, 2),
                    "reduction": round(1 - t / b, 3) if b > 0 else 0.0,
                    "changes": res.changes,
                    "warnings": res.warnings,
                }
            )
        out[path] = rows
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
