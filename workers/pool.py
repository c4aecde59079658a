"""The `WorkerPool` the manager uses, and its in-process implementation.

Order of use: `devices()` lists the device hosts; `submit(device, cmd)` queues a command and returns its
op id at once; `poll()` returns the results that have finished since the last poll, never blocking;
`status(device)` reads what a host really holds (to reconcile); `infer(device, model, inputs)` is the
data plane. `RayWorkerPool` (workers.ray_pool) runs each device host in a named Ray actor;
`InProcessWorkerPool` runs them in this process, one command thread per device — the same device host
code, for unit tests and single-process use. Its `close` does not wait for a model's own code that
hangs (a load's factory or read): the hosts stop, the command threads get `close_grace_s` to end, and
what still runs then is abandoned, said in the log (device, command, model), and left to the
process's end (daemon threads: the interpreter's exit does not wait for them either), as is a
describe still running on its host (a factory that hangs). `left_running()` says what the pools
closed in this process left so and still runs, and the other describes still running in this
process (the manager's: `workers.bounded.running_builds`): a daemon thread inside a model's native
code while the interpreter finalizes can abort the process, so `residency serve` then ends it at
once instead (`manager.cli`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from workers import protocol as P
from workers.bounded import running_builds
from workers.host import DeviceHost

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 5.0
"""How long `InProcessWorkerPool.close` lets the commands running end (a load or promote one waits
for included: its host's `stop` gives it the same grace) before it abandons them."""


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


class _CommandThread:
    """One device's commands, in submission order, on a daemon thread of its own (an executor's
    thread would hold the interpreter's exit while a command hangs in a model's own code)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.queue: queue.SimpleQueue[tuple[Future[P.CommandResult], DeviceHost, P.Command, str] | None] = (
            queue.SimpleQueue()
        )
        self.running: tuple[P.Command, float] | None = None
        """The command running now, and when it started (time.monotonic)."""
        self.thread = threading.Thread(target=self._loop, name=f"dev-{device}", daemon=True)
        self.thread.start()

    def submit(self, host: DeviceHost, cmd: P.Command, op_id: str) -> Future[P.CommandResult]:
        fut: Future[P.CommandResult] = Future()
        self.queue.put((fut, host, cmd, op_id))
        return fut

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            fut, host, cmd, op_id = item
            if not fut.set_running_or_notify_cancel():
                continue
            self.running = (cmd, time.monotonic())
            try:
                fut.set_result(host.apply(cmd, op_id))  # never raises
            except BaseException as e:  # handed to whoever polls it, never lost
                fut.set_exception(e)
            finally:
                self.running = None

    def stop(self) -> None:
        """No command after those queued (a stopping host answers them at once)."""
        self.queue.put(None)


_closed_hosts: weakref.WeakSet[DeviceHost] = weakref.WeakSet()
_closed_threads: weakref.WeakSet[_CommandThread] = weakref.WeakSet()
"""The device hosts and command threads of the in-process pools closed in this process (`left_running`).
Weak: what a thread still runs holds its host, and its thread object, while it runs, not after."""


def left_running() -> list[str]:
    """What still runs model code on a thread of this process that nothing waits for any more, one
    phrase each ("the load of 'x' on cpu0 (running 12 s)"): of the in-process pools closed in this
    process, the loads and promotes their hosts gave up (`DeviceHost.abandoned`: a model's factory,
    read or warm-up), the describes still running on their hosts (`DeviceHost.describing`: a
    factory), and the commands still running on their command threads; and the builds still running
    of this process's other single flights (the manager's describes: `running_builds`). Empty when
    none (Ray's device hosts run in other processes)."""
    now = time.monotonic()
    out: list[str] = running_builds()
    seen: set[tuple[str, str]] = set()
    for host in list(_closed_hosts):
        for model, (what, secs) in sorted(host.abandoned().items()):
            seen.add((host.name, model))
            out.append(f"the {what} of {model!r} on {host.name} (running {secs:.0f} s)")
        for model, secs in host.describing():
            out.append(f"the describe of {model!r} on {host.name} (running {secs:.0f} s)")
    for t in list(_closed_threads):
        running = t.running
        if running is None or not t.thread.is_alive():
            continue
        cmd, since = running
        op, model = P.command_op(cmd), P.command_model(cmd)
        if (t.device, model) not in seen:  # (one its host gave up is said above)
            out.append(f"the {op} of {model!r} on {t.device} (running {now - since:.0f} s)")
    return sorted(out)


class InProcessWorkerPool:
    """Device hosts in this process; commands run on one thread per device, in submission order."""

    def __init__(
        self, devices: list[DeviceSpec], *, close_grace_s: float = CLOSE_GRACE_S, **host_kwargs: object
    ) -> None:
        self.hosts = {
            d.name: DeviceHost(d.name, d.kind, index=d.index, node=d.node, **host_kwargs)  # type: ignore[arg-type]
            for d in devices
        }
        self.close_grace_s = close_grace_s
        self._threads = {d.name: _CommandThread(d.name) for d in devices}
        self._futures: dict[str, Future[P.CommandResult]] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._closed = False

    def _host(self, device: str) -> DeviceHost:
        if device not in self.hosts:
            raise UnknownDevice(device)
        return self.hosts[device]

    def devices(self) -> list[str]:
        return list(self.hosts)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        host = self._host(device)
        if self._closed:
            raise RuntimeError(
                f"device {device!r}: the worker pool is closed; {P.command_op(cmd)} not queued"
            )
        op = op_id or new_op_id()
        fut = self._threads[device].submit(host, cmd, op)
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
        """Stop the hosts and their command threads, within `close_grace_s`: a load or promote a
        command waits for may end within it (its host's `stop`), commands queued are answered
        "stopping"; one still running past the grace (a model's own code that hangs) is abandoned,
        and said, not waited for. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        _closed_hosts.update(self.hosts.values())
        _closed_threads.update(self._threads.values())
        deadline = time.monotonic() + self.close_grace_s
        for host in self.hosts.values():  # (a load about to end is let end, within the grace)
            host.stop(max(0.0, deadline - time.monotonic()))
        for t in self._threads.values():
            t.stop()
        for t in self._threads.values():
            t.thread.join(max(0.0, deadline - time.monotonic()))
            running = t.running
            if t.thread.is_alive() and running is not None:
                cmd, since = running
                logger.warning(
                    "device %s: %s of %s still running %.1f s after it began, past the stop's grace "
                    "(%g s); abandoned, its thread is left to the process's end", t.device,
                    P.command_op(cmd), P.command_model(cmd), time.monotonic() - since, self.close_grace_s,
                )  # fmt: skip
