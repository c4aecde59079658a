"""Replay speed: requests per second per policy on one core (one process, one thread).

usage: python bench/replay_speed.py [--weeks 4] [--repeat 3]
A busy home: `--weeks` synthetic home weeks back to back (about 10k requests a week). Each policy's
figure is the best (least CPU time) of `--repeat` replays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from manager.config import load_config
from manager.policy.factory import POLICY_NAMES
from manager.replay.synth import synth


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 weeks has no requests to time, and 0
    repeats timed nothing: it printed `Infinity` seconds, which is not JSON)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1")
    return n


def main(argv: list[str] | None = None) -> int:
    from manager.replay.sim import replay

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/home.yaml")
    ap.add_argument("--weeks", type=at_least_one, default=4)
    ap.add_argument("--repeat", type=at_least_one, default=3)
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    reqs = synth("home", 7 * a.weeks, 1)
    out: dict[str, object] = {"requests": len(reqs), "weeks": a.weeks, "policies": {}}
    for p in POLICY_NAMES:
        best = float("inf")
        for _ in range(a.repeat):
            t = time.process_time()
            replay(cfg, reqs, p)
            best = min(best, time.process_time() - t)
        out["policies"][p] = {"seconds": round(best, 3), "requests_per_s": round(len(reqs) / best)}  # type: ignore[index]
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
