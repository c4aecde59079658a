"""Found in the third review of the decision engine; each failed before its fix."""

from __future__ import annotations

from test_review_engine2 import server

from manager.policy.baselines import LruKeepAlive
from manager.policy.engine import Engine
from manager.policy.types import DISK, GPU

GiB = 1 << 30


def engine() -> Engine:
    # two 6 GiB models on a 10 GiB device; the thrash window is the default 10 minutes
    eng = Engine(server([{"name": n, "memory": "6GiB"} for n in ("a", "b")]), LruKeepAlive())
    eng.actions = []
    eng.start(0.0)
    return eng


def ask(eng: Engine, name: str, now: float, busy: float = 1.0) -> str:
    m = eng.models[name]
    eng.observe(m, now)
    adm = eng.admit(m, 0, now)
    if adm.status in ("hit", "load"):
        eng.finish(m, max(now, adm.ready_at), busy)
    return adm.status


class TestAReloadAfterAFailedLoadIsNotThrashAgain:
    """One eviction, then a reload within the thrash window whose load failed on the device host
    (the live manager takes it off the books with `evict(failed=True)`), then the reload that
    worked: the thrash counter said 2 for the one eviction, as the failed load left the eviction's
    clock running (the log's own count, one per departure, says 1)."""

    def test_the_failed_reload_counts_and_the_retry_does_not(self) -> None:
        eng = engine()
        assert ask(eng, "a", 0.0) == "load"
        assert ask(eng, "b", 10.0) == "load"  # a goes (6 + 6 GiB > 10 GiB)
        assert eng.models["a"].tier != GPU
        assert ask(eng, "a", 60.0) == "load"  # back within 10 minutes: thrash 1
        assert eng.counters.thrash == 1
        eng.evict(eng.models["a"], 61.0, "load failed: out of memory", failed=True)
        assert eng.models["a"].tier == DISK
        ask(eng, "a", 120.0)
        assert eng.models["a"].tier == GPU
        assert eng.counters.thrash == 1  # was 2

    def test_a_reload_after_a_later_real_eviction_is_thrash_again(self) -> None:
        eng = engine()
        ask(eng, "a", 0.0)
        ask(eng, "b", 10.0)
        ask(eng, "a", 60.0)
        eng.evict(eng.models["a"], 61.0, "load failed: out of memory", failed=True)
        ask(eng, "a", 120.0)
        ask(eng, "b", 200.0)  # a real eviction of a again
        ask(eng, "a", 300.0)
        assert eng.counters.thrash == 3  # a at 60 (not its retry at 120), b at 200, a at 300
