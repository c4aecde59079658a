"""Baseline policies, each the rule of a system users run today (see RESIDENCY_REFERENCE.md).

- `lru-keepalive` (Ollama's scheduler): a fixed keep-alive (5 min by default) after which an idle
  model is unloaded; under pressure the idle model with the shortest keep-alive goes first, ties by
  name (sched.go ByDurationAndName - not LRU, not size-aware); at most 3 models per GPU
  (OLLAMA_MAX_LOADED_MODELS=0 means 3 x GPUs); no host tier (the OS page cache still helps).
- `histogram` (Serverless in the Wild, ATC'20): per-model idle-time histogram; with enough data a
  pre-warm window (5th percentile) and a keep-alive window (99th percentile), 10 % margins;
  unloads at once when a pre-warm window applies and reloads at its end; few or out-of-range
  samples fall back to a fixed keep-alive; LRU under pressure.
- `gdsf` (GreedyDual-Size-Frequency, Cao & Irani 1997): H = L + cost * freq / size with the
  measured load cost; evict the lowest H and inflate L to it; capacity-driven only.
"""

from __future__ import annotations

import math

from manager.policy.base import Enough, Policy
from manager.policy.state import ModelState
from manager.policy.types import GPU

MIN_SAMPLES = 10
"""Intervals needed before the histogram policy trusts its histogram (the paper's scarce-data rule)."""
HIST_RANGE_S = 4 * 3600.0
"""The histogram's range (4 h of 1-minute bins in the paper); more out-of-range idle times: fallback."""


class LruKeepAlive(Policy):
    name = "lru-keepalive"
    eager_expiry = True

    max_loaded = 3

    def keep_alive(self, m: ModelState, now: float) -> float:
        if m.pinned:
            return math.inf
        return self.default_keep_alive if m.keep_alive_req is None else m.keep_alive_req

    def honours_keep_alive(self, m: ModelState) -> bool:
        # its keep-alive is its own fixed one, not the config's; a request's own is honoured (Ollama)
        return m.keep_alive_req is not None and not m.pinned

    def victim_key(self, c: ModelState, now: float) -> tuple[float, str]:
        return (self.keep_alive(c, now), c.name)


class HistogramPolicy(Policy):
    name = "histogram"
    eager_expiry = True

    def __init__(self) -> None:
        self._windows: dict[str, tuple[float, float]] = {}
        self._prewarm_at: dict[str, float] = {}

    def _compute(self, m: ModelState) -> tuple[float, float]:
        """(pre-warm window, keep-alive window) in seconds from the idle-time histogram."""
        h = m.hist
        if h.intervals < MIN_SAMPLES or h.cdf(HIST_RANGE_S) < 0.5:
            return (0.0, self.default_keep_alive)
        head, tail = h.quantiles(0.05, 0.99)
        tail = min(tail, HIST_RANGE_S)
        pre = head * 0.9 if head >= 60.0 else 0.0  # 1-minute bins: a head below one bin means none
        return (pre, max(60.0, tail * 1.1 - pre))

    def on_request(self, m: ModelState, now: float) -> None:
        pre, ka = self._compute(m)
        self._windows[m.name] = (pre, ka)
        self._prewarm_at.pop(m.name, None)

    def reloaded(self) -> None:
        # the windows of a model with too few samples are the default keep-alive: the new one
        models = self.engine.models
        self._windows = {name: self._compute(models[name]) for name in self._windows}

    def keep_alive(self, m: ModelState, now: float) -> float:
        if m.pinned:
            return math.inf
        pre, ka = self._windows.get(m.name, (0.0, self.default_keep_alive))
        pw = self._prewarm_at.get(m.name)
        if pw is not None:  # re-loaded by the pre-warm: kept for the keep-alive window after it
            return pw + ka - self.engine.idle_since(m)
        return 0.0 if pre > 0 else ka

    def honours_keep_alive(self, m: ModelState) -> bool:
        return False  # its windows come from the histogram; its pre-warm follows an unload by design

    def after_request(self, m: ModelState, now: float) -> list[ModelState]:
        pre, _ = self._windows.get(m.name, (0.0, 0.0))
        if pre > 0:  # unloaded right after its request: wake up at the pre-warm time
            self.engine.wakeups.append(m.last_end + pre)
        return []

    def prewarm(self, now: float) -> list[ModelState]:
        out = []
        for m in self.engine.models.values():
            pre, _ = self._windows.get(m.name, (0.0, 0.0))
            if pre <= 0 or m.tier == GPU or m.name in self._prewarm_at:
                continue
            if m.last_end + pre <= now < m.last_end + pre + 60.0:
                self._prewarm_at[m.name] = now
                out.append(m)
        return out

    def may_displace(self, c: ModelState, m: ModelState, now: float) -> bool:
        return self.expired(c, now)


class GDSF(Policy):
    name = "gdsf"

    def __init__(self) -> None:
        self.inflation = 0.0
        self._h: dict[str, float] = {}
        self._freq: dict[str, int] = {}

    def _cost(self, m: ModelState) -> float:
        return m.cost.get(self.engine.load_source(m))

    def on_request(self, m: ModelState, now: float) -> None:
        f = self._freq.get(m.name, 0) + 1 if m.tier == GPU else 1
        self._freq[m.name] = f
        self._h[m.name] = self.inflation + self._cost(m) * f / max(1, m.weights) * 2**30

    def victim_key(self, c: ModelState, now: float) -> tuple[float, str]:
        return (self._h.get(c.name, self.inflation), c.name)

    def choose_victims(
        self, m: ModelState, cands: list[ModelState], enough: Enough, now: float
    ) -> list[ModelState] | None:
        victims = super().choose_victims(m, cands, enough, now)
        if victims:
            self.inflation = max(self.inflation, max(self._h.get(v.name, 0.0) for v in victims))
        return victims
