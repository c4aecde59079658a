"""Review 17: with Ray device hosts, a request that got no answer within its deadline (a slow model,
or one whose forward hangs) came back WORKER_DIED "no answer from device ...": the client got
UNAVAILABLE (a host that died), not DEADLINE_EXCEEDED (its deadline passed). It is now its own code,
DEADLINE: the client gets DEADLINE_EXCEEDED, the model is not taken for lost (not reloaded), and the
device is still looked at (`_resync_soon`: a host that is silent because it hung). The Ray calls are
faked here (unit tests only; `tests/integration` runs the real pool): `ray.get` timing out, a batch
that never answers; the live manager runs over real in-process hosts."""

from __future__ import annotations

import asyncio
import threading
import types
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from live_helpers import AUDIO, local_config, run

import workers.ray_pool as rp
from manager.api.errors import status_of
from manager.errors import DeadlineExceeded
from manager.live import LiveManager
from workers import protocol as P


def test_a_ray_get_that_times_out_is_a_deadline_not_a_death(monkeypatch: pytest.MonkeyPatch) -> None:
    def silent(ref: Any, timeout: float) -> Any:
        raise rp.GetTimeoutError("timed out")

    monkeypatch.setattr(rp.ray, "get", silent)
    deaths = rp._Deaths()
    fake = types.SimpleNamespace(_deaths=deaths)
    value, why, code = rp.RayWorkerPool._get(fake, object(), "gpu0", 0.5, "model 'voice'")  # type: ignore[arg-type]
    assert (value, code) == (None, P.DEADLINE)
    assert why == "model 'voice': no answer from device 'gpu0' within 0.5 s"
    assert not deaths.reported("gpu0", 0.0)  # not a death


def test_a_batch_that_never_answers_is_a_deadline() -> None:
    class Hung:
        async def submit(self, model: str, inputs: Any, sent: Any = None) -> P.InferResult:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    fake = types.SimpleNamespace(_refusal=lambda device: None, _batchers={"gpu0": Hung()})
    r = asyncio.run(rp.RayWorkerPool.infer_async(fake, "gpu0", "voice", {}, 0.05))  # type: ignore[arg-type]
    assert (r.ok, r.error_code) == (False, P.DEADLINE)
    assert "no answer from device 'gpu0' within 0.05 s" in (r.error or "")


class _SilentPool:
    """The in-process pool, but its `infer_async` (the Ray pool's data path) answers DEADLINE."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    async def infer_async(
        self,
        device: str,
        model: str,
        inputs: dict[str, np.ndarray],
        timeout_s: float = 30.0,
        late: Any = None,
    ) -> P.InferResult:
        return P.InferResult(
            model, False, error_code=P.DEADLINE, error=f"model {model!r}: no answer from device {device!r}"
        )


def test_the_client_gets_deadline_exceeded_and_the_model_stays(tmp_path: Path) -> None:
    cfg = local_config(tmp_path, ("voice",))

    async def body(lm: LiveManager) -> tuple[Exception, str, list[str]]:
        resyncs: list[str] = []
        real = lm._resync_soon
        lm._resync_soon = lambda device, why: (resyncs.append(why), real(device, why))[1]  # type: ignore[method-assign]
        with pytest.raises(DeadlineExceeded) as e:
            await lm.infer("voice", AUDIO)
        await asyncio.sleep(0.2)  # (a model taken for lost goes off the books at once)
        return e.value, lm.live["voice"].tier, resyncs

    err, tier, resyncs = run(cfg, body, wrap=_SilentPool)
    assert status_of(err) == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[arg-type]
    assert "no answer from device" in str(err)
    assert tier == "gpu"  # not taken for lost: not reloaded
    assert len(resyncs) == 1 and resyncs[0].startswith("deadline under a request of voice")


class _HungPool:
    """The in-process pool, whose forwards of `voice` hang until `go` is set (a model whose code waits
    on something that never comes)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.go = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> P.InferResult:
        self.entered.set()
        self.go.wait(30)
        return self.pool.infer(device, model, inputs, timeout_s)


def test_an_in_process_forward_that_hangs_is_answered_at_the_requests_deadline(tmp_path: Path) -> None:
    """In process, the request's timeout was not applied at all: a forward that hung held its
    request (and its client) for good. It is answered DEADLINE_EXCEEDED at its deadline now, as with
    Ray; once the forward ends, the model serves again."""
    cfg = local_config(tmp_path, ("voice",))
    hung: list[_HungPool] = []

    def wrap(pool: Any) -> _HungPool:
        hung.append(_HungPool(pool))
        return hung[0]

    async def body(lm: LiveManager) -> None:
        pool = hung[0]
        with pytest.raises(DeadlineExceeded, match=r"no answer from device 'cpu0' within [0-9.]+ s"):
            await lm.infer("voice", AUDIO, timeout_s=0.5)
        assert pool.entered.is_set()
        pool.go.set()
        served = await lm.infer("voice", AUDIO, timeout_s=30)
        assert served.result.ok

    run(cfg, body, wrap=wrap)
