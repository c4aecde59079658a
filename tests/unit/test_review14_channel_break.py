"""Review 14, the data channel breaking under a batch (workers.channel, the batcher in
workers.ray_pool), with real Unix sockets and a real DeviceHost running a stateful model (silero-vad):
a batch whose channel broke after it was sent (its reply was cut, or did not decode) ran again through
Ray, stepping the VAD twice; it now runs once and its requests get an error saying so (`internal`
while the host is alive, so the manager neither retries it nor takes the host for dead). A reply that
does not pickle in the host is answered, not a closed connection. A break before the request was sent
(nothing ran) still goes through Ray. The Ray actor's side is in
tests/integration/test_review14_channel_break.py."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ray.exceptions import ActorDiedError

from workers import protocol as P
from workers.adapters import Adapter, HostCopy, make_adapter
from workers.channel import ChannelAddress, ChannelClient, ChannelError, ChannelServer, ReplyLost
from workers.host import DeviceHost
from workers.measure import Phases
from workers.ray_pool import _Batcher, _Deaths

AUDIO = {"audio": np.zeros(1024, dtype=np.float32)}
DEVICE = "r14b-cpu0"


def _refuse() -> None:
    raise ImportError("no such output type here")


class _Undecodable:
    """An output name that pickles in the host and does not unpickle in the manager (a type the
    manager cannot import, say)."""

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _refuse, ()


def _unpicklable() -> object:
    class Local(str):  # pickle writes classes by name, and a local one has none it can look up
        pass

    return Local("y")


class _Odd(Adapter):
    """Fake adapter (unit tests only, beside the real silero-vad): counts its runs and names its one
    output `key`, which pickle cannot write (`_unpicklable`) or cannot read back (`_Undecodable`)."""

    name = "odd"

    def __init__(self, spec: P.ModelSpec, device: torch.device, key: Any) -> None:
        super().__init__(spec, device)
        self.key = key
        self.runs = 0

    def inputs(self) -> list[P.TensorSpec]:
        return []

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
        return HostCopy()

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return "runnable"

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy()

    def runnable_bytes(self, runnable: Any) -> int:
        return 0

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs += 1
        return {self.key: np.zeros(1, np.float32)}


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The channel's socket directory in a fresh temporary one (short: a socket path fits in 107 bytes)."""
    top = tempfile.mkdtemp(prefix="r14b-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", top)
    yield Path(top) / f"residency-{os.getuid()}"
    shutil.rmtree(top, ignore_errors=True)


def make_host(key: Any = "y") -> DeviceHost:
    """A real host with the real VAD ("voice") and, when `key` is not None, an `_Odd` model ("odd")."""

    def factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
        return _Odd(spec, device, key) if spec.adapter == "odd" else make_adapter(spec, device)

    host = DeviceHost(DEVICE, "cpu", adapter_factory=factory)
    assert host.apply(P.Load(P.ModelSpec("voice", "silero-vad")), "load-voice").ok
    assert host.apply(P.Load(P.ModelSpec("odd", "odd")), "load-odd").ok
    return host


@pytest.fixture
def served(socket_dir: Path) -> Iterator[tuple[DeviceHost, ChannelServer]]:
    host = make_host()
    server = ChannelServer(host, "residency-device-" + DEVICE)
    yield host, server
    server.close()


def steps(host: DeviceHost) -> int:
    return host.status().models["voice"].inferences


def odd_runs(host: DeviceHost) -> int:
    adapter = host.models["odd"].adapter
    assert isinstance(adapter, _Odd)
    return adapter.runs


class _CutAfterRun:
    """Stands in for the host the channel server calls: runs the batch on the real host, then cuts
    the server's connections (something other than the host ends them mid-reply), once."""

    def __init__(self, server: ChannelServer) -> None:
        self.server, self.host = server, server.host

    def infer_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> list[P.InferResult]:
        out: list[P.InferResult] = self.host.infer_many(items)
        self.server.host = self.host
        for c in list(self.server._conns):
            c.shutdown(socket.SHUT_RDWR)
        return out


