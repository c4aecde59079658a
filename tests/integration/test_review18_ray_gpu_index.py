"""Review 18, a CUDA device's `index` under Ray (workers.ray_pool), with a real local Ray (the
session's: 2 logical GPUs, no real one needed; unit tests: `tests/unit/test_review18_ray_gpu_index.py`).

A CUDA device's host actor asks Ray for `num_gpus=1`, and Ray then set CUDA_VISIBLE_DEVICES in the
actor's process to the one GPU it picked: inside the host that GPU was cuda:0, whichever it was, while
the host used the config's index (`cuda:<index>`, and NVML's GPU <index>, which counts physical GPUs).
A device with `index: 1` found no cuda:1; one with `index: 0` could be handed GPU 1 and read GPU 0's
power. Now Ray still counts the GPU (scheduling is unchanged) but leaves CUDA_VISIBLE_DEVICES as the
node's Ray has it, so a host sees the GPUs as the manager's own process does and the index names the
same GPU as in-process; a host of an earlier run made without that is replaced."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ray

from workers import ray_pool
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE
from .test_ray_workers import wait_status


def _seen() -> Callable[[Any], tuple[str | None, int, str]]:
    """What the host actor runs: its process's CUDA_VISIBLE_DEVICES, its host's index and torch
    device (made here, so that Ray sends it by value: the actor cannot import this module)."""

    def seen(actor: Any) -> tuple[str | None, int, str]:
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES"), actor.host.index, str(actor.host.torch_device)

    return seen


def test_cuda_hosts_see_the_gpus_as_the_manager_does_and_still_count_against_ray(
    ray_actors: list[object],
) -> None:
    pool = RayWorkerPool(
        [DeviceSpec("r18-gpu-a", "cuda", index=0), DeviceSpec("r18-gpu-b", "cuda", index=1)],
        namespace=TEST_NAMESPACE,
    )
    ray_actors.append(pool)
    for device in pool.devices():
        assert wait_status(pool, device, timeout=120.0).kind == "cuda"
    a = ray.get(pool.actors["r18-gpu-a"].__ray_call__.remote(_seen()), timeout=60)
    b = ray.get(pool.actors["r18-gpu-b"].__ray_call__.remote(_seen()), timeout=60)
    # the local Ray was started by this process: its workers have this process's environment, which
    # Ray no longer narrows to the one GPU it picked for each host
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert (a, b) == ((ours, 0, "cuda:0"), (ours, 1, "cuda:1"))
    # Ray still counts each host's GPU: both of the cluster's 2 are taken
    assert ray.available_resources().get("GPU", 0.0) == 0.0  # type: ignore[no-untyped-call]


def test_a_cuda_host_of_an_earlier_release_is_replaced_and_a_current_one_kept(
    ray_actors: list[object],
) -> None:
    device = "r18-gpu-old"
    # a host as the release before this one made it: num_gpus=1, Ray sets its CUDA_VISIBLE_DEVICES
    old = ray_pool.RemoteDeviceHost.options(
        name=ray_pool.actor_name(device), namespace=TEST_NAMESPACE, lifetime="detached",
        max_restarts=-1, max_task_retries=0, num_cpus=0, num_gpus=1, get_if_exists=True,
    ).remote(device, "cuda", 0, None)  # fmt: skip
    try:
        before, _, _ = ray.get(old.__ray_call__.remote(_seen()), timeout=120)
        assert before in ("0", "1")  # (what the fix is about: the GPU Ray picked, as cuda:0)
        pool = RayWorkerPool([DeviceSpec(device, "cuda", index=0)], namespace=TEST_NAMESPACE)
        ray_actors.append(pool)
        assert not pool.reattached[device]
        boot = wait_status(pool, device, timeout=120.0).boot_id
        seen = ray.get(pool.actors[device].__ray_call__.remote(_seen()), timeout=60)
        assert seen == (os.environ.get("CUDA_VISIBLE_DEVICES"), 0, "cuda:0")

        again = RayWorkerPool([DeviceSpec(device, "cuda", index=0)], namespace=TEST_NAMESPACE)
        ray_actors.append(again)
        assert again.reattached[device] and wait_status(again, device, timeout=120.0).boot_id == boot
    finally:
        ray.kill(old, no_restart=True)
