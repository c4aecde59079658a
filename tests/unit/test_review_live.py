"""Found in the review of the live manager and its Open Inference Protocol servicer (2026-12-03);
each failed before its fix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from live_helpers import CONFIG, TEXT, run

from manager.api.oip import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, InferenceServicer
from manager.config import load_config
from manager.errors import DeadlineExceeded, InvalidRequest
from manager.live import LiveManager
from residency_proto.inference import grpc_service_pb2 as pb


def _timeout(param: tuple[str, Any] | None, left: float | None = None) -> float:
    req = pb.ModelInferRequest(model_name="voice")
    if param is not None:
        setattr(req.parameters["timeout"], param[0], param[1])
    return InferenceServicer._timeout(SimpleNamespace(), req, left)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("param", "shown"),
    [
        (("int64_param", -5), "-5"),
        (("string_param", "5"), "'5'"),
        (("double_param", 1.5), "1.5"),
        (("bool_param", True), "True"),
    ],
)
def test_a_malformed_timeout_parameter_is_refused_by_name(param: tuple[str, Any], shown: str) -> None:
    """Triton's `timeout` parameter is whole microseconds; anything else was silently ignored (the
    request then waited up to a minute, not what its sender asked)."""
    wanted = rf"parameter 'timeout' must be a positive integer .* got {shown}"
    with pytest.raises(InvalidRequest, match=wanted):
        _timeout(param)


def test_a_timeout_parameter_is_capped_and_never_outlasts_the_call() -> None:
    assert _timeout(("int64_param", 2_500_000)) == 2.5
    assert _timeout(("uint64_param", 2**64 - 1)) == MAX_TIMEOUT_S  # was a deadline ~1.8e13 s away
    assert _timeout(("int64_param", 10_000_000), left=3.0) == pytest.approx(2.95)
    assert _timeout(None) == DEFAULT_TIMEOUT_S


class _SlowLoads:
    """A recording wrapper beside the real in-process pool: each finished load is reported 0.5 s
    late, so an admin can act while a request waits for it."""

    def __init__(self, pool: Any, delay: float = 0.5) -> None:
        self.pool, self.delay = pool, delay
        self.held: list[tuple[float, Any]] = []

    def __getattr__(self, k: str) -> Any:
        return getattr(self.pool, k)

    def poll(self) -> list[Any]:
        now = time.monotonic()
        for r in self.pool.poll():
            self.held.append((now + (self.delay if r.op == "load" else 0.0), r))
        out = [r for t, r in self.held if t <= now]
        self.held = [(t, r) for t, r in self.held if t > now]
        return out


def test_a_request_admitted_again_keeps_its_own_class(tmp_path: Path) -> None:
    """A background request (its class may not evict) for embed was admitted into free room; embed
    was taken off during its load and an admin preloaded world into that room. Re-admitted under the
    model's class instead of its own, the background request evicted world under the admin's
    preload. Now it waits for free room, and past its deadline it gets DEADLINE_EXCEEDED.

    (It was an admin's evict that took embed off; since 2026-12-04 that waits for the requests
    waiting for the load, so here a resync finds the device host no longer holds it: `_off_books`.)"""
    text = (
        CONFIG.read_text()
        .replace("memory: 4GiB, reserve: 512MiB", "memory: 200MiB, reserve: 0")
        .replace("class: background", "class: INTER")  # embed: interactive here
        .replace("class: interactive", "class: background")  # world: background here
        .replace("class: INTER", "class: interactive")
        .replace("policy: {name: residency}", "policy: {name: lru-keepalive}")
    )
    assert text.count("class: background") == 1 and "lru-keepalive" in text
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg = load_config(path)

    async def body(lm: LiveManager) -> None:
        world = lm.engine.models["world"]
        # long enough for world's preload to be confirmed (then idle: evictable by an interactive
        # request, not by a background one) on a busy two-core machine
        request = asyncio.create_task(lm.infer("embed", TEXT, cls="background", timeout_s=10))
        await asyncio.sleep(0.1)
        lm._off_books(lm.engine.models["embed"], "test: the device host no longer holds it")
        await asyncio.wait_for(lm.preload("world", timeout_s=60), 90)
        with pytest.raises(DeadlineExceeded, match="no room became free again before the deadline"):
            await asyncio.wait_for(request, 30)
        assert world.tier.name == "GPU", "a background request evicted the admin's preload"

    run(cfg, body, wrap=_SlowLoads)
