"""Review 17: a worker's NOT_AVAILABLE (its device host stopping, a device the Ray cluster cannot
place, a CUDA device on a node without CUDA) reached the client as INVALID_ARGUMENT, which says the
request is malformed and must not be retried; it is the server's state, so it is UNAVAILABLE now. A
call the model does not offer (one-shot inference on a world model) stays INVALID_ARGUMENT, as
BAD_INPUT. Real in-process device host with the WorldPager stand-in."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from manager.api.errors import status_of
from manager.errors import InvalidRequest, WorkerUnavailable
from manager.live_sessions import worker_error
from workers import protocol as P
from workers.host import DeviceHost


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (P.NOT_AVAILABLE, WorkerUnavailable),
        (P.WORKER_DIED, WorkerUnavailable),
        (P.LOAD_TIMEOUT, WorkerUnavailable),
        (P.BAD_INPUT, InvalidRequest),
    ],
)
def test_worker_codes_map_to_what_the_client_can_do(code: str, kind: type) -> None:
    e = worker_error(code, "model 'voice': the device host gpu0 is stopping; infer not run")
    assert type(e) is kind
    want = grpc.StatusCode.INVALID_ARGUMENT if kind is InvalidRequest else grpc.StatusCode.UNAVAILABLE
    assert status_of(e) == want


def test_one_shot_inference_on_a_world_model_is_the_requests_fault() -> None:
    host = DeviceHost("cpu0", "cpu")
    spec = P.ModelSpec("world", "worldpager-mg2", source={"preset": "micro"})
    assert host.apply(P.Load(spec, "gpu"), "op-1").ok
    r = host.infer("world", {"actions": np.zeros((1, 4), np.float32)})
    assert (r.ok, r.error_code) == (False, P.BAD_INPUT)
    assert "world session" in (r.error or "")
    assert status_of(worker_error(r.error_code, r.error or "")) == grpc.StatusCode.INVALID_ARGUMENT
