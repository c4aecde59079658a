"""Review of `residency serve`'s exit when a model's describe still runs in this process.

A describe (a model's factory, run on a thread of its own to read its declared inputs and outputs,
waited for at most its limit) is not waited for at a stop either: its daemon thread is left to the
process's end. `workers.pool.left_running()` named only the loads, promotes and commands the closed
in-process pools abandoned, so a describe still inside torch's native code at the exit was not
counted: `serve` did not end the process itself, and the interpreter's finalization aborted it
(SIGABRT, the exit status lost). Now `left_running()` also names the describes still running on the
hosts of closed in-process pools ("the describe of 'x' on cpu0 (running 12 s)") and those of the
manager's describer (any listed `SingleFlight` of this process: `workers.bounded.running_builds`).

The subprocess runs the real `serve` (`cli.main()` as the `residency` script calls it) with one
model whose describe, asked for by a ModelMetadata call, loops in torch's native code for good.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import pool as pool_mod
from workers import protocol as P
from workers.adapters import Adapter, HostCopy
from workers.bounded import SingleFlight, running_builds
from workers.measure import Phases
from workers.pool import DeviceSpec, InProcessWorkerPool

GATE = threading.Event()
ENTERED = threading.Event()


@pytest.fixture
def gate() -> Iterator[None]:
    GATE.clear()
    ENTERED.clear()
    yield
    GATE.set()  # a describe still waiting ends


class _GatedDescribe(Adapter):
    """Its inputs wait on a gate (a factory that hangs while building the module on the meta device);
    everything else answers at once."""

    name = "gated-describe"

    def inputs(self) -> list[P.TensorSpec]:
        ENTERED.set()
        GATE.wait(60)
        return [P.TensorSpec("x", "FP32", (1,))]

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
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


def _naming(model: str) -> list[str]:
    return [x for x in pool_mod.left_running() if f"{model!r}" in x]


def test_left_running_names_a_describe_still_running_on_a_closed_pool_until_it_ends(gate: None) -> None:
    """Before: the describe was never listed (only loads, promotes and commands were)."""
    pool = InProcessWorkerPool(
        [DeviceSpec("cpu8")], close_grace_s=0.05, adapter_factory=lambda s, d: _GatedDescribe(s, d)
    )
    spec = P.ModelSpec("described-r15", "gated-describe")
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(pool.hosts["cpu8"].describe(spec)), daemon=True)
    try:
        caller.start()
        assert ENTERED.wait(30)
        assert _naming("described-r15") == []  # its pool is not closed: not listed
        pool.close()
        (line,) = _naming("described-r15")
        assert line.startswith("the describe of 'described-r15' on cpu8 (running ")
        assert line.endswith(" s)")
    finally:
        GATE.set()
    caller.join(30)
    assert [x.name for x in answers[0][0]] == ["x"]  # its caller got its answer
    _until(lambda: _naming("described-r15") == [], "its end to be seen")


def test_a_describe_that_ended_before_the_close_is_not_listed(gate: None) -> None:
    GATE.set()
    pool = InProcessWorkerPool(
        [DeviceSpec("cpu9")], close_grace_s=0.05, adapter_factory=lambda s, d: _GatedDescribe(s, d)
    )
    pool.hosts["cpu9"].describe(P.ModelSpec("quick-r15", "gated-describe"))
    pool.close()
    assert _naming("quick-r15") == []


def test_a_build_replaced_by_another_specs_is_still_counted_while_it_runs(gate: None) -> None:
    """A describe of a changed spec starts its own build; the old one, no longer the key's, still
    runs on its thread: both are counted until each ends."""
    flights: SingleFlight[str] = SingleFlight(30, what="describe", where="in the test")
    flights.begin("m", "spec-1", lambda: (GATE.wait(60), "one")[1], "residency-test-r15-one")
    flights.begin("m", "spec-2", lambda: (GATE.wait(60), "two")[1], "residency-test-r15-two")
    assert [key for key, _ in flights.running()] == ["m", "m"]
    mine = [x for x in running_builds() if "in the test" in x]
    assert len(mine) == 2 and all(x.startswith("the describe of 'm' in the test (running ") for x in mine)
    assert len([x for x in pool_mod.left_running() if "in the test" in x]) == 2  # what serve's exit reads
    GATE.set()
    _until(lambda: flights.running() == [], "both builds to end")
    assert not any("in the test" in x for x in running_builds())


def test_an_unlisted_single_flight_is_left_to_its_owner(gate: None) -> None:
    flights: SingleFlight[str] = SingleFlight(30, what="describe", where="nowhere-r15", listed=False)
    flights.begin("m", "spec", lambda: (GATE.wait(60), "one")[1], "residency-test-r15-unlisted")
    assert [key for key, _ in flights.running()] == ["m"]
    assert not any("nowhere-r15" in x for x in running_builds())
    GATE.set()
    _until(lambda: flights.running() == [], "the build to end")


# ---- the real serve, in a process of its own

SCRIPT = """
import atexit, os, sys, threading
from pathlib import Path
import torch
from workers import protocol as P
from workers.adapters import ADAPTERS, Adapter, HostCopy
import manager.workers_bridge as bridge
import manager.cli as cli

