"""Core value types of the pure decision engine (no ray/grpc/redis/torch imports).

Primitives, in the order a request meets them:
  Request  - one served request, as in the ▶ trace contract (JSON Lines).
  Tier     - where a model's weights are: GPU (ready to run), HOST (RAM), DISK (checkpoint only).
  Action   - a decision as data: load, promote, demote, drop, prewarm, shrink/grow lease.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Request:
    """One request: `t` Unix seconds, `model` name, `busy_s` how long it keeps the model busy.

    `cls` overrides the model's configured class for this request; `kind` is "infer" or "session"
    (a world-model session whose `busy_s` is its length); `client` is free-form; `keep_alive` is
    the request's own keep-alive in seconds (inf: forever; None: the config's), as Ollama's.
    """

    t: float
    model: str
    busy_s: float
    cls: str | None = None
    kind: str = "infer"
    client: str | None = None
    keep_alive: float | None = None


class Tier(enum.IntEnum):
    """Tiers, ordered by warmth."""

    DISK = 0
    HOST = 1
    GPU = 2


# The members under plain names, for the engine's and the policies' hot paths: reading `Tier.GPU`
# is a lookup on the enum's metaclass (about 0.1 us in CPython 3.11, several per replayed request).
DISK, HOST, GPU = Tier.DISK, Tier.HOST, Tier.GPU

# Each tier's name where it is written down (the store's intents, the admin API, device hosts' reports).
TIER_NAMES: dict[Tier, str] = {DISK: "disk", HOST: "host", GPU: "gpu"}


class ActionKind(enum.Enum):
    LOAD = "load"  # disk -> gpu (from the OS page cache when the file is cached)
    PROMOTE = "promote"  # host -> gpu
    LOAD_HOST = "load_host"  # disk -> host
    DEMOTE = "demote"  # gpu -> host
    DROP = "drop"  # gpu|host -> disk
    SHRINK_LEASE = "shrink_lease"  # elastic tenant gives bytes back
    GROW_LEASE = "grow_lease"  # elastic tenant takes bytes


@dataclass(slots=True, frozen=True)
class Action:
    """A decision as data. `prewarm` marks a load made before a predicted request.

    `bytes` is the size moved (or the new lease size for lease actions); `reason` says why, for
    events and for `why was X evicted`. `moved` is False for a drop that only brings the books in
    line with the device (a failed load, a model its host no longer holds): no eviction is counted.
    """

    kind: ActionKind
    model: str
    device: str
    bytes: int
    reason: str
    prewarm: bool = False
    moved: bool = True
