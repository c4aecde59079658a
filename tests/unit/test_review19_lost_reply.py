"""Review 19: Ray's lost-object errors on a device host's call (`ObjectLostError` and its kin).

Ray 2.60's exceptions module: `ObjectLostError` says that every copy of a call's reply was lost from
the object store (node failure or system error); `ObjectReconstructionFailedError` and
`ObjectFetchTimedOutError` are kinds of it (the reply could not be made again, or not found);
`OwnerDiedError` says the reply's *owner* died, the process that made the call (the manager itself,
which is then not there to see it). None of them says that the host process died (Ray says that with
`RayActorError`, `WorkerCrashedError`, ...): the host's next call does. They are not a death here.
But the host may have run the command whose reply was lost: it was answered INTERNAL "failed on
device host (alive)" and the manager's books counted a load that the host had made as failed. Now a
command whose reply is lost is sent again, once, under the same op id (the host answers a repeated op
id from its cache of results, without running it again); an inference whose reply is lost says so.

Driven with Ray's own exception objects on a pool built without actors, as in
`test_ray_pool_restarting.py`."""

from __future__ import annotations

import pytest
from ray.exceptions import (
    ActorDiedError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    ObjectReconstructionFailedError,
    OwnerDiedError,
)
from test_ray_pool_restarting import bare_pool

from workers import protocol as P
from workers.ray_pool import _is_death

LOST = [
    ObjectLostError("ab" * 14, None, ""),
    ObjectReconstructionFailedError("ab" * 14, None, ""),
    ObjectFetchTimedOutError("ab" * 14, None, ""),
    OwnerDiedError("ab" * 14, None, ""),
]
IDS = [type(e).__name__ for e in LOST]


@pytest.mark.parametrize("e", LOST, ids=IDS)
def test_a_lost_reply_is_not_the_hosts_death(e: Exception) -> None:
    assert not _is_death(e)
    assert _is_death(ActorDiedError())  # (what a dead host's call raises)


@pytest.mark.parametrize("e", LOST, ids=IDS)
def test_a_command_whose_reply_was_lost_is_sent_again_once_under_its_op_id(e: Exception) -> None:
    pool = bare_pool()
    pool._queued["gpu0"].append(("op-2", P.Drop("other")))
    load = P.Drop("llm")
    assert pool._failed("gpu0", "op-1", load, e, now=100.0) is None  # sent again, first in line
    assert list(pool._queued["gpu0"]) == [("op-1", load), ("op-2", P.Drop("other"))]
    assert not pool._deaths.reported("gpu0", 100.0)
    pool._queued["gpu0"].popleft()
    again = pool._failed("gpu0", "op-1", load, e, now=101.0)  # lost a second time: it fails
    assert again is not None and again.error_code == P.INTERNAL and not again.ok
    assert "reply was lost" in (again.error or "") and "gpu0" in (again.error or "")
    assert "(alive)" not in (again.error or "")
    assert [op for op, _ in pool._queued["gpu0"]] == ["op-2"]
    assert not pool._deaths.reported("gpu0", 101.0) and "op-1" not in pool._lost_replies


def test_the_resent_command_finding_the_host_dead_reports_its_death() -> None:
    pool = bare_pool()
    load = P.Drop("llm")
    assert pool._failed("gpu0", "op-1", load, ObjectLostError("ab" * 14, None, ""), now=100.0) is None
    pool._queued["gpu0"].popleft()
    died = pool._failed("gpu0", "op-1", load, ActorDiedError(), now=101.0)
    assert died is not None and died.error_code == P.WORKER_DIED
    assert "op-1" not in pool._lost_replies  # (read-through: it stayed there for good)


@pytest.mark.parametrize("e", LOST[:2], ids=IDS[:2])
def test_an_inference_whose_reply_was_lost_says_so(e: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def lost(ref: object, timeout: float | None = None) -> object:
        raise e

    monkeypatch.setattr(ray, "get", lost)
    pool = bare_pool()
    value, why, code = pool._get(object(), "gpu0", 5.0, "model 'llm'")
    assert value is None and code == P.INTERNAL
    assert why is not None and why.startswith("model 'llm' on device host 'gpu0': its reply was lost")
    assert "(alive)" not in why and not pool._deaths.reported("gpu0", 0.0)
