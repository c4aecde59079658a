"""The policy interface: what a residency policy decides, given the engine's state.

A policy never moves bytes itself: the engine asks it (which victims, where to, when a model
expires, what to prewarm) and applies the answer within the admission rules. Policies read
`ModelState` (tier, bytes, times, reuse histogram, load-cost estimates) and the injected time.

Primitives, in the order the engine calls them:
  bind(engine) -> start(now) -> on_request(m, now) -> choose_victims(...) / evict_dest via
  uses_host_tier + host_victim(...) -> expiry(m, now) / expired(m, now) -> prewarm(now)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from manager.policy.state import ModelState
from manager.policy.types import HOST

if TYPE_CHECKING:
    from manager.policy.engine import Engine

Enough = Callable[[list[ModelState]], bool]


class Policy:
    """Defaults: LRU victims, drop to disk, keep-alive from the config (or the policy default)."""

    name = "base"
    eager_expiry = False
    """True: a model whose keep-alive expired is unloaded then (Ollama); False: it stays until its
    room is wanted, and expiry only makes it available to classes that may not evict."""
    uses_host_tier = False
    prewarm_min_residency = True
    """Does `min_residency` protect models from this policy's prewarms? (The oracle's prewarms are
    demand loads moved earlier, not predictions, so it is exempt.)"""
    prewarm_yields = False
    """May a request evict a model of its own class that this policy prewarmed and that has not
    served yet, within `min_residency`? (False: the guess holds its room like a demand load; the
    oracle's guesses are never wrong.)"""
    prewarm_as_demand = False
    """Are this policy's prewarms demand loads moved earlier? Then they take what the request would
    take a moment later: the room of a higher class's model past its keep-alive. (False: a guess
    does not touch a higher class; True for the oracle, whose prewarms are never wrong.) Room lent
    to an elastic lease every prewarm takes back first, as a request does: leases shrink before
    any weights are evicted (since 2026-12-03; a guess used to evict weights rather than shrink a
    running session's KV)."""
    max_loaded: int | None = None
    """A cap on models per device (Ollama's OLLAMA_MAX_LOADED_MODELS), pinned models not counted
    (a pin always wins); None: memory decides."""

    engine: Engine

    def bind(self, engine: Engine) -> None:
        self.engine = engine
        self.default_keep_alive = engine.config.policy.default_keep_alive

    def is_eager(self, m: ModelState) -> bool:
        """Is `m` unloaded as soon as its keep-alive expires?"""
        return self.eager_expiry

    def honours_keep_alive(self, m: ModelState) -> bool:
        """Is `m`'s keep-alive under this policy the config's explicit one (the user's word)? Then
        once it has expired and `m` has left the GPU, no prewarm brings `m` back before its next
        request (the engine refuses it, see `ModelState.held_off`)."""
        return m.keep_alive_cfg is not None and not m.pinned

    def after_request(self, m: ModelState, now: float) -> list[ModelState]:
        """Models to prewarm right after a request for `m` was admitted (e.g. its usual successors)."""
        return []

    def wants_wakeup_after(self, m: ModelState) -> bool:
        """Should the engine tick when `m`'s current request ends (e.g. to restore what it displaced)?"""
        return False

    def start(self, now: float) -> None:
        """Called once, after the pinned models are loaded."""

    def on_request(self, m: ModelState, now: float) -> None:
        """A request for `m` arrived (its histogram already holds it)."""

    def reloaded(self) -> None:
        """The config was reloaded in place (the engine's timers and `default_keep_alive` are the new
        ones): what the policy computed from the old ones is computed again."""

    def keep_alive(self, m: ModelState, now: float) -> float:
        if m.pinned:
            return math.inf
        return m.keep_alive_cfg if m.keep_alive_cfg is not None else self.default_keep_alive

    def expiry(self, m: ModelState, now: float) -> float:
        """Absolute time at which `m`'s GPU residency stops being protected."""
        return self.engine.idle_since(m) + self.keep_alive(m, now)

    def expired(self, m: ModelState, now: float) -> bool:
        return self.expiry(m, now) <= now

    def gives_way_at(self, m: ModelState, now: float) -> float:
        """When `m`, idle on the GPU and still within its keep-alive, gives its room to a request of a
        class that may not evict, or of a lower class than `m`'s (which otherwise wait until `m`'s
        keep-alive expires); inf: never (the default: its keep-alive protects it)."""
        return math.inf

    def victim_key(self, c: ModelState, now: float) -> tuple[float, str]:
        return (self.engine.idle_since(c), c.name)

    def choose_victims(
        self, m: ModelState, cands: list[ModelState], enough: Enough, now: float
    ) -> list[ModelState] | None:
        """Victims to evict so that `m` fits, in eviction order; None if no set is enough."""
        chosen: list[ModelState] = []
        for c in sorted(cands, key=lambda c: self.victim_key(c, now)):
            chosen.append(c)
            if enough(chosen):
                return chosen
        return None

    def host_victim(self, incoming: ModelState, now: float) -> ModelState | None:
        """A host-tier model to drop so `incoming` can be demoted, or None to drop `incoming`."""
        return None

    def may_displace(self, c: ModelState, m: ModelState, now: float) -> bool:
        """May a prewarm of `m` evict `c`?"""
        return False

    def prewarm(self, now: float) -> list[ModelState]:
        """Models to load now, before a predicted request."""
        return []

    def lease_headroom(self, m: ModelState, now: float) -> int:
        """Free bytes the elastic lease of `m` leaves ungrown in a session (room the policy expects
        a model back in soon: shrinking a lease spills KV pages first, which delays that load)."""
        return 0


def host_models(engine: Engine) -> list[ModelState]:
    """The host tier's models, less the one being loaded to the GPU from there this moment (a victim
    chosen among them would drop it, and it would load again from disk) and those already chosen to
    leave host RAM this moment (`Engine.host_leaving`)."""
    leaving = engine.host_leaving
    return [
        m for m in engine.models.values() if m.tier == HOST and m is not engine.incoming and m not in leaving
    ]
