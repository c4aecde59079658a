"""Review of `residency serve`'s stop when a model's inference never returns, and of a second signal.

With `--in-process` device hosts, a request's inference runs on a thread of the event loop's default
executor (`asyncio.to_thread`). One whose forward never returned (it waits for good, or loops in
torch's native code) held the stop for good: the request was cancelled by gRPC at the end of the
stop's grace ("Cancelling all calls"), then `asyncio.Runner`'s close waited for the executor's
thread (`shutdown_default_executor`, no timeout in Python 3.11) and the process never ended. A
second SIGINT (or SIGTERM) did nothing either: it was only counted. Now:

- `serve`'s default executor is `StopBoundedExecutor`: at the stop's grace, an inference still
  running in this process is answered INTERNAL (since review 20; it was UNAVAILABLE), "the server
  is stopping" (logged in the request log as a failed request), its thread left to the process's
  end; the stop goes on as usual (the request log flushed, the statistics saved) and the process
  exits with its usual status, its last log line naming the inference
  (`manager.cli._exit_past_abandoned`);
- a second stop signal while the stop is under way ends the process at once: one line on stderr,
  exit status 128 + the signal, even while the event loop is held by a blocking step of the stop.

The subprocesses run the real `serve` (`cli.main()` as the `residency` script calls it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
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

from manager.api.server import SAME_STOP_S, StopBoundedExecutor, abandoned_calls
from manager.live_batch import LocalBatcher
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import protocol as P
from workers.pool import DeviceSpec, InProcessWorkerPool

SCRIPT = '''
import atexit, sys, threading
from pathlib import Path
import numpy as np
import torch
from workers import protocol as P
from workers.adapters import ADAPTERS, Adapter, HostCopy
import manager.workers_bridge as bridge
import manager.cli as cli

work, mode = Path(sys.argv[1]), sys.argv[2]
NEVER = threading.Event()


class Hung(Adapter):
    """`infer`: its forward never returns. `load`: its read never returns."""

    name = "hung-test"
    def inputs(self): return [P.TensorSpec("x", "FP32", (1,))]
    def outputs(self): return [P.TensorSpec("y", "FP32", (1,))]
    def read(self, ph):
        if mode == "load":
            (work / "loading").write_text("1")
            NEVER.wait()
        return HostCopy(tensors={"w": torch.zeros(4)})
    def materialize(self, host, ph): return host.tensors
    def to_host(self, runnable, ph): return HostCopy(tensors=runnable)
    def runnable_bytes(self, runnable): return 16
    def infer(self, runnable, inputs):
        (work / "inferring").write_text("1")
        NEVER.wait()
        return {"y": np.zeros(1, np.float32)}


def at_exit():
    (work / "atexit").write_text("1")


def create_pool(config, **kw):
    # mode "load": the stuck load holds the stop's pool close (and the event loop) for 300 s
    pool = create(config, **kw, host_kwargs={"close_grace_s": 300.0 if mode == "load" else 0.2})
    close = pool.close

    def close_said():
        (work / "closing").write_text("1")
        close()

    pool.close = close_said
    return pool


ADAPTERS["hung-test"] = Hung
create = bridge.create_pool
bridge.create_pool = create_pool
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
  - name: hung
    class: realtime
    adapter: hung-test
    device: cpu0
    memory: 1MiB
    load_seconds: {{disk: 0.1, cached: 0.1, host: 0.1}}
    pin: true
    keep_alive: forever
"""


