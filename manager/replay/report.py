"""The `residency tune --report DIR` page: plots of two replays (before / after tuning) and a table.

Pure plotting and HTML (matplotlib with the Agg backend); the page is self-contained: inline CSS,
no scripts, no external URLs, PNGs next to `index.html`.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from manager.policy.stats import HomeHours
from manager.policy.types import Action, ActionKind, Request
from manager.replay.sim import ReplayResult

DAY = 86400.0
GIB = float(1 << 30)
TIER_COLORS = {"gpu": "#2ca02c", "host": "#ff7f0e", "disk": "#d9d9d9"}
DAY_NAMES = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
SUMMARY_HEAD = ("requests", "served", "rejected", "cold_starts", "load_wait_s")
SUMMARY_TAIL = ("evictions", "thrash", "budget_violations", "prewarm_loads", "wasted_loads")
Actions = Sequence[tuple[float, Action]]
Runs = list[tuple[str, ReplayResult]]


def _tier_after(a: Action, tier: str) -> str:
    """The tier of `a.model` after `a`, given its tier `tier` before."""
    if a.kind in (ActionKind.LOAD, ActionKind.PROMOTE):
        return "gpu"
    if a.kind in (ActionKind.DEMOTE, ActionKind.LOAD_HOST):
        return "host"
    if a.kind is ActionKind.DROP:
        return "disk"
    return tier  # lease actions don't move the model


def tier_spans(
    actions: Actions, models: Sequence[str], t_start: float, t_end: float
) -> dict[str, list[tuple[float, float, str]]]:
    """Per model, the spans `(t0, t1, tier)` covering [t_start, t_end], tier one of gpu/host/disk.

    Every model starts on disk; actions before `t_start` set the tier at `t_start`, actions after
    `t_end` are ignored, and so are models not in `models`. Adjacent spans have different tiers.
    """
    tier = {m: "disk" for m in models}
    since = {m: t_start for m in models}
    spans: dict[str, list[tuple[float, float, str]]] = {m: [] for m in models}
    for t, a in sorted(actions, key=lambda ta: ta[0]):
        if a.model not in tier or t > t_end:
            continue
        new = _tier_after(a, tier[a.model])
        if new == tier[a.model]:
            continue
        tc = max(t, t_start)
        if tc > since[a.model]:
            spans[a.model].append((since[a.model], tc, tier[a.model]))
            since[a.model] = tc
        tier[a.model] = new
    for m in models:
        if t_end > since[m]:
            spans[m].append((since[m], t_end, tier[m]))
    return spans


def gpu_bytes(
    actions: Actions, models: Sequence[str], model_weights: dict[str, int], t_start: float, t_end: float
) -> tuple[list[float], dict[str, list[int]]]:
    """GPU bytes per model as a step function: `(times, {model: values})`, value i holding on
    [times[i], times[i+1]); times run from `t_start` to `t_end` (the last value repeats there).

    LOAD/PROMOTE set a model's bytes to `a.bytes`; lease actions to its weights + the new lease;
    DEMOTE and DROP from the GPU (device != "host") set them to 0.
    """
    cur = dict.fromkeys(models, 0)
    times: list[float] = [t_start]
    values: dict[str, list[int]] = {m: [0] for m in models}
    for t, a in sorted(actions, key=lambda ta: ta[0]):
        if a.model not in cur or t > t_end:
            continue
        if a.kind in (ActionKind.LOAD, ActionKind.PROMOTE):
            cur[a.model] = a.bytes
        elif a.kind in (ActionKind.SHRINK_LEASE, ActionKind.GROW_LEASE):
            cur[a.model] = model_weights.get(a.model, 0) + a.bytes
        elif a.kind in (ActionKind.DEMOTE, ActionKind.DROP) and a.device != "host":
            cur[a.model] = 0
        else:
            continue
        tc = max(t, t_start)
        if tc > times[-1]:
            times.append(tc)
            for m in models:
                values[m].append(values[m][-1])
        values[a.model][-1] = cur[a.model]
    times.append(t_end)
    for m in models:
        values[m].append(values[m][-1])
    return times, values


def cold_by_hour(
    served_log: Sequence[tuple[float, str, bool, float]], hours: HomeHours | None = None
) -> list[int]:
    """Count of cold requests per hour of week (168 entries, 0 = Monday 00:00) on the home's wall
    clock `hours` (UTC's when None)."""
    hours = hours or HomeHours()
    counts = [0] * 168
    for t, _model, cold, _wait in served_log:
        if cold:
            counts[hours(t)] += 1
    return counts


def _mark_days(
    ax: Any, edges: list[float], mids: list[float], labels: list[str], xlim: tuple[float, float]
) -> None:
    """Gridlines at day edges, day names (unticked) at day middles, x over `xlim`."""
    ax.set_xticks(edges, [""] * len(edges))
    ax.set_xticks(mids, labels, minor=True)
    ax.tick_params(axis="x", which="minor", length=0)
    ax.grid(axis="x", which="major", color="#999999", linewidth=0.6)
    ax.set_xlim(*xlim)


MAX_DAY_MARKS = 31
"""Periods up to this many days get a gridline per midnight and day names; longer ones a coarser step."""
MAX_DATE_MARKS = 16
"""The most dated gridlines on a longer period (week, month or year steps): labels stay readable and
drawing stays quick whatever the span (a holdout line at t=0 makes it 56 years)."""
_WEEK_STEPS = (1, 2)
_MONTH_STEPS = (1, 2, 3, 6, 12, 24, 60, 120, 240, 600, 1200, 2400, 6000)
_MONDAY0 = 4 * DAY  # 1970-01-05, the first Monday of Unix time


def date_marks(t_start: float, t_end: float, most: int = MAX_DATE_MARKS) -> tuple[list[float], str]:
    """Unix times of at most `most` gridlines in [t_start, t_end] and the strftime format of their
    labels: Mondays every week or two, else the first of every k months (k = 1, 2, 3, 6, 12,
    24, 60, ... so that years line up)."""
    span = t_end - t_start
    for weeks in _WEEK_STEPS:
        step = 7 * weeks * DAY
        if span / step <= most:
            first = math.ceil((t_start - _MONDAY0) / step) * step + _MONDAY0
            return [first + i * step for i in range(int((t_end - first) // step) + 1)], "%d %b"
    start = datetime.fromtimestamp(t_start, tz=UTC)
    end = datetime.fromtimestamp(t_end, tz=UTC)
    m0, m1 = start.year * 12 + start.month - 1, end.year * 12 + end.month - 1
    k = next((k for k in _MONTH_STEPS if (m1 - m0) / k <= most), _MONTH_STEPS[-1])
    marks = []
    for m in range(math.ceil(m0 / k) * k, m1 + 1, k):
        t = datetime(m // 12, m % 12 + 1, 1, tzinfo=UTC).timestamp()
        if t_start <= t <= t_end:
            marks.append(t)
    return marks, ("%b %Y" if k < 12 else "%Y")


_CLOCK_STEPS_S = (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 7200, 10800)
"""Gridline steps of a period shorter than a day (it may hold no midnight and no noon to mark)."""


def _xlabel(t_start: float, t_end: float) -> str:
    """What the x axis's labels are, as `_day_axis` writes them: over more than MAX_DAY_MARKS
    days they are dates (`Dec 2026`, `2031`), which under "days since start" read as day counts."""
    span = t_end - t_start
    if span > MAX_DAY_MARKS * DAY:
        return "date (UTC)"
    return "days since start (UTC)" if span >= DAY else "time of day (UTC wall clock)"


def _day_axis(ax: Any, t_start: float, t_end: float) -> None:
    """x axis in days since t_start: gridlines at midnights (UTC), day names at noons; over more
    than MAX_DAY_MARKS days, dated gridlines every week, month(s) or year(s) (`date_marks`); under
    a day, gridlines labelled with the clock time every few seconds, minutes or hours."""
    span = t_end - t_start
    if span < DAY:
        step = float(next((s for s in _CLOCK_STEPS_S if span / s <= 12), _CLOCK_STEPS_S[-1]))
        first = math.ceil(t_start / step) * step
        marks = [first + i * step for i in range(max(0, int((t_end - first) // step) + 1))]
        fmt = "%a %H:%M" if step >= 60 else "%H:%M:%S"
        labels = [datetime.fromtimestamp(t, tz=UTC).strftime(fmt) for t in marks]
        ax.set_xticks([(t - t_start) / DAY for t in marks], labels)
        ax.grid(axis="x", which="major", color="#999999", linewidth=0.6)
        ax.set_xlim(0.0, span / DAY)
        return
    if span > MAX_DAY_MARKS * DAY:
        marks, fmt = date_marks(t_start, t_end)
        labels = [datetime.fromtimestamp(t, tz=UTC).strftime(fmt) for t in marks]
        ax.set_xticks([(t - t_start) / DAY for t in marks], labels)
        ax.grid(axis="x", which="major", color="#999999", linewidth=0.6)
        ax.set_xlim(0.0, (t_end - t_start) / DAY)
        return
    first = math.ceil(t_start / DAY) * DAY
    edges = [(first + i * DAY - t_start) / DAY for i in range(max(0, int((t_end - first) // DAY) + 1))]
    noon0 = math.floor(t_start / DAY) * DAY + DAY / 2
    noons = [n for n in (noon0 + i * DAY for i in range(int((t_end - noon0) // DAY) + 1)) if n >= t_start]
    labels = [datetime.fromtimestamp(n, tz=UTC).strftime("%a") for n in noons]
    _mark_days(ax, edges, [(n - t_start) / DAY for n in noons], labels, (0.0, (t_end - t_start) / DAY))


def _shown(name: str) -> str:
    """A name of the config's (a device's, a model's) as plot text: its `$` escaped, which matplotlib
    reads as math (`gpu$_$0` failed the whole report, after the search, with a traceback)."""
    return name.replace("$", r"\$")


def _save(fig: Any, path: Path, xlabel: str | None = None) -> None:
    if xlabel:
        fig.supxlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_timeline(path: Path, runs: Runs, models: list[str], t0: float, t1: float) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.5 + 0.5 * len(models) * len(runs)), squeeze=False)
    for ax, (label, res) in zip(axes[:, 0], runs, strict=True):
        spans = tier_spans(res.actions or [], models, t0, t1)
        for i, m in enumerate(models):
            for tier, color in TIER_COLORS.items():
                xr = [((a - t0) / DAY, (b - a) / DAY) for a, b, k in spans[m] if k == tier]
                if xr:
                    ax.broken_barh(xr, (i - 0.4, 0.8), facecolors=color)
        ax.set_yticks(range(len(models)), [_shown(m) for m in models])
        ax.set_ylim(len(models) - 0.5, -0.5)
        ax.set_title(f"Residency per model — {label}")
        _day_axis(ax, t0, t1)
    handles = [Patch(facecolor=c, label=k) for k, c in TIER_COLORS.items()]
    axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _save(fig, path, _xlabel(t0, t1))


def device_groups(
    models: list[str], model_devices: dict[str, str] | None
) -> list[tuple[str | None, list[str]]]:
    """The models by the device they run on, devices in order of their first model (one group, device
    None, when `model_devices` is not given): the memory plot stacks each device's models apart, as
    each device's memory is its own (one stack over three GPUs showed more than any one held)."""
    if not model_devices:
        return [(None, list(models))]
    groups: dict[str | None, list[str]] = {}
    for m in models:
        groups.setdefault(model_devices.get(m), []).append(m)
    return list(groups.items())


def _plot_memory(
    path: Path,
    runs: Runs,
    models: list[str],
    weights: dict[str, int],
    t0: float,
    t1: float,
    model_devices: dict[str, str] | None = None,
) -> None:
    groups = device_groups(models, model_devices)
    fig, axes = plt.subplots(
        len(runs) * len(groups), 1, figsize=(12, 3.6 * len(runs) * len(groups)), squeeze=False
    )
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    rows = [(run, group) for group in groups for run in runs]  # a device's runs one above the other
    first: dict[str | None, Any] = {}  # a device's first plot, whose y scale its others share
    for ax, ((label, res), (device, names)) in zip(axes[:, 0], rows, strict=True):
        if device in first:
            ax.sharey(first[device])
        first.setdefault(device, ax)
        times, values = gpu_bytes(res.actions or [], names, weights, t0, t1)
        x = [(t - t0) / DAY for t in times]
        ys = [[v / GIB for v in values[m]] for m in names]
        ax.stackplot(
            x, *ys, labels=[_shown(m) for m in names], colors=[colors[m] for m in names], step="post"
        )
        ax.set_ylabel("GiB")
        where = f"device {_shown(device)}" if device is not None else "GPU"
        ax.set_title(f"{where}: memory per model — {label}")
        _day_axis(ax, t0, t1)
        if first[device] is ax:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _save(fig, path, _xlabel(t0, t1))


def _plot_cold(path: Path, runs: Runs, hours: HomeHours) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.8 * len(runs)), squeeze=False, sharey=True)
    for ax, (label, res), color in zip(axes[:, 0], runs, ("#d62728", "#1f77b4"), strict=False):
        counts = cold_by_hour(res.served_log or [], hours)
        ax.bar(range(168), counts, width=0.9, color=color)
        ax.set_title(f"Cold starts by hour of week — {label} (total {sum(counts)})")
        ax.set_ylabel("cold requests")
        days = [24.0 * d for d in range(8)]
        _mark_days(ax, [h - 0.5 for h in days], [h + 11.5 for h in days[:7]], DAY_NAMES, (-0.5, 167.5))
    _save(fig, path, f"hour of week ({hours.name} wall clock)")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return "—" if v is None else str(v)


def _summary_rows(b: dict[str, Any], a: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    rows: list[tuple[str, Any, Any]] = [(k, b.get(k), a.get(k)) for k in SUMMARY_HEAD]
    bw, aw = b.get("wait_p99_s", {}), a.get("wait_p99_s", {})
    for c in list(bw) + [c for c in aw if c not in bw]:
        rows.append((f"wait_p99_s [{c}]", bw.get(c), aw.get(c)))
    rows += [(k, b.get(k), a.get(k)) for k in SUMMARY_TAIL]
    return rows


def _table(before: ReplayResult, after: ReplayResult) -> str:
    out = ["<table>", "<tr><th>figure</th><th>before</th><th>after</th><th>change</th></tr>"]
    for name, bv, av in _summary_rows(before.to_json(), after.to_json()):
        delta = "" if bv is None or av is None else _fmt(round(av - bv, 3))
        if delta and not delta.startswith("-") and delta != "0":
            delta = "+" + delta
        cells = (name, _fmt(bv), _fmt(av), delta)
        out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


CSS = """body{font-family:sans-serif;max-width:1250px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 10px}
td:not(:first-child){text-align:right;font-variant-numeric:tabular-nums}th{background:#f0f0f0}
img{max-width:100%;display:block;margin:1em 0}"""


def report_period(reqs: Sequence[Request]) -> tuple[float, float]:
    """The period a replay of `reqs` covers, for its report: from the first arrival until the last
    request ends (a session closing the trace would otherwise fall off the plots)."""
    return reqs[0].t, max(r.t + r.busy_s for r in reqs)


REPORT_FILES = ("index.html", "timeline.png", "memory.png", "cold_starts.png")
"""The files `write_report` writes into its folder (checked by `residency tune` before its search)."""


def write_report(
    out_dir: Path,
    *,
    before: ReplayResult,
    after: ReplayResult,
    t_start: float,
    t_end: float,
    model_weights: dict[str, int],
    title: str = "Residency tuning report",
    notes: list[str] | None = None,
    model_devices: dict[str, str] | None = None,
    hours: HomeHours | None = None,
) -> Path:
    """Write `index.html` and its PNGs (timeline, memory, cold starts) into `out_dir`; return the page.
    `model_devices` (model -> device) has the memory plot stack each device's models apart; `hours`
    (the config's `policy.timezone`; UTC when None) is the clock of the cold starts by hour of week.

    Both results must come from `replay(..., record=True)` (their actions and served logs).

    Raises:
        ValueError: a result without recorded actions or served log, or t_end <= t_start.
    """
    for res in (before, after):
        if res.actions is None or res.served_log is None:
            raise ValueError(f"replay of {res.policy!r} was not recorded (use record=True)")
    if t_end <= t_start:
        raise ValueError(f"empty report period: t_start={t_start}, t_end={t_end}")
    out_dir.mkdir(parents=True, exist_ok=True)
    acted = (a.model for res in (before, after) for _t, a in res.actions or [])
    models = list(dict.fromkeys([*model_weights, *acted]))
    runs = [(f"before ({before.policy})", before), (f"after ({after.policy})", after)]
    images = [
        ("timeline.png", "Residency timeline: tier (GPU, host RAM, disk) of each model over the period"),
        ("memory.png", "Memory of each device stacked per model over the period, in GiB"),
        ("cold_starts.png", "Cold starts per hour of week, before and after"),
    ]
    # each file written beside its place first, and all put in place once all are written: a report
    # that fails part way (a full disk) leaves the folder's earlier report whole, not mixed with this one
    staged = {name: out_dir / f".partial-{os.getpid()}-{name}" for name in REPORT_FILES}
    try:
        _plot_timeline(staged[images[0][0]], runs, models, t_start, t_end)
        _plot_memory(staged[images[1][0]], runs, models, model_weights, t_start, t_end, model_devices)
        _plot_cold(staged[images[2][0]], runs, hours or HomeHours())
        page = _page(before, after, t_start, t_end, title, notes, images)
        staged["index.html"].write_text(page, encoding="utf-8")
        for name, tmp in staged.items():
            os.replace(tmp, out_dir / name)
    except OSError as e:  # named by the report's own file, not the staged one (removed below)
        for name, tmp in staged.items():
            if e.filename is not None and Path(e.filename) == tmp:
                e.filename = str(out_dir / name)
        raise
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    return out_dir / "index.html"


def _page(
    before: ReplayResult,
    after: ReplayResult,
    t_start: float,
    t_end: float,
    title: str,
    notes: list[str] | None,
    images: list[tuple[str, str]],
) -> str:
    """The report's `index.html`."""
    fmt = "%a %Y-%m-%d %H:%M"
    span = " – ".join(datetime.fromtimestamp(t, tz=UTC).strftime(fmt) for t in (t_start, t_end))
    parts = [
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Replay period {html.escape(span)} (UTC wall clock).</p>",
        "<h2>Summary</h2>",
        _table(before, after),
    ]
    if notes:
        parts.append("<h2>Notes</h2>\n<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    parts.append("<h2>Plots</h2>")
    for name, alt in images:
        parts.append(f'<img src="{html.escape(name)}" alt="{html.escape(alt)}">')
    parts.append("</body></html>\n")
    return "\n".join(parts)
