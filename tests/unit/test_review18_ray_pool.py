"""Review 18, the Ray pool (workers.ray_pool): what a failed call on a device host is taken for, and
which host of an earlier run is reattached.

1. An error a host raised (its method raised: Ray's `RayTaskError`; or any exception that is not Ray
   saying the actor died or is unreachable) was reported as the host's death: `worker_died`, which
   makes the manager resync the device and take its models for lost, and counted in the death
   bookkeeping, so that the host's next real unavailability was waited out as a restart. The host
   is alive: it is now a failure of that command or request (`internal`, naming the exception), no
   death is recorded, and the host counts as answering.
2. A restarted manager reattached to a CUDA host of an earlier run that serves another GPU index
   than the config's entry now says (cuda:1 for a config saying cuda:0). It is replaced now, as one
   of another kind or on another node is, and the log says why.

Ray's API is stood in for by fakes here (unit tests never start Ray); the actor handle's
`__ray_call__` runs the function the pool sends on a stand-in of the actor object, as Ray's does."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from workers import protocol as P
from workers import ray_pool
from workers.channel import ReplyLost
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool, _Batcher, _Deaths


def raised(cause: Exception, method: str = "apply") -> RayTaskError:
    """What `ray.get` raises when the actor's `method` raised `cause` (the host lives on)."""
    tb = f"ray::DeviceHostActor.{method}() (pid=7, ip=10.0.0.1)\n  File ...\n{type(cause).__name__}: {cause}"
    err: RayTaskError = RayTaskError(f"DeviceHostActor.{method}", tb, cause).as_instanceof_cause()  # type: ignore[no-untyped-call]
    return err


# A host's code raised: an error of its own, or a Ray error it met itself (a call it made on another
# actor that died), which Ray hands on wrapped; and an error that is not Ray's at all.
APP_ERRORS = [
    pytest.param(lambda m: raised(ValueError("checkpoint header names 3 tensors, found 2"), m), "ValueError",
                 "checkpoint header names 3 tensors, found 2", id="raised"),
    pytest.param(lambda m: raised(ActorDiedError(), m), "ActorDiedError", "", id="raised-actor-died"),
    pytest.param(lambda m: TypeError("cannot unpickle 'Thing'"), "TypeError", "cannot unpickle 'Thing'",
                 id="not-ray"),
]  # fmt: skip


class Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class Method:
    def __init__(self, host: Host, name: str) -> None:
        self.host, self.name = host, name

    def remote(self, *args: Any) -> Ref:
        self.host.calls.append(self.name)
        fail = self.host.fail.get(self.name)
        if fail is not None:
            return Ref(fail)
        if self.name == "apply":
            cmd, op = args
            return Ref(P.CommandResult(op, P.command_model(cmd), P.command_op(cmd), True, "disk", "gpu"))
        if self.name == "status":
            kind: Any = self.host.kind
            return Ref(P.WorkerStatus(self.host.device, kind, self.host.node, 1, 0.0, {}, 0))
        if self.name == "infer":
            return Ref(P.InferResult(args[0], True))
        if self.name == "session":
            return Ref(P.SessionReply(True))
        if self.name == "__ray_call__":  # Ray runs the function on the actor object
            fn, *rest = args
            actor = SimpleNamespace(host=SimpleNamespace(index=self.host.index, kind=self.host.kind))
            return Ref(fn(actor, *rest))
        return Ref(True)


class Host:
    """An actor handle; `fail[method]`: what `ray.get` of that method's calls raises."""

    def __init__(self, device: str, kind: str, index: int = 0, node: str | None = None) -> None:
        self.device, self.kind, self.index, self.node = device, kind, index, node or ""
        self.calls: list[str] = []
        self.fail: dict[str, BaseException] = {}
        for name in ("__ray_ready__", "__ray_call__", "apply", "status", "infer", "session"):
            setattr(self, name, Method(self, name))


