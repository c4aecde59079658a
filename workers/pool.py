"""The `WorkerPool` the manager uses, and its in-process implementation.

Order of use: `devices()` lists the device hosts; `submit(device, cmd)` queues a command and returns its
op id at once; `poll()` returns the results that have finished since the last poll, never blocking;
`status(device)` reads what a host really holds (to reconcile); `infer(device, model, inputs)` is the
data plane. `RayWorkerPool` (workers.ray_pool) runs each device host in a named Ray actor;
`InProcessWorkerPool` runs them in this process, one command thread per device — the same device host
code, for unit tests and single-process use.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from workers import protocol as P
from workers.host import DeviceHost


@dataclass(frozen=True)
class DeviceSpec:
    """One configured device (from the config's `devices`)."""

    name: str
    kind: str = "cpu"
    index: int = 0
    node: str | None = None


def new_op_id() -> str:
    return uuid.uuid4().hex


class WorkerPool(Protocol):
    def devices(self) -> list[str]: ...

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        """Queue `cmd` on `device`; returns the op id (retry with the same id: done at most once)."""

    def poll(self) -> list[P.CommandResult]:
        """Results finished since the last poll; never blocks."""

    def pending(self) -> int: ...

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus: ...

    def infer(
        self, device: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 30.0
    ) -> P.InferResult: ...

    def close(self) -> None: ...


class UnknownDevice(KeyError):
    def __str__(self) -> str:
        return f"unknown device {self.args[0]!r}"


class InProcessWorkerPool:
    """Device hosts in this process; commands run on one thread per device, in submission order."""

    def __init__(self, devices: list[DeviceSpec], **host_kwargs: object) -> None:
        self.hosts = {
            d.name: DeviceHost(d.name, d.kind, index=d.index, node=d.node, **host_kwargs)  # type: ignore[arg-type]
            for d in devices
        }
        self._exec = {d.name: ThreadPoolExecutor(1, thread_name_prefix=f"dev-{d.name}") for d in devices}
        self._futures: dict[str, Future[P.CommandResult]] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def _host(self, device: str) -> DeviceHost:
        if device not in self.hosts:
            raise UnknownDevice(device)
        return self.hosts[device]

    def devices(self) -> list[str]:
        return list(self.hosts)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        host = self._host(device)
        op = op_id or new_op_id()
        fut = self._exec[device].submit(host.apply, cmd, op)
        with self._lock:
            self._futures[f"{next(self._seq)}:{op}"] = fut
        return op

    def poll(self) -> list[P.CommandResult]:
        with self._lock:
            done = [k for k, f in self._futures.items() if f.done()]
            return [self._futures.pop(k).result() for k in done]

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus:
        return self._host(device).status()

    def infer(
        self, device: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 30.0
    ) -> P.InferResult:
        return self._host(device).infer(model, inputs)

    def infer_many(
        self, device: str, items: list[tuple[str, dict[str, np.ndarray]]], timeout_s: float = 30.0
    ) -> list[P.InferResult]:
        """Requests that queued together, in one call of the host (DeviceHost.infer_many batches)."""
        return self._host(device).infer_many(items)

    def session(self, device: str, method: str, *args: object, timeout_s: float = 120.0) -> P.SessionReply:
        """World-session calls: method is open, step, resize or close (see DeviceHost.session_*)."""
        fn = getattr(self._host(device), f"session_{method}")
        reply: P.SessionReply = fn(*args)
        return reply

    def close(self) -> None:
        for ex in self._exec.values():
            ex.shutdown(wait=True)
