"""The service's gRPC server in this process on a real socket (grpc.aio, a free port), with in-process
device hosts: `async with serving(config) as (target, manager): ...`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from manager.api.server import build_server
from manager.config import Config
from manager.live import LiveManager
from manager.workers_bridge import create_pool


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[str, LiveManager]]:
    """`config.server.listen` should name port 0 (any free port)."""
    pool = create_pool(config, in_process=True)
    manager = LiveManager(config, pool)
    server, port, _ = await build_server(config, manager)
    await server.start()
    await manager.start()
    try:
        yield f"127.0.0.1:{port}", manager
    finally:
        await server.stop(None)
        await manager.stop()
        pool.close()
