"""Hot config reload: what a running service can take from a changed config, and what needs a restart.

`plan_reload(old, new)` returns the fields that changed (a model's `memory` and `load_seconds`,
which only seed what the running service measures, and the `server`, `store`, `ray` settings, read
at start, marked as taking effect at the next restart, but for `store.sessions_keep`, read at each
use; `tuning.schedule` too when it was off: its loop starts at start), or raises
`RestartNeeded` naming the first structural change (devices, host memory, the set of models, a model's
adapter/device/source/class/elastic range/max_batch, the classes' names or order, the policy's name).
`apply_reload(engine, new)` then updates the engine in place — keep-alives, prewarm, pins, class
reservations and rules, policy windows — so in-flight requests, resident models and learned
statistics are untouched.
"""

from __future__ import annotations

import math

from manager.config import Config
from manager.policy.engine import Engine


class RestartNeeded(ValueError):
    """The new config changes what the running service is built from."""


_SHAPE_FIELDS = ("adapter", "device", "source", "class", "elastic", "max_batch")
"""A model's fields a reload cannot change in place (its device host would need another build)."""


def _model_shape(config: Config) -> dict[str, tuple[object, ...]]:
    shapes: dict[str, tuple[object, ...]] = {}
    for m in config.models:
        elastic = m.elastic.model_dump() if m.elastic else None
        shapes[m.name] = (m.adapter, m.device, m.source, m.class_, elastic, m.max_batch)
    return shapes


def plan_reload(old: Config, new: Config) -> list[str]:
    if [d.model_dump() for d in old.devices] != [d.model_dump() for d in new.devices]:
        raise RestartNeeded("devices changed")
    if old.host != new.host:  # the books of host RAM are built once, around what it holds now
        raise RestartNeeded("host memory or reserve changed")
    if [c.name for c in old.classes] != [c.name for c in new.classes]:
        raise RestartNeeded("class names or their order changed")
    if old.policy.name != new.policy.name:
        raise RestartNeeded(f"policy changed from {old.policy.name!r} to {new.policy.name!r}")
    before, after = _model_shape(old), _model_shape(new)
    if set(before) != set(after):
        added, gone = sorted(set(after) - set(before)), sorted(set(before) - set(after))
        raise RestartNeeded(f"models added {added} or removed {gone}")
    for name in before:
        if before[name] != after[name]:
            changed = [f for f, b, a in zip(_SHAPE_FIELDS, before[name], after[name], strict=True) if b != a]
            raise RestartNeeded(
                f"model {name!r}: {', '.join(changed)} changed (adapter, device, source, class, elastic "
                "range and max_batch take effect at a restart)"
            )
    changes: list[str] = []
    olds = {m.name: m for m in old.models}
    for m in new.models:
        o = olds[m.name]
        for f in ("keep_alive", "prewarm", "pin"):
            if getattr(o, f) != getattr(m, f):
                changes.append(f"models.{m.name}.{f}")
        for f in ("memory", "load_seconds"):  # seeds of what the running service measures itself
            if getattr(o, f) != getattr(m, f):
                changes.append(f"models.{m.name}.{f} (at the next restart)")
    for oc, nc in zip(old.classes, new.classes, strict=True):
        for f in ("reserve", "may_evict", "max_wait", "max_queue"):
            if getattr(oc, f) != getattr(nc, f):
                changes.append(f"classes.{nc.name}.{f}")
    for f in ("thrash_window", "min_residency", "default_keep_alive"):
        if getattr(old.policy, f) != getattr(new.policy, f):
            changes.append(f"policy.{f}")
    return changes + _service_changes(old, new)


def _service_changes(old: Config, new: Config) -> list[str]:
    """The tuning settings read at each run, and the settings read once, at start (listed, so a
    reload never says "no changes" while it ignores them)."""
    changes = [
        f"tuning.{f}"
        for f in ("apply", "since", "out_dir")
        if getattr(old.tuning, f) != getattr(new.tuning, f)
    ]
    for section in ("server", "store", "ray"):
        o, n = getattr(old, section), getattr(new, section)
        changes += [
            f"{section}.{f}" + ("" if (section, f) in _READ_LIVE else " (at the next restart)")
            for f in type(o).model_fields
            if getattr(o, f) != getattr(n, f)
        ]
    if old.tuning.schedule != new.tuning.schedule:
        # the schedule's loop is started at start, when it is on, and reads the schedule at each check:
        # another period, or off, holds at once; turned on, it starts with the next restart
        later = old.tuning.schedule == "off"
        changes.append("tuning.schedule" + (" (at the next restart)" if later else ""))
    return changes


_READ_LIVE = {("store", "sessions_keep")}
"""Settings of the sections read at start that the running service reads at each use all the same
(the saved world sessions are trimmed to `store.sessions_keep` each time one closes)."""


def apply_reload(engine: Engine, new: Config) -> None:
    state = engine.state
    for mc in new.models:
        m = engine.models[mc.name]
        m.cfg = mc
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
    engine.config = new
    engine.recheck_fit()  # pins and reservations may have changed
