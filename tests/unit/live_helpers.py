"""Helpers for the live-manager unit tests: the config, sample inputs, and a manager on in-process
device hosts (no Ray, no sockets), started and killed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

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


def lru_config(tmp_path: Path, extra: str = "") -> Config:
    """local-cpu with a policy that preloads nothing at start: what is loaded then is adoption and
    recorded intent alone."""
    cfg = tmp_path / "lru.yaml"
    cfg.write_text(
        CONFIG.read_text().replace("policy: {name: residency}", "policy: {name: lru-keepalive}") + extra
    )
    return load_config(cfg)
