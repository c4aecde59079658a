"""The replay simulator's timing model: waiting for room, class deadlines, the page cache, one load
at a time per device, and requests queueing behind busy models."""

from __future__ import annotations

from typing import Any

import pytest

from manager.config import Config
from manager.policy.types import Request
from manager.replay.sim import replay

T0 = 1793577600.0  # Monday 2026-11-02 00:00


def server(models: list[dict[str, Any]], **classes: Any) -> Config:
    bg: dict[str, Any] = {"name": "background", "may_evict": False, **classes}
    return Config.model_validate(
        {
            "devices": [{"name": "gpu0", "kind": "cuda", "memory": "10GiB", "reserve": "1GiB"}],
            "host": {"memory": "24GiB", "reserve": "4GiB"},
            "classes": [{"name": "interactive"}, bg],
            "models": [
                {"adapter": "test", "device": "gpu0", "prewarm": False, "keep_alive": "10m", **m}
                for m in models
            ],
            "policy": {"min_residency": 0},
        }
    )


def m(
    name: str, cls: str, memory: str, disk: float = 4.0, cached: float = 2.0, host: float = 1.0
) -> dict[str, Any]:
    return {
        "name": name,
        "class": cls,
        "memory": memory,
        "load_seconds": {"disk": disk, "cached": cached, "host": host},
    }


def req(t: float, model: str, busy: float = 1.0) -> Request:
    return Request(t=T0 + t, model=model, busy_s=busy)


class TestWaitingForRoom:
    def test_background_waits_for_a_busy_model_then_runs(self) -> None:
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")])
        # chat is busy for 100 s and holds 6 of 9 GiB; batch (4 GiB) may not evict: it waits
        # until chat's keep-alive (10 min after its request ends) expires, then takes the room.
        r = replay(cfg, [req(0, "chat", busy=100.0), req(10, "batch")], "gdsf")
        assert r.served == 2 and r.rejected == 0
        # chat loaded (4 s) and ran until 104; it expired at 104 + 600 = 704, when batch (waiting
        # since t=10) took its room and loaded from disk (4 s).
        assert r.models["batch"].load_wait_s == pytest.approx(704 - 10 + 4.0)

    def test_a_class_deadline_rejects_what_waited_too_long(self) -> None:
        cfg = server([m("chat", "interactive", "6GiB"), m("batch", "background", "4GiB")], max_wait="1m")
        r = replay(cfg, [req(0, "chat", busy=100.0), req(10, "batch")], "gdsf")
        assert r.served == 1 and r.rejected == 1
        assert any("max_wait" in reason for reason in r.reject_reasons)


class TestLoadTiming:
    def test_loads_on_one_device_run_one_at_a_time(self) -> None:
        cfg = server([m("a", "interactive", "2GiB", disk=4.0), m("b", "interactive", "2GiB", disk=3.0)])
        r = replay(cfg, [req(0, "a"), req(0, "b")], "gdsf")
        assert r.models["a"].load_wait_s == pytest.approx(4.0)  # a loads first
        assert r.models["b"].load_wait_s == pytest.approx(7.0)  # b's load queues behind a's

    def test_a_dropped_model_comes_back_from_the_page_cache(self) -> None:
        cfg = server([m("a", "interactive", "6GiB"), m("b", "interactive", "6GiB")])
        # a loads from disk; b needs its room (gdsf drops a to disk); a's file stays in the page cache,
        # so a's second load costs `cached`, not `disk`.
        r = replay(cfg, [req(0, "a"), req(100, "b"), req(200, "a")], "gdsf")
        assert r.loads_by_source == {"disk": 2, "cached": 1, "host": 0}
        assert r.models["a"].load_wait_s == pytest.approx(4.0 + 2.0)

    def test_requests_queue_behind_a_busy_model(self) -> None:
        cfg = server([m("a", "interactive", "2GiB")])
        r = replay(cfg, [req(0, "a", busy=10.0), req(1, "a", busy=1.0)], "gdsf")
        # the second request waits for the load (until 4) and then for the first (4 + 10 = 14).
        assert r.wait_p99_s["interactive"] == pytest.approx(14.0 - 1.0)
        assert r.models["a"].cold_starts == 2  # both arrived before the model was ready


class TestBadRequests:
    def test_unknown_models_and_classes_are_rejected_with_a_reason(self) -> None:
        cfg = server([m("a", "interactive", "2GiB")])
        r = replay(cfg, [req(0, "nope"), Request(t=T0 + 1, model="a", busy_s=1.0, cls="vip")], "residency")
        assert r.rejected == 2 and r.served == 0
        assert set(r.reject_reasons) == {"unknown model 'nope'", "unknown class 'vip'"}


def test_class_reservations_hold_on_gpu_devices_only_as_the_config_says() -> None:
    # `ClassConfig.reserve` is "bytes on each GPU (cuda) device"; the config's cross-checks ignore it
    # on cpu devices, and so does the engine: a 700 MiB interactive model fits a 1 GiB cpu device
    # beside a 512 MiB realtime reservation (it was rejected, "can never give it more than 512MiB").
    def config(kind: str) -> Config:
        return Config.model_validate(
            {
                "devices": [{"name": "dev0", "kind": kind, "memory": "1GiB"}],
                "host": {"memory": "8GiB", "reserve": "1GiB"},
                "classes": [{"name": "realtime", "reserve": "512MiB"}, {"name": "interactive"}],
                "models": [{**m("chat", "interactive", "700MiB"), "adapter": "test", "device": "dev0"}],
            }
        )

    assert config("cpu").class_reserves("dev0") == [0, 0]
    assert replay(config("cpu"), [req(0, "chat")], "residency").served == 1
    with pytest.raises(ValueError, match="can never fit"):  # on a GPU the reservation holds
        config("cuda")


def test_times_so_large_that_a_second_is_lost_in_rounding_replay_without_dividing_by_zero() -> None:
    # The trace reader refuses t > 1e11; replay itself, given such Requests directly, still finishes.
    cfg = server([m("a", "interactive", "2GiB")])
    res = replay(cfg, [Request(t=1e19, model="a", busy_s=1.0)], "residency")
    assert res.served == 1
    assert res.models["a"].resident_fraction == 0.0
