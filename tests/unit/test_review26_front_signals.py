"""Review 26: a residency started with SIGINT and SIGHUP ignored (`nohup`, a shell's `&`) keeps them
ignored, and now so do its gRPC front ends. A SIGHUP to the process group (the terminal closed)
killed each front end, and a SIGINT stopped it: the manager served on and started new ones, and the
calls and streams open through them broke. The real `residency serve`, in a session of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RESIDENCY = Path(sys.executable).with_name("residency")
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _front_ends(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"manager.api.front" in cmdline:
            found.append(int(entry.name))
    return found


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_front_ends_outlive_a_hangup_the_service_ignores(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text() + "server: {frontends: 1}\n")
    log = tmp_path / "serve.log"
    listen = f"127.0.0.1:{_free_port()}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RESIDENCY), "serve", "--config", str(cfg), "--in-process", "--listen", listen],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
            preexec_fn=_ignore_stop_signals,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "serving on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "serving on" in log.read_text(), log.read_text()[-3000:]
        fronts = _front_ends(proc.pid)
        assert len(fronts) == 1, fronts
        os.killpg(proc.pid, signal.SIGHUP)  # the terminal closed
        os.killpg(proc.pid, signal.SIGINT)  # a Ctrl-C meant for another job of the group
        time.sleep(2.0)
        assert proc.poll() is None
        assert _front_ends(proc.pid) == fronts  # the same process, not a new one
        assert "exited with" not in log.read_text(), log.read_text()[-3000:]
        with socket.create_connection(tuple(listen.rsplit(":", 1)), timeout=5):  # (still listening)
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert not any(Path(f"/proc/{pid}").exists() for pid in fronts)  # stopped with the service


SERVER = """
import sys, time, grpc
from concurrent import futures
from residency_proto.v1 import residency_pb2, residency_pb2_grpc
class S(residency_pb2_grpc.ResidencyServicer):
    def Events(self, request, context):
        yield residency_pb2.Event(kind="model_loaded")
        time.sleep(60)
server = grpc.server(futures.ThreadPoolExecutor(2))
residency_pb2_grpc.add_ResidencyServicer_to_server(S(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
time.sleep(60)
"""


def test_an_events_stream_whose_server_went_away_is_not_told_to_try_tls() -> None:
    """`residency events` through a front end that died said "the server closed the connection at
    once: if it serves TLS, give its certificate": the stream had been open, and had events."""
    from manager.api.client import ClientError, watch_events

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        got = []
        try:
            for event in watch_events(f"127.0.0.1:{port}", None):
                got.append(event.kind)
                server.kill()  # the server goes away with the stream open
        except ClientError as e:
            said = str(e)
        else:
            raise AssertionError("the stream ended without an error")
    finally:
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()
    assert got == ["model_loaded"]
    assert "UNAVAILABLE" in said and "the connection to the service was lost" in said, said
    assert "TLS" not in said, said
