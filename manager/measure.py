"""`residency measure`: real load times per transition for each configured model, as a table.

Each model runs through: a cold disk→gpu load (its files dropped from the OS page cache first), a
drop, a disk→gpu load from the page cache, gpu→host, host→gpu, drop, disk→host — on an in-process
device host of the model's configured device (the same code the Ray actors run). A CUDA device on a
machine without CUDA is measured on the CPU stand-in, and the output says so. The medians feed the
policy's cost table: `--write-config OUT` writes a copy of the config whose `load_seconds` and
`memory` are the measured ones (comments kept, but a comment beside a value that changed becomes
`# residency measure: memory was 9GiB (the comment)`: it spoke of the value that is gone).

Edge module: imports torch and the workers (the pure policy never does).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from manager.config import Config, ModelConfig

MIN_SECONDS = 0.001
"""Measured times below this are written as this (config fields must be > 0)."""


@dataclass
class ModelMeasure:
    name: str
    adapter: str
    device: str
    measured_on: str
    ok: bool = True
    error: str | None = None
    transitions: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per transition (`disk->gpu(cold)`, `disk->gpu(cached)`, `gpu->host`, `host->gpu`, `disk->host`,
    `drop`): median seconds of `total_s` and of each phase, and `bytes`."""
    footprint_bytes: int = 0
    memory_released: bool | None = None
    cold_was_cached: bool = False
    """The files stayed in the OS page cache though they were dropped from it before the cold load
    (a file on tmpfs, or mapped by another process): `disk->gpu(cold)` is a page-cache load, so a
    written config keeps its `disk` estimate instead of taking it."""

    def seconds(self, transition: str) -> float | None:
        t = self.transitions.get(transition)
        return None if t is None else t["total_s"]


