"""Hot config reload: what a running service can take from a changed config, and what needs a restart.

`plan_reload(old, new)` returns the fields that changed (a model's `memory` and `load_seconds`,
which only seed what the running service measures, and the `server`, `store`, `ray` settings, read
at start, marked as taking effect at the next restart, but for `store.sessions_keep` and
`server.world_idle_timeout`, read at each use; `tuning.schedule` too when it was off: its loop starts
at start), or raises `RestartNeeded` naming the first structural change (devices, host memory, the
set of models, a model's adapter/device/source/class/elastic range/max_batch, the classes' names or
order, the policy's name).
`check_measured_fit(engine, new, pins, measured)` refuses (`PinsDoNotFit`) a config whose pinned
models, at the footprints their device hosts measured, do not fit a device together with its class
reservations (the config's own check sees only its estimates). `apply_reload(engine, new)` then
updates the engine in place — keep-alives, prewarm, pins, class reservations and rules, policy
windows — so in-flight requests, resident models and learned statistics are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

from manager.config import Config, ConfigError
from manager.policy.engine import Engine
from manager.policy.stats import home_hours, hours_between
from manager.units import format_size


class RestartNeeded(ValueError):
    """The new config changes what the running service is built from."""


class CheckNotAnswered(TimeoutError):
    """A reload check that got no answer in its time (the service's event loop is held up): what it
    would have said is not known, and the check is not made later."""


class PinsDoNotFit(ConfigError):
    """The new config pins models that, at their measured footprints, do not fit their device together
    with its class reservations (a ConfigError: reported, and the running config kept, as a config
    that fails its own checks is)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("", [("", p) for p in problems])

    def __str__(self) -> str:
        return "; ".join(msg for _, msg in self.errors)


_SHAPE_FIELDS = ("adapter", "device", "source", "class", "elastic", "max_batch")
"""A model's fields a reload cannot change in place (its device host would need another build)."""


def _model_shape(config: Config) -> dict[str, tuple[object, ...]]:
    shapes: dict[str, tuple[object, ...]] = {}
    for m in config.models:
        elastic = m.elastic.model_dump() if m.elastic else None
        shapes[m.name] = (m.adapter, m.device, m.source, m.class_, elastic, m.max_batch)
    return shapes


def _said(field: str, v: object) -> str:
    """A setting's value as the config would say it (sizes in units)."""
    return format_size(v) if field in ("memory", "reserve") and isinstance(v, int) else repr(v)


def _fields_changed(what: str, old: Mapping[str, object], new: Mapping[str, object]) -> str:
    """`{what} memory changed (24GiB -> 12GiB), ...`: each field that differs, old and new."""
    said = [
        f"{f} changed ({_said(f, old.get(f))} -> {_said(f, new.get(f))})"
        for f in dict.fromkeys([*old, *new])
        if old.get(f) != new.get(f)
    ]
    return f"{what} {', '.join(said)}"


def _added_removed(what: str, before: list[str], after: list[str]) -> str:
    """`models added ['x'], removed ['y']` (each part only when not empty), or the order changed."""
    added, gone = [n for n in after if n not in before], [n for n in before if n not in after]
    parts = ([f"added {added}"] if added else []) + ([f"removed {gone}"] if gone else [])
    return f"{what} {', '.join(parts)}" if parts else f"{what}: their order changed"


def _device_change(old: Config, new: Config) -> str | None:
    """What changed in the devices (the first device that differs, and its fields), or None."""
    olds, news = [d.name for d in old.devices], [d.name for d in new.devices]
    if olds != news:
        return _added_removed("devices", olds, news)
    for o, n in zip(old.devices, new.devices, strict=True):
        if o.model_dump() != n.model_dump():
            return _fields_changed(f"device {o.name!r}:", o.model_dump(), n.model_dump())
    return None


TunedField = tuple[str, str, str]
"""A tuned setting: ("models" or "classes", the entry's name, the field)."""
TunedHold = dict[TunedField, tuple[Any, Any]]
"""The tuned settings a running service holds that its config file could not take (read-only):
each field's value in the file when the tuning applied it, and the tuned value (a YAML scalar)."""


def entry_values(config: Config) -> dict[TunedField, Any]:
    """Every model's and class's field in `config`, as its dump gives them."""
    data = config.model_dump(by_alias=True)
    return {
        (section, e["name"], f): v
        for section in ("models", "classes")
        for e in data[section]
        for f, v in e.items()
    }


def held_updates(held: Mapping[TunedField, tuple[Any, Any]], section: str) -> dict[str, dict[str, Any]]:
    """The tuned values of `held` for `section`'s entries, as `with_settings` takes them."""
    out: dict[str, dict[str, Any]] = {}
    for (sec, name, key), (_, tuned) in held.items():
        if sec == section:
            out.setdefault(name, {})[key] = tuned
    return out


def _with_held(config: Config, held: Mapping[TunedField, tuple[Any, Any]]) -> Config | None:
    """`config` with the tuned values of `held`; None when that is not a valid config."""
    from manager.replay.tune import with_settings

    try:
        return with_settings(config, held_updates(held, "models"), held_updates(held, "classes"))
    except ValidationError:
        return None


def over_file(new: Config, held: Mapping[TunedField, tuple[Any, Any]]) -> tuple[Config, TunedHold]:
    """`new` (the config file as read again) with the tuned settings of `held` whose field the file
    still holds as it did when the tuning applied them (a person's edit of the field wins), and
    those settings. One that no longer fits the file's other values goes, not all of them."""
    now = entry_values(new) if held else {}
    kept = {k: v for k, v in held.items() if k in now and now[k] == v[0]}
    while kept:
        config = _with_held(new, kept)
        if config is not None:
            return config, kept
        del kept[next((k for k in kept if _with_held(new, {k: kept[k]}) is None), next(iter(kept)))]
    return new, {}


def plan_reload(old: Config, new: Config, started: Config | None = None) -> list[str]:
    """The changes a reload from `old` to `new` applies (and those read at the next restart), or
    RestartNeeded naming the first structural change, its fields and their old and new values.
    `started` (default `old`): the config the service started with. A setting read only at start is
    listed "(at the next restart)" where `new` differs from it, not from `old`: one changed by an
    earlier reload is still waiting for the restart, and one changed back needs none."""
    started = old if started is None else started
    devices = _device_change(old, new)
    if devices is not None:
        raise RestartNeeded(devices)
    if old.host != new.host:  # the books of host RAM are built once, around what it holds now
        raise RestartNeeded(_fields_changed("host", old.host.model_dump(), new.host.model_dump()))
    if [c.name for c in old.classes] != [c.name for c in new.classes]:
        raise RestartNeeded(
            "class names or their order changed: "
            f"{[c.name for c in old.classes]} -> {[c.name for c in new.classes]}"
        )
    if old.policy.name != new.policy.name:
        raise RestartNeeded(f"policy changed from {old.policy.name!r} to {new.policy.name!r}")
    before, after = _model_shape(old), _model_shape(new)
    if set(before) != set(after):
        raise RestartNeeded(_added_removed("models", list(before), list(after)))
    for name in before:
        if before[name] != after[name]:
            changed = [f for f, b, a in zip(_SHAPE_FIELDS, before[name], after[name], strict=True) if b != a]
            raise RestartNeeded(
                f"model {name!r}: {', '.join(changed)} changed (adapter, device, source, class, elastic "
                "range and max_batch take effect at a restart)"
            )
    changes: list[str] = []
    olds = {m.name: m for m in old.models}
    firsts = {m.name: m for m in started.models}
    for m in new.models:
        o = olds[m.name]
        for f in ("keep_alive", "prewarm", "pin"):
            if getattr(o, f) != getattr(m, f):
                changes.append(f"models.{m.name}.{f}")
        first = firsts.get(m.name, o)
        for f in ("memory", "load_seconds"):  # seeds of what the running service measures itself
            if getattr(first, f) != getattr(m, f):
                # a seed: a footprint or load time the service has measured holds over it (saved
                # with the statistics), the restart included; the new value seeds one not measured
                changes.append(f"models.{m.name}.{f} (at the next restart, unless measured)")
    for oc, nc in zip(old.classes, new.classes, strict=True):
        for f in ("reserve", "may_evict", "max_wait", "max_queue"):
            if getattr(oc, f) != getattr(nc, f):
                changes.append(f"classes.{nc.name}.{f}")
    for f in ("thrash_window", "min_residency", "default_keep_alive", "timezone"):
        if getattr(old.policy, f) != getattr(new.policy, f):
            changes.append(f"policy.{f}")
    return changes + _service_changes(old, new, started)


def _service_changes(old: Config, new: Config, started: Config) -> list[str]:
    """The tuning settings read at each run, and the settings read once, at start (listed, so a
    reload never says "no changes" while it ignores them; against `started`, the config the service
    started with)."""
    changes = [
        f"tuning.{f}"
        for f in ("apply", "since", "out_dir")
        if getattr(old.tuning, f) != getattr(new.tuning, f)
    ]
    for section in ("server", "store", "ray"):
        o, n, first = getattr(old, section), getattr(new, section), getattr(started, section)
        for f in type(o).model_fields:
            if (section, f) in _READ_LIVE:
                if getattr(o, f) != getattr(n, f):
                    changes.append(f"{section}.{f}")
            elif getattr(first, f) != getattr(n, f):
                changes.append(f"{section}.{f} (at the next restart)")
    # the schedule's loop is started at start, when it is on, and reads the schedule at each check:
    # another period, or off, holds at once; turned on from off at start, it starts with the restart
    if started.tuning.schedule == "off":
        if new.tuning.schedule != "off":
            changes.append("tuning.schedule (at the next restart)")
    elif old.tuning.schedule != new.tuning.schedule:
        changes.append("tuning.schedule")
    return changes


_READ_LIVE = {
    ("store", "sessions_keep"),
    ("store", "request_log_retention"),
    ("server", "world_idle_timeout"),
}
"""Settings of the sections read at start that the running service reads at each use all the same
(the saved world sessions are trimmed to `store.sessions_keep` each time one closes; the request log
to `store.request_log_retention` at each hourly trim; a world stream reads
`server.world_idle_timeout` at each wait for its client's next action)."""


def check_measured_fit(
    engine: Engine, new: Config, pins: Mapping[str, bool], measured: Collection[str]
) -> None:
    """Refuse (PinsDoNotFit) `new` when, on some device, its pinned models (`pins`: model -> pinned, an
    admin's pins over the file's) at the footprints the engine holds for them (`measured`: the models
    whose footprint a device host measured; the others at the config's estimate) and its class
    reservations need more than the usable bytes, as the config's own check adds them up (per class,
    its reservation or its pinned models, whichever is more). A device the running config crowds as
    much already (pins measured too large after the start) does not refuse a reload that crowds it no
    more: another keep-alive, or an unpin, is still taken."""
    problems = []
    running = {name: m.pinned for name, m in engine.models.items()}
    for d in new.devices:
        dev = engine.state.devices[d.name]
        need, parts = _pinned_need(engine, d.name, new, new.class_reserves(d.name), pins, measured)
        if need <= dev.usable:
            continue
        if need <= _pinned_need(engine, d.name, new, dev.reserves, running, measured)[0]:
            continue
        problems.append(
            f"device {d.name!r}: the pinned models at their measured sizes and the class reservations "
            f"need {format_size(need)} ({'; '.join(parts)}) but only {format_size(dev.usable)} is usable "
            f"(memory {format_size(d.memory)} - reserve {format_size(d.reserve)}): unpin a model there, "
            "or lower a class reservation"
        )
    if problems:
        raise PinsDoNotFit(problems)


def _pinned_need(
    engine: Engine,
    device: str,
    config: Config,
    reserves: list[int],
    pins: Mapping[str, bool],
    measured: Collection[str],
) -> tuple[int, list[str]]:
    """What `device` holds for its classes: per class, its reservation or its pinned models (at the
    engine's footprints, with their elastic minimum), whichever is more; and that said per class."""
    total, parts = 0, []
    for rank, (c, reserve) in enumerate(zip(config.classes, reserves, strict=True)):
        pinned = [
            m
            for m in engine.models.values()
            if m.device == device and m.rank == rank and pins.get(m.name, False)
        ]
        need = max(reserve, sum(m.weights + m.lease_min for m in pinned))
        total += need
        if not need:
            continue
        said = []
        for m in pinned:
            # its weights (measured, or the config's estimate) and, for an elastic model, the lease's
            # minimum: the config's `memory` is compared with the weights alone
            weights = format_size(m.weights)
            if m.name in measured:
                estimate = config.model(m.name).memory
                weights += " measured" + (
                    f" (the config says {format_size(estimate)})" if m.weights != estimate else ""
                )
            size = weights
            if m.lease_min:
                both = format_size(m.weights + m.lease_min)
                size += f" + its elastic minimum {format_size(m.lease_min)} = {both}"
            said.append(f"{m.name} {size}")
        reserved = f" (reserve {format_size(reserve)})" if reserve and pinned else ""
        parts.append(
            f"{c.name} {format_size(need)}{reserved}" + (f" [pinned {', '.join(said)}]" if said else "")
        )
    return total, parts


def apply_reload(engine: Engine, new: Config, now: float | None = None) -> None:
    state = engine.state
    for mc in new.models:
        m = engine.models[mc.name]
        m.cfg = mc
        if mc.keep_alive != m.keep_alive_conf:  # the hold-off was the old keep-alive's word
            m.held_off = False
        m.keep_alive_conf = mc.keep_alive
        if m.keep_alive_req is None:  # (a request's own keep-alive holds until the next request)
            m.keep_alive_cfg = mc.keep_alive
        m.prewarm_ok = mc.prewarm
        m.pinned = mc.pin
    state.class_may_evict = [c.may_evict for c in new.classes]
    state.class_max_wait = [c.max_wait if c.max_wait is not None else math.inf for c in new.classes]
    for name, dev in state.devices.items():
        dev.reserves = new.class_reserves(name)
    engine.thrash_window = new.policy.thrash_window
    engine.min_residency = new.policy.min_residency
    engine.policy.default_keep_alive = new.policy.default_keep_alive
    if new.policy.timezone != engine.config.policy.timezone:  # the home's clock, from now on: what
        # the statistics counted is turned by the two clocks' difference (`now`: the clock's time;
        # by default the latest arrival), so each habit keeps its hour
        old, hours = engine.hours, home_hours(new.policy.timezone)
        if now is None:
            now = max((m.hist.last_t for m in engine.models.values() if m.hist.count), default=0.0)
        turn = hours_between(old.name, old.offset(now), hours, now)
        engine.hours = state.hours = hours
        for m in engine.models.values():
            m.hist.hours = hours
            m.hist.turn(turn)  # (its last arrival's hour read again on the new clock, too)
    engine.config = new
    engine.policy.reloaded()  # what it computed from the old timers
    engine.recheck_fit()  # pins and reservations may have changed
