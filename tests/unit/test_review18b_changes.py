"""Review 18b: a second look at the morning's review-18 changes to the Ray pool and to WorldPager's
resume; each finding reproduced here before it was fixed.

1. The Ray pool took any error that is not a `RayActorError` for a failure of the call alone, on a
   host that lives on (`internal`, no death recorded). But Ray 2.60 says a host's death in other
   words too: an actor Ray's memory monitor killed fails its calls with `OutOfMemoryError` (the
   actor's death cause is an OOM context), one whose node died with `NodeDiedError`, a worker that
   crashed with `WorkerCrashedError`. Those were reported `internal` "(alive)": the manager did not
   resync the device, and a world session on the killed host was not reopened. They are deaths
   again (`worker_died`), as before the morning's change; what the host's own code raised (a
   `RayTaskError`, whatever it wraps) still is not.
2. A `GetTimeoutError` the host's own code raised (Ray's `RayTaskError(GetTimeoutError)`, an
   instance of both) was taken for the host not answering in time: `deadline` for a request, and
   for a world-session call `worker_died` (the session reopened as a lost host's). The host answered:
   it is that call's `internal` failure, naming the host's error.
3. `Session.resume(resume_at=N)` with N at or past the step the saved session stopped at threw away
   a valid saved window (`window.bin`) whenever the log lacks the session's last segments (their
   writes failed on a full disk): it went back to the log's last whole window, steps earlier, when
   without `resume_at` it continues where it stopped. "At the latest N" continues where it stopped.
4. `worldpager session --resume --resume-at N` on a full disk (the roll-back cannot be recorded)
   exited 2, the status of a user's mistake, though the machine failed (a full disk exits 1, as
   the module says and a full disk at the save already does).

Ray's API is stood in for by fakes here (unit tests never start Ray)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import (
    ActorDiedError,
    GetTimeoutError,
    NodeDiedError,
    OutOfMemoryError,
    RayTaskError,
    WorkerCrashedError,
)
from test_review18_worldpager import CFG, SEG, _Disk, _no_space, _pose, _resume

from workers import protocol as P
from workers import ray_pool
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool, _Batcher, _Deaths
from worldpager.cli import main
from worldpager.model import TinyCausalWan
from worldpager.session import SESSION_FILE, Session
from worldpager.session_records import MissingSegment

# ---- Ray fakes ------------------------------------------------------------------------------------


def raised(cause: Exception, method: str = "apply") -> RayTaskError:
    """What `ray.get` raises when the actor's `method` raised `cause` (the host lives on)."""
    tb = f"ray::DeviceHostActor.{method}() (pid=7, ip=10.0.0.1)\n  File ...\n{type(cause).__name__}: {cause}"
    err: RayTaskError = RayTaskError(f"DeviceHostActor.{method}", tb, cause).as_instanceof_cause()  # type: ignore[no-untyped-call]
    return err


class Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class Host:
    """An actor handle; `fail[method]`: what `ray.get` of that method's calls raises."""

    def __init__(self) -> None:
        self.fail: dict[str, BaseException] = {}
        for name in ("__ray_ready__", "apply", "infer", "session"):
            setattr(self, name, SimpleNamespace(remote=self._method(name)))

    def _method(self, name: str) -> Any:
        def remote(*args: Any) -> Ref:
            if name in self.fail:
                return Ref(self.fail[name])
            if name == "apply":
                cmd, op = args
                return Ref(P.CommandResult(op, P.command_model(cmd), P.command_op(cmd), True, "disk", "gpu"))
            return Ref(True)

        return remote


def _get(ref: Ref, timeout: float | None = None) -> Any:
    if isinstance(ref.value, BaseException):
        raise ref.value
    return ref.value


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> RayWorkerPool:
    """A pool of one CUDA device "gpu0" whose host is a `Host` (no host of an earlier run)."""
    m = monkeypatch
    m.setattr(ray, "is_initialized", lambda: True)
    m.setattr(ray, "get_actor", lambda name, namespace=None: (_ for _ in ()).throw(ValueError(name)))
    m.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    m.setattr(ray, "get", _get)
    m.setattr(ray_pool, "_cluster_name", lambda: "the Ray cluster")
    m.setattr(ray_pool, "RemoteDeviceHost", SimpleNamespace(options=lambda **_: SimpleNamespace(
        remote=lambda *a: Host())))  # fmt: skip
    m.setattr(ray_pool, "_scheduled", lambda handle: True)
    return RayWorkerPool([DeviceSpec("gpu0", "cuda")])