def _until(
    cond: Any, what: str, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + 120
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve ended ({proc.returncode}) before {what}: " + _text(log))
        assert time.monotonic() < deadline, f"waited too long for {what}: " + _text(log)
        time.sleep(0.05)


def _text(log: Path | None) -> str:
    return log.read_text(errors="replace") if log is not None and log.exists() else ""


class Served:
    """The script's `serve` in a process of its own (`mode`: "infer", its model's forward never
    returns; "load", its model's read never returns), its port once it serves."""

    def __init__(self, work: Path, mode: str) -> None:
        (work / "c.yaml").write_text(CONFIG.format(work=work))
        (work / "serve.py").write_text(SCRIPT)
        self.work, self.log = work, work / "serve.log"
        env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
        env.pop("RAY_ADDRESS", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(work / "serve.py"), str(work), mode],
                stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
            )  # fmt: skip
        found: list[int] = []

        def serving() -> bool:
            m = re.search(r"serving on [^ ]+:(\d+) ", self.text())
            found.extend([int(m.group(1))] if m else [])
            return bool(found)

        self.until(serving, "serve to start")
        self.port = found[0]

    def text(self) -> str:
        return _text(self.log)

    def until(self, cond: Any, what: str) -> None:
        _until(cond, what, self.proc, self.log)

    def ask(self) -> tuple[list[tuple[str, str]], threading.Thread]:
        """A ModelInfer call of `hung` on a thread of its own: its answer (status, details), once it
        has one."""
        answers: list[tuple[str, str]] = []

        def call() -> None:
            request = pb.ModelInferRequest(model_name="hung")
            request.inputs.add(name="x", datatype="FP32", shape=[1])
            request.raw_input_contents.append(np.zeros(1, np.float32).tobytes())
            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                try:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                    stub.ModelInfer(request, timeout=300)
                    answers.append(("OK", ""))
                except grpc.RpcError as e:
                    answers.append((e.code().name, e.details() or ""))

        t = threading.Thread(target=call, daemon=True)
        t.start()
        return answers, t

    def wait(self) -> int:
        """Its exit status (a generous limit: one that never ends fails the test)."""
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve did not end: " + self.text()) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Any]:
    made: list[Served] = []

    def start(mode: str) -> Served:
        made.append(Served(tmp_path, mode))
        return made[-1]

    yield start
    for s in made:
        s.kill()


def test_an_inference_that_never_returns_no_longer_holds_the_stop(served: Any) -> None:
    """Before: the request was cancelled ("Cancelling all calls") and the process never ended
    (asyncio.Runner's close waited for the executor's thread)."""
    s = served("infer")
    answers, caller = s.ask()
    s.until(lambda: (s.work / "inferring").exists(), "the inference to start")
    s.proc.send_signal(signal.SIGTERM)
    rc = s.wait()
    caller.join(60)
    text = s.text()
    assert rc == 0, text
    assert "Traceback" not in text and "Fatal Python error" not in text
    ((code, details),) = answers
    assert code == "INTERNAL", details  # (review 20: it may have run; was UNAVAILABLE)
    assert details.startswith("model 'hung': the server is stopping, and its inference on cpu0 had not ended")
    last = text.strip().splitlines()[-1]
    assert "WARNING manager.cli:" in last
    assert "the service stopped (exit status 0) with what its stop abandoned still running" in last
    assert "the inference of 'hung' on cpu0 (running" in last
    assert (s.work / "atexit").exists()  # the exit's own steps ran (the log flushed)
    with sqlite3.connect(s.work / "state.db") as db:  # the stop flushed the request log, saved the stats
        assert db.execute("SELECT model, outcome FROM requests").fetchall() == [("hung", "error")]
        assert db.execute("SELECT count(*) FROM docs WHERE key = 'stats'").fetchone() == (1,)


def test_a_second_sigint_while_the_stop_waits_for_an_inference_exits_at_once(served: Any) -> None:
    """Before: the second signal was only counted; the stop (and the process) went on for good."""
    s = served("infer")
    s.ask()
    s.until(lambda: (s.work / "inferring").exists(), "the inference to start")
    s.proc.send_signal(signal.SIGTERM)
    # the stop began: its own line, written as the first signal is taken (health's NOT_SERVING was
    # looked for with calls of up to 5 s, and on a loaded machine one that timed out was seen as the
    # stop only once the stop's 5 s wait was over, its handlers put back: the second signal late)
    s.until(lambda: "residency: stopping (SIGTERM)" in s.text(), "the stop to begin")
    time.sleep(SAME_STOP_S + 0.1)  # a second signal, not one that came with the first
    s.proc.send_signal(signal.SIGINT)
    rc = s.wait()
    text = s.text()
    assert rc == 128 + signal.SIGINT, text
    assert text.strip().splitlines()[-1] == (
        "residency: second SIGINT: exiting now, without waiting for the stop to finish"
    )
    assert not (s.work / "atexit").exists()  # at once: nothing else ran


def test_a_second_sigint_while_a_blocking_step_holds_the_event_loop_exits_at_once(served: Any) -> None:
    """The pool's close waits (on the event loop's thread) for a load that never ends, within its
    grace (300 s here): the event loop's own handler could not run meanwhile (it would say the second
    signal only after that grace). Before: the second SIGINT was only counted; the stop ended after
    that grace, exit status 0."""
    s = served("load")
    s.until(lambda: (s.work / "loading").exists(), "the load to start")
    s.proc.send_signal(signal.SIGTERM)
    s.until(lambda: (s.work / "closing").exists(), "the pool's close")
    time.sleep(SAME_STOP_S + 0.1)
    s.proc.send_signal(signal.SIGINT)
    rc = s.wait()
    text = s.text()
    assert rc == 128 + signal.SIGINT, text
    assert text.strip().splitlines()[-1] == (
        "residency: second SIGINT: exiting now, without waiting for the stop to finish"
    )


