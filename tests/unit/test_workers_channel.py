"""The direct data channel (workers.channel): a real Unix socket between a real DeviceHost with a
real model (silero-vad) and the asyncio client, in one process (the Ray side is in
tests/integration/test_data_channel.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from workers import protocol as P
from workers.channel import ChannelClient, ChannelError, ChannelServer, boot_id, same_machine
from workers.host import DeviceHost

AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}


@pytest.fixture
def served() -> Iterator[tuple[DeviceHost, ChannelServer]]:
    host = DeviceHost("chan-cpu0", "cpu")
    assert host.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "load-voice").ok
    server = ChannelServer(host, "test-channel")
    yield host, server
    server.close()


def test_batches_come_back_in_order_and_equal_direct_calls(served: tuple[DeviceHost, ChannelServer]) -> None:
    host, server = served
    direct = host.infer("voice", AUDIO)

    async def main() -> list[list[P.InferResult]]:
        client = ChannelClient(server.address, connections=2)
        try:
            items = [("voice", AUDIO), ("nope", AUDIO), ("voice", AUDIO)]
            return await asyncio.gather(*(client.infer_many(items) for _ in range(5)))
        finally:
            client.close()

    for batch in asyncio.run(main()):
        assert [r.model for r in batch] == ["voice", "nope", "voice"]
        assert batch[0].ok and batch[0].outputs == direct.outputs and batch[2].outputs == direct.outputs
        assert not batch[1].ok and batch[1].error_code == P.BAD_TRANSITION  # the host's own answer
    assert host.status().models["voice"].inferences == 1 + 10


def test_the_socket_is_private_to_this_user(served: tuple[DeviceHost, ChannelServer]) -> None:
    _, server = served
    path = Path(server.path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    assert server.address.pid == os.getpid() and same_machine(server.address)
    assert not same_machine(server.address.__class__(server.path, boot_id() + "-other", 1))


def test_a_bad_frame_closes_that_connection_only(served: tuple[DeviceHost, ChannelServer]) -> None:
    _, server = served
    for junk in (struct.pack(">I", 5) + b"\x00junk", struct.pack(">I", 2**31)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(server.path)
            s.sendall(junk)
            assert s.recv(1) == b""  # closed by the server, no reply

    async def main() -> list[P.InferResult]:
        client = ChannelClient(server.address)
        try:
            return await client.infer_many([("voice", AUDIO)])
        finally:
            client.close()

    assert asyncio.run(main())[0].ok  # the server still serves new connections


def test_a_closed_server_is_a_channel_error_not_a_hang(served: tuple[DeviceHost, ChannelServer]) -> None:
    _, server = served

    async def main() -> None:
        client = ChannelClient(server.address)
        assert (await client.infer_many([("voice", AUDIO)]))[0].ok
        server.close()  # the host went away: its socket is gone, the open connection breaks
        with pytest.raises(ChannelError):
            await asyncio.wait_for(client.infer_many([("voice", AUDIO)]), 10)
        with pytest.raises(ChannelError, match="broken"):
            await client.infer_many([("voice", AUDIO)])
        client.close()

    asyncio.run(main())
    assert not os.path.exists(server.path)


def test_stale_sockets_of_dead_hosts_are_removed(served: tuple[DeviceHost, ChannelServer]) -> None:
    host, server = served
    stale = Path(server.path).parent / "residency-device-gone-999999999.sock"
    stale.touch()
    other = ChannelServer(host, "test-channel-2")
    try:
        assert not stale.exists() and Path(server.path).exists()  # a live host's socket is kept
    finally:
        other.close()


def test_many_callers_share_two_connections_and_every_one_is_answered(
    served: tuple[DeviceHost, ChannelServer],
) -> None:
    host, server = served

    async def main() -> int:
        client = ChannelClient(server.address, connections=2)
        done = 0
        try:
            for wave in range(20):  # callers arrive while others wait for a connection
                calls = [client.infer_many([("voice", AUDIO)] * (1 + i % 3)) for i in range(wave % 7 + 3)]
                for batch in await asyncio.wait_for(asyncio.gather(*calls), 30):
                    assert all(r.ok for r in batch)
                    done += len(batch)
        finally:
            client.close()
        return done

    n = asyncio.run(main())
    assert host.status().models["voice"].inferences == n


def test_a_connection_back_from_its_frame_after_close_is_closed_not_kept(
    served: tuple[DeviceHost, ChannelServer],
) -> None:
    _, server = served

    async def main() -> ChannelClient:
        client = ChannelClient(server.address, connections=2)
        call = asyncio.ensure_future(client.infer_many([("voice", AUDIO)] * 8))
        await asyncio.sleep(0)  # the frame is on its way
        client.close()
        assert all(r.ok for r in await call)  # the frame in flight still gets its answer
        return client

    client = asyncio.run(main())
    assert client._free == [] and client._opened == 0
