"""A local Ray whose node is slow to come up is started again, a bounded number of times.

Ray 2.60 waits a fixed 30 s for a new node's raylet to register and then raises "The current node
timed out during startup"; on a loaded two-core CI machine that happened once in a full run. These
tests stand `ray.init` in with a fake (unit tests never start Ray); the real start is exercised by
every integration test through the `ray_cluster` fixture, which uses the same function.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import warnings
from typing import Any

import psutil
import pytest
import ray

from workers import ray_pool

TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class FakeInit:
    """`ray.init` that fails with the given errors in turn, then succeeds."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = list(errors)
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture
def shutdowns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append(1))
    return seen


def test_a_start_that_timed_out_is_tried_again_with_the_same_arguments(
    monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]
) -> None:
    fake = FakeInit([TIMEOUT])
    monkeypatch.setattr(ray, "init", fake)
    ray_pool.start_local_ray(num_cpus=2, namespace="ns")
    assert fake.calls == [{"num_cpus": 2, "namespace": "ns"}] * 2
    assert len(shutdowns) == 1  # the failed start is shut down before the next


def test_the_last_timeout_is_raised(monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]) -> None:
    fake = FakeInit([TIMEOUT] * 3)
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_pool.start_local_ray(tries=3)
    assert len(fake.calls) == 3


def test_any_other_failure_is_raised_at_once(monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]) -> None:
    fake = FakeInit([ValueError("bad object_store_memory")])
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(ValueError, match="object_store_memory"):
        ray_pool.start_local_ray()
    assert len(fake.calls) == 1
    assert shutdowns == []


def test_ensure_ray_joins_a_cluster_once_and_starts_a_local_one_with_retries(
    monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]
) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    joined = FakeInit([TIMEOUT])
    monkeypatch.setattr(ray, "init", joined)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_pool.ensure_ray("10.0.0.5:6379")  # joining: nothing of ours to start again
    assert len(joined.calls) == 1
    assert joined.calls[0]["address"] == "10.0.0.5:6379"
    local = FakeInit([TIMEOUT])
    monkeypatch.setattr(ray, "init", local)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_pool.ensure_ray(None, num_gpus=1)
    assert len(local.calls) == 2
    assert local.calls[1]["namespace"] == ray_pool.NAMESPACE
    assert local.calls[1]["num_gpus"] == 1
    # Ray's None joins the last `ray start` on the machine (its ray_current_cluster file), dead or alive
    assert local.calls[1]["address"] == "local"


def test_a_local_start_still_joins_ray_address_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]
) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    fake = FakeInit([])
    monkeypatch.setattr(ray, "init", fake)
    ray_pool.ensure_ray(None)
    assert len(fake.calls) == 1 and "address" not in fake.calls[0]  # Ray reads RAY_ADDRESS itself


def test_the_failed_starts_processes_are_ended(monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]) -> None:
    """Ray keeps no handle on the GCS and raylet of a start that raised: the processes that start
    left behind (children of this process that were not there before it) are killed."""
    left: list[subprocess.Popen[bytes]] = []

    def init(**kwargs: Any) -> None:
        if not left:  # the first start leaves a "daemon" behind and fails
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
            raise TIMEOUT

    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        monkeypatch.setattr(ray, "init", init)
        ray_pool.start_local_ray()
        assert not psutil.pid_exists(left[0].pid)  # killed (and reaped)
        assert older.poll() is None  # a child from before the start is left alone
    finally:
        for proc in [older, *left]:
            proc.kill()
            proc.wait()  # a child psutil reaped already reads as ended (ECHILD)


def test_rays_token_auth_on_warning_is_not_passed_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, shutdowns: list[int]
) -> None:
    """Ray 2.60 turns token authentication on for a new local cluster and warns at every start that
    it did ("Set RAY_AUTH_MODE=disabled to opt out"): a home server should keep it on, so that line
    is dropped; Ray's other warnings, that it is off included, still reach the log."""
    auth_log = logging.getLogger(ray_pool.RAY_AUTH_LOGGER)

    def init(**kwargs: Any) -> None:  # what Ray's own start logs
        auth_log.warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
        )
        auth_log.warning("Token authentication is disabled for this Ray cluster. Anyone with access ...")

    monkeypatch.setattr(ray, "init", init)
    with caplog.at_level(logging.WARNING, logger=ray_pool.RAY_AUTH_LOGGER):
        ray_pool.start_local_ray()
        ray_pool.start_local_ray()  # the filter is added once
    said = [r.getMessage() for r in caplog.records if r.name == ray_pool.RAY_AUTH_LOGGER]
    assert [s.split(".")[0] for s in said] == ["Token authentication is disabled for this Ray cluster"] * 2
    assert auth_log.filters.count(ray_pool._QUIET_TOKEN_AUTH_ON) == 1


def test_the_failed_starts_process_handles_go_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, shutdowns: list[int]
) -> None:
    """Seen in CI: after a start that timed out and was retried, Ray's Popen handles on the failed
    start's processes, held only by the failed start's traceback, were let go while those still ran
    ("subprocess N is still running", a ResourceWarning), which pytest's warnings-as-errors turned
    into an error of the next test."""
    pids: list[int] = []

    def init(**kwargs: Any) -> None:
        if not pids:  # as Ray's failed start: a running daemon, its handle held by this frame only
            daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            pids.append(daemon.pid)
            raise Exception(str(TIMEOUT))  # a new one: its traceback (and the handle) go with it

    monkeypatch.setattr(ray, "init", init)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ray_pool.start_local_ray()
        gc.collect()
    assert not psutil.pid_exists(pids[0])
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
