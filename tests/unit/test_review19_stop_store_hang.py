"""Review 19: `residency serve`'s stop when a store write never returns.

The stop's last writes (the admin pins, the request log's flush, the statistics save) run on the
event loop's executor and the manager's stop waits for each. A store call that hangs (a stuck
network filesystem under the SQLite file, a store that never answers) held `LiveManager.stop` for
good, and with it the process: SIGTERM never ended it. Now `serve` gives the manager's stop
STOP_MANAGER_S; past it, the store calls still running are abandoned, each named in the log, their
threads left to the process's end, and the stop goes on (the store closed on a thread, bounded
too): the process ends with its usual status, its last line naming what still ran.

The subprocess runs the real `serve` (`cli.main()` as the `residency` script calls it), over the real
SQLite store, whose statistics write is made to hang (holding the store's lock, as a write stuck in
the filesystem does) once the test says so.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SCRIPT = """
import sys, threading
from pathlib import Path
import numpy as np
import torch
from workers import protocol as P
from workers.adapters import ADAPTERS, Adapter, HostCopy
from manager.store.sqlite import SQLiteStore
import manager.api.server as server
import manager.cli as cli

work = Path(sys.argv[1])
NEVER = threading.Event()


class Tiny(Adapter):
    name = "tiny-r19"
    def inputs(self): return [P.TensorSpec("x", "FP32", (1,))]
    def outputs(self): return [P.TensorSpec("y", "FP32", (1,))]
    def read(self, ph): return HostCopy(tensors={"w": torch.zeros(4)})
    def materialize(self, host, ph): return host.tensors
    def to_host(self, runnable, ph): return HostCopy(tensors=runnable)
    def runnable_bytes(self, runnable): return 16
    def infer(self, runnable, inputs): return {"y": np.zeros(1, np.float32)}


put_doc = SQLiteStore.put_doc


def hung_put_doc(self, key, doc):
    if key == "stats" and (work / "hang").exists():
        with self._lock:  # a write stuck in the filesystem: the store's lock held for good
            (work / "hung").write_text("1")
            NEVER.wait()
    return put_doc(self, key, doc)


ADAPTERS["tiny-r19"] = Tiny
SQLiteStore.put_doc = hung_put_doc
server.STOP_MANAGER_S = 1.0
sys.argv = ["residency", "serve", "--config", str(work / "c.yaml"), "--in-process", "--listen", "127.0.0.1:0"]
sys.exit(cli.main())
"""

CONFIG = """\
store: {{url: "sqlite:///{work}/state.db", journal: "{work}/requests.jsonl"}}
devices:
  - {{name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - name: tiny
    class: realtime
    adapter: tiny-r19
    device: cpu0
    memory: 1MiB
    load_seconds: {{disk: 0.1, cached: 0.1, host: 0.1}}
"""


class Served:
    def __init__(self, work: Path) -> None:
        (work / "c.yaml").write_text(CONFIG.format(work=work))
        (work / "serve.py").write_text(SCRIPT)
        self.work, self.log = work, work / "serve.log"
        env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
        env.pop("RAY_ADDRESS", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(work / "serve.py"), str(work)],
                stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
            )  # fmt: skip
        self.until(lambda: re.search(r"serving on [^ ]+:\d+ ", self.text()) is not None, "serve to start")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def until(self, cond: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"serve ended ({self.proc.returncode}) before {what}: " + self.text())
            assert time.monotonic() < deadline, f"waited too long for {what}: " + self.text()
            time.sleep(0.05)

    def wait(self) -> int:
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve did not end: " + self.text()) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.kill()


def test_a_store_write_that_never_returns_no_longer_holds_the_stop(served: Served) -> None:
    s = served
    (s.work / "hang").write_text("1")
    s.proc.send_signal(signal.SIGTERM)
    rc = s.wait()
    text = s.text()
    assert (s.work / "hung").exists(), text  # the stop's statistics save did hang
    assert rc == 0, text
    assert "Traceback" not in text and "Fatal Python error" not in text, text
    abandoned = [line for line in text.splitlines() if "abandoned" in line and "_put_stats" in line]
    assert abandoned, text
    assert "had not ended 1 s into the manager's stop" in abandoned[0], abandoned[0]
    assert "residency: stopped" in text
    last = text.strip().splitlines()[-1]
    assert "the service stopped (exit status 0) with what its stop abandoned still running" in last, last
    assert "_put_stats" in last, last
