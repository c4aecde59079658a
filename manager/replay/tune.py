"""Weekly tuning: search keep-alive windows, prewarm switches and class reservations by replay.

Coordinate descent over per-model settings (two passes), then class reservations (raised, or
trimmed down to what the class's models need: `reserve_floor`, never below), each candidate
scored by replaying the search trace through the policy; a change is kept only when it lowers the
objective by more than `MIN_GAIN`. The chosen config is then measured on the held-out days, which
the search never saw. Pure Python (it only runs the simulator).

Thin data: with `min_requests=MIN_MODEL_REQUESTS` (as `residency tune` and the service's tuning
job call it), a model with fewer than that many requests in the search days is not tuned
(its keep-alive and prewarm stay as configured: a window chosen from a handful of reuses fits
noise), and a warning names it with its count; a search shorter than `MIN_SEARCH_SPAN_S` (a day)
is warned of too (the windows then fit the hours it holds, not a day's round), but still tuned.
Class reservations are searched as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from manager.config import Config
from manager.policy.types import Request
from manager.replay.sim import ReplayResult, replay
from manager.units import format_duration, format_size

KEEP_ALIVE_CHOICES: tuple[float | None, ...] = (None, 120.0, 600.0, 1800.0, 3600.0, 4 * 3600.0)
"""Candidate keep-alives: None is `auto` (learned from the reuse-interval histogram)."""
RESERVE_CHOICES_GIB = (0.0, 1.0, 2.0, 3.0, 4.0)
MIN_GAIN = 0.005
HOLDOUT_DAYS = 2.0
MIN_MODEL_REQUESTS = 10
"""A model with fewer requests than this in the search days keeps its configured keep-alive and
prewarm (about ten reuse intervals, as the histogram policy's scarce-data rule asks before it
trusts a window); the warning names it."""
MIN_SEARCH_SPAN_S = 86400.0
"""A search shorter than this (a day) is warned of: it has not seen a whole day's round."""


class TuningStopped(Exception):
    """A tuning run ended early on request: nothing was written."""


def objective(r: ReplayResult) -> float:
    """What tuning minimises: load wait, plus the highest class's tail (`realtime` in the example
    configs; `wait_p99_s` lists classes highest first) and rejections at a high price."""
    top_p99 = next(iter(r.wait_p99_s.values()), 0.0)
    return r.load_wait_s + 10.0 * top_p99 + 60.0 * r.rejected + r.thrash


@dataclass
class TuneResult:
    config: Config
    model_updates: dict[str, dict[str, Any]]
    class_updates: dict[str, dict[str, Any]]
    search_before: ReplayResult
    search_after: ReplayResult
    holdout_before: ReplayResult | None
    holdout_after: ReplayResult | None
    evaluations: int
    changes: list[str] = field(default_factory=list)
    """The settings the tuned config holds that differ from the config's, `llm.keep_alive = 1h`, in
    the order the search first changed them (a setting changed in the first pass and changed back in
    the second is not one)."""
    thin: dict[str, int] = field(default_factory=dict)
    """The models left as configured for too few requests in the search days (`thin_data`): name ->
    requests, in the config's order."""
    warnings: list[str] = field(default_factory=list)
    """What to tell the user about the data the search had (`thin_data`); empty when it was enough."""


def split_holdout(reqs: Sequence[Request], days: float = HOLDOUT_DAYS) -> tuple[list[Request], list[Request]]:
    """The last `days` of the trace are held out (the last 30 % if the trace is shorter than 2x that)."""
    if not reqs:
        return [], []
    span = reqs[-1].t - reqs[0].t
    cut = reqs[-1].t - days * 86400.0 if span >= 2 * days * 86400.0 else reqs[0].t + 0.7 * span
    return [r for r in reqs if r.t < cut], [r for r in reqs if r.t >= cut]


