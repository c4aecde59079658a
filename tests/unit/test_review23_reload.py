"""Found in review (2026-12-06, twenty-third session): a config reload applied to the engine's timers
but not to what the policies had computed from the old ones, nor to the hold-off of the old
keep-alive; load calls that waited 120 s whatever their deadline; ServerMetadata's extensions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from manager.api import admin as admin_module
from manager.api.admin import AdminServicer
from manager.api.oip import InferenceServicer
from manager.api.runtime import LOAD_WAIT_S
from manager.config import Config
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.policy.types import DISK, GPU, HOST
from manager.reload import apply_reload, plan_reload
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.v1 import residency_pb2 as admin_pb


def config(policy: dict[str, Any], *models: dict[str, Any], classes: int = 1) -> Config:
    names = ["realtime", "interactive", "background"] if classes == 3 else ["interactive"]
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "16GiB", "reserve": "4GiB"},
            "classes": [{"name": n, **({"may_evict": False} if n == "background" else {})} for n in names],
            "models": [
                {"adapter": "t", "device": "gpu0", "load_seconds": {"disk": 3, "host": 0.5}, **m}
                for m in models
            ],
            "policy": policy,
        }
    )


def serve(eng: Engine, name: str, t: float, busy: float = 0.5) -> None:
    m = eng.models[name]
    eng.observe(m, t)
    a = eng.admit(m, m.rank, t)
    eng.finish(m, max(t, a.ready_at), busy)


def reloaded(eng: Engine, new: Config, what: str) -> None:
    assert plan_reload(eng.config, new) == [what]
    apply_reload(eng, new)


def test_a_reloaded_min_residency_floors_the_learned_keep_alive_at_once() -> None:
    """`keep_alive: auto` is max(min_residency, the reuse p95), cached while the history grows by
    1/16: a reload from 60 s to 1 h left the busy voice model at 60 s, and a background request 2
    minutes after its last one evicted it ("keep-alive expired")."""
    models = (
        {"name": "tts", "class": "realtime", "memory": "5GiB", "prewarm": False},
        {"name": "batch", "class": "background", "memory": "5GiB", "prewarm": False},
    )
    eng = Engine(
        config({"name": "residency", "min_residency": 60}, *models, classes=3), create_policy("residency")
    )
    tts = eng.models["tts"]
    for i in range(200):  # 10 s apart: the p95 is about 10 s, the keep-alive the 60 s floor
        serve(eng, "tts", 10.0 * i)
        eng.tick(10.0 * i)
    assert eng.policy.keep_alive(tts, 2000.0) == 60.0
    reloaded(
        eng, config({"name": "residency", "min_residency": 3600}, *models, classes=3), "policy.min_residency"
    )
    assert eng.policy.keep_alive(tts, 2000.0) == 3600.0
    serve(eng, "batch", tts.last_end + 120.0)
    assert tts.tier == GPU  # within its keep-alive: a background request does not take its room


def test_a_reloaded_default_keep_alive_reaches_the_histogram_policys_windows() -> None:
    llm = {"name": "llm", "class": "interactive", "memory": "4GiB"}
    eng = Engine(config({"name": "histogram", "default_keep_alive": 3600}, llm), create_policy("histogram"))
    serve(eng, "llm", 0.0, busy=1.0)  # too few samples for windows of its own: the default
    reloaded(eng, config({"name": "histogram", "default_keep_alive": 60}, llm), "policy.default_keep_alive")
    assert eng.policy.keep_alive(eng.models["llm"], 100.0) == 60.0
    eng.tick(600.0)
    assert eng.models["llm"].tier == DISK  # expired 60 s after its request (it stayed: 1 h)


def test_the_hold_off_of_an_expired_keep_alive_goes_with_it_at_a_reload() -> None:
    """An explicit keep-alive that expired holds the model off prewarms until it is asked for again
    (the user's word); reloaded to `auto`, that word is gone, and the policy may prewarm it."""

    def llm(keep_alive: Any) -> dict[str, Any]:
        return {"name": "llm", "class": "interactive", "memory": "4GiB", "keep_alive": keep_alive}

    eng = Engine(config({"name": "residency"}, llm(60)), create_policy("residency"))
    eng.start(0.0)
    for t in (100.0, 400.0):
        serve(eng, "llm", t, busy=1.0)
    eng.tick(1000.0)
    m = eng.models["llm"]
    assert m.tier == HOST and m.held_off
    reloaded(eng, config({"name": "residency"}, llm("auto")), "models.llm.keep_alive")
    assert not m.held_off
    assert eng.prewarm(m, 1001.0) and m.tier == GPU


class _Loads:
    """A stand-in manager for the servicers' load calls: records each preload's wait."""

    def __init__(self) -> None:
        self.config = config({"name": "residency"}, {"name": "llm", "class": "interactive", "memory": "4GiB"})
        self.waits: list[tuple[str, float]] = []

    def _model(self, name: str) -> None:
        pass

    async def preload(self, name: str, tier: str = "gpu", timeout_s: float = 120.0) -> None:
        self.waits.append((tier, timeout_s))


class _Call:
    def __init__(self, left: float | None) -> None:
        self.left = left

    def time_remaining(self) -> float | None:
        return self.left


@pytest.mark.parametrize(("left", "waited"), [(None, LOAD_WAIT_S), (600.0, 599.0), (5.0, 4.5)])
def test_a_load_call_waits_as_long_as_its_deadline_lets_it(
    left: float | None, waited: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: RepositoryModelLoad (tritonclient's load_model, no deadline by default) and
    the admin's Preload waited 120 s, whatever the call's deadline: a slower cold load was answered
    DEADLINE_EXCEEDED to a client that set none, and went on loading; Triton's load waits for it."""
    monkeypatch.setattr(admin_module, "model_status", lambda manager, name: admin_pb.ModelStatus(name=name))
    manager = _Loads()
    oip_servicer = InferenceServicer(manager, describe=None)  # type: ignore[arg-type]
    asyncio.run(
        oip_servicer.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="llm"), _Call(left))
    )
    admin = AdminServicer(manager)  # type: ignore[arg-type]
    asyncio.run(admin.Preload(admin_pb.PreloadRequest(name="llm", tier="gpu"), _Call(left)))
    assert manager.waits == [("gpu", pytest.approx(waited))] * 2
    assert LOAD_WAIT_S >= 86400.0


def test_server_metadata_lists_tritons_names_for_what_is_served() -> None:
    """Found in review: ModelConfig and ModelStatistics are served but `model_configuration` and
    `statistics` were not listed, so a tool checking the list first took them for unsupported."""
    meta = asyncio.run(
        InferenceServicer(_Loads(), None).ServerMetadata(pb.ServerMetadataRequest(), _Call(None))
    )  # type: ignore[arg-type]
    assert {"model_repository", "model_configuration", "statistics", "schedule_policy"} <= set(
        meta.extensions
    )
