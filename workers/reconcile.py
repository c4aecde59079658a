"""Reconcile what a device host really holds with what the manager intends (pure data, no Ray).

After a manager restart (or a device host restart), the manager reads `WorkerStatus` from each
reattached host and `plan` returns the commands that bring it to the intended tiers: loads for models
that should be resident and are not (a restarted host holds nothing) or are held with another spec,
drops for models held but not intended. Declarative commands make the plan safe to apply more than once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from workers import protocol as P


@dataclass(frozen=True)
class Drift:
    model: str
    intended: P.TierName
    actual: P.TierName


def drift(intent: Mapping[str, P.TierName], status: P.WorkerStatus) -> list[Drift]:
    """Models whose actual tier differs from the intended one (absent from `intent` = disk)."""
    names = sorted(set(intent) | set(status.models))
    out = []
    for n in names:
        want = intent.get(n, "disk")
        have: P.TierName = status.models[n].tier if n in status.models else "disk"
        if want != have:
            out.append(Drift(n, want, have))
    return out


def plan(
    intent: Mapping[str, P.TierName], specs: Mapping[str, P.ModelSpec], status: P.WorkerStatus
) -> list[P.Command]:
    """Commands that converge `status` to `intent` (KeyError if an intended model has no spec). A model
    held in its intended tier but with another spec than `specs` gives (another adapter, source or
    budget: the config changed while the host kept running) is loaded again from its spec, which
    replaces the old weights on the host."""
    cmds: list[P.Command] = []
    for d in drift(intent, status):
        if d.intended == "disk":
            cmds.append(P.Drop(d.model))
        else:
            cmds.append(P.Load(specs[d.model], d.intended))
    for name, held in sorted(status.models.items()):
        want = intent.get(name, "disk")
        if want == "disk" or held.tier != want or held.spec is None:  # (a drifted one is planned above)
            continue
        spec = specs.get(name, held.spec)
        if held.spec != spec:
            cmds.append(P.Load(spec, want))
    return cmds