def thin_data(
    config: Config, search: Sequence[Request], min_requests: int = MIN_MODEL_REQUESTS
) -> tuple[dict[str, int], list[str]]:
    """The models tuning would change (not pinned) that have fewer than `min_requests` requests in
    `search` (name -> count, in the config's order), and the warnings to print: one naming those
    models with their counts, one when `search` spans less than `MIN_SEARCH_SPAN_S`."""
    counts = dict.fromkeys((m.name for m in config.models if not m.pin), 0)
    for r in search:
        if r.model in counts:
            counts[r.model] += 1
    thin = {name: n for name, n in counts.items() if n < min_requests}
    warnings: list[str] = []
    if thin:
        named = ", ".join(f"{name} ({n})" for name, n in thin.items())
        warnings.append(
            f"too few requests to tune (fewer than {min_requests} requests in the search days): "
            f"{named}; their keep_alive and prewarm are left as configured"
        )
    span = search[-1].t - search[0].t if search else 0.0
    if span < MIN_SEARCH_SPAN_S:
        warnings.append(
            f"the search days span {_about(span)}, less than a day: the tuned windows fit those hours, "
            "not a whole day's round"
        )
    return thin, warnings


def reserve_floor(config: Config, class_name: str) -> int:
    """The least `reserve` tuning may give the class `class_name`: what its models need on a GPU
    (the most, over cuda devices, of the footprints of the class's models placed there), but never
    more than the configured reserve. A reservation is a guarantee for the worst moment (voice must
    answer while a large model loads), which a week's replay may not hold: tuning may raise it, or
    trim one larger than the class's models, but not take the room they need."""
    configured = next(c.reserve for c in config.classes if c.name == class_name)
    need = 0
    for d in config.devices:
        if d.kind == "cuda":
            on = sum(m.footprint_min for m in config.models if m.class_ == class_name and m.device == d.name)
            need = max(need, on)
    return min(configured, need)


OWN_KEEP_ALIVE = {
    "lru-keepalive": "keeps its fixed keep-alive (policy.default_keep_alive, as Ollama's)",
    "histogram": "keeps the windows its histograms give",
    "oracle": "keeps what its foresight says",
}
"""The policies whose keep-alive is their own: a model's `keep_alive` changes nothing under them."""


LiveSizes = dict[str, tuple[int, bool]]
"""A running service's view of its models: name -> (bytes measured, pinned now: an admin's pin
or unpin included)."""


Measured = dict[str, tuple[int, dict[str, float]]]
"""A running service's measurements of its models: name -> (bytes on its device, load seconds by
source: "disk", "cached", "host"), as its engine decides by (the config's estimates until a load of
the model measured them)."""


def as_measured(config: Config, measured: Measured | None) -> Config:
    """`config` with its models' `memory` and `load_seconds` as the running service measured them
    (`measured`), for the replays of its tuning: the machine that runs, not the config's estimates
    (an LLM measured at 12 GiB and 20 s where the config says 9 GiB and 8 s is swapped very
    differently). Unvalidated (a copy of a valid config, two fields of its models replaced); the
    tuned settings go into `config` itself, never these sizes."""
    if not measured:
        return config
    models = []
    for m in config.models:
        got = measured.get(m.name)
        if got is None:
            models.append(m)
            continue
        nbytes, secs = got
        ls = m.load_seconds
        disk = float(secs.get("disk", ls.disk))
        host = min(float(secs.get("host", ls.host)), disk)  # (RAM beats disk, as the config's rule)
        cached = min(max(float(secs.get("cached", ls.cached_s)), host), disk)
        times = ls.model_copy(update={"disk": disk, "host": host, "cached": cached})
        models.append(m.model_copy(update={"memory": max(int(nbytes), 1), "load_seconds": times}))
    return config.model_copy(update={"models": models})


def _running(config: Config, live: LiveSizes | None) -> Any:
    """An engine of `config` holding the running service's sizes and pins (`live`)."""
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy

    eng = Engine(config, create_policy("residency"))
    if live:
        for m in eng.models.values():
            if m.name in live:
                m.weights, m.pinned = live[m.name]
        eng.recheck_fit()
    return eng


