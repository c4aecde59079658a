"""End-to-end: `residency serve` as a subprocess, ready when its health service says SERVING.

Runs in a pytest process of its own (`RESIDENCY_E2E=1 pytest tests/e2e`, as `make test` does): the
stock client's generated `inference` protos and the server's cannot live in one process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from integration.ray_head import PRIVATE_RAY, head_node  # noqa: F401  (fixture)
from integration.redis_server import free_port, redis_clean, redis_url  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "local-cpu.yaml"


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    target: str
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return int(self.proc.returncode)


def _died(server: Server) -> None:
    if server.proc.poll() is not None:
        pytest.fail(
            f"residency serve exited with {server.proc.returncode}:\n{server.log.read_text()[-3000:]}"
        )


def wait_serving(server: Server, timeout_s: float = 180.0) -> None:
    """Poll grpc.health.v1 until SERVING (never a fixed sleep); fail with the server's log if it dies.
    A server told to listen on port 0 is found at the port its "serving on" line names."""
    deadline = time.monotonic() + timeout_s
    while server.target.endswith(":0"):
        _died(server)
        said = re.search(r"serving on (\S+:\d+) ", server.log.read_text(errors="replace"))
        if said:
            server.target = said[1]
        elif time.monotonic() > deadline:
            pytest.fail(
                f"residency serve said no address within {timeout_s} s:\n{server.log.read_text()[-3000:]}"
            )
        else:
            time.sleep(0.1)
    with grpc.insecure_channel(server.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            _died(server)
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    pytest.fail(f"residency serve was not SERVING within {timeout_s} s:\n{server.log.read_text()[-3000:]}")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(
        store_url: str,
        *extra: str,
        config_text: str | None = None,
        env: dict[str, str] | None = None,
        listen: str | None = None,
    ) -> Server:
        cfg = tmp_path / f"config-{len(servers)}.yaml"
        text = config_text if config_text is not None else CONFIG.read_text()
        cfg.write_text(f'store: {{url: "{store_url}"}}\n' + text)
        # (port 0 by default: a port picked here could be taken by the local Ray serve starts first)
        target = listen or "127.0.0.1:0"
        log = tmp_path / f"server-{len(servers)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(BIN / "residency"), "serve", "--config", str(cfg), "--listen", target, *extra],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})},
            )  # fmt: skip
        server = Server(proc, target, log)
        servers.append(server)
        wait_serving(server)
        return server

    yield start
    for s in servers:
        s.stop()
