"""Markdown tables for bench/RESULTS.md from the JSON in bench/results/ (no replay is run).

usage: python bench/results_tables.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent / "results"
POLICIES = ["residency", "oracle", "lru-keepalive", "histogram", "gdsf"]


def quality(fname: str = "replay_quality.json") -> None:
    d = json.loads((HERE / fname).read_text())["traces"]
    print("| trace | " + " | ".join(POLICIES) + " | residency / oracle | realtime p99 s (res / oracle) |")
    print("|---|" + "---:|" * (len(POLICIES) + 2))
    for name, t in d.items():
        p, c = t["policies"], t["checks"]
        ratio = "n/a (oracle 0)" if c["ratio_to_oracle"] is None else f"{c['ratio_to_oracle']:.2f}"
        cells = " | ".join(f"{p[x]['load_wait_s']:.1f} ({p[x]['thrash']})" for x in POLICIES)
        rt = f"{p['residency']['p99_realtime_s']:.2f} / {p['oracle']['p99_realtime_s']:.2f}"
        print(f"| {name} | {cells} | {ratio} | {rt} |")
    print()
    keys = [k for k in next(iter(d.values()))["checks"] if k != "ratio_to_oracle"]
    print("| check | traces where it holds |")
    print("|---|---:|")
    for k in keys:
        print(f"| {k} | {sum(1 for t in d.values() if t['checks'][k])} of {len(d)} |")
    print()
    aggregate(d)


def aggregate(d: dict[str, dict[str, dict[str, dict[str, float]]]]) -> None:
    """Whole-set sums per group of weeks (shipped, held out): load wait (thrash), and the ratio of
    `residency`'s summed load wait to the oracle's."""
    groups: dict[str, list[str]] = {}
    for name in d:
        groups.setdefault("held out" if name.startswith("heldout-") else "shipped", []).append(name)
    print("| weeks | " + " | ".join(POLICIES) + " | residency / oracle (sums) |")
    print("|---|" + "---:|" * (len(POLICIES) + 1))
    for g, names in groups.items():
        lw = {x: sum(d[n]["policies"][x]["load_wait_s"] for n in names) for x in POLICIES}
        th = {x: sum(int(d[n]["policies"][x]["thrash"]) for n in names) for x in POLICIES}
        ratio = f"{lw['residency'] / lw['oracle']:.2f}" if lw["oracle"] > 0 else "n/a (oracle 0)"
        cells = " | ".join(f"{lw[x]:.1f} ({th[x]})" for x in POLICIES)
        print(f"| {g} ({len(names)}) | {cells} | {ratio} |")


def quality_heldout401() -> None:
    quality("replay_quality_heldout401.json")


def gaps() -> None:
    """Summed load wait by part, per group of weeks, for `residency`, the oracle and the oracle that
    does not foresee world-session starts; and how many weeks are within 1.5x of each reference."""
    groups: dict[str, dict[str, Any]] = {}
    files = {
        "gap_decomposition.json": "held out 301-305",
        "gap_decomposition_heldout401.json": "held out 401-410",
    }
    for fname, held in files.items():
        for name, t in json.loads((HERE / fname).read_text())["traces"].items():
            groups.setdefault(held if name.startswith("heldout-") else "shipped", {})[name] = t
    refs = ["oracle", "oracle-session-blind"]
    head = ["weeks", "policy", "session starts", "other requests in sessions", "requests outside sessions"]
    print("| " + " | ".join([*head, "total (thrash)", "residency within 1.5x of it"]) + " |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for g, d in groups.items():
        for x in ["residency", *refs]:
            rows = [t["policies"][x] for t in d.values()]
            part = {k: sum(r["by_part"][k] for r in rows) for k in ("session_starts", "in_session", "other")}
            total = sum(r["load_wait_s"] for r in rows)
            thrash = sum(r["thrash"] for r in rows)
            within = ""
            if x in refs:
                ok = sum(1 for t in d.values() if (q := t["residency_ratio_to"][x]) is not None and q <= 1.5)
                within = f"{ok} of {len(d)}"
            print(
                f"| {g} ({len(d)}) | {x} | {part['session_starts']:.1f} | {part['in_session']:.1f} | "
                f"{part['other']:.1f} | {total:.1f} ({thrash}) | {within} |"
            )
    print()
    cols = [
        "weeks",
        "the blind oracle within 1.5x of the oracle",
        "residency within 1.5x of the oracle on those weeks",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|---|---:|---:|")
    for g, d in groups.items():
        feasible = [t for t in d.values() if near_oracle(t, "oracle-session-blind")]
        met = sum(1 for t in feasible if near_oracle(t, "residency"))
        print(f"| {g} ({len(d)}) | {len(feasible)} of {len(d)} | {met} of {len(feasible)} |")


def near_oracle(t: dict[str, Any], policy: str, factor: float = 1.5) -> bool:
    """Whether `policy`'s load wait on a week of gap_decomposition.json is within `factor` times the
    oracle's (never, when the oracle waits 0 s and `policy` does not)."""
    wait = {p: r["load_wait_s"] for p, r in t["policies"].items()}
    return bool(wait[policy] <= factor * wait["oracle"] if wait["oracle"] > 0 else wait[policy] == 0)


def speed() -> None:
    d = json.loads((HERE / "replay_speed.json").read_text())
    print(f"{d['requests']:,} requests ({d['weeks']} weeks)\n")
    print("| policy | seconds | requests/s |")
    print("|---|---:|---:|")
    for p, v in d["policies"].items():
        print(f"| {p} | {v['seconds']} | {v['requests_per_s']:,} |")


def change_pct(reduction: float) -> str:
    """Week 2's change in load wait from `tune_gain.json`'s `reduction` (1 - after / before): a cut
    reads "−72.7 %", a rise (a tuned config that waits longer on the unseen week) "+5.0 %"."""
    sign = "−" if reduction >= 0 else "+"
    return f"{sign}{100 * abs(reduction):.1f} %"


def tune() -> None:
    d = json.loads((HERE / "tune_gain.json").read_text())
    pairs = len(next(iter(d.values())))
    print("| starting config | " + " | ".join(f"pair {i + 1}" for i in range(pairs)) + " |")
    print("|---|" + "---|" * pairs)
    for k, rows in d.items():
        cells = " | ".join(
            f"{r['week2_load_wait_before_s']} → {r['week2_load_wait_after_s']} s "
            f"({change_pct(r['reduction'])})"
            for r in rows
        )
        print(f"| `{k}` | {cells} |")


if __name__ == "__main__":
    for f in (quality, quality_heldout401, gaps, speed, tune):
        print(f"<!-- {f.__name__} -->")
        f()
        print()