class _Call:
    """Stands in for a Ray actor method: `.remote(...)` runs it in a thread, awaitable."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0

    def remote(self, *args: Any) -> Any:
        self.calls += 1
        return asyncio.to_thread(self.fn, *args)


class _Handle:
    """The device-host actor's calls the batcher makes, as `DeviceHostActor` makes them; `channel`
    answers `address` (the host's own; another: it restarted) or raises it (it died)."""

    def __init__(self, host: DeviceHost, address: ChannelAddress | Exception) -> None:
        def channel() -> ChannelAddress:
            if isinstance(address, Exception):
                raise address
            return address

        self.infer_many = _Call(host.infer_many)
        self.channel = _Call(channel)
        self.channel_reply = _Call(lambda token: None)
        self.kept = False


def run_batch(
    host: DeviceHost,
    address: ChannelAddress,
    items: list[tuple[str, dict[str, np.ndarray]]],
    answers: ChannelAddress | Exception | None = None,
) -> tuple[list[P.InferResult], _Batcher, _Handle]:
    """`items` as one batch of the pool's batcher, over a channel to `address`; the actor's `channel`
    call answers `answers` (default: `address`, the same host). `handle.kept`: the batcher still has
    that channel, unbroken, afterwards."""
    handle = _Handle(host, address if answers is None else answers)
    batcher = _Batcher(handle, DEVICE, _Deaths())
    batcher._looked_at = math.inf  # no discovery of a next channel: this test's batch only

    async def main() -> list[P.InferResult]:
        batcher.loop = asyncio.get_running_loop()
        batcher.channel = ChannelClient(address, connections=2)
        batch = [(m, x, batcher.loop.create_future()) for m, x in items]
        batcher.inflight = 1
        await batcher._run(batch)
        handle.kept = batcher.channel is not None and not batcher.channel.broken
        return [fut.result() for _, _, fut in batch]

    try:
        return asyncio.run(main()), batcher, handle
    finally:
        batcher.close()


def assert_lost(results: list[P.InferResult], items: list[tuple[str, Any]], code: str) -> None:
    assert [r.model for r in results] == [m for m, _ in items]
    for r in results:
        assert not r.ok and r.error_code == code, r
        assert "may have run" in (r.error or "") and "not run again" in (r.error or "")
        assert f"model {r.model!r} on device {DEVICE!r}" in (r.error or "")


ITEMS: list[tuple[str, dict[str, np.ndarray]]] = [("voice", AUDIO), ("odd", {})]


# ---- a break after the request was sent: it may have run ------------------------------------------


def test_a_reply_cut_after_the_batch_ran_is_an_error_not_a_second_run(
    served: tuple[DeviceHost, ChannelServer],
) -> None:
    """The connection was cut mid-reply, with the host alive: the batcher ran the batch again through
    Ray, and the VAD stepped twice for one request."""
    host, server = served
    server.host = _CutAfterRun(server)
    results, batcher, handle = run_batch(host, server.address, ITEMS)
    assert steps(host) == 1 and odd_runs(host) == 1
    assert handle.infer_many.calls == 0 and handle.channel.calls == 1
    assert_lost(results, ITEMS, P.INTERNAL)  # the host is alive: not WORKER_DIED (no retry, no resync)
    assert "is alive" in (results[0].error or "")
    assert not handle.kept  # dropped: the next one is found again
    assert batcher.deaths.reported(DEVICE, time.monotonic()) is False


def test_a_reply_that_does_not_decode_is_an_error_not_a_second_run(socket_dir: Path) -> None:
    host = make_host(_Undecodable())
    server = ChannelServer(host, "residency-device-" + DEVICE)
    try:
        results, _, handle = run_batch(host, server.address, ITEMS)
    finally:
        server.close()
    assert steps(host) == 1 and odd_runs(host) == 1 and handle.infer_many.calls == 0
    assert_lost(results, ITEMS, P.INTERNAL)
    assert "ImportError" in (results[0].error or "")  # why the answer was lost


@pytest.mark.parametrize("answers", ["restarted", "died"])
def test_a_host_gone_under_a_sent_batch_is_worker_died_still_without_a_second_run(
    served: tuple[DeviceHost, ChannelServer], answers: str
) -> None:
    """The host that was sent the batch is gone (Ray says it died, or a restarted one with a new
    channel answers): WORKER_DIED, as a call through Ray to a dead host says, so that the manager
    resyncs it; still the batch does not run a second time."""
    host, server = served
    server.host = _CutAfterRun(server)
    restarted = ChannelAddress(server.path + ".new", server.address.boot_id, server.address.pid + 1)
    said = restarted if answers == "restarted" else ActorDiedError()
    results, batcher, handle = run_batch(host, server.address, ITEMS, answers=said)
    assert steps(host) == 1 and odd_runs(host) == 1 and handle.infer_many.calls == 0
    assert_lost(results, ITEMS, P.WORKER_DIED)
    assert batcher.deaths.reported(DEVICE, time.monotonic()) is (answers == "died")


def test_the_client_says_reply_lost_only_once_the_request_was_sent(
    served: tuple[DeviceHost, ChannelServer],
) -> None:
    host, server = served
    server.host = _CutAfterRun(server)

    async def main() -> ChannelClient:
        client = ChannelClient(server.address, connections=1)
        with pytest.raises(ReplyLost, match="after the request was sent"):
            await asyncio.wait_for(client.infer_many([("voice", AUDIO)]), 30)
        return client

    client = asyncio.run(main())
    assert client.broken and client._opened == 0 and steps(host) == 1
    assert issubclass(ReplyLost, ChannelError)  # (a caller that knows only ChannelError drops the channel)


# ---- a reply that does not pickle in the host --------------------------------------------------------


def test_a_result_that_does_not_pickle_is_answered_with_an_error_and_the_rest_come_back(
    socket_dir: Path,
) -> None:
    """It closed the connection (a "bad frame"): the manager could not tell the batch had run, and ran
    it again through Ray."""
    host = make_host(_unpicklable())
    server = ChannelServer(host, "residency-device-" + DEVICE)
    try:
        items = [*ITEMS, ("voice", AUDIO)]
        results, batcher, handle = run_batch(host, server.address, items)
        assert steps(host) == 2 and odd_runs(host) == 1  # each request ran once
        assert handle.infer_many.calls == 0 and batcher.channel_batches == 1
        assert results[0].ok and results[2].ok and "speech_prob" in results[2].outputs
        odd = results[1]
        assert not odd.ok and odd.error_code == P.INTERNAL
        assert f"model 'odd' ran on device {DEVICE!r}" in (odd.error or "")
        assert "does not pickle" in (odd.error or "")
        assert handle.kept  # the connection serves on
    finally:
        server.close()


# ---- a break before the request was sent: nothing ran ------------------------------------------------


def test_a_channel_gone_before_the_request_was_sent_still_goes_through_ray(
    served: tuple[DeviceHost, ChannelServer],
) -> None:
    host, server = served
    address = server.address
    server.close()  # the socket is gone: the connection is refused, nothing is sent
    results, _, handle = run_batch(host, address, ITEMS)
    assert handle.infer_many.calls == 1 and handle.channel.calls == 0
    assert steps(host) == 1 and results[0].ok and results[1].ok
    assert not handle.kept


def test_a_connection_that_breaks_while_the_request_is_sent_is_a_plain_channel_error(
    socket_dir: Path,
) -> None:
    """The host read none of the frame (it ended the connection): nothing ran, so this is no
    ReplyLost, and the batcher goes through Ray."""
    socket_dir.mkdir(mode=0o700)
    path = str(socket_dir / "cut.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def accept_and_close() -> None:
        conn, _ = listener.accept()
        conn.close()  # reads nothing: the sender's write breaks

    t = threading.Thread(target=accept_and_close)
    t.start()
    big = {"audio": np.zeros(8 << 20, dtype=np.float32)}  # 32 MiB: far more than a socket buffers

    async def main() -> None:
        client = ChannelClient(ChannelAddress(path, "boot", os.getpid()), connections=1)
        with pytest.raises(ChannelError) as e:
            await asyncio.wait_for(client.infer_many([("voice", big)]), 30)
        assert not isinstance(e.value, ReplyLost), e.value

    try:
        asyncio.run(main())
    finally:
        t.join(10)
        listener.close()