def test_two_signals_that_come_together_are_one_stop(served: Any) -> None:
    """Review 16: a supervisor that signals the whole process group (systemd's control-group kill)
    while the `make run` above the service forwards its own SIGTERM delivers two at once. Before, the
    second ended the process at once (exit 143: no stop, nothing flushed). Now one within SAME_STOP_S
    of the first is the same stop: the stop runs to its end, exit status 0."""
    s = served("infer")
    s.ask()
    s.until(lambda: (s.work / "inferring").exists(), "the inference to start")
    # two different signals, back to back: the kernel would merge a second SIGTERM still pending into
    # the first, and a pause between them could, on a loaded machine, outlast SAME_STOP_S
    os.kill(s.proc.pid, signal.SIGTERM)
    os.kill(s.proc.pid, signal.SIGINT)
    rc = s.wait()
    text = s.text()
    assert rc == 0, text
    assert re.search(r"residency: SIG(TERM|INT) came with the first stop signal: the same stop", text)
    assert "exiting now" not in text
    assert (s.work / "atexit").exists()  # the stop's own steps ran (the log flushed)


# ---- the executor itself, in this process

GATE = threading.Event()


@pytest.fixture
def gate() -> Iterator[None]:
    GATE.clear()
    yield
    GATE.set()  # what still waits ends


class _GatedPool(InProcessWorkerPool):
    """An in-process pool whose inferences wait on a gate (a forward that hangs)."""

    def infer(
        self, device: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 30.0
    ) -> P.InferResult:
        GATE.wait(60)
        return P.InferResult(model, True)

    def session(self, device: str, method: str, *args: object, timeout_s: float = 120.0) -> P.SessionReply:
        GATE.wait(60)
        return P.SessionReply(True)


def test_an_abandoned_world_step_is_answered_that_the_server_is_stopping(gate: None) -> None:
    pool = _GatedPool([DeviceSpec("cpu6")])
    executor = StopBoundedExecutor(shutdown_grace_s=60)

    async def body() -> Any:
        call = asyncio.ensure_future(asyncio.to_thread(pool.session, "cpu6", "step", "s-r15", {}))
        while not _busy(executor):
            await asyncio.sleep(0.01)
        assert executor.abandon_running(5.0) == ["the world step of session 's-r15' on cpu6"]
        return await call

    try:
        reply = _run_on(executor, body)
        assert not reply.ok and reply.error.startswith("the server is stopping, and this step on cpu6")
    finally:
        GATE.set()
        pool.close()


def _run_on(executor: StopBoundedExecutor, body: Any) -> Any:
    async def main() -> Any:
        asyncio.get_running_loop().set_default_executor(executor)
        return await body()

    with asyncio.Runner() as runner:  # its close shuts the executor down
        return runner.run(main())


def _naming(what: str) -> list[str]:
    return [x for x in abandoned_calls() if what in x]


@pytest.mark.parametrize("batched", [False, True], ids=["infer", "batch"])
def test_an_abandoned_inference_is_answered_and_its_thread_left(gate: None, batched: bool) -> None:
    pool = _GatedPool([DeviceSpec("cpu5")])
    executor = StopBoundedExecutor(shutdown_grace_s=60)
    model = f"gated-{'batch' if batched else 'infer'}-r15"

    async def body() -> Any:
        if batched:
            call = asyncio.ensure_future(LocalBatcher(pool, "cpu5", model, 4, lambda n: False).submit({}))
        else:
            call = asyncio.ensure_future(asyncio.to_thread(pool.infer, "cpu5", model, {}, 30.0))
        while not _busy(executor):
            await asyncio.sleep(0.01)
        assert executor.abandon_running(5.0) == [f"the inference of {model!r} on cpu5"]
        return await call

    try:
        result = _run_on(executor, body)  # the loop's close did not wait for the thread (60 s)
        assert not result.ok and result.model == model
        assert result.error.startswith(f"model {model!r}: the server is stopping, and its inference on cpu5")
        (line,) = _naming(f"'{model}'")
        assert line.startswith(f"the inference of {model!r} on cpu5 (running ")
    finally:
        GATE.set()
        pool.close()
    _until(lambda: not _naming(f"'{model}'"), "its end to be seen")


