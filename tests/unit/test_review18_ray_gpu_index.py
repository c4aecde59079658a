"""Review 18, a CUDA device's `index` under Ray (workers.ray_pool): the options its host actor is made
with, and which host of an earlier run is kept (the real-Ray check:
`tests/integration/test_review18_ray_gpu_index.py`).

Ray set CUDA_VISIBLE_DEVICES in a `num_gpus=1` actor to the one GPU it picked, so the host's
`cuda:<index>` (and NVML's GPU <index>) was not the GPU the config names. A CUDA host is now made with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES in its runtime env (still `num_gpus=1`, for Ray's
scheduling); a CPU host's options are unchanged; a CUDA host of an earlier run made without it is
replaced (Ray's `get_if_exists` would hand it back whatever its options).

Ray's API is stood in for by fakes here (unit tests never start Ray); `__ray_call__` runs the
function the pool sends on a stand-in of the actor object, in this process, as Ray's runs it in the
actor's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import pytest
import ray
from test_review18_ray_pool import FakeRay as PoolFakeRay
from test_review18_ray_pool import Ref

from workers import protocol as P
from workers import ray_pool
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class Host:
    """An actor handle made with `options`; `env`: its runtime env's env_vars (None: it cannot say)."""

    def __init__(self, device: str, kind: str, index: int, options: dict[str, Any]) -> None:
        self.device, self.kind, self.index, self.options = device, kind, index, options
        env = (options.get("runtime_env") or {}).get("env_vars", {})
        self.env: dict[str, str] | None = dict(env)
        self.__ray_ready__ = SimpleNamespace(remote=lambda: Ref(True))
        self.status = SimpleNamespace(remote=self._status)
        self.__ray_call__ = SimpleNamespace(remote=self._call)

    def _status(self) -> Ref:
        return Ref(P.WorkerStatus(self.device, self.kind, "", 1, 0.0, {}, 0))  # type: ignore[arg-type]

    def _call(self, fn: Any, *args: Any) -> Ref:
        """As Ray runs it in the actor's process, where the runtime context is the actor's own."""
        env = self.env
        context = SimpleNamespace(runtime_env={"env_vars": env} if env is not None else None)
        actor = SimpleNamespace(host=SimpleNamespace(index=self.index, kind=self.kind))
        real = ray.get_runtime_context
        setattr(ray, "get_runtime_context", lambda: context)  # noqa: B010
        try:
            return Ref(fn(actor, *args))
        except Exception as e:
            return Ref(e)
        finally:
            setattr(ray, "get_runtime_context", real)  # noqa: B010


