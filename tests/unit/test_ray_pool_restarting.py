"""A host's death is reported once; a command that then finds the host still restarting waits for
the new host instead of failing a second time.

`RayWorkerPool._failed` decides what a failed actor call becomes; here it is driven with Ray's own
exception objects on a pool built without actors (the real path, a host killed under a load and under
a request, is `tests/integration/test_worker_kill.py`).
"""

from __future__ import annotations

from collections import deque

from ray.exceptions import ActorDiedError, ActorUnavailableError

from workers import protocol as P
from workers import ray_pool
from workers.ray_pool import RayWorkerPool, _Deaths


def bare_pool() -> RayWorkerPool:
    pool = object.__new__(RayWorkerPool)  # no Ray: only what `_failed` touches
    pool._queued = {"gpu0": deque()}
    pool._not_before = {"gpu0": 0.0}
    pool._unavailable_since = {}
    pool._lost_replies = set()
    pool._deaths = _Deaths()
    return pool


RESTARTING = ActorUnavailableError("The actor is restarting", None)


def test_the_first_failure_is_reported_and_the_next_command_waits_for_the_new_host() -> None:
    pool = bare_pool()
    died = pool._failed("gpu0", "op-1", P.Drop("llm"), ActorDiedError(), now=100.0)  # under a load
    assert died is not None and died.error_code == P.WORKER_DIED and "gpu0" in (died.error or "")
    # The manager asks for a reload; the host is still restarting: queued again, first in line.
    pool._queued["gpu0"].append(("op-3", P.Drop("other")))
    assert pool._failed("gpu0", "op-2", P.Drop("llm"), RESTARTING, now=101.0) is None
    assert [op for op, _ in pool._queued["gpu0"]] == ["op-2", "op-3"]
    assert pool._not_before["gpu0"] == 101.0 + ray_pool.UNAVAILABLE_RETRY_S


def test_an_unreachable_host_not_yet_reported_dead_is_reported() -> None:
    # A command in flight when the host went away fails with ActorUnavailableError too: the manager
    # must hear of it (the host comes back empty), once.
    pool = bare_pool()
    first = pool._failed("gpu0", "op-1", P.Drop("llm"), RESTARTING, now=100.0)
    assert first is not None and first.error_code == P.WORKER_DIED
    assert pool._failed("gpu0", "op-2", P.Drop("llm"), RESTARTING, now=100.5) is None


def test_a_host_that_stays_unreachable_fails_the_command_in_the_end() -> None:
    pool = bare_pool()
    pool._failed("gpu0", "op-1", P.Drop("llm"), ActorDiedError(), now=100.0)
    assert pool._failed("gpu0", "op-2", P.Drop("llm"), RESTARTING, now=100.0) is None
    pool._queued["gpu0"].clear()
    late = 100.0 + ray_pool.UNAVAILABLE_MAX_S
    result = pool._failed("gpu0", "op-2", P.Drop("llm"), RESTARTING, now=late)
    assert result is not None and result.error_code == P.WORKER_DIED
    assert not pool._queued["gpu0"] and "op-2" not in pool._unavailable_since


def test_after_the_host_answered_a_new_death_is_reported_again() -> None:
    pool = bare_pool()
    pool._failed("gpu0", "op-1", P.Drop("llm"), ActorDiedError(), now=100.0)
    pool._deaths.alive("gpu0")  # a call succeeded on the new host
    again = pool._failed("gpu0", "op-2", P.Drop("llm"), RESTARTING, now=110.0)
    assert again is not None and again.error_code == P.WORKER_DIED
