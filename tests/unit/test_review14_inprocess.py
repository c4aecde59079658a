"""Found in review of the in-process device hosts and their stop (fourteenth session); each failed
before its fix.

The models are real (`safetensors-module` over real checkpoint files); their factory is a function
of a module made here that waits on a `threading.Event` while its gate is closed (a build stuck on a
lock, a read from a dead server), standing beside the real factories. The hosts and the pool are the
real ones.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.host import DeviceHost
from workers.pool import DeviceSpec, InProcessWorkerPool
from workers.st_io import write_safetensors

KW = {"in_features": 4, "out_features": 2}
MODULE = "residency_review14_inprocess"


class _Gate:
    """A factory's switch: while closed, the factory waits; `calls` counts the builds that entered."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.calls = 0

    def linear(self, in_features: int = 4, out_features: int = 2) -> nn.Module:
        self.calls += 1
        self.entered.set()
        self.open.wait(60)
        return nn.Linear(in_features, out_features)

    def hanging(self, in_features: int = 4, out_features: int = 2) -> nn.Module:
        """A module whose forward waits while the gate is closed (an inference that hangs)."""
        gate = self

        class Hanging(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                gate.entered.set()
                gate.open.wait(60)
                return super().forward(x)

        return Hanging(in_features, out_features)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    mod = types.ModuleType(MODULE)
    mod.linear = g.linear  # type: ignore[attr-defined]
    mod.hanging = g.hanging  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, mod)
    before = set(threading.enumerate())
    yield g
    g.open.set()  # a thread still waiting in the factory ends
    for t in threading.enumerate():  # (this test's: one an earlier test left cost 30 s a test)
        if t not in before and t.name.startswith(("residency-load-", "residency-promote-", "dev-")):
            t.join(30)


