"""Helpers for the live-manager unit tests: the config, sample inputs, a manager on in-process
device hosts (no Ray, no sockets), started and killed, and a model factory that hangs until let go."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from torch import nn

from manager.config import Config, load_config
from manager.live import LiveManager
from manager.workers_bridge import create_pool

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"
AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}
TEXT = {"text": np.array([b"turn on the lights"], dtype=object)}


def run(
    config: Config,
    body: Callable[[LiveManager], Awaitable[Any]],
    store: Any = None,
    wrap: Callable[[Any], Any] | None = None,
) -> Any:
    """`await body(manager)` on a started live manager over in-process hosts (its pool is
    `manager.pool`, wrapped by `wrap` when given, e.g. in a recording pool), then stop both."""

    async def main() -> Any:
        pool = create_pool(config, in_process=True)
        pool = wrap(pool) if wrap is not None else pool
        manager = LiveManager(config, pool, store=store)
        await manager.start()
        try:
            return await body(manager)
        finally:
            await manager.stop()
            pool.close()

    return asyncio.run(main())


async def started(config: Config, store: Any, journal: Path) -> tuple[LiveManager, Any]:
    """A live manager on `store` with a request journal, started, and its in-process pool."""
    pool = create_pool(config, in_process=True)
    lm = LiveManager(config, pool, store=store, journal=journal)
    await lm.start()
    return lm, pool


def kill(lm: LiveManager, pool: Any) -> None:
    """The process is killed: its reconciler stops where it is (no stop(): no flush, no save) and
    the OS closes its files."""
    assert lm._task is not None and lm.journal is not None
    lm._task.cancel()
    lm.journal.close()
    pool.close()


def local_config(tmp_path: Path, models: tuple[str, ...], **server: Any) -> Config:
    """configs/local-cpu.yaml with only `models`, on port 0, its state under `tmp_path`."""
    base = load_config(CONFIG)
    return base.model_copy(
        update={
            "models": [m for m in base.models if m.name in models],
            "server": base.server.model_copy(update={"listen": "127.0.0.1:0", **server}),
            "store": base.store.model_copy(
                update={
                    "url": f"sqlite:///{tmp_path}/state.db",
                    "journal": str(tmp_path / "requests.journal"),
                    "sessions": str(tmp_path / "sessions"),
                }
            ),
        }
    )


def lru_config(tmp_path: Path, extra: str = "") -> Config:
    """local-cpu with a policy that preloads nothing at start: what is loaded then is adoption and
    recorded intent alone."""
    cfg = tmp_path / "lru.yaml"
    cfg.write_text(
        CONFIG.read_text().replace("policy: {name: residency}", "policy: {name: lru-keepalive}") + extra
    )
    return load_config(cfg)


WORLD_CONFIG = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: interactive}]
store: {sessions: SESSIONS}
models:
  - {name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {min: 16MiB, max: 64MiB}, load_seconds: {disk: 0.2, host: 0.05}, source: {preset: micro}}
"""
"""A CPU device with the world model (the micro stand-in); SESSIONS: where its sessions are saved."""
POSES = [(float(i), 0.0, 0.0, 0.0, 20.0 * i) for i in range(8)]
"""Poses of a short walk (x, y, z, pitch, yaw) for world-session steps."""


def world_config(tmp_path: Path, extra: str = "") -> Config:
    """WORLD_CONFIG, its sessions saved under tmp_path, with `extra` (more model lines) added."""
    (tmp_path / "c.yaml").write_text(WORLD_CONFIG.replace("SESSIONS", str(tmp_path / "sessions")) + extra)
    return load_config(tmp_path / "c.yaml")


def on_port_0(config: Config, tmp_path: Path) -> Config:
    """`config` on port 0 (a free port), its SQLite store and journal under `tmp_path`."""
    return config.model_copy(
        update={
            "server": config.server.model_copy(update={"listen": "127.0.0.1:0"}),
            "store": config.store.model_copy(
                update={"url": f"sqlite:///{tmp_path}/state.db", "journal": str(tmp_path / "j")}
            ),
        }
    )


def served_world_config(tmp_path: Path, extra: str = "") -> Config:
    """`world_config` (WORLD_CONFIG, `extra` appended) on port 0, its state under `tmp_path`."""
    return on_port_0(world_config(tmp_path, extra), tmp_path)


@contextlib.asynccontextmanager
async def grpc_service(config: Config) -> AsyncIterator[tuple[int, LiveManager, Any, Any]]:
    """The service's gRPC server on a free port over in-process device hosts: its port, the manager,
    the server and the pool; all stopped after."""
    from manager.api.server import build_server

    pool = create_pool(config, in_process=True)
    manager = LiveManager(config, pool)
    server, port, _ = await build_server(config, manager)
    await server.start()
    await manager.start()
    try:
        yield port, manager, server, pool
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait (polling the event loop) until `cond()`; fails saying `what` did not happen in time."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def drain(q: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    """What an event queue holds now, emptied."""
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


PoolT = TypeVar("PoolT")


def run_with_pinned_voice(
    config: Config, wrap: Callable[[Any], PoolT], body: Callable[[LiveManager, PoolT], Awaitable[None]]
) -> list[dict[str, Any]]:
    """Start a manager on in-process device hosts (`wrap`ped: a test's fault injection), wait for its
    pinned voice model, run `body`, stop it; returns the events it published."""

    async def main() -> list[dict[str, Any]]:
        pool = wrap(create_pool(config, in_process=True))
        lm = LiveManager(config, pool)  # type: ignore[arg-type]
        events = lm.subscribe()
        await lm.start()
        try:
            await until(lambda: lm.live["voice"].ready.is_set(), "the pinned voice loaded")
            await body(lm, pool)
        finally:
            await lm.stop()
            pool.close()  # type: ignore[attr-defined]
        return drain(events)

    return asyncio.run(main())


class Gate:
    """A model factory that waits while `open` is clear (a load hung, or still on its way):
    `entered` says a call started, `calls` counts them."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def linear(self, in_features: int = 4, out_features: int = 2) -> nn.Module:
        self.calls += 1
        self.entered.set()
        self.open.wait(60)
        return nn.Linear(in_features, out_features)


def gated_module(monkeypatch: pytest.MonkeyPatch, module: str) -> Iterator[Gate]:
    """The body of a `gate` fixture: a Gate whose factory is `{module}:linear` (a module made up under
    that name); after the test the gate opens and the load and promote threads still in it end."""
    g = Gate()
    mod = types.ModuleType(module)
    mod.linear = g.linear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    yield g
    g.open.set()
    for t in threading.enumerate():
        if t.name.startswith(("residency-load-", "residency-promote-")):
            t.join(30)


def in_time(fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """`fn()` on a thread: what it returned, or the exception it raised; fails (not hangs) when it
    takes longer than `timeout_s` (a read that blocks: a FIFO at a file's path)."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"still running after {timeout_s} s"
    return out[0]
