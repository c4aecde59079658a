"""residency.v1.WorldSession over a real socket (grpc.aio, in-process server, in-process hosts):
start, one pose per segment, latents and stall/tier figures back; bad streams get clear statuses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from manager.config import Config, load_config
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

from .grpc_server import serving

CONFIG = """
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: realtime}, {name: interactive}]
models:
  - {name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 4MiB,
     elastic: {min: 16MiB, max: 256MiB}, load_seconds: {disk: 0.2, host: 0.05}, source: {preset: micro}}
  - {name: voice, class: realtime, adapter: silero-vad, device: cpu0, memory: 3MiB,
     load_seconds: {disk: 0.1, host: 0.05}}
"""


def world_config(tmp_path: Path, **server: Any) -> Config:
    """CONFIG serving on a free port with its sessions under `tmp_path`, `server` fields overridden."""
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(CONFIG)
    config = load_config(cfg_path)
    return config.model_copy(
        update={
            "server": config.server.model_copy(update={"listen": "127.0.0.1:0", **server}),
            "store": config.store.model_copy(update={"sessions": str(tmp_path / "sessions")}),
        }
    )


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_world_session_stream(tmp_path: Path, frontends: int) -> None:
    """Also through a gRPC front end, which relays the bidirectional stream message by message."""
    config = world_config(tmp_path, frontends=frontends)

    async def inputs(*msgs: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
        for m in msgs:
            yield m

    async def main() -> None:
        async with serving(config) as (target, manager), grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.WorldSessionStub(ch)
            start = pb.WorldInput(start=pb.WorldStart(model="world"))
            poses = [pb.WorldInput(action=pb.WorldAction(x=i, yaw=20.0 * i)) for i in range(3)]
            outs = [o async for o in stub.Run(inputs(start, *poses))]
            assert [o.segment for o in outs] == [-1, 0, 1, 2]
            assert len({o.session_id for o in outs}) == 1
            last = outs[-1]
            lat = np.frombuffer(last.latents, dtype="<f4").reshape(tuple(last.shape))
            assert lat.size > 0 and np.isfinite(lat).all()
            assert last.lease_bytes >= 16 * 2**20 and last.stall_s >= 0 and last.max_position > 0
            for _ in range(500):  # a relayed stream's end reaches the manager's process a moment later
                if not manager.sessions:
                    break
                await asyncio.sleep(0.01)
            assert manager.sessions == {}  # closed when the client ended its stream
            assert not any(o.resumed for o in outs) and outs[0].next_segment == 0

            # a new stream resumes the saved session by id: it goes on at segment 3
            sid = outs[0].session_id
            resume = pb.WorldInput(start=pb.WorldStart(model="world", resume_session_id=sid))
            more = [pb.WorldInput(action=pb.WorldAction(x=3 + i, yaw=20.0 * (3 + i))) for i in range(2)]
            again = [o async for o in stub.Run(inputs(resume, *more))]
            assert [o.segment for o in again] == [-1, 3, 4] and {o.session_id for o in again} == {sid}
            assert again[0].resumed and again[0].next_segment == 3 and list(again[0].unusable) == []

            # one session at a time per world model: a second start while one runs is refused
            held = stub.Run()
            await held.write(start)
            running = await held.read()
            assert isinstance(running, pb.WorldOutput) and running.segment == -1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [o async for o in stub.Run(inputs(start))]
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = e.value.details() or ""
            assert "runs a session;" in details and running.session_id not in details
            await held.done_writing()
            assert await held.read() == grpc.aio.EOF and await held.code() == grpc.StatusCode.OK
            for msgs, code, words in [
                ((pb.WorldInput(start=pb.WorldStart(model="world", resume_session_id="0" * 12)),),
                 grpc.StatusCode.NOT_FOUND, "no saved world session"),
                ((pb.WorldInput(start=pb.WorldStart(model="world", resume_session_id="../x")),),
                 grpc.StatusCode.INVALID_ARGUMENT, "not a session id"),
            ]:  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    _ = [o async for o in stub.Run(inputs(*msgs))]
                assert e.value.code() == code and words in (e.value.details() or "")

            for msgs, code, words in [
                ((poses[0],), grpc.StatusCode.INVALID_ARGUMENT, "first message"),
                (
                    (pb.WorldInput(start=pb.WorldStart(model="nope")),),
                    grpc.StatusCode.NOT_FOUND,
                    "unknown model",
                ),
                (
                    (pb.WorldInput(start=pb.WorldStart(model="voice")),),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "not a world",
                ),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    _ = [o async for o in stub.Run(inputs(*msgs))]
                assert e.value.code() == code and words in (e.value.details() or "")

    asyncio.run(main())


class Blackhole:
    """A TCP proxy between a client and the server that, once `vanish()` is called, stops passing
    bytes either way without closing anything: the client is gone as a laptop that fell asleep or
    a dropped Wi-Fi link is (no FIN, no RST reaches the server)."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.vanished = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def vanish(self) -> None:
        self.vanished.set()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while not self.vanished.is_set():
            data = await r.read(65536)
            if not data or self.vanished.is_set():
                break
            w.write(data)
            await w.drain()
        await asyncio.Event().wait()  # vanished: hold both sockets open, pass nothing

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(self.host, self.port)
        self.writers += [cw, sw]
        await asyncio.gather(self._pipe(cr, sw), self._pipe(sr, cw))

    def close(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.server.close()


@pytest.mark.parametrize("frontends", [0, 1], ids=["direct", "front-end"])
def test_a_vanished_clients_world_session_is_closed_by_the_keepalive(tmp_path: Path, frontends: int) -> None:
    # A world model runs one session at a time, so a client that vanished without closing its stream
    # (no FIN, no RST) would hold the world model for good: nothing else reads or writes on that
    # stream while the session waits for the next pose. The server's keepalive pings find it gone.
    # (pings every 3 s, each answered within 3 s: the proxy relays them on this test's own event loop,
    # which a loaded 2-core machine may stall for a second)
    config = world_config(tmp_path, frontends=frontends, keepalive=3.0)

    async def main() -> None:
        async with serving(config) as (target, manager):
            proxy = Blackhole(target)
            via = await proxy.start()
            ch = grpc.aio.insecure_channel(via)
            try:
                call = pb_grpc.WorldSessionStub(ch).Run()
                await call.write(pb.WorldInput(start=pb.WorldStart(model="world")))
                first = await call.read()
                assert isinstance(first, pb.WorldOutput) and first.session_id in manager.sessions
                await asyncio.sleep(4.0)  # an idle stream of a client that is still there: kept
                assert first.session_id in manager.sessions
                proxy.vanish()
                t0 = time.monotonic()
                while (manager.sessions or manager.live["world"].inflight) and time.monotonic() - t0 < 20:
                    await asyncio.sleep(0.1)  # the books close once the host has closed it
                assert manager.sessions == {}, "the vanished client's session was not closed"
                assert manager.live["world"].inflight == 0
            finally:
                proxy.close()
                await ch.close(grace=None)
            async with grpc.aio.insecure_channel(target) as direct:  # the world model takes a new one
                start = pb.WorldInput(start=pb.WorldStart(model="world"))
                outs = [o async for o in pb_grpc.WorldSessionStub(direct).Run(_one(start))]
                assert [o.segment for o in outs] == [-1]

    asyncio.run(main())


async def _one(msg: pb.WorldInput) -> AsyncIterator[pb.WorldInput]:
    yield msg
