"""Review of the server's lifecycle and process plumbing: `residency serve` (manager/api/server.py),
the front ends' links (manager/api/front.py, manager/api/fastpath.py) and the data channel to device
hosts (workers/channel.py). One class per bug found; each docstring says what failed before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from live_helpers import local_config

from manager.api.fastpath import FastPathServer
from manager.api.runtime import ServeError
from manager.api.server import Frontends, auth_token, build_server, serve
from manager.config import Config
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from workers.channel import ChannelAddress, ChannelClient, ChannelError, boot_id


def config(tmp_path: Path, **server: Any) -> Config:
    """The local CPU config with only its voice model (quick to start), its state under `tmp_path`."""
    return local_config(tmp_path, ("voice",), **server)


def serve_until_ready(cfg: Config, on_ready: Callable[[int], None] = lambda port: None) -> None:
    """`residency serve` in this process: `on_ready(port)` once it serves, then a SIGTERM stops it."""

    def ready(port: int) -> None:
        on_ready(port)
        os.kill(os.getpid(), signal.SIGTERM)  # caught by serve's handler: a clean stop

    asyncio.run(serve(cfg, in_process=True, ready=ready))


def free_port(family: socket.AddressFamily = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def answers(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) == 0


class TestMetricsListenerIsClosedAtStop:
    """`server.metrics_listen`: prometheus' HTTP server was started and never stopped, so after a clean
    stop of `serve` its socket still listened on the metrics port (and its thread still ran): a
    second start in the same process (or anything else) could not bind the port."""

    def test_the_metrics_port_is_free_after_a_clean_stop(self, tmp_path: Path) -> None:
        port = free_port()
        seen: list[bool] = []
        cfg = config(tmp_path, metrics_listen=f"127.0.0.1:{port}")
        serve_until_ready(cfg, lambda _: seen.append(answers(socket.AF_INET, "127.0.0.1", port)))
        assert seen == [True]  # it served metrics meanwhile
        assert not answers(socket.AF_INET, "127.0.0.1", port)
        with socket.socket() as s:  # and the port can be bound again
            s.bind(("127.0.0.1", port))


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
class TestMetricsListenOnBracketedIPv6:
    """`server.metrics_listen: "[::1]:9100"` passes the config's host:port check (as `server.listen`
    does, where gRPC takes it), but serve handed "[::1]" with its brackets to the HTTP server, which
    failed to resolve it: the service refused to start with "cannot listen: Name or service not
    known" on a valid address."""

    def test_the_service_starts_and_serves_metrics_on_ipv6_loopback(self, tmp_path: Path) -> None:
        port = free_port(socket.AF_INET6, "::1")
        seen: list[bool] = []
        cfg = config(tmp_path, metrics_listen=f"[::1]:{port}")
        serve_until_ready(cfg, lambda _: seen.append(answers(socket.AF_INET6, "::1", port)))
        assert seen == [True]


