"""Review of `residency serve`'s exit when its stop abandoned a load still running in this process.

With `--in-process` device hosts, a load still running past the pool's close grace is abandoned on
its daemon thread. One inside a model's native code (torch) while the interpreter finalized aborted
the process after the service had stopped cleanly: "terminate called without an active exception",
SIGABRT, the exit status lost. Now `serve`, as the program, ends the process by `os._exit` with its
own status after the usual exit steps (atexit handlers: the log flushed), its last log line naming
the load; a stop with nothing left running exits as before, through the interpreter's finalization.

The subprocess runs the real `serve` (`cli.main()` as the `residency` script calls it) with one
pinned model whose adapter's read loops in torch's native code for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import manager.cli as cli
from workers import pool as pool_mod
from workers import protocol as P
from workers.adapters import Adapter, HostCopy
from workers.measure import Phases
from workers.pool import DeviceSpec, InProcessWorkerPool

SCRIPT = '''
import atexit, os, sys, types
from pathlib import Path
import torch
from workers.adapters import ADAPTERS, Adapter, HostCopy
import manager.workers_bridge as bridge
import manager.cli as cli

work, mode = Path(sys.argv[1]), sys.argv[2]


class Stuck(Adapter):
    name = "stuck-test"
    def inputs(self): return []
    def outputs(self): return []
    def read(self, ph):
        if mode == "stuck":
            (work / "loading").write_text("1")
            a = torch.randn(1200, 1200)
            while True:
                torch.mm(a, a)  # torch's native code, the GIL released: still running at the exit
        return HostCopy(tensors={"w": torch.zeros(4)})
    def materialize(self, host, ph): return host.tensors
    def to_host(self, runnable, ph): return HostCopy(tensors=runnable)
    def runnable_bytes(self, runnable): return 16
    def infer(self, runnable, inputs): return {}


class Witness:
    """Goes at the interpreter's finalization (its module taken out of sys.modules), not before."""

    def __init__(self, path):
        self.path, self.open, self.close = path, os.open, os.close

    def __del__(self):
        self.close(self.open(self.path, os.O_CREAT | os.O_WRONLY))


def at_exit():
    (work / "atexit").write_text("1")
    mod = types.ModuleType("witness_r15")  # made now: after serve's gc.freeze (which keeps what it froze)
    mod.witness = Witness(str(work / "finalized"))
    sys.modules["witness_r15"] = mod


