"""Review 14, the data channel (workers.channel, the batcher in workers.ray_pool), with real Unix
sockets and a real DeviceHost running a stateful model (silero-vad): a batch whose reply is over the
frame limit runs once (its results are fetched, never the batch run again through Ray); socket names
are unique and only sockets no process listens on are removed as stale, whatever their pid says (a
container sharing /tmp has its own pid namespace). The Ray actor's side is in
tests/integration/test_review14_channel.py."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workers import channel
from workers import protocol as P
from workers.channel import ChannelClient, ChannelServer, ReplyTooLarge
from workers.host import DeviceHost
from workers.ray_pool import _Batcher, _Deaths

AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}
# One VAD step and many requests for a model the host lacks: a small request (the repeated item
# pickles once) whose reply (an error each) is three times larger.
ITEMS: list[tuple[str, dict[str, np.ndarray]]] = [("voice", AUDIO)] + [("nope", {})] * 100
LIMIT = 8192


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The channel's socket directory, in a fresh temporary directory standing for a /tmp shared with
    other containers (a short one: a socket path must fit in 107 bytes, and pytest's tmp_path is long)."""
    top = tempfile.mkdtemp(prefix="r14-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", top)
    yield Path(top) / f"residency-{os.getuid()}"
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def vad(socket_dir: Path) -> Iterator[tuple[DeviceHost, ChannelServer]]:
    host = DeviceHost("r14-cpu0", "cpu")
    assert host.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "load-voice").ok
    server = ChannelServer(host, "residency-device-r14-cpu0")
    yield host, server
    server.close()


def steps(host: DeviceHost) -> int:
    return host.status().models["voice"].inferences


def over_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame limit the request fits under and its reply does not."""
    reply = DeviceHost("r14-sizes", "cpu").infer_many(ITEMS)  # (every item fails there: nothing loaded)
    assert len(pickle.dumps(ITEMS, protocol=pickle.HIGHEST_PROTOCOL)) < LIMIT
    assert len(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)) > LIMIT
    monkeypatch.setattr(channel, "MAX_FRAME", LIMIT)


class _Call:
    """Stands in for a Ray actor method: `.remote(...)` runs it in a thread, awaitable."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0

    def remote(self, *args: Any) -> Any:
        self.calls += 1
        return asyncio.to_thread(self.fn, *args)


class _Handle:
    """The device-host actor's two inference calls, as `DeviceHostActor` makes them."""

    def __init__(self, host: DeviceHost, server: ChannelServer) -> None:
        self.infer_many = _Call(host.infer_many)
        self.channel_reply = _Call(server.take)
        self.kept = False


def run_batch(host: DeviceHost, server: ChannelServer) -> tuple[list[P.InferResult], _Batcher, _Handle]:
    """ITEMS as one batch of the pool's batcher, over the channel to `server`; `handle.kept`: the
    batcher still has that channel, unbroken, afterwards."""
    handle = _Handle(host, server)
    batcher = _Batcher(handle, "r14-cpu0", _Deaths())

    async def main() -> list[P.InferResult]:
        batcher.loop = asyncio.get_running_loop()
        batcher.channel = ChannelClient(server.address, connections=2)
        batch = [(m, x, batcher.loop.create_future()) for m, x in ITEMS]
        batcher.inflight = 1
        await batcher._run(batch)
        handle.kept = batcher.channel is not None and not batcher.channel.broken
        return [fut.result() for _, _, fut in batch]

    try:
        return asyncio.run(main()), batcher, handle
    finally:
        if batcher.channel is not None:
            batcher.channel.close()


# ---- a reply over the frame limit ------------------------------------------------------------------


