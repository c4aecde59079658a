"""From the config to the worker side: device and model specs, and the worker pool (edge module).

`create_pool(config)` starts or joins Ray per `ray.address` (null: a local Ray; "auto" or an address:
an existing cluster, whose devices are named per node with `node:`) and attaches to the named device
hosts, creating those that do not exist yet; `in_process=True` runs the same device hosts in this
process instead (tests, single-process use). An address where nothing answers is said at once
(`RayUnreachable`, naming `ray.address`), not after Ray's minutes of retries.

CPU fallback: when a `kind: cuda` device's hosts would run on this machine (a local Ray, not one
RAY_ADDRESS names, or in-process) and this machine has no usable CUDA, `serve` runs that device's
models on the CPU, as Ollama does, and says so; the device keeps its configured budget.
`fallback=False` turns it off (the models then answer NOT_AVAILABLE, naming the missing CUDA; on a
local Ray, whose node has no GPU, the pool says the device's host cannot be placed, and how to run
it on the CPU instead).
"""

from __future__ import annotations

import os
from typing import Any

from manager.config import Config


def cuda_missing_here(config: Config, *, in_process: bool = False) -> list[str]:
    """The CUDA devices whose hosts would run on this machine, which has no usable CUDA (not so on a
    cluster joined: `ray.address` set, or RAY_ADDRESS, which Ray joins in place of a null one)."""
    cuda = [d.name for d in config.devices if d.kind == "cuda" and not d.node]
    joins = config.ray.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    if not cuda or (joins and not in_process):
        return []  # a cluster's GPUs live on its nodes: their hosts report NOT_AVAILABLE themselves
    import torch

    return [] if torch.cuda.is_available() else cuda


def device_specs(config: Config, cpu_fallback: frozenset[str] = frozenset()) -> list[Any]:
    from workers.pool import DeviceSpec

    return [
        DeviceSpec(d.name, "cpu" if d.name in cpu_fallback else d.kind, d.index, d.node)
        for d in config.devices
    ]


LOAD_TIMEOUT_FACTOR = 4.0
"""A model's load or promote is abandoned (LOAD_TIMEOUT) after this many times its configured disk load
time, where that is longer than its device host's own limit (`workers.host.LOAD_TIMEOUT_S`, 15 min): a
config that says a load takes 20 minutes (a large checkpoint on a slow disk) is not cut at 15."""


def model_specs(config: Config) -> dict[str, Any]:
    """Per model: what its device host needs; its budget is its device's memory minus the reserve."""
    from workers.protocol import ModelSpec

    usable = {d.name: d.usable for d in config.devices}
    return {
        m.name: ModelSpec(
            m.name,
            m.adapter,
            dict(m.source),
            budget_bytes=usable[m.device],
            max_batch=m.max_batch,
            load_timeout_s=LOAD_TIMEOUT_FACTOR * m.load_seconds.disk,
        )
        for m in config.models
    }


def create_pool(
    config: Config,
    *,
    in_process: bool = False,
    cpu_fallback: frozenset[str] = frozenset(),
    host_kwargs: dict[str, Any] | None = None,
    **ray_init: Any,
) -> Any:
    """The worker pool; `host_kwargs` (in process only) go to each `DeviceHost` (e.g. `load_timeout_s`)
    and to the pool (`close_grace_s`)."""
    specs = device_specs(config, cpu_fallback)
    if in_process:
        from workers.pool import InProcessWorkerPool

        return InProcessWorkerPool(specs, **(host_kwargs or {}))
    import ray

    from workers.ray_pool import RayUnreachable, RayWorkerPool, ensure_ray, unreachable

    address = config.ray.address
    field = f"ray.address {'null' if address is None else repr(address)}"
    started = not ray.is_initialized()
    why = unreachable(address) if started else None
    if why is not None:
        raise RayUnreachable(f"{field}: {why}")
    try:
        ensure_ray(address, **ray_init)
    except ConnectionError as e:  # Ray's own: what answers there is not Ray, or "auto" found none
        raise RayUnreachable(f"{field}: {e}") from None
    # a local Ray has this machine's node only: a GPU it lacks is this machine's (the hint: the CPU fallback)
    local = started and address is None and not os.environ.get("RAY_ADDRESS")
    return RayWorkerPool(specs, local=local)