def _load() -> P.Command:
    return P.Load(P.ModelSpec("llm", "safetensors-module", {}), "gpu")


# Ray 2.60's words for a host that is gone, besides RayActorError (ray/_private/serialization.py:
# OUT_OF_MEMORY, NODE_DIED, WORKER_DIED; an actor Ray's memory monitor killed has an OOM death cause,
# and its calls fail with OUT_OF_MEMORY).
GONE = [
    pytest.param(
        lambda: OutOfMemoryError("Task was killed due to the node running low on memory."),
        "OutOfMemoryError: Task was killed due to the node running low on memory.", id="oom-killed",
    ),
    pytest.param(lambda: NodeDiedError("node 10.0.0.2 died"), "NodeDiedError: node 10.0.0.2 died", id="node"),
    pytest.param(lambda: WorkerCrashedError(), "WorkerCrashedError: The worker died", id="crashed"),
]  # fmt: skip


# ---- 1. a host Ray killed, or whose node died, is a death --------------------------------------------


@pytest.mark.parametrize(("error", "named"), GONE)
def test_a_command_whose_host_ray_killed_is_a_death(pool: RayWorkerPool, error: Any, named: str) -> None:
    host: Host = pool.actors["gpu0"]
    host.fail["apply"] = error()
    op = pool.submit("gpu0", _load())
    (result,) = pool.poll()  # was INTERNAL, "failed on device host 'gpu0' (alive)"
    assert (result.op_id, result.ok, result.error_code) == (op, False, P.WORKER_DIED)
    assert (result.error or "").startswith(f"device host 'gpu0' died: {named}"), result.error
    assert "gpu0" in pool._deaths._at  # reported once: a restarting host is then waited for


@pytest.mark.parametrize(("error", "named"), GONE)
def test_a_request_or_session_call_whose_host_ray_killed_is_a_death(
    pool: RayWorkerPool, error: Any, named: str
) -> None:
    host: Host = pool.actors["gpu0"]
    host.fail["infer"] = host.fail["session"] = error()
    r = pool.infer("gpu0", "llm", {})
    assert r.error_code == P.WORKER_DIED and (r.error or "").startswith(
        f"device host 'gpu0' died: {named}"
    ), r
    reply = pool.session("gpu0", "step", "s-1", None)  # the manager reopens it (it was INTERNAL: ended)
    assert reply.error_code == P.WORKER_DIED, reply


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def _batch_handle(error: BaseException) -> Any:
    async def fail() -> Any:
        raise error

    async def none() -> None:
        return None

    return SimpleNamespace(
        infer_many=_Remote(lambda items: fail()),
        channel=_Remote(lambda: SimpleNamespace(future=lambda: asyncio.ensure_future(none()))),
    )


@pytest.mark.parametrize(("error", "named"), GONE)
def test_a_batch_whose_host_ray_killed_is_a_death(error: Any, named: str) -> None:
    deaths = _Deaths()

    async def run() -> P.InferResult:
        return await _Batcher(_batch_handle(error()), "gpu0", deaths).submit("llm", {})

    r = asyncio.run(run())
    assert r.error_code == P.WORKER_DIED and named in (r.error or ""), r
    assert "gpu0" in deaths._at


@pytest.mark.parametrize(
    "cause", [OutOfMemoryError("a task it ran was killed"), NodeDiedError("x"), ActorDiedError()]
)
def test_the_same_errors_raised_by_the_hosts_own_code_are_not_a_death(
    pool: RayWorkerPool, cause: Exception
) -> None:
    # (the host's code met them on work of its own: Ray hands them on wrapped, the host lives on)
    host: Host = pool.actors["gpu0"]
    host.fail["apply"] = raised(cause)
    pool.submit("gpu0", _load())
    (result,) = pool.poll()
    assert result.error_code == P.INTERNAL and not pool._deaths._at, result


# ---- 2. a GetTimeoutError the host raised is not the host's silence ----------------------------------