def _busy(executor: StopBoundedExecutor) -> bool:
    with executor._mu:
        return bool(executor._running)


def test_other_calls_are_not_abandoned_at_the_grace_and_are_waited_for_at_the_end() -> None:
    executor = StopBoundedExecutor(shutdown_grace_s=60)
    started, release = threading.Event(), threading.Event()

    def store_write() -> str:
        started.set()
        release.wait(30)
        return "written"

    async def body() -> Any:
        call = asyncio.ensure_future(asyncio.to_thread(store_write))
        await asyncio.to_thread(started.wait, 30)
        assert executor.abandon_running(5.0) == []  # not a model's code: it runs on
        threading.Timer(0.2, release.set).start()
        return await call

    assert _run_on(executor, body) == "written"
    assert not any("store_write" in x for x in abandoned_calls())


def test_a_call_still_running_past_the_shutdown_grace_is_abandoned_and_named(gate: None) -> None:
    executor = StopBoundedExecutor(shutdown_grace_s=0.1)
    started = threading.Event()

    def stuck_r15() -> None:
        started.set()
        GATE.wait(60)

    async def body() -> None:
        call = asyncio.ensure_future(asyncio.to_thread(stuck_r15))
        await asyncio.to_thread(started.wait, 30)
        assert not call.done()

    _run_on(executor, body)  # its close waited 0.1 s, not 60
    (line,) = [x for x in abandoned_calls() if "stuck_r15" in x]
    assert re.fullmatch(r"a call of .*stuck_r15 \(running \d+ s\)", line), line
    GATE.set()
    _until(lambda: not any("stuck_r15" in x for x in abandoned_calls()), "its end to be seen")
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print)


def test_a_call_after_a_burst_and_hung_forwards_still_gets_a_thread() -> None:
    """The executor counted a worker as idle when it finished a call, though it then took a call queued
    behind it (a burst of one more call than it has threads): the count stayed one too high. Once
    every thread ran a forward that never returns and the grace abandoned them, the next call (the
    stop's log flush) was counted on that idle worker, no thread was started, and it never ran (found
    in review)."""
    never = threading.Event()

    class HungPool(InProcessWorkerPool):
        def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> P.InferResult:
            never.wait()
            return P.InferResult(model, True)

    pool = HungPool([DeviceSpec("cpu9")])
    ex = StopBoundedExecutor(shutdown_grace_s=1.0)
    n = ex._max_workers

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ex)
        gate = threading.Event()
        burst = [asyncio.ensure_future(asyncio.to_thread(gate.wait, 30)) for _ in range(n + 1)]
        await asyncio.sleep(0.1)
        gate.set()
        assert all(await asyncio.gather(*burst))
        hung = [asyncio.ensure_future(asyncio.to_thread(pool.infer, "cpu9", "hung", {})) for _ in range(n)]
        while len(ex._running) < n:
            await asyncio.sleep(0.01)
        assert len(ex.abandon_running(0.0)) == n
        answers = await asyncio.gather(*hung)
        assert all(not a.ok and "the server is stopping" in a.error for a in answers)
        flushed = asyncio.ensure_future(asyncio.to_thread(lambda: "flushed"))
        done, _ = await asyncio.wait([flushed], timeout=30)
        assert flushed in done and flushed.result() == "flushed"

    try:
        asyncio.run(main())
    finally:
        never.set()


def test_a_call_that_has_answered_is_not_taken_for_abandoned() -> None:
    """Between a call's answer (whose done-callbacks run at once, on its worker) and its worker letting
    it go, the grace's `abandon_running` took it for a forward that had not ended: logged so, named in
    what the exit says still runs, and its worker thread given up (found in review)."""

    class QuickPool(InProcessWorkerPool):
        def infer(self, device: str, model: str, inputs: Any, timeout_s: float = 30.0) -> P.InferResult:
            return P.InferResult(model, True)

    pool = QuickPool([DeviceSpec("cpu8")])
    ex = StopBoundedExecutor(max_workers=2, shutdown_grace_s=1.0)
    in_callback, go_on = threading.Event(), threading.Event()
    try:
        fut = ex.submit(pool.infer, "cpu8", "quick", {}, 30.0)
        fut.add_done_callback(lambda _f: (in_callback.set(), go_on.wait(30)))
        assert in_callback.wait(30)  # answered; its worker is still inside the callback
        assert fut.result().ok
        assert ex.abandon_running(5.0) == []
        go_on.set()
    finally:
        go_on.set()
        ex.shutdown()
        pool.close()
    assert ex.still_running() == []