class TestAuthTokenThatNoClientCanSend:
    """A token in the environment that gRPC cannot carry in a header (a trailing newline from
    `$(cat file)`-style quoting, a control or a non-ASCII character) was accepted: the service
    started, and every admin call failed on the client with an opaque "execute_batch" error from
    gRPC's metadata validation, no error naming the variable."""

    @pytest.mark.parametrize(
        "token", ["s3cret\n", "s3cret\tx", "p\u00e4ss"], ids=["newline", "tab", "non-ascii"]
    )
    def test_it_is_refused_at_start_naming_the_variable(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str
    ) -> None:
        monkeypatch.setenv("RESIDENCY_REVIEW_TOKEN", token)
        cfg = config(tmp_path, auth_token_env="RESIDENCY_REVIEW_TOKEN")
        with pytest.raises(ServeError, match="RESIDENCY_REVIEW_TOKEN") as e:
            auth_token(cfg)
        assert token not in str(e.value) and token.strip() not in str(e.value)  # no secret shown

    def test_a_printable_token_is_taken_as_it_is(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("RESIDENCY_REVIEW_TOKEN", "a b~!x")
        assert auth_token(config(tmp_path, auth_token_env="RESIDENCY_REVIEW_TOKEN")) == "a b~!x"


class TestFrontEndSocketPathTooLong:
    """With `server.frontends` and a long TMPDIR, the private sockets' paths passed the 107 bytes a
    Unix socket address holds: the service refused to start with "cannot listen on 'unix:/tmp/…/
    grpc.sock' (address in use or not available)", naming neither the cause nor TMPDIR (the user's
    `server.listen` was fine)."""

    def test_the_error_names_the_length_and_tmpdir_and_leaves_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        long_tmp = tmp_path / ("t" * 100)
        long_tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
        cfg = config(tmp_path, frontends=1)

        async def main() -> None:
            pool = create_pool(cfg, in_process=True)
            manager = LiveManager(cfg, pool)
            try:
                fronts = Frontends(cfg, manager)
                try:
                    await build_server(cfg, manager, listen=fronts.backend)
                finally:
                    await fronts.stop()
            finally:
                pool.close()

        with pytest.raises(ServeError, match="TMPDIR") as e:
            asyncio.run(main())
        assert "too long" in str(e.value)
        assert list(long_tmp.iterdir()) == []  # no private directory left behind


class TestFastPathPeerClosingMidFrame:
    """A front end that died in the middle of a frame (or sent a frame whose body does not decode,
    e.g. an empty one) made the manager's fast-path server fail with IncompleteReadError / EOFError,
    which its handler did not catch: asyncio logged "Unhandled exception in client_connected_cb" with
    a traceback instead of the one-line warning that a front end's connection ended."""

    @pytest.mark.parametrize(
        "junk",
        [(100).to_bytes(4, "big") + b"partial", b"\x00\x00", (0).to_bytes(4, "big")],
        ids=["mid-body", "mid-header", "empty-body"],
    )
    def test_it_is_a_warning_not_a_traceback(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, junk: bytes
    ) -> None:
        caplog.set_level(logging.WARNING)

        async def handler(raw: bytes, left: float | None) -> tuple[int, str, bytes]:
            return 0, "", raw

        async def main() -> None:
            server = FastPathServer(handler)
            path = str(tmp_path / "f.sock")
            await server.start(path)
            try:
                _, writer = await asyncio.open_unix_connection(path)
                writer.write(junk)
                await writer.drain()
                writer.close()  # the front end dies here
                await writer.wait_closed()
                for _ in range(1000):  # until the server has dealt with it (10 s at most)
                    if any(r.levelno >= logging.WARNING for r in caplog.records):
                        break
                    await asyncio.sleep(0.01)
                for _ in range(5):
                    await asyncio.sleep(0)  # (a task's done callbacks run a turn later)
            finally:
                await server.stop()

        asyncio.run(main())
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert any("a front end's connection ended" in r.getMessage() for r in caplog.records)


@contextlib.contextmanager
def fake_host(
    tmp_path: Path, reply: Callable[[bytes], bytes], gate: threading.Event | None = None
) -> Iterator[str]:
    """A device host's channel socket that answers each frame with `reply(body)` (raw bytes, its own
    length header included), once `gate` is set when given."""
    path = str(tmp_path / "host.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    conns: list[socket.socket] = []

    def serve_conn(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                head = conn.recv(4, socket.MSG_WAITALL)
                if len(head) < 4:
                    return
                body = conn.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL)
                if gate is not None:
                    gate.wait(30)
                conn.sendall(reply(body))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conns.append(conn)
                threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield path
    finally:
        if gate is not None:
            gate.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def framed(obj: Any) -> bytes:
    data = pickle.dumps(obj)
    return struct.pack(">I", len(data)) + data


class TestChannelGarbageReply:
    """A reply frame from the host that does not decode as pickle in a way other than
    UnpicklingError (an empty body: EOFError; a class that does not import here:
    ModuleNotFoundError) escaped `infer_many` as that raw exception, not ChannelError: the batcher
    then failed the whole batch as WORKER_DIED (and counted it against the device) instead of
    falling back to Ray, and the channel was not marked broken."""

    @pytest.mark.parametrize(
        "body", [b"", b"cno_such_module_here\nthing\n."], ids=["empty", "unimportable-class"]
    )
    def test_it_is_a_channel_error_and_the_channel_is_broken(self, tmp_path: Path, body: bytes) -> None:
        def reply(_: bytes) -> bytes:
            return struct.pack(">I", len(body)) + body

        async def main(path: str) -> ChannelClient:
            client = ChannelClient(ChannelAddress(path, boot_id(), os.getpid()), connections=1)
            try:
                with pytest.raises(ChannelError, match=r"host\.sock"):
                    await asyncio.wait_for(client.infer_many([("voice", {})]), 10)
            finally:
                client.close()
            return client

        with fake_host(tmp_path, reply) as path:
            client = asyncio.run(main(path))
        assert client.broken and client._opened == 0


class TestChannelWakeupLostToACancelledWaiter:
    """ChannelClient with all its connections busy queues callers; a released connection wakes the
    first. When that caller was cancelled after it was woken but before it ran, the wake-up was
    lost: the connection sat free while the next caller waited for ever (nothing else would release
    one)."""

    def test_the_next_waiter_gets_the_connection(self, tmp_path: Path) -> None:
        gate = threading.Event()

        async def main(path: str) -> list[Any]:
            client = ChannelClient(ChannelAddress(path, boot_id(), os.getpid()), connections=1)
            try:
                second: asyncio.Task[Any] | None = None

                async def first() -> list[Any]:
                    results = await client.infer_many([("voice", {})])
                    assert second is not None
                    second.cancel()  # woken by this release, cancelled before it runs
                    return results

                a = asyncio.ensure_future(first())
                await asyncio.sleep(0)
                second = asyncio.ensure_future(client.infer_many([("voice", {})]))
                await asyncio.sleep(0)
                third = asyncio.ensure_future(client.infer_many([("voice", {})]))
                while len(client._waiters) < 2:
                    await asyncio.sleep(0.01)
                gate.set()  # the host answers
                assert await asyncio.wait_for(a, 10) == []
                with pytest.raises(asyncio.CancelledError):
                    await second
                result: list[Any] = await asyncio.wait_for(third, 10)
                return result
            finally:
                client.close()

        with fake_host(tmp_path, lambda _: framed([]), gate) as path:
            assert asyncio.run(main(path)) == []


def test_a_port_in_use_is_said_before_the_device_hosts_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a README walk-through: a second `serve` on a port in use was refused only after it had
    started a whole local Ray (about 9 s). The port is now probed first; the real bind still checks."""
    import manager.workers_bridge as bridge
    from manager.api.server import probe_listen

    started: list[bool] = []
    monkeypatch.setattr(bridge, "create_pool", lambda *a, **k: started.append(True))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        target = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ServeError, match=rf"cannot listen on '{target}'.*another server holds it"):
            probe_listen(target)
        cfg = config(tmp_path, listen=target)
        with pytest.raises(ServeError, match=rf"cannot listen on '{target}'"):
            asyncio.run(serve(cfg, in_process=True))
    assert started == []  # refused before any device host was made
    probe_listen(target)  # free again
    probe_listen("127.0.0.1:0")  # any free port: nothing to probe
