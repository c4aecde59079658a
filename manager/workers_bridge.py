"""From the config to the worker side: device and model specs, and the worker pool (edge module).

`create_pool(config)` starts or joins Ray per `ray.address` (null: a local Ray; "auto" or an address:
an existing cluster, whose devices are named per node with `node:`) and attaches to the named device
hosts, creating those that do not exist yet; `in_process=True` runs the same device hosts in this
process instead (tests, single-process use).
"""

from __future__ import annotations

from typing import Any

from manager.config import Config


def device_specs(config: Config) -> list[Any]:
    from workers.pool import DeviceSpec

    return [DeviceSpec(d.name, d.kind, d.index, d.node) for d in config.devices]


def model_specs(config: Config) -> dict[str, Any]:
    """Per model: what its device host needs; its budget is its device's memory minus the reserve."""
    from workers.protocol import ModelSpec

    usable = {d.name: d.usable for d in config.devices}
    return {
        m.name: ModelSpec(m.name, m.adapter, dict(m.source), budget_bytes=usable[m.device])
        for m in config.models
    }


def create_pool(config: Config, *, in_process: bool = False, **ray_init: Any) -> Any:
    if in_process:
        from workers.pool import InProcessWorkerPool

        return InProcessWorkerPool(device_specs(config))
    from workers.ray_pool import RayWorkerPool, ensure_ray

    ensure_ray(config.ray.address, **ray_init)
    return RayWorkerPool(device_specs(config))
