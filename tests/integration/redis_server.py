"""A private, real redis-server for the integration tests (STYLE 8 and 4.8).

Fixtures:
  redis_url   (session) - starts `redis-server` on a free 127.0.0.1 port, with no persistence, in a
                          temp dir; waits for PING (polling against a deadline, never a fixed sleep);
                          yields `redis://127.0.0.1:<port>/0`; stops the server (and waits) at the end.
                          No binary on PATH: a failure under CI=true (CI must exercise the real
                          server), a skip elsewhere.
  redis_clean (function) - the same url, with every key flushed before the test.

Use: `from .redis_server import redis_clean, redis_url  # noqa: F401` in a test module, or import
them into tests/integration/conftest.py. Talks RESP over a plain socket, so the fixture needs no
client library.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["redis_clean", "redis_url"]

START_TIMEOUT_S = 15.0
_ATTEMPTS = 3  # another process may take the free port between our probe and redis-server's bind


def free_port() -> int:
    """A port nothing listens on now (Redis treats --port 0 as "no TCP listener", so ask the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def redis_command(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """Send one command (RESP array) to 127.0.0.1:port; return the first reply line."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args
    )
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.strip()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
    """Poll PING until +PONG (True), the process exits (False) or the deadline passes (False)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if redis_command(port, "PING", timeout=0.5) == b"+PONG":
                return True
        except OSError:
            pass  # not listening yet
        time.sleep(0.02)  # a poll interval, not a startup barrier
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(exe: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start redis-server on a free port and wait for it; pytest.fail with its log if it never answers."""
    log = workdir / "redis.log"
    for _ in range(_ATTEMPTS):
        port = free_port()
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(workdir), "--logfile", str(log)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_ready(proc, port, time.monotonic() + START_TIMEOUT_S):
            return proc, port
        _stop(proc)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    pytest.fail(f"redis-server did not answer PING after {_ATTEMPTS} tries; its log ends:\n{tail}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`redis://127.0.0.1:<port>/0` of a private redis-server, for the whole session."""
    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not on PATH (apt-get install redis-server, or `make redis-server`)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; CI must run the Redis tests")
        pytest.skip(msg)
    proc, port = _start(exe, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)


@pytest.fixture
def redis_clean(redis_url: str) -> str:
    """`redis_url`, with every key of every db flushed first."""
    port = int(redis_url.rsplit(":", 1)[1].split("/", 1)[0])
    reply = redis_command(port, "FLUSHALL")
    assert reply == b"+OK", reply
    return redis_url


@pytest.fixture
def rstore(redis_clean: str) -> Iterator[Any]:
    """A RedisStore on the flushed private server."""
    from manager.store import open_store
    from manager.store.redis import RedisStore

    s = open_store(redis_clean)
    assert isinstance(s, RedisStore)
    yield s
    s.close()


@pytest.fixture
def client(redis_clean: str) -> Iterator[Any]:
    """A plain client on the same server, to look at (or damage) what the store wrote."""
    import redis

    c = redis.Redis.from_url(redis_clean)
    yield c
    c.close()