class FakeRay(PoolFakeRay):
    """The Ray API the pool uses (that of `test_review18_ray_pool`), its actors made as `Host`s here.
    `held`: named actors of an earlier run; `made`: the options of each actor the pool made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        monkeypatch.setattr(ray_pool, "_cluster_name", lambda: "the Ray cluster")

    def host(self, name: str, kind: str, index: int, node: str | None, options: dict[str, Any]) -> Host:
        return Host(name, kind, index, options)


def _old(device: str, index: int) -> Host:
    """A CUDA host as the release before this one made it (no runtime env)."""
    return Host(device, "cuda", index, {"num_gpus": 1})


def _current(device: str, index: int) -> Host:
    return Host(device, "cuda", index, {"num_gpus": 1, "runtime_env": {"env_vars": {NOSET: "1"}}})


def test_the_env_var_is_rays_own() -> None:
    from ray._private.accelerators import nvidia_gpu

    assert NOSET == ray_pool.NOSET_CUDA_VISIBLE_DEVICES == nvidia_gpu.NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR


def test_a_cuda_host_counts_a_gpu_and_keeps_the_gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu1", "cuda", index=1)])
    (host,) = fake.made
    assert pool.actors["gpu1"] is host and host.index == 1
    assert host.options["num_gpus"] == 1  # Ray's scheduling and accounting, as before
    assert host.options["runtime_env"] == {"env_vars": {NOSET: "1"}}


def test_a_cpu_host_is_made_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(monkeypatch)
    RayWorkerPool([DeviceSpec("cpu0", "cpu"), DeviceSpec("cpu1", "cpu", node="10.0.0.2")])
    assert [h.options for h in fake.made] == [
        {"name": ray_pool.actor_name(d), "namespace": ray_pool.NAMESPACE, "lifetime": "detached",
         "max_restarts": -1, "max_task_retries": 0, "num_cpus": 0, "get_if_exists": True, **extra}
        for d, extra in [("cpu0", {}), ("cpu1", {"resources": {"node:10.0.0.2": ray_pool.NODE_SHARE}})]
    ]  # fmt: skip


def test_a_cuda_host_of_an_earlier_release_is_replaced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu0")] = _old("gpu0", 0)
    with caplog.at_level(logging.WARNING, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda", index=0)])
    assert not pool.reattached["gpu0"] and fake.killed == [old]
    (new,) = fake.made
    assert pool.actors["gpu0"] is new and new.options["runtime_env"] == {"env_vars": {NOSET: "1"}}
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "device gpu0" in line and "CUDA_VISIBLE_DEVICES" in line and "replaced" in line, line


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_a_current_cuda_host_is_reattached(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu1")] = _current("gpu1", 1)
    assert old.env is not None
    old.env[NOSET] = value  # (Ray reads "1" or "true", any case)
    pool = RayWorkerPool([DeviceSpec("gpu1", "cuda", index=1)])
    assert pool.reattached["gpu1"] and pool.actors["gpu1"] is old
    assert fake.killed == [] and fake.made == []


def test_a_cuda_host_that_cannot_say_its_runtime_env_is_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # as one that cannot say its status or index now: kept, as before (and said in the log)
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu0")] = _old("gpu0", 0)
    old.env = None
    with caplog.at_level(logging.INFO, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda", index=0)])
    assert pool.reattached["gpu0"] and fake.killed == []
    assert "did not say how it sees its GPUs" in caplog.text, caplog.text


def test_an_old_cuda_host_on_another_index_says_the_index(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRay(monkeypatch)
    fake.held[ray_pool.actor_name("gpu0")] = _old("gpu0", 1)
    with caplog.at_level(logging.WARNING, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda", index=0)])
    assert not pool.reattached["gpu0"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "cuda:1" in line and "cuda:0" in line, line


def test_a_cpu_host_is_not_asked_about_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("cpu0")] = Host("cpu0", "cpu", 0, {})
    old.env = None  # it could not say: not asked, so kept either way; and not replaced for lacking it
    calls: list[Any] = []
    call = old.__ray_call__.remote

    def counted(fn: Any, *args: Any) -> Ref:
        calls.append(fn)
        ref: Ref = call(fn, *args)
        return ref

    old.__ray_call__ = SimpleNamespace(remote=counted)
    pool = RayWorkerPool([DeviceSpec("cpu0", "cpu")])
    assert pool.reattached["cpu0"] and calls == [] and fake.killed == []


def test_a_host_of_an_earlier_release_can_run_the_check(tmp_path: Path) -> None:
    # the check is sent by value: a host whose `workers` package is older (or absent) runs it
    data = cloudpickle.dumps(ray_pool._GPU_ENV_ASKED)
    script = (
        "import sys, types, cloudpickle, ray\n"
        "assert 'workers' not in sys.modules\n"
        "fn = cloudpickle.loads(sys.stdin.buffer.read())\n"
        "assert 'workers' not in sys.modules, 'the check imported workers'\n"
        "ctx = types.SimpleNamespace(runtime_env={'env_vars': {sys.argv[1]: '1'}})\n"
        "ray.get_runtime_context = lambda: ctx\n"
        "print(fn(types.SimpleNamespace()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", script, NOSET], input=data, capture_output=True, cwd=tmp_path, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "1"