work = Path(sys.argv[1])


class Stuck(Adapter):
    name = "stuck-describe-test"
    def inputs(self):
        if threading.current_thread().name.startswith("residency-describe"):
            (work / "describing").write_text("1")
            a = torch.randn(1200, 1200)
            while True:
                torch.mm(a, a)  # torch's native code, the GIL released: still running at the exit
        return [P.TensorSpec("x", "FP32", (1,))]
    def outputs(self): return []
    def read(self, ph): return HostCopy(tensors={"w": torch.zeros(4)})
    def materialize(self, host, ph): return host.tensors
    def to_host(self, runnable, ph): return HostCopy(tensors=runnable)
    def runnable_bytes(self, runnable): return 16
    def infer(self, runnable, inputs): return {}


def at_exit():
    (work / "atexit").write_text("1")


ADAPTERS["stuck-describe-test"] = Stuck
create = bridge.create_pool
bridge.create_pool = lambda config, **kw: create(config, **kw, host_kwargs={"close_grace_s": 0.2})
atexit.register(at_exit)
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
  - name: stuck
    class: realtime
    adapter: stuck-describe-test
    device: cpu0
    memory: 1MiB
    load_seconds: {{disk: 0.1, cached: 0.1, host: 0.1}}
"""


def _ask_metadata(port: int) -> None:
    """A ModelMetadata call of `stuck` (its describe starts, then hangs); its own answer is not waited for."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.ModelMetadata(pb.ModelMetadataRequest(name="stuck"), timeout=1.0)


def test_a_describe_still_running_in_native_code_at_the_stop_no_longer_aborts_the_exit(
    tmp_path: Path,
) -> None:
    """Before: nothing was listed, so the interpreter finalized with the describe's thread inside
    torch.mm and aborted ("terminate called without an active exception", exit status -6, not 0)."""
    work = tmp_path
    (work / "c.yaml").write_text(CONFIG.format(work=work))
    script = work / "serve.py"
    script.write_text(SCRIPT)
    log = work / "serve.log"
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    env.pop("RAY_ADDRESS", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(work)],
            stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while (m := re.search(r"serving on [^ ]+:(\d+) ", log.read_text(errors="replace"))) is None:
                assert proc.poll() is None, log.read_text(errors="replace")
                assert time.monotonic() < deadline, "serve did not start: " + log.read_text(errors="replace")
                time.sleep(0.1)
            _ask_metadata(int(m.group(1)))
            _until(lambda: (work / "describing").exists(), "the describe to start")
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text
    assert "terminate called" not in text and "Fatal Python error" not in text
    last = text.strip().splitlines()[-1]
    assert "WARNING manager.cli:" in last
    assert "the service stopped (exit status 0) with what its stop abandoned still running" in last
    assert re.search(r"the \w+ of 'stuck' in [\w ]+ \(running \d+ s\)", last), last
    assert (work / "atexit").exists()  # the exit's own steps still ran (the log flushed)