class FakeRay:
    """Stands in for the Ray API the pool uses. `held`: named actors of an earlier run, by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: dict[str, Host] = {}
        self.killed: list[Host] = []
        self.made: list[Host] = []
        m = monkeypatch
        m.setattr(ray, "is_initialized", lambda: True)
        m.setattr(ray, "get_actor", self.get_actor)
        m.setattr(ray, "kill", self.kill)
        m.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.1:6379"))
        m.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
        m.setattr(ray, "get", self.get)
        m.setattr(ray_pool, "RemoteDeviceHost", SimpleNamespace(options=self.options))
        m.setattr(ray_pool, "_scheduled", lambda handle: True)

    def get_actor(self, name: str, namespace: str | None = None) -> Host:
        if name not in self.held:
            raise ValueError(name)
        return self.held[name]

    def kill(self, handle: Host, no_restart: bool = False) -> None:
        self.killed.append(handle)
        self.held = {k: v for k, v in self.held.items() if v is not handle}

    @staticmethod
    def get(ref: Ref, timeout: float | None = None) -> Any:
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    def options(self, **opts: Any) -> Any:
        def remote(name: str, kind: str, index: int, node: str | None) -> Any:
            host = self.host(name, kind, index, node, opts)
            self.made.append(host)
            return host

        return SimpleNamespace(remote=remote)

    def host(self, name: str, kind: str, index: int, node: str | None, options: dict[str, Any]) -> Any:
        """The handle of an actor the pool made (with `options`)."""
        return Host(name, kind, index, node)


def load(model: str = "llm") -> P.Command:
    return P.Load(P.ModelSpec(model, "safetensors-module", {}), "gpu")


# ---- 1. an error the host raised is that command's failure, not the host's death -----------------


@pytest.mark.parametrize(("error", "name", "message"), APP_ERRORS)
def test_a_command_the_host_raised_on_fails_alone_and_no_death_is_recorded(
    monkeypatch: pytest.MonkeyPatch, error: Any, name: str, message: str
) -> None:
    FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    host: Host = pool.actors["gpu0"]
    host.fail["apply"] = error("apply")
    op = pool.submit("gpu0", load())
    (result,) = pool.poll()
    assert (result.op_id, result.ok, result.error_code, result.device) == (op, False, P.INTERNAL, "gpu0")
    why = result.error or ""
    assert why.startswith("load of 'llm' failed on device host 'gpu0' (alive): "), why
    assert f"{name}: {message}".rstrip() in why, why
    # no death was recorded: when the host really goes away, that is reported (not waited out as the
    # restart of a death already reported)
    host.fail["apply"] = ActorUnavailableError("The actor is unreachable", None)
    op2 = pool.submit("gpu0", load())
    (lost,) = pool.poll()
    assert (lost.op_id, lost.error_code) == (op2, P.WORKER_DIED)


def test_a_command_that_raised_on_a_restarted_host_says_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # the host died (reported), came back, and raised on a command: it answers, so its next
    # unavailability is a new death, reported, not a wait for the restart of the first
    FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    host: Host = pool.actors["gpu0"]
    host.fail["apply"] = ActorDiedError()
    pool.submit("gpu0", load())
    assert [r.error_code for r in pool.poll()] == [P.WORKER_DIED]
    host.fail["apply"] = raised(ValueError("bad header"))
    pool.submit("gpu0", load())
    assert [r.error_code for r in pool.poll()] == [P.INTERNAL]
    host.fail["apply"] = ActorUnavailableError("The actor is unreachable", None)
    pool.submit("gpu0", load())
    assert [r.error_code for r in pool.poll()] == [P.WORKER_DIED]


@pytest.mark.parametrize(("error", "name", "message"), APP_ERRORS)
def test_a_request_the_host_raised_on_is_internal(
    monkeypatch: pytest.MonkeyPatch, error: Any, name: str, message: str
) -> None:
    FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    host: Host = pool.actors["gpu0"]
    host.fail["infer"] = error("infer")
    r = pool.infer("gpu0", "llm", {})
    assert (r.model, r.ok, r.error_code) == ("llm", False, P.INTERNAL)
    assert f"{name}: {message}".rstrip() in (r.error or ""), r.error
    assert not pool._deaths.reported("gpu0", 0.0) and not pool._deaths._at


@pytest.mark.parametrize(("error", "name", "message"), APP_ERRORS)
def test_a_session_call_the_host_raised_on_is_internal(
    monkeypatch: pytest.MonkeyPatch, error: Any, name: str, message: str
) -> None:
    FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    host: Host = pool.actors["gpu0"]
    host.fail["session"] = error("session")
    reply = pool.session("gpu0", "step", "s-1", None)
    assert (reply.ok, reply.error_code) == (False, P.INTERNAL)  # not reopened as a lost host's
    assert f"{name}: {message}".rstrip() in (reply.error or ""), reply.error
    assert not pool._deaths._at


def test_a_host_that_died_under_a_request_or_a_session_call_is_a_death(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeRay(monkeypatch)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    host: Host = pool.actors["gpu0"]
    host.fail["infer"] = host.fail["session"] = ActorDiedError()
    assert pool.infer("gpu0", "llm", {}).error_code == P.WORKER_DIED
    assert pool.session("gpu0", "step", "s-1", None).error_code == P.WORKER_DIED
    assert pool._deaths.reported("gpu0", pool._deaths._at["gpu0"])


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class BatchHandle:
    """A fake actor handle for the batcher: `infer_many` raises `error`; no data channel."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.infer_many = _Remote(self._many)
        self.channel = _Remote(self._channel)

    def _channel(self) -> Any:
        async def none() -> None:
            return None

        return SimpleNamespace(future=lambda: asyncio.ensure_future(none()))

    def _many(self, items: list[tuple[str, Any]]) -> Any:
        async def fail() -> list[P.InferResult]:
            raise self.error

        return fail()


