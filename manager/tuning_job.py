"""The weekly loop, built in: export the request log from the store, tune, write the proposal and its
report, and say whether it beats the running config on the most recent days (held out from the search).

`run_tuning` is what `tuning.schedule` runs inside the service (and what `residency tune --from-store`
does by hand). Applying is the caller's business: with `tuning.apply: auto`, and only when `better` is
true, the service writes the tuned fields into its config file (the file it replaced is kept beside the
proposal, as `previous.yaml`), so that they outlive a restart, and hot-reloads it. A run that fails is
recorded and tried again after `RETRY_S`, not at every check of the schedule.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.config import Config, ConfigError, write_config_with_updates
from manager.replay.sim import replay
from manager.replay.trace import read_trace
from manager.replay.tune import TuningStopped, objective, split_holdout, tune
from manager.store.base import CorruptDocument
from manager.store.export import export_trace

PERIOD_S = {"daily": 86400.0, "weekly": 7 * 86400.0}
RETRY_S = 3600.0
"""A scheduled run that failed is tried again after this long."""


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
    model_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    class_updates: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_tuning(
    config: Config,
    config_path: Path,
    store: Any,
    now: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> TuningOutcome:
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
    res = tune(config, search, holdout, policy=config.policy.name, stop=stop)
    proposal = out_dir / "proposed.yaml"
    header = f"Proposed by the service's tuning on {stamp} from {len(search)} requests; changes: " + (
        "; ".join(res.changes) or "none"
    )
    write_config_with_updates(
        config_path, proposal, res.model_updates, res.class_updates, header, note_changes=True
    )
    report = _report(out_dir / "report", config, res, holdout)
    before, after = res.holdout_before, res.holdout_after
    assert before is not None and after is not None
    better = bool(res.changes) and objective(after) < objective(before)
    why = "beats the running config on the held-out days" if better else "no improvement on the held-out days"
    return TuningOutcome(
        proposal, report, n, list(res.changes), better, before.to_json(), after.to_json(), why,
        res.model_updates, res.class_updates,
    )  # fmt: skip


def _report(out: Path, config: Config, res: Any, reqs: list[Any]) -> Path | None:
    """The held-out days' report, over the period until the last request ends (as `residency tune
    --report`); None when that period is empty (every request at one instant, none busy)."""
    from manager.replay.report import report_period, write_report

    t0, t1 = report_period(reqs)
    if t1 <= t0:
        return None
    before = replay(config, reqs, config.policy.name, record=True)
    after = replay(res.config, reqs, config.policy.name, record=True)
    notes = [f"change: {c}" for c in res.changes] or ["no change beat the running config"]
    return write_report(
        out, before=before, after=after, t_start=t0, t_end=t1,
        model_weights={m.name: m.memory for m in config.models}, notes=notes,
        title="Residency tuning report (held-out days)",
    )  # fmt: skip


def due(config: Config, store: Any, now: float) -> bool:
    """Whether the schedule says a tuning run is due (the last run's time is kept in the store); a run
    that failed is tried again `RETRY_S` after its failure. A record that cannot be read (not JSON, or
    times that are not numbers) counts as no record: the next run writes a good one."""
    period = PERIOD_S.get(config.tuning.schedule)
    if period is None:
        return False
    doc = _record(store)
    failed = _seconds(doc, "failed_at")
    if failed is not None and now - failed < RETRY_S:
        return False
    return bool(now - (_seconds(doc, "last_run") or 0.0) >= period)


def _record(store: Any) -> dict[str, Any]:
    """The store's tuning record ({} when there is none, or when the store answers but the record is
    corrupt: a run rewrites it). A store that does not answer raises."""
    try:
        return store.get_doc("tuning") or {}
    except CorruptDocument:
        return {}


def _seconds(doc: dict[str, Any], key: str) -> float | None:
    """`doc[key]` when it is a finite number (a time in Unix seconds), else None."""
    v = doc.get(key)
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _keep_copy(src: Path, dst: Path) -> None:
    """`src`'s bytes into `dst` with `src`'s file mode (a 0600 config stays private in its copy), never
    through a symlink at `dst` (OSError)."""
    data, mode = src.read_bytes(), src.stat().st_mode & 0o7777
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # (a copy left by an earlier run keeps its own mode otherwise)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_back(config_path: Path, outcome: TuningOutcome) -> str:
    """Write the tuned fields into the config file itself (comments kept; the replaced file kept as
    `previous.yaml` beside the proposal). Returns "" when written, else why not."""
    assert outcome.proposal is not None
    target = config_path.resolve()  # a symlinked config stays a symlink: its target is rewritten
    tmp = target.with_name(f".{target.name}.tuned")
    try:
        _keep_copy(target, outcome.proposal.parent / "previous.yaml")
        write_config_with_updates(
            target, tmp, outcome.model_updates, outcome.class_updates, note_changes=True
        )
        shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except (OSError, ValueError, ConfigError) as e:  # ConfigError: the file changed under us
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return f"not written into {config_path}: {e}"
    return ""


def tuning_step(
    manager: Any, config_path: Path, store: Any, now: float, stop: Callable[[], bool] | None = None
) -> TuningOutcome:
    """One scheduled run: tune, record it in the store, and apply it when `apply: auto` and better
    (written into the config file, then hot-reloaded; when the file cannot be written, the tuned
    fields alone are applied to the running config, so an edit hot-reloaded while the run went on
    is kept, as the file keeps it)."""
    from pydantic import ValidationError

    from manager.config import load_config
    from manager.reload import RestartNeeded
    from manager.replay.tune import with_settings

    config: Config = manager.config
    outcome = run_tuning(config, config_path, store, now, stop)
    if stop is not None and stop():  # the service is stopping: nothing is written or reloaded now
        raise TuningStopped("the tuning run was stopped (the service is stopping)")
    applied = False
    if outcome.better and config.tuning.apply == "auto" and outcome.proposal is not None:
        unwritten = write_back(config_path, outcome)
        try:
            if unwritten:  # not the proposal, made from the config as it was when the run began
                new = with_settings(manager.config, outcome.model_updates, outcome.class_updates)
            else:
                new = load_config(config_path)
            manager.reload(new)
            applied = True
            outcome.reason += "; applied" + (f", but {unwritten}: a restart reverts it" if unwritten else "")
        except (ConfigError, RestartNeeded, ValidationError) as e:
            outcome.reason += f"; not applied: {e}"
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


def scheduled_tuning(
    manager: Any, config_path: Path, store: Any, now: float, stop: Callable[[], bool] | None = None
) -> str | None:
    """What the service's schedule runs at each check: a tuning run when one is due (None when none
    is). Never raises: a failure (the store down, the output folder not writable, a bug) is recorded,
    when the store allows, and tried again after `RETRY_S`. `stop` (the service stopping) ends a run
    at its next replay, recording nothing. Returns what to say of the run."""
    try:
        if not due(manager.config, store, now):
            return None
        out = tuning_step(manager, config_path, store, now, stop)
    except TuningStopped as e:
        return f"stopped: {e}"
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        try:
            doc = _record(store)
            store.put_doc("tuning", {**doc, "failed_at": now, "error": why})
        except Exception:
            return f"failed ({why}); the store could not record it: retried at the next check"
        return f"failed ({why}); retried in {RETRY_S / 3600:g} h"
    return f"{out.reason}; changes: {', '.join(out.changes) or 'none'}; proposal: {out.proposal}"