def _summ(results: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("total_s", "read_s", "deserialize_s", "to_device_s", "warmup_s", "release_s"):
        out[key] = statistics.median(getattr(r.timing, key) for r in results)
    out["bytes"] = float(statistics.median(r.bytes_moved for r in results))
    return out


def _sequence(spec: Any) -> list[tuple[str, Any]]:
    from workers import protocol as P

    return [
        ("disk->gpu(cold)", P.Load(spec)),
        ("drop", P.Drop(spec.name)),
        ("disk->gpu(cached)", P.Load(spec)),
        ("gpu->host", P.Demote(spec.name)),
        ("host->gpu", P.Promote(spec.name)),
        ("drop", P.Drop(spec.name)),
        ("disk->host", P.Load(spec, "host")),
        ("drop", P.Drop(spec.name)),
    ]


def measure_model(config: Config, m: ModelConfig, repeats: int = 3) -> ModelMeasure:
    """One model's measurements; a failure of any kind is its error (whole), never a raise: the
    other models are still measured."""
    try:
        return _measure_model(config, m, repeats)
    except Exception as e:  # a raise here ended `residency measure` with a traceback, others unmeasured
        dev = next((d.name for d in config.devices if d.name == m.device), m.device)
        return ModelMeasure(m.name, m.adapter, dev, dev, ok=False, error=f"model {m.name!r}: {e!r}")


def _measure_model(config: Config, m: ModelConfig, repeats: int) -> ModelMeasure:
    import torch

    from manager.workers_bridge import model_specs
    from workers import protocol as P
    from workers.adapters import AdapterError, make_adapter
    from workers.host import DeviceHost
    from workers.st_io import drop_file_cache

    dev = next(d for d in config.devices if d.name == m.device)
    kind = dev.kind if dev.kind == "cpu" or torch.cuda.is_available() else "cpu"
    on = dev.name if kind == dev.kind else f"{dev.name} (CPU stand-in: no CUDA here)"
    out = ModelMeasure(m.name, m.adapter, dev.name, on)
    host = DeviceHost(dev.name, kind, index=dev.index)
    spec = model_specs(config)[m.name]
    try:
        paths = make_adapter(spec, host.torch_device).disk_paths()
    except AdapterError as e:
        out.ok, out.error = False, e.message
        return out
    except Exception as e:  # an adapter's own raise while naming its files: said, not raised
        out.ok, out.error = False, f"model {m.name!r}: its files cannot be named: {e!r}"
        return out
    runs: dict[str, list[Any]] = {}
    for i in range(repeats):
        for label, cmd in _sequence(spec):
            if label.endswith("(cold)"):
                for p in paths:
                    if p.is_file():
                        drop_file_cache(p)
            r = host.apply(cmd, f"{m.name}-{i}-{len(runs.get(label, []))}-{label}")
            if not r.ok:
                out.ok, out.error = False, f"{label}: {r.error}"
                host.apply(P.Drop(m.name), f"cleanup-{i}")
                return out
            runs.setdefault(label, []).append(r)
            if label.endswith("(cold)") and r.source == "cached":
                out.cold_was_cached = True
            if label == "host->gpu":
                out.footprint_bytes = max(out.footprint_bytes, r.footprint.device_bytes)
            if label == "drop":
                out.memory_released = bool(out.memory_released is not False and r.memory_released)
    out.transitions = {k: _summ(v) for k, v in runs.items()}
    return out


def measure_all(config: Config, models: list[str] | None = None, repeats: int = 3) -> list[ModelMeasure]:
    chosen = [m for m in config.models if models is None or m.name in models]
    return [measure_model(config, m, repeats) for m in chosen]


def _estimates(config: Config | None) -> dict[str, float]:
    """Each model's configured disk load seconds (what a cold load from the page cache keeps)."""
    return {m.name: m.load_seconds.disk for m in config.models} if config is not None else {}


def _load_seconds(mm: ModelMeasure, estimates: dict[str, float]) -> tuple[float, float, float] | None:
    """(disk, cached, host) as measured (a cold load from the page cache: the config's disk
    estimate), or None where one is missing."""
    disk, cached, host = (mm.seconds(t) for t in ("disk->gpu(cold)", "disk->gpu(cached)", "host->gpu"))
    if mm.cold_was_cached:
        disk = estimates.get(mm.name)
    if not mm.ok or disk is None or cached is None or host is None:
        return None
    return disk, cached, host


def _in_order(disk: float, cached: float, host: float) -> tuple[float, float, float]:
    """The config keeps host <= cached <= disk. On small files the measured medians can come out in
    another order (noise of milliseconds; where a model's start-up outweighs its read, more): keep
    the order, moving the noisy value the least."""
    host = max(host, MIN_SECONDS)
    disk = max(disk, cached, host)
    cached = min(max(cached, host), disk)
    return disk, cached, host


def config_updates(measures: list[ModelMeasure], config: Config | None = None) -> dict[str, dict[str, Any]]:
    """`load_seconds` and `memory` from the measurements, for `write_config_with_updates`. A model
    whose cold load came from the page cache (`cold_was_cached`) keeps `config`'s `disk` estimate,
    raised to the measured cached time if below it (no `load_seconds` is written for it without
    `config`)."""
    updates: dict[str, dict[str, Any]] = {}
    estimates = _estimates(config)
    for mm in measures:
        measured = _load_seconds(mm, estimates)
        if measured is None:
            continue
        disk, cached, host = _in_order(*measured)
        updates[mm.name] = {
            "load_seconds": {"disk": round(disk, 4), "cached": round(cached, 4), "host": round(host, 4)},
            "memory": max(mm.footprint_bytes, 1),
        }
    return updates


REORDER_NOTE_S = 0.05
"""A written load time this far (and 10 %) from its measurement is said (`reordered`)."""


def reordered(measures: list[ModelMeasure], config: Config | None = None) -> list[str]:
    """What `config_updates` wrote other than measured, beyond noise: for each such model, its
    measured and written load seconds (the config keeps host <= cached <= disk)."""
    notes = []
    estimates = _estimates(config)
    for mm in measures:
        measured = _load_seconds(mm, estimates)
        if measured is None:
            continue
        written = _in_order(*measured)
        moved = [
            (name, a, b)
            for name, a, b in zip(("disk", "cached", "host"), measured, written, strict=True)
            if abs(b - a) > max(REORDER_NOTE_S, 0.1 * a)
        ]
        if moved:
            said = ", ".join(
                f"the config's disk estimate {a:.3f} s written as {b:.3f} s"
                if name == "disk" and mm.cold_was_cached  # (its cold load was a page-cache one)
                else f"measured {name} {a:.3f} s written as {b:.3f} s"
                for name, a, b in moved
            )
            notes.append(
                f"{mm.name}: {said} (the config keeps host <= cached <= disk: where a model's start-up, "
                "not its read, decides these loads, their order is noise; more --repeats show the spread)"
            )
    return notes


def as_json(measures: list[ModelMeasure]) -> dict[str, Any]:
    return {"models": [asdict(m) for m in measures]}


def write_measured_config(src: Path, dst: Path, measures: list[ModelMeasure]) -> Config:
    """`src` with the measured figures into `dst` (which may be `src` itself), whole or not at all:
    a disk that fills up, or a service watching the file, never meets half a config. A symlink at
    `dst` is kept (its target written), an existing `dst` keeps its mode and owner, and a new one
    takes `src`'s mode (a private config's copy stays private). OSError (`NotWritable`) naming
    `dst` when it cannot be written; `dst` is then as it was."""
    from manager.config import load_config, write_config_with_updates
    from manager.tuning_job import write_config_atomically

    updates = config_updates(measures, load_config(src))

    def write(tmp: Path) -> Config:
        return write_config_with_updates(
            src,
            tmp,
            updates,
            header_comment=f"load_seconds and memory measured by `residency measure --config {src}`",
            note_measured=True,
        )

    return write_config_atomically(dst, write, mode=src.stat().st_mode & 0o7777)