@pytest.mark.parametrize(("error", "name", "message"), APP_ERRORS)
def test_a_batch_the_host_raised_on_is_internal(error: Any, name: str, message: str) -> None:
    deaths = _Deaths()

    async def main() -> list[P.InferResult]:
        b = _Batcher(BatchHandle(error("infer_many")), "gpu0", deaths)
        return list(await asyncio.gather(b.submit("llm", {}), b.submit("llm", {})))

    results = asyncio.run(main())
    assert [(r.model, r.ok, r.error_code) for r in results] == [("llm", False, P.INTERNAL)] * 2
    assert all(f"{name}: {message}".rstrip() in (r.error or "") for r in results), results
    assert not deaths._at


def test_a_batch_whose_host_died_is_still_a_death() -> None:
    deaths = _Deaths()

    async def main() -> P.InferResult:
        return await _Batcher(BatchHandle(ActorDiedError()), "gpu0", deaths).submit("llm", {})

    assert asyncio.run(main()).error_code == P.WORKER_DIED
    assert "gpu0" in deaths._at


class BrokenChannel:
    address = ("127.0.0.1", 1)

    async def infer_many(self, items: list[tuple[str, Any]]) -> list[P.InferResult]:
        raise ReplyLost("connection reset after the request was sent")

    def close(self) -> None:
        pass


def test_a_check_the_host_raised_on_after_its_channel_broke_is_not_a_death() -> None:
    deaths = _Deaths()

    async def main() -> P.InferResult:
        handle = BatchHandle(raised(RuntimeError("unused")))
        handle.channel = _Remote(lambda: _fails(raised(RuntimeError("server stopped"), "channel")))
        b = _Batcher(handle, "gpu0", deaths)
        b.channel = BrokenChannel()  # type: ignore[assignment]
        b._looked_at = float("inf")
        return await b.submit("llm", {})

    r = asyncio.run(main())
    assert (r.ok, r.error_code) == (False, P.INTERNAL), r
    assert "RuntimeError: server stopped" in (r.error or "") and "not run again" in (r.error or ""), r.error
    assert not deaths._at


async def _fails(e: BaseException) -> Any:
    raise e


# ---- 2. a reattached CUDA host that serves another GPU index is replaced ---------------------------


def test_a_cuda_host_of_an_earlier_run_on_another_index_is_replaced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu0")] = Host("gpu0", "cuda", index=1)
    with caplog.at_level(logging.WARNING, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda", index=0)])
    assert not pool.reattached["gpu0"]
    assert fake.killed == [old]
    (new,) = fake.made
    assert pool.actors["gpu0"] is new and new.index == 0
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "device gpu0" in line and "cuda:1" in line and "cuda:0" in line and "replaced" in line, line


def test_a_cuda_host_of_an_earlier_run_on_its_index_is_reattached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu1")] = Host("gpu1", "cuda", index=1)
    pool = RayWorkerPool([DeviceSpec("gpu1", "cuda", index=1)])
    assert pool.reattached["gpu1"] and pool.actors["gpu1"] is old
    assert fake.killed == [] and fake.made == []


def test_a_cpu_host_is_reattached_whatever_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU device's index selects nothing (its host runs on the CPU either way)
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("cpu0")] = Host("cpu0", "cpu", index=3)
    pool = RayWorkerPool([DeviceSpec("cpu0", "cpu", index=0)])
    assert pool.reattached["cpu0"] and pool.actors["cpu0"] is old and fake.killed == []


def test_a_host_that_cannot_say_its_index_is_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # as one that cannot say its status now: kept, as before (and said in the log)
    fake = FakeRay(monkeypatch)
    old = fake.held[ray_pool.actor_name("gpu0")] = Host("gpu0", "cuda", index=1)
    old.fail["__ray_call__"] = raised(AttributeError("'DeviceHostActor' object has no attribute 'host'"))
    with caplog.at_level(logging.INFO, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda", index=0)])
    assert pool.reattached["gpu0"] and fake.killed == []
    assert "did not say which GPU it runs" in caplog.text, caplog.text
