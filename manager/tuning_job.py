"""The weekly loop, built in: export the request log from the store, tune, write the proposal and its
report, and say whether it beats the running config on the most recent days (held out from the search).

`run_tuning` is what `tuning.schedule` runs inside the service (and what `residency tune --from-store`
does by hand). Applying is the caller's business: the service hot-reloads the proposal only with
`tuning.apply: auto` and only when `better` is true.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.config import Config, write_config_with_updates
from manager.replay.sim import replay
from manager.replay.trace import read_trace
from manager.replay.tune import objective, split_holdout, tune
from manager.store.export import export_trace

PERIOD_S = {"daily": 86400.0, "weekly": 7 * 86400.0}


@dataclass
class TuningOutcome:
    proposal: Path | None
    report: Path | None
    requests: int
    changes: list[str] = field(default_factory=list)
    better: bool = False
    holdout_before: dict[str, Any] | None = None
    holdout_after: dict[str, Any] | None = None
    reason: str = ""


def run_tuning(config: Config, config_path: Path, store: Any, now: float | None = None) -> TuningOutcome:
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    out_dir = Path(config.tuning.out_dir) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "requests.jsonl"
    n = export_trace(store, config.tuning.since, now, trace)
    names = {m.name for m in config.models}
    reqs = [r for r in read_trace(trace, strict=False).requests if r.model in names]
    search, holdout = split_holdout(reqs)
    if not search or not holdout:
        return TuningOutcome(None, None, n, reason=f"{n} requests logged: too few days to tune and hold out")
    res = tune(config, search, holdout, policy=config.policy.name)
    proposal = out_dir / "proposed.yaml"
    header = f"Proposed by the service's tuning on {stamp} from {len(search)} requests; changes: " + (
        "; ".join(res.changes) or "none"
    )
    write_config_with_updates(config_path, proposal, res.model_updates, res.class_updates, header)
    report = _report(out_dir / "report", config, res, holdout)
    before, after = res.holdout_before, res.holdout_after
    assert before is not None and after is not None
    better = bool(res.changes) and objective(after) < objective(before)
    why = "beats the running config on the held-out days" if better else "no improvement on the held-out days"
    return TuningOutcome(
        proposal, report, n, list(res.changes), better, before.to_json(), after.to_json(), reason=why
    )


def _report(out: Path, config: Config, res: Any, reqs: list[Any]) -> Path:
    from manager.replay.report import write_report

    before = replay(config, reqs, config.policy.name, record=True)
    after = replay(res.config, reqs, config.policy.name, record=True)
    notes = [f"change: {c}" for c in res.changes] or ["no change beat the running config"]
    return write_report(
        out, before=before, after=after, t_start=reqs[0].t, t_end=reqs[-1].t,
        model_weights={m.name: m.memory for m in config.models}, notes=notes,
        title="Residency tuning report (held-out days)",
    )  # fmt: skip


def due(config: Config, store: Any, now: float) -> bool:
    """Whether the schedule says a tuning run is due (the last run's time is kept in the store)."""
    period = PERIOD_S.get(config.tuning.schedule)
    if period is None:
        return False
    last = (store.get_doc("tuning") or {}).get("last_run", 0.0)
    return bool(now - float(last) >= period)


def tuning_step(manager: Any, config_path: Path, store: Any, now: float) -> TuningOutcome:
    """One scheduled run: tune, record it in the store, and hot-apply it when `apply: auto` and better."""
    from manager.config import load_config

    config: Config = manager.config
    outcome = run_tuning(config, config_path, store, now)
    applied = False
    if outcome.better and config.tuning.apply == "auto" and outcome.proposal is not None:
        manager.reload(load_config(outcome.proposal))
        applied = True
    store.put_doc(
        "tuning",
        {
            "last_run": now, "proposal": str(outcome.proposal) if outcome.proposal else None,
            "report": str(outcome.report) if outcome.report else None, "changes": outcome.changes,
            "better": outcome.better, "applied": applied, "reason": outcome.reason,
            "requests": outcome.requests,
            "holdout_before": outcome.holdout_before, "holdout_after": outcome.holdout_after,
        },
    )  # fmt: skip
    return outcome