def reload_takes(running: Any, candidate: Config, live: LiveSizes | None) -> bool:
    """Whether the running service's reload would take `candidate`'s reservations beside its pinned
    models at their measured sizes (`manager.reload.check_measured_fit`, the reload's own rule:
    per class, its reservation or its pinned models, whichever is more, on each device). `running`:
    `_running(config, live)`. Without `live` (no service: the config's estimates), the config's
    own check has said it."""
    from manager.reload import PinsDoNotFit, check_measured_fit

    if not live:
        return True
    try:
        check_measured_fit(running, candidate, {n: p for n, (_, p) in live.items()}, set(live))
    except PinsDoNotFit:
        return False
    return True


def _reservable(
    config: Config,
    models: dict[str, dict[str, Any]],
    classes: dict[str, dict[str, Any]],
    live: LiveSizes | None,
    unservable: set[str],
    running: Any,
) -> bool:
    """Whether reservations `classes` are a candidate: not one that leaves some model no room anywhere
    (a model the search days never asked for costs nothing in their replay, and would be refused
    after), nor one the service's reload would refuse beside its pins at their measured sizes (the
    first rule counts higher classes' reservations only: one of the lowest class passed it, and the
    refused apply lost the run's keep-alives with it, week after week)."""
    try:
        candidate = with_settings(config, models, classes)
    except ValidationError:
        return False
    return never_fit(candidate, live) <= unservable and reload_takes(running, candidate, live)


def never_fit(config: Config, live: LiveSizes | None = None) -> set[str]:
    """The models `config` leaves room for on no device, its pins and reservations standing (the
    engine's own rule, which `config check` warns of): every request for them is refused. `live`:
    the sizes and pins a running service has (its measured footprints, not the config's estimates)."""
    return {name for name, why in _running(config, live).never_fits.items() if why}


def with_settings(
    base: Config, models: dict[str, dict[str, Any]], classes: dict[str, dict[str, Any]]
) -> Config:
    """`base` with per-model and per-class fields replaced (validated; raises ValidationError)."""
    data = base.model_dump(by_alias=True)
    for m in data["models"]:
        m.update(models.get(m["name"], {}))
    for c in data["classes"]:
        c.update(classes.get(c["name"], {}))
    return Config.model_validate(data)


def yaml_value(field_name: str, v: Any) -> Any:
    """A setting as the YAML scalar a person would write."""
    if field_name == "keep_alive":
        return "auto" if v is None else ("forever" if v == math.inf else format_duration(float(v)))
    if field_name == "reserve":
        return format_size(int(v))
    return v