def test_a_batch_with_an_over_limit_reply_runs_once(
    vad: tuple[DeviceHost, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It ran over the channel, the client refused the reply, and the batcher ran the whole batch
    again through Ray: the VAD stepped twice for one request."""
    host, server = vad
    over_limit(monkeypatch)
    results, batcher, handle = run_batch(host, server)
    assert steps(host) == 1
    assert handle.infer_many.calls == 0 and handle.channel_reply.calls == 1
    assert [r.model for r in results] == [m for m, _ in ITEMS]
    assert results[0].ok and "speech_prob" in results[0].outputs
    assert all(not r.ok and r.error_code == P.BAD_TRANSITION for r in results[1:])
    assert batcher.channel_batches == 0 and handle.channel_reply.calls == 1
    assert handle.kept  # the channel itself is fine
    assert server.take("anything") is None and server._held == {}  # fetched once, nothing kept


def test_an_over_limit_reply_is_held_for_one_take_and_the_connection_serves_on(
    vad: tuple[DeviceHost, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    host, server = vad
    over_limit(monkeypatch)

    async def main() -> tuple[ReplyTooLarge, list[P.InferResult]]:
        client = ChannelClient(server.address, connections=1)
        try:
            with pytest.raises(ReplyTooLarge) as held:
                await client.infer_many(ITEMS)
            return held.value, await client.infer_many([("voice", AUDIO)])  # the same connection
        finally:
            client.close()

    held, after = asyncio.run(main())
    assert f"over the channel's {LIMIT}-byte frame limit" in str(held) and held.nbytes > LIMIT
    taken = server.take(held.token)
    assert taken is not None and [r.model for r in taken] == [m for m, _ in ITEMS] and taken[0].ok
    assert server.take(held.token) is None  # once
    assert after[0].ok and steps(host) == 2


def test_a_reply_no_longer_held_is_an_error_not_a_second_run(
    vad: tuple[DeviceHost, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    host, server = vad
    over_limit(monkeypatch)
    monkeypatch.setattr(channel, "HELD_S", -1.0)  # every held reply has expired by its fetch
    results, _, handle = run_batch(host, server)
    assert steps(host) == 1 and handle.infer_many.calls == 0
    assert all(not r.ok and r.error_code == P.INTERNAL for r in results)
    assert "not run again" in (results[0].error or "") and "'voice'" in (results[0].error or "")


def test_a_host_keeps_at_most_held_max_replies(
    vad: tuple[DeviceHost, ChannelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies whose callers never fetch them (gone meanwhile) do not pile up in the host."""
    _, server = vad
    tokens = [server._hold([P.InferResult("m", True)]) for _ in range(channel.HELD_MAX + 3)]
    assert len(server._held) == channel.HELD_MAX
    assert server.take(tokens[0]) is None and server.take(tokens[-1]) is not None


# ---- socket names and stale sockets ----------------------------------------------------------------


def listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(4)
    return s


def crashed(path: Path) -> None:
    """The socket file a host that crashed leaves: bound once, no one listens on it now."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def reaches(path: Path, listener: socket.socket) -> bool:
    """Does a connection to `path` arrive at `listener`?"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(path))
        listener.settimeout(5)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return False
        conn.close()
        return True


def vad_answers(server: ChannelServer) -> bool:
    async def main() -> list[P.InferResult]:
        client = ChannelClient(server.address)
        try:
            return await client.infer_many([("voice", AUDIO)])
        finally:
            client.close()

    return asyncio.run(main())[0].ok


def test_a_live_socket_of_another_container_is_kept_whatever_its_pid(
    vad: tuple[DeviceHost, ChannelServer],
) -> None:
    """Another container sharing /tmp (same uid, its own pid namespace): its live host's socket was
    removed because its pid does not run here, and one with our name and pid was replaced by ours."""
    host, _ = vad
    d = Path(vad[1].path).parent
    elsewhere = d / "residency-device-cpu0-999999999.sock"  # a pid that runs in no namespace here
    twin = d / f"residency-device-r14-cpu1-{os.getpid()}.sock"  # our name and pid, over there
    theirs = [listening(elsewhere), listening(twin)]
    try:
        server = ChannelServer(host, "residency-device-r14-cpu1")
        try:
            assert reaches(elsewhere, theirs[0]) and reaches(twin, theirs[1])
            assert server.path not in (str(elsewhere), str(twin)) and vad_answers(server)
        finally:
            server.close()
        assert reaches(elsewhere, theirs[0]) and reaches(twin, theirs[1])  # our close left them
    finally:
        for s in theirs:
            s.close()


def test_a_crashed_hosts_socket_is_removed_even_when_its_pid_runs_again(
    vad: tuple[DeviceHost, ChannelServer],
) -> None:
    """A crashed run's socket whose pid now belongs to a live process (reused, or the host of a new
    container run) stayed for ever."""
    host, first = vad
    d = Path(first.path).parent
    stale = [
        d / f"residency-device-r14-cpu4-{os.getpid()}.sock",  # our own pid: a restart in a container
        d / f"residency-device-r14-cpu2-{os.getppid()}.sock",
        d / "residency-device-gone-999999999.sock",
    ]
    for p in stale:
        crashed(p)
    server = ChannelServer(host, "residency-device-r14-cpu4")
    try:
        assert not any(p.exists() for p in stale)
        assert Path(first.path).exists() and vad_answers(first)  # a live host's socket is kept
        assert vad_answers(server)
    finally:
        server.close()


def test_a_host_between_bind_and_listen_is_not_taken_for_stale(
    vad: tuple[DeviceHost, ChannelServer],
) -> None:
    """A socket is named `.sock` only once it listens; before that it is a `.bind`, removed only
    when old enough that its host died starting."""
    host, first = vad
    d = Path(first.path).parent
    starting, died = d / "residency-device-a-1-aa.bind", d / "residency-device-b-2-bb.bind"
    crashed(starting)
    crashed(died)
    old = time.time() - channel.STALE_BIND_S - 5
    os.utime(died, (old, old), follow_symlinks=False)
    server = ChannelServer(host, "residency-device-r14-cpu3")
    try:
        assert starting.exists() and not died.exists()
        assert server.path.endswith(".sock") and not list(d.glob("residency-device-r14-cpu3*.bind"))
    finally:
        server.close()


def test_a_long_or_odd_device_name_still_gets_a_channel(
    vad: tuple[DeviceHost, ChannelServer],
) -> None:
    """A socket path is at most 107 bytes: a long device name left its host without a channel."""
    host, _ = vad
    server = ChannelServer(host, "residency-device-" + "kitchen/den " * 20)
    try:
        name = Path(server.path).name
        assert len(os.fsencode(server.path)) <= 107 and "/" not in name and " " not in name
        assert name.startswith("residency-device-kitchen_den_") and f"-{os.getpid()}-" in name
        assert vad_answers(server)
    finally:
        server.close()
    assert not os.path.exists(server.path)
