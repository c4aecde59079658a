"""Review 19: gRPC core's own INFO lines reached `residency serve`'s stderr: each plaintext client that
tried the TLS port added "I… ssl_transport_security.cc:…] Handshake failed with error SSL_ERROR_SSL:
… WRONG_VERSION_NUMBER", so anyone on the LAN could fill the log. gRPC (1.85 here) reads
GRPC_VERBOSITY once, when `grpc` is first imported (set after that import it changes nothing: checked),
and `serve`'s first import of it is manager.api.admin's, in cli._serve, before manager.api.server's.

The fix belongs where `serve` starts (cli._serve, beside `quiet_grpc_fork()`): GRPC_VERBOSITY=ERROR
unless the user set it. Until it is there, the first test is an expected failure (strict: it fails
once the fix is in, so the marker goes with it); the others show the mechanism: ERROR set before the
import silences the line, and a user's own GRPC_VERBOSITY still wins.

The real `serve` (`cli.main()`, as the `residency` script calls it) in a subprocess, with a fresh
self-signed certificate, over a fake adapter (it returns zeros); a plaintext client tries its port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import sys
import numpy as np
import torch
from workers import protocol as P
from workers.adapters import ADAPTERS, Adapter, HostCopy
import manager.cli as cli


class FakeZeros(Adapter):
    name = "fake-r19-log"
    def inputs(self): return [P.TensorSpec("x", "FP32", (1,))]
    def outputs(self): return [P.TensorSpec("y", "FP32", (1,))]
    def read(self, ph): return HostCopy(tensors={"w": torch.zeros(4)})
    def materialize(self, host, ph): return host.tensors
    def to_host(self, runnable, ph): return HostCopy(tensors=runnable)
    def runnable_bytes(self, runnable): return 16
    def infer(self, runnable, inputs): return {"y": np.zeros(1, np.float32)}


ADAPTERS["fake-r19-log"] = FakeZeros
sys.argv = ["residency", "serve", "--config", sys.argv[1], "--in-process", "--listen", "127.0.0.1:0"]
sys.exit(cli.main())
"""

CONFIG = """\
store: {{url: "sqlite:///{work}/state.db", journal: "{work}/requests.jsonl"}}
server: {{tls_cert: "{cert}", tls_key: "{key}"}}
devices:
  - {{name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - {{name: tiny, class: realtime, adapter: fake-r19-log, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.1, cached: 0.1, host: 0.1}}}}
"""

HANDSHAKE_LINE = "Handshake failed"


def serve_and_knock(work: Path, tls_pair: tuple[Path, Path], verbosity: str | None) -> str:
    """`serve` with TLS; a plaintext client tries its port (the server closes it); then it is stopped.
    Its stderr."""
    cert, key = tls_pair
    (work / "c.yaml").write_text(CONFIG.format(work=work, cert=cert, key=key))
    (work / "serve.py").write_text(SCRIPT)
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    env.pop("RAY_ADDRESS", None)
    env.pop("GRPC_VERBOSITY", None)
    if verbosity is not None:
        env["GRPC_VERBOSITY"] = verbosity
    log = work / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(work / "serve.py"), str(work / "c.yaml")],
            stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (found := re.search(r"serving on [^ ]+:(\d+) ", log.read_text(errors="replace"))) is None:
            assert proc.poll() is None, "serve ended: " + log.read_text(errors="replace")
            assert time.monotonic() < deadline, "serve did not start: " + log.read_text(errors="replace")
            time.sleep(0.05)
        port = int(found.group(1))
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # plaintext HTTP/2, as an insecure channel
                while c.recv(4096):  # until the server closes it (its handshake failed)
                    pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return log.read_text(errors="replace")


def test_serve_keeps_grpc_core_info_lines_off_its_stderr(tmp_path: Path, tls_pair: tuple[Path, Path]) -> None:
    text = serve_and_knock(tmp_path, tls_pair, verbosity=None)
    assert "residency: stopped" in text
    assert HANDSHAKE_LINE not in text, text


def test_grpc_verbosity_error_set_before_grpc_starts_silences_them(
    tmp_path: Path, tls_pair: tuple[Path, Path]
) -> None:
    text = serve_and_knock(tmp_path, tls_pair, verbosity="ERROR")
    assert "residency: stopped" in text
    assert HANDSHAKE_LINE not in text, text


def test_a_users_own_grpc_verbosity_is_honoured(tmp_path: Path, tls_pair: tuple[Path, Path]) -> None:
    text = serve_and_knock(tmp_path, tls_pair, verbosity="INFO")
    assert HANDSHAKE_LINE in text