ADAPTERS["stuck-test"] = Stuck
create = bridge.create_pool
bridge.create_pool = lambda config, **kw: create(config, **kw, host_kwargs={"close_grace_s": 0.2})
atexit.register(at_exit)
sys.argv = ["residency", "serve", "--config", str(work / "c.yaml"), "--in-process", "--listen", "127.0.0.1:0"]
sys.exit(cli.main())
'''

CONFIG = """\
store: {{url: "sqlite:///{work}/state.db", journal: "{work}/requests.jsonl"}}
devices:
  - {{name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - name: stuck
    class: realtime
    adapter: stuck-test
    device: cpu0
    memory: 1MiB
    load_seconds: {{disk: 0.1, cached: 0.1, host: 0.1}}
    pin: true
    keep_alive: forever
"""


def _serve_then_stop(work: Path, mode: str) -> tuple[int, str]:
    """The script's `serve` in a process of its own, stopped by SIGTERM once it serves (and, `stuck`,
    once its model's load runs): its exit status (negative: the signal that ended it) and stderr."""
    (work / "c.yaml").write_text(CONFIG.format(work=work))
    script = work / "serve.py"
    script.write_text(SCRIPT)
    log = work / "serve.log"
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    env.pop("RAY_ADDRESS", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(work), mode],
            stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (
                "serving on" in log.read_text(errors="replace")
                and (mode != "stuck" or (work / "loading").exists())
            ):
                assert proc.poll() is None, log.read_text(errors="replace")
                assert time.monotonic() < deadline, "serve did not start: " + log.read_text(errors="replace")
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, log.read_text(errors="replace")


def test_a_load_still_running_in_native_code_at_the_stop_no_longer_aborts_the_exit(tmp_path: Path) -> None:
    """Before: the service stopped cleanly, then the interpreter's finalization aborted the process
    (torch's thread re-taking the GIL: "terminate called without an active exception", SIGABRT,
    exit status -6 instead of 0)."""
    rc, log = _serve_then_stop(tmp_path, "stuck")
    assert rc == 0, log
    assert "terminate called" not in log and "Fatal Python error" not in log
    last = log.strip().splitlines()[-1]
    assert "WARNING manager.cli:" in last
    assert "the service stopped (exit status 0) with what its stop abandoned still running" in last
    assert "the load of 'stuck' on cpu0 (running" in last
    assert (tmp_path / "atexit").exists()  # the exit's own steps still ran (the log flushed)
    assert not (tmp_path / "finalized").exists()  # the interpreter's finalization did not


def test_a_stop_with_nothing_left_running_exits_as_before(tmp_path: Path) -> None:
    """No load abandoned: no os._exit; atexit handlers and the interpreter's finalization run."""
    rc, log = _serve_then_stop(tmp_path, "quick")
    assert rc == 0, log
    assert "abandoned" not in log and "Traceback" not in log
    assert (tmp_path / "atexit").exists()
    assert (tmp_path / "finalized").exists()


class _Held(Adapter):
    """A read that waits on a gate (unit tests only): a load still running at the pool's close."""

    name = "held"
    gate = threading.Event()
    started = threading.Event()

    def inputs(self) -> list[P.TensorSpec]:
        return []

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
        self.started.set()
        self.gate.wait(60)
        return HostCopy(tensors={"w": torch.zeros(4)})

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return host.tensors

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy(tensors=runnable)

    def runnable_bytes(self, runnable: Any) -> int:
        return 16

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_left_running_names_an_abandoned_load_until_it_ends() -> None:
    _Held.gate.clear()
    _Held.started.clear()
    pool = InProcessWorkerPool(
        [DeviceSpec("cpu7")], close_grace_s=0.05, adapter_factory=lambda s, d: _Held(s, d)
    )
    try:
        pool.submit("cpu7", P.Load(P.ModelSpec("held-r15", "held")))
        assert _Held.started.wait(30)
        assert not any("'held-r15'" in x for x in pool_mod.left_running())  # not closed: not listed
        pool.close()
        (line,) = [x for x in pool_mod.left_running() if "'held-r15'" in x]
        assert line.startswith("the load of 'held-r15' on cpu7 (running ")
    finally:
        _Held.gate.set()
    _until(lambda: not any("'held-r15'" in x for x in pool_mod.left_running()), "its end to be seen")


def test_only_the_program_serve_ends_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`main([...])` (a test, a program embedding it) returns the status; `main()` as `residency
    serve` checks for what its stop left running; other commands never do."""
    calls: list[int] = []
    monkeypatch.setattr(cli, "_run", lambda args: 7)
    monkeypatch.setattr(cli, "_exit_past_abandoned", calls.append)
    assert cli.main(["serve", "--config", "c.yaml"]) == 7 and calls == []
    monkeypatch.setattr(sys, "argv", ["residency", "config", "schema"])
    assert cli.main() == 7 and calls == []
    monkeypatch.setattr(sys, "argv", ["residency", "serve", "--config", "c.yaml"])
    assert cli.main() == 7 and calls == [7]


def test_nothing_left_running_returns_without_exiting(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_exit(rc: int) -> None:
        raise AssertionError(f"os._exit({rc})")

    monkeypatch.setattr(os, "_exit", no_exit)
    monkeypatch.setattr(pool_mod, "left_running", list)
    cli._exit_past_abandoned(0)  # returns: the interpreter ends as usual