def _checkpoint(tmp_path: Path, name: str = "lin") -> Path:
    p = tmp_path / f"{name}.safetensors"
    write_safetensors({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, p)
    return p


def _spec(name: str, path: Path, factory: str = f"{MODULE}:linear") -> P.ModelSpec:
    return P.ModelSpec(name, "safetensors-module", {"factory": factory, "path": str(path), "kwargs": KW})


def _in_thread(fn: object, wait_s: float) -> tuple[bool, list[object]]:
    """(whether `fn()` returned within `wait_s`, [its value]); it goes on, on a daemon thread."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    t.join(wait_s)
    return not t.is_alive(), got


def _drain(pool: InProcessWorkerPool, n: int, timeout: float = 30.0) -> list[P.CommandResult]:
    out: list[P.CommandResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += pool.poll()
        time.sleep(0.01)
    return out


# ---- 1. a stop does not wait for a load that hangs


class TestStopWithAHungLoad:
    """The pool's close waited for the device's command thread (`ThreadPoolExecutor.shutdown(wait=
    True)`), which waited for the hung load up to its `load_timeout_s` (900 s by default); and the
    interpreter's exit joined that thread again: Ctrl-C left the service running for 15 minutes."""

    def test_the_pools_close_returns_and_the_log_names_the_model_and_device(
        self, gate: _Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        pool = InProcessWorkerPool([DeviceSpec("cpu0")])  # the default load limit: 900 s
        gate.open.clear()
        pool.submit("cpu0", P.Load(_spec("stuck", _checkpoint(tmp_path))))
        queued = pool.submit("cpu0", P.Load(_spec("after", _checkpoint(tmp_path, "a"), "torch.nn:Linear")))
        assert gate.entered.wait(30)
        with caplog.at_level(logging.WARNING):
            returned, _ = _in_thread(pool.close, 30)
        assert returned, "the pool's close waited for the hung load"
        assert "stuck" in caplog.text and "cpu0" in caplog.text and "abandoned" in caplog.text
        results = {r.op_id: r for r in _drain(pool, 2, timeout=10)}
        # the command queued behind it does not run on a stopping host: it is answered, not loaded
        assert queued in results and not results[queued].ok
        assert "stopping" in (results[queued].error or "")
        assert "after" not in pool.status("cpu0").models
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit("cpu0", P.Drop("after"))

    def test_a_load_that_ends_within_the_grace_is_let_end_not_abandoned(
        self, gate: _Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A stop right after the start (a pinned model's load under way, a second long) gave the
        load up at once: the process then exited with the load's thread inside torch's native code,
        and aborted ("terminate called without an active exception", exit -6, not 0). A load about
        to end is now let end within the close's grace."""
        pool = InProcessWorkerPool([DeviceSpec("cpu0")], close_grace_s=10)
        gate.open.clear()
        op = pool.submit("cpu0", P.Load(_spec("soon", _checkpoint(tmp_path))))
        assert gate.entered.wait(30)
        threading.Timer(0.3, gate.open.set).start()  # it ends a moment after the stop
        with caplog.at_level(logging.WARNING):
            returned, _ = _in_thread(pool.close, 30)
        assert returned
        (result,) = [r for r in _drain(pool, 1, timeout=10) if r.op_id == op]
        assert result.ok, result
        assert "abandoned" not in caplog.text

    def test_a_command_held_past_the_grace_by_a_hung_inference_is_abandoned_and_said(
        self, gate: _Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Not a load: a drop waits for the model's running inference (its forward hangs); the
        close gives it its grace, then leaves it, naming the command, the model and the device."""
        pool = InProcessWorkerPool([DeviceSpec("cpu0")], close_grace_s=0.5)
        spec = _spec("slow", _checkpoint(tmp_path), f"{MODULE}:hanging")
        pool.submit("cpu0", P.Load(spec))
        (loaded,) = _drain(pool, 1)
        assert loaded.ok, loaded
        gate.open.clear()
        gate.entered.clear()
        inferring, _ = _in_thread(
            lambda: pool.infer("cpu0", "slow", {"input": np.ones((1, 4), np.float32)}), 0
        )
        assert not inferring and gate.entered.wait(30)
        pool.submit("cpu0", P.Drop("slow"))  # waits for the inference's end
        deadline = time.monotonic() + 30
        while pool._threads["cpu0"].running is None and time.monotonic() < deadline:
            time.sleep(0.01)  # (the drop has started: it now waits for the inference)
        with caplog.at_level(logging.WARNING, logger="workers.pool"):
            returned, _ = _in_thread(pool.close, 30)
        assert returned, "the pool's close waited for the drop held by a hung inference"
        assert "drop of slow" in caplog.text and "cpu0" in caplog.text and "abandoned" in caplog.text

    def test_a_process_whose_load_hangs_exits_after_the_pools_close(self, tmp_path: Path) -> None:
        """What Ctrl-C does: the pool closes, then the interpreter exits (and joins its threads)."""
        (tmp_path / "hangs.py").write_text(
            "import threading\n\n\ndef linear(in_features=4, out_features=2):\n"
            "    ENTERED.set()\n    threading.Event().wait()  # never returns\n\n\n"
            "ENTERED = threading.Event()\n"
        )
        script = textwrap.dedent(
            f"""
            import logging, sys
            sys.path.insert(0, {str(tmp_path)!r})
            logging.basicConfig(level=logging.INFO)
            import hangs
            from workers import protocol as P
            from workers.pool import DeviceSpec, InProcessWorkerPool
            pool = InProcessWorkerPool([DeviceSpec("cpu0")])
            spec = P.ModelSpec("stuck", "safetensors-module", {{"factory": "hangs:linear",
                               "path": {str(_checkpoint(tmp_path))!r}, "kwargs": {KW!r}}})
            pool.submit("cpu0", P.Load(spec))
            assert hangs.ENTERED.wait(60)
            pool.close()
            print("closed", flush=True)
            """
        )
        try:
            done = subprocess.run(
                [sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the process did not exit after its pool closed: {e.stdout!r} {e.stderr!r}")
        assert done.returncode == 0, done.stderr
        assert "closed" in done.stdout
        assert "stuck" in done.stderr and "cpu0" in done.stderr and "abandoned" in done.stderr

    def test_the_hosts_stop_answers_the_load_it_waits_for(
        self, gate: _Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t")  # the default load limit: 900 s
        gate.open.clear()
        got: list[P.CommandResult] = []
        t = threading.Thread(
            target=lambda: got.append(host.apply(P.Load(_spec("stuck", _checkpoint(tmp_path))), "1"))
        )
        t.start()
        assert gate.entered.wait(30)
        with caplog.at_level(logging.WARNING, logger="workers.host"):
            host.stop()
            t.join(30)
        assert got, "the load went on waiting after the host's stop"
        (r,) = got
        assert not r.ok and r.error_code == P.NOT_AVAILABLE and r.transition == "disk->disk"
        assert "'stuck'" in (r.error or "") and "stopping" in (r.error or "")
        assert "stuck" in caplog.text and "cpu0" in caplog.text
        later = host.apply(P.Load(_spec("x", _checkpoint(tmp_path, "x"), "torch.nn:Linear")), "2")
        assert not later.ok and later.error_code == P.NOT_AVAILABLE and "stopping" in (later.error or "")
        assert gate.calls == 1


# ---- 2. a hung load keeps its memory: no second one of the model starts while it runs


class TestAnAbandonedLoadStillRunning:
    """After a load was abandoned (LOAD_TIMEOUT), the host forgot it: the manager's books counted its
    bytes free, and the next request for the model started a second build beside the hung one (twice
    its memory, and a second thread stuck for good), with nothing in the host's status or log to say
    the first one still ran."""

    def test_a_new_load_of_the_model_is_refused_at_once_until_the_abandoned_one_ends(
        self, gate: _Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=0.5)
        spec = _spec("stuck", _checkpoint(tmp_path))
        gate.open.clear()
        first = host.apply(P.Load(spec), "1")
        assert not first.ok and first.error_code == P.LOAD_TIMEOUT
        assert set(host.abandoned()) == {"stuck"} and host.abandoned()["stuck"][0] == "load"
        again = host.apply(P.Load(spec), "2")
        assert not again.ok and again.error_code == P.LOAD_TIMEOUT
        assert "still running" in (again.error or "") and "'stuck'" in (again.error or "")
        assert gate.calls == 1, "a second build of the model started beside the hung one"
        host.load_timeout_s = 60.0  # (the loads that must succeed from now on: never timed out by a stall)
        # another model loads meanwhile: the refusal is the hung model's only
        assert host.apply(P.Load(_spec("other", _checkpoint(tmp_path, "o"), "torch.nn:Linear")), "3").ok
        with caplog.at_level(logging.INFO, logger="workers.host"):
            gate.open.set()  # the abandoned build ends: what it made is thrown away, and it is said
            deadline = time.monotonic() + 30
            while host.abandoned() and time.monotonic() < deadline:
                time.sleep(0.01)
        assert host.abandoned() == {}
        assert "stuck" in caplog.text and "ended" in caplog.text and "cpu0" in caplog.text
        assert "stuck" not in host.status().models  # its late end does not make it resident
        assert host.apply(P.Load(spec), "4").ok and gate.calls == 2
        assert host.infer("stuck", {"input": np.ones((1, 4), np.float32)}).ok

    def test_a_new_promote_waits_for_the_abandoned_one(self, gate: _Gate, tmp_path: Path) -> None:
        host = DeviceHost("cpu0", "cpu", node="t", load_timeout_s=60.0)
        assert host.apply(P.Load(_spec("m", _checkpoint(tmp_path)), "host"), "1").ok
        built = gate.calls  # (a read into host RAM checks the checkpoint against the module on meta)
        host.load_timeout_s = 0.5  # the promote that hangs is abandoned
        gate.open.clear()
        assert host.apply(P.Promote("m"), "2").error_code == P.LOAD_TIMEOUT
        again = host.apply(P.Promote("m"), "3")
        assert not again.ok and "still running" in (again.error or "") and again.transition == "host->host"
        assert gate.calls == built + 1  # the hung promote's build alone: none started beside it
        assert host.status().models["m"].tier == "host"

    def test_the_manager_does_not_start_a_second_load_beside_the_hung_one(
        self, gate: _Gate, tmp_path: Path
    ) -> None:
        """Through the live manager: its books evict the failed model (its bytes count free), so its
        next request asks the host for a load again; the host refuses it at once, naming the hung one."""
        from manager.config import load_config
        from manager.errors import ResidencyError
        from manager.live import LiveManager
        from manager.workers_bridge import create_pool

        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            "devices:\n  - {name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}\n"
            "host: {memory: 4GiB, reserve: 1GiB}\nclasses:\n  - {name: interactive}\nmodels:\n"
            "  - {name: stuck, class: interactive, adapter: safetensors-module, device: cpu0,"
            " memory: 1MiB, load_seconds: {disk: 0.05, host: 0.01},\n"
            f"     source: {{factory: '{MODULE}:linear', path: '{_checkpoint(tmp_path)}',"
            " kwargs: {in_features: 4, out_features: 2}}}\n"
        )
        config = load_config(cfg)
        x = {"input": np.ones((1, 4), np.float32)}

        async def main() -> tuple[str, str, int]:
            pool = create_pool(config, in_process=True, host_kwargs={"load_timeout_s": 0.5})
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                gate.open.clear()
                calls = gate.calls
                errors = []
                for _ in range(2):
                    with pytest.raises(ResidencyError) as e:
                        await lm.infer("stuck", x)
                    errors.append(str(e.value))
                return errors[0], errors[1], gate.calls - calls
            finally:
                await lm.stop()
                pool.close()

        first, second, builds = asyncio.run(main())
        assert "did not finish within 0.5 s" in first
        assert "still running" in second
        assert builds == 1, "the manager's second request started a second build beside the hung one"
