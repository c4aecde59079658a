"""Review 17: a front end queued every ModelInfer call for the manager's process on its link without
ever waiting for the link to drain: with the manager's event loop held up (a long GC, a stuck call),
each front end kept every call's bytes in memory, without bound. Calls now wait (`drain`) once
`WRITE_HIGH` bytes are unsent. Real Unix socket; the manager's end is a server that does not read."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from manager.api import fastpath
from manager.api.fastpath import FLUSH_BYTES, WRITE_HIGH, FastPathClient

ITEM = 256 * 1024
CALLS = 400  # 100 MiB in all


def test_a_manager_that_does_not_read_holds_the_calls_not_their_bytes(tmp_path: Path) -> None:
    async def main() -> tuple[int, int]:
        held: list[asyncio.StreamWriter] = []

        async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # connected, never read

        path = str(tmp_path / "fp.sock")
        server = await asyncio.start_unix_server(stuck, path)
        client = FastPathClient()
        await client.connect(path)
        calls = [asyncio.ensure_future(client.call(b"x" * ITEM, 30.0)) for _ in range(CALLS)]
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert client._out is not None
        unsent = client._out.writer.transport.get_write_buffer_size()
        queued = len(client._pending)
        for c in calls:
            c.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*calls, return_exceptions=True)
        await client.close()
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
        return unsent, queued

    unsent, queued = asyncio.run(main())
    assert unsent <= WRITE_HIGH + FLUSH_BYTES + ITEM + fastpath.ITEM_OVERHEAD  # (not 100 MiB)
    assert queued < CALLS  # the rest wait to be queued
