"""Review 17, a restarted manager reattaching to a device host of an earlier run whose device the
config has changed since (workers.ray_pool.RayWorkerPool), with a real local Ray.

Device hosts are detached named actors: on a cluster they outlive the manager, and a restarted
manager reattaches to them by name. It did so whatever the config now says of the device: a device
changed from `kind: cpu` to `kind: cuda` (or moved to another `node:`) kept its old host, so its
models went on running on the CPU (or on the old node), silently. Now a host whose kind or node is
not the config's is replaced by one made from the config (said in the log); one that matches is
reattached as before."""

from __future__ import annotations

import time

from workers import protocol as P
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE

DEVICE = "r17-reattach"


def _status(pool: RayWorkerPool, timeout: float = 60.0) -> P.WorkerStatus:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return pool.status(DEVICE, timeout_s=5)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_host_whose_device_changed_is_replaced_and_one_that_did_not_is_reattached(
    ray_actors: list[object],
) -> None:
    first = RayWorkerPool([DeviceSpec(DEVICE, "cpu")], namespace=TEST_NAMESPACE)
    ray_actors.append(first)
    before = _status(first)
    assert before.kind == "cpu"

    same = RayWorkerPool([DeviceSpec(DEVICE, "cpu")], namespace=TEST_NAMESPACE)
    ray_actors.append(same)
    assert same.reattached[DEVICE]
    assert _status(same).boot_id == before.boot_id  # the same host

    changed = RayWorkerPool([DeviceSpec(DEVICE, "cuda")], namespace=TEST_NAMESPACE)
    ray_actors.append(changed)
    assert not changed.reattached[DEVICE]
    after = _status(changed)
    assert after.kind == "cuda" and after.boot_id != before.boot_id


def test_a_device_moved_to_a_named_node_gets_a_host_there(ray_actors: list[object]) -> None:
    import ray

    (ip,) = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    first = RayWorkerPool([DeviceSpec(DEVICE, "cpu")], namespace=TEST_NAMESPACE)
    ray_actors.append(first)
    before = _status(first)

    moved = RayWorkerPool([DeviceSpec(DEVICE, "cpu", node=ip)], namespace=TEST_NAMESPACE)
    ray_actors.append(moved)
    assert not moved.reattached[DEVICE]
    after = _status(moved)
    assert after.node == ip and after.boot_id != before.boot_id

    again = RayWorkerPool([DeviceSpec(DEVICE, "cpu", node=ip)], namespace=TEST_NAMESPACE)
    ray_actors.append(again)
    assert again.reattached[DEVICE] and _status(again).boot_id == after.boot_id
