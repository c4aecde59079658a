"""The service's gRPC server in this process on a real socket (grpc.aio, a free port), with in-process
device hosts: `async with serving(config) as (target, manager): ...`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from manager.api.server import Frontends, build_server
from manager.config import Config
from manager.live import LiveManager
from manager.workers_bridge import create_pool


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[str, LiveManager]]:
    """`config.server.listen` should name port 0 (any free port). With `server.frontends` > 0 the
    front-end processes listen there, as `residency serve` runs them."""
    pool = create_pool(config, in_process=True)
    manager = LiveManager(config, pool)
    fronts = Frontends(config, manager) if config.server.frontends else None
    if fronts is not None:
        server, _, _ = await build_server(config, manager, listen=fronts.backend)
    else:
        server, port, _ = await build_server(config, manager)
    await server.start()
    if fronts is not None:
        port = await fronts.start()
    await manager.start()
    try:
        yield f"127.0.0.1:{port}", manager
    finally:
        if fronts is not None:
            await fronts.stop()
        await server.stop(None)
        await manager.stop()
        pool.close()