def test_a_timeout_the_host_raised_is_internal_not_silence(pool: RayWorkerPool) -> None:
    host: Host = pool.actors["gpu0"]
    host.fail["infer"] = raised(GetTimeoutError("Get timed out: some object(s) not ready."), "infer")
    host.fail["session"] = raised(GetTimeoutError("Get timed out: some object(s) not ready."), "session")
    r = pool.infer("gpu0", "llm", {}, timeout_s=30.0)
    assert r.error_code == P.INTERNAL, r  # was DEADLINE, "no answer from device 'gpu0' within 30 s"
    assert "GetTimeoutError: Get timed out" in (r.error or "") and "no answer" not in (r.error or ""), r.error
    reply = pool.session("gpu0", "step", "s-1", None)
    assert reply.error_code == P.INTERNAL, reply  # was WORKER_DIED: reopened as a lost host's
    assert not pool._deaths._at


def test_the_hosts_own_silence_is_still_a_deadline(pool: RayWorkerPool) -> None:
    host: Host = pool.actors["gpu0"]
    host.fail["infer"] = host.fail["session"] = GetTimeoutError("Get timed out")
    r = pool.infer("gpu0", "llm", {}, timeout_s=30.0)
    assert r.error_code == P.DEADLINE and "no answer from device 'gpu0' within 30 s" in (r.error or "")
    assert pool.session("gpu0", "step", "s-1", None).error_code == P.WORKER_DIED  # (as before)


# ---- WorldPager fakes --------------------------------------------------------------------------------

# ---- 3. resume_at at or past where the session stopped ------------------------------------------------


def _saved_with_its_last_segments_unwritten(log_dir: Path) -> None:
    """A session saved at step 10 whose segments 8 and 9 never reached its log (the disk was full
    when they were written: they stayed in host RAM); its window.bin holds them."""
    torch.manual_seed(0)
    with Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=log_dir, retrieval_k=2) as s:
        s.run([_pose(i) for i in range(8)])
        assert s.wait_written(7, timeout=30.0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "pwritev", _no_space)
            s.run([_pose(8), _pose(9)])
            assert not s.wait_written(9, timeout=30.0) and not s.wait_written(8, timeout=30.0)


@pytest.mark.parametrize("resume_at", [10, 11, 1000])
def test_resume_at_the_step_it_stopped_at_or_past_it_continues_where_it_stopped(
    tmp_path: Path, resume_at: int
) -> None:
    d, same = tmp_path / "s", tmp_path / "copy"
    _saved_with_its_last_segments_unwritten(d)
    shutil.copytree(d, same)
    with _resume(same) as plain:
        assert (plain.step_index, plain.window_source) == (10, "checkpoint")
        assert sorted(e.segment_id for e in plain.events if isinstance(e, MissingSegment)) == [8, 9]
    with _resume(d, resume_at=resume_at) as r:  # was (8, "log"): steps 8 and 9 generated again
        assert (r.step_index, r.window_source) == (10, "checkpoint")
        assert sorted(e.segment_id for e in r.events if isinstance(e, MissingSegment)) == [8, 9]
        assert r.step(_pose(10)).step == 10


def test_resume_at_below_where_it_stopped_still_goes_back(tmp_path: Path) -> None:
    d = tmp_path / "s"
    _saved_with_its_last_segments_unwritten(d)
    with _resume(d, resume_at=9) as r:  # (the saved window is step 10's: past it, not used)
        assert (r.step_index, r.window_source) == (8, "log")


# ---- 4. the CLI's roll-back on a full disk is the machine's failure -----------------------------------


def test_cli_resume_at_on_a_full_disk_exits_1_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    assert main(["session", "--preset", "micro", "--segments", "5", "--log-dir", str(d), "--json"]) == 0
    capsys.readouterr()
    before = (d / SESSION_FILE).read_bytes()
    with monkeypatch.context() as mp:
        _Disk(mp).fill()
        argv = ["session", "--resume", "--resume-at", "3", "--segments", "1", "--log-dir", str(d), "--json"]
        rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 1, err  # was 2: "errors in what the user gave"
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"worldpager: session: {d}: disk full: cannot save the roll-back to step 3"), err
    assert (d / SESSION_FILE).read_bytes() == before
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp")) == []
    # with room again, the same command rolls back
    argv = ["session", "--resume", "--resume-at", "3", "--segments", "1", "--log-dir", str(d), "--json"]
    assert main(argv) == 0