def tune(
    config: Config,
    search: Sequence[Request],
    holdout: Sequence[Request] | None,
    *,
    policy: str = "residency",
    progress: Callable[[str], None] | None = None,
    stop: Callable[[], bool] | None = None,
    min_requests: int = 0,
    live: LiveSizes | None = None,
    measured: Measured | None = None,
) -> TuneResult:
    """The search; `stop` (checked before each replay) ends it early with TuningStopped. A model
    with fewer than `min_requests` requests in `search` is not tuned (`thin_data`): `residency
    tune` and the service's tuning job give `MIN_MODEL_REQUESTS`; 0 (the search alone, as the
    benchmarks and the search's own tests run it) tunes every model that is not pinned. `live` (the
    service's tuning job): its measured sizes and pins, which a class reservation tried is checked
    against (`never_fit`). `measured` (the service's tuning job): its models' measured sizes and
    load times, which every replay of the search and of the holdout takes (`as_measured`)."""
    thin, warnings = thin_data(config, search, min_requests)
    if policy in OWN_KEEP_ALIVE:
        warnings.append(
            f"policy {policy!r} {OWN_KEEP_ALIVE[policy]}, not the models' keep_alive: tuning their "
            "keep_alive changes nothing under it"
        )
    models: dict[str, dict[str, Any]] = {}
    classes: dict[str, dict[str, Any]] = {}
    evals = 0

    def stopped() -> None:
        if stop is not None and stop():
            raise TuningStopped("the tuning run was stopped (the service is stopping)")

    def score(
        ms: dict[str, dict[str, Any]], cs: dict[str, dict[str, Any]]
    ) -> tuple[float, ReplayResult] | None:
        nonlocal evals
        stopped()
        try:
            cfg = with_settings(config, ms, cs)
        except ValidationError:
            return None
        evals += 1
        r = replay(as_measured(cfg, measured), search, policy)
        return objective(r), r

    first = score(models, classes)
    assert first is not None, "the starting config is valid"
    best, before = first
    best_r = before
    changed: list[tuple[str, str, str]] = []  # (models or classes, name, field), first change first
    tunable = [m for m in config.models if not m.pin and m.name not in thin]
    for _ in range(2):
        for m in tunable:
            cands: list[dict[str, Any]] = [{"keep_alive": k} for k in KEEP_ALIVE_CHOICES]
            cands += [{"prewarm": not models.get(m.name, {}).get("prewarm", m.prewarm)}]
            for cand in cands:
                trial = {**models, m.name: {**models.get(m.name, {}), **cand}}
                s = score(trial, classes)
                if s is not None and s[0] < best * (1.0 - MIN_GAIN):
                    best, best_r, models = s[0], s[1], trial
                    changed += [("models", m.name, k) for k in cand]
            if progress is not None:
                progress(f"{m.name}: objective {best:.1f}")
    running = _running(config, live)
    unservable = {name for name, why in running.never_fits.items() if why}  # (`never_fit`'s)
    for c in config.classes:
        floor = reserve_floor(config, c.name)
        for gib in RESERVE_CHOICES_GIB:
            if int(gib * 2**30) < floor:
                continue
            trial_c = {**classes, c.name: {"reserve": int(gib * 2**30)}}
            if not _reservable(config, models, trial_c, live, unservable, running):
                continue
            s = score(models, trial_c)
            if s is not None and s[0] < best * (1.0 - MIN_GAIN):
                best, best_r, classes = s[0], s[1], trial_c
                changed.append(("classes", c.name, "reserve"))
    tuned = with_settings(config, models, classes)
    model_updates, class_updates, changes = _net(config, changed, models, classes)
    hb = ha = None
    if holdout:  # (a stop is looked at before each of these replays too: each is a week's)
        stopped()
        hb = replay(as_measured(config, measured), holdout, policy)
        stopped()
        ha = replay(as_measured(tuned, measured), holdout, policy)
    return TuneResult(
        config=tuned,
        model_updates=model_updates,
        class_updates=class_updates,
        search_before=before,
        search_after=best_r,
        holdout_before=hb,
        holdout_after=ha,
        evaluations=evals,
        changes=changes,
        thin=thin,
        warnings=warnings,
    )


def _net(
    config: Config,
    changed: list[tuple[str, str, str]],
    models: dict[str, dict[str, Any]],
    classes: dict[str, dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """The settings the search left different from `config`'s: the model and class updates (as
    YAML scalars) and one `name.field = value` per setting, in the order of `changed` (each change
    the search kept). A setting changed back is in none of them: the config's writer would note
    a value it did not change, and the header count a change the config does not hold."""
    updates: dict[str, dict[str, dict[str, Any]]] = {"models": {}, "classes": {}}
    chosen: dict[str, dict[str, dict[str, Any]]] = {"models": models, "classes": classes}
    was: dict[str, dict[str, Any]] = {
        "models": {m.name: m for m in config.models},
        "classes": {c.name: c for c in config.classes},
    }
    out: list[str] = []
    for what, name, field_name in dict.fromkeys(changed):
        v = chosen[what][name][field_name]
        if v != getattr(was[what][name], field_name):
            updates[what].setdefault(name, {})[field_name] = yaml_value(field_name, v)
            out.append(f"{name}.{field_name} = {_yaml_text(yaml_value(field_name, v))}")
    return updates["models"], updates["classes"], out


def _about(seconds: float) -> str:
    """A span as a person says it: `3.7 h`, `25 min`, `40 s`."""
    if seconds >= 3600.0:
        return f"{seconds / 3600.0:.1f} h"
    if seconds >= 60.0:
        return f"{seconds / 60.0:.0f} min"
    return f"{seconds:.3g} s"


def _yaml_text(v: Any) -> str:
    """A YAML scalar as it reads in the config: `false`, not Python's `False`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
