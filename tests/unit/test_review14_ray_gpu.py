"""A device host actor that no Ray node can take is said at once, naming what it asks and what the
cluster has, instead of leaving its models `loading` for good.

`residency serve --no-cpu-fallback` on a machine without CUDA created the CUDA device's actor with
`num_gpus=1` on a local Ray that has no GPU: Ray never scheduled it, and said nothing. The start logged
only "device gpu0 did not report its status at start"; every model stayed `loading` and each request
ended DEADLINE_EXCEEDED with no cause. The same for a device whose `node:` is not in the cluster.
Now the pool refuses such a device's commands at once (NOT_AVAILABLE, naming the device, what it
asks for and what the cluster has), `status` raises the same, and the start logs it as an error,
once. A cluster joined by address is asked again at each later attempt (a node with a GPU may
join), and a host whose resources the cluster has but that waits to be placed past
PLACEMENT_WAIT_S is refused too (its GPUs held elsewhere), until it is placed.

These tests stand Ray's API (`ray.nodes`, `ray.wait`, the actor class) in with stand-ins; the real
Ray does the same in `tests/integration/test_review14_ray_gpu.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from workers import protocol as P
from workers import ray_pool
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

GCS = "10.0.0.1:6379"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml"


def node(ip: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    """A `ray.nodes()` record."""
    res = {"CPU": 4.0, "memory": 8e9, f"node:{ip}": 1.0, **resources}
    return {"NodeID": ip, "Alive": alive, "NodeManagerAddress": ip, "Resources": res}


class Ref:
    def __init__(self, value: Any = None) -> None:
        self.value = value


class Method:
    def __init__(self, host: StandInHost, name: str) -> None:
        self.host, self.name = host, name

    def remote(self, *args: Any) -> Ref:
        self.host.calls.append((self.name, args))
        if self.name == "apply":
            cmd, op = args
            ref = Ref(P.CommandResult(op, P.command_model(cmd), P.command_op(cmd), True, "disk", "gpu"))
        elif self.name == "status":
            ref = Ref(P.WorkerStatus(self.host.name, "cuda", "", 1, 0.0, {}, 0))
        else:
            ref = Ref(True)
        self.host.refs.append(ref)
        return ref


class StandInHost:
    """An actor handle: records the calls made on it; their refs are ready when `Cluster.placed`."""

    def __init__(self, opts: dict[str, Any], name: str, kind: str) -> None:
        self.opts, self.name, self.kind = opts, name, kind
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.refs: list[Ref] = []
        self.__ray_ready__ = Method(self, "__ray_ready__")
        self.apply = Method(self, "apply")
        self.status = Method(self, "status")


class Cluster:
    """Stands in for the Ray API the pool uses: its nodes, what is free, which actors are placed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.free: dict[str, float] = {}
        self.placed: set[str] = set()  # devices whose actors run (their calls answer)
        self.scheduled: bool | None = False  # what the GCS actor table says of an actor not placed
        self.hosts: dict[str, StandInHost] = {}
        m = monkeypatch
        m.setattr(ray, "is_initialized", lambda: True)
        m.setattr(ray, "get_actor", self.get_actor)
        m.setattr(ray, "nodes", lambda: self.nodes)
        m.setattr(ray, "available_resources", lambda: self.free)
        m.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address=GCS))
        m.setattr(ray, "wait", self.wait)
        m.setattr(ray, "get", lambda ref, timeout=None: ref.value)
        m.setattr(ray_pool, "RemoteDeviceHost", SimpleNamespace(options=self.options))
        m.setattr(ray_pool, "_scheduled", lambda handle: self.scheduled)

    def get_actor(self, name: str, namespace: str | None = None) -> Any:
        raise ValueError(name)

    def options(self, **opts: Any) -> Any:
        def remote(name: str, kind: str, index: int, node: str | None) -> StandInHost:
            self.hosts[name] = StandInHost(opts, name, kind)
            return self.hosts[name]

        return SimpleNamespace(remote=remote)

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None) -> Any:
        live = {id(r) for d in self.placed for r in self.hosts[d].refs}
        ready = [r for r in refs if id(r) in live]
        return ready, [r for r in refs if id(r) not in live]


def load(model: str = "llm") -> P.Command:
    return P.Load(P.ModelSpec(model, "safetensors-module", {}), "gpu")


@pytest.fixture(autouse=True)
def check_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_pool, "PLACEMENT_CHECK_S", 0.0)


def test_a_gpu_device_on_a_cluster_without_a_gpu_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Cluster(monkeypatch, [node("10.0.0.1"), node("10.0.0.2")])
    with caplog.at_level(logging.INFO, logger="workers.ray_pool"):
        pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text  # the start says it, once
    op = pool.submit("gpu0", load())
    (result,) = pool.poll()
    assert (result.op_id, result.ok, result.error_code, result.device) == (op, False, P.NOT_AVAILABLE, "gpu0")
    why = result.error or ""
    assert why.startswith("model 'llm': device 'gpu0' needs a GPU")
    assert f"the Ray cluster at {GCS} has none (GPU: 0 on its 2 nodes)" in why, why
    assert "once a Ray node with a GPU joins" in why, why  # a joined cluster: not refused for good
    assert errors[0] in why
    assert pool.pending() == 0 and pool.poll() == []
    # the command was never sent: it would run whenever a node took the actor, long after its answer
    assert [c for c, _ in pool.actors["gpu0"].calls if c == "apply"] == []
    with pytest.raises(ray_pool.HostNotPlaced, match="device 'gpu0' needs a GPU"):
        pool.status("gpu0")


def test_a_local_ray_without_a_gpu_names_the_cpu_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    Cluster(monkeypatch, [node("192.0.2.2")])
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")], local=True)
    pool.submit("gpu0", load("voice"))
    pool.submit("gpu0", load("tts"))
    results = pool.poll()
    assert [(r.model, r.error_code) for r in results] == [
        ("voice", P.NOT_AVAILABLE),
        ("tts", P.NOT_AVAILABLE),
    ]
    why = results[0].error or ""
    assert "has none (GPU: 0 on its 1 node)" in why, why
    assert "on a machine without CUDA, serve without --no-cpu-fallback to run it on the CPU" in why, why


def test_a_later_attempt_succeeds_once_a_gpu_node_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch, [node("10.0.0.1")])
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    pool.submit("gpu0", load())
    assert pool.poll()[0].error_code == P.NOT_AVAILABLE
    # a node with a GPU joins; Ray places the actor there, which starts (not yet answering)
    cluster.nodes = [node("10.0.0.1"), node("10.0.0.3", GPU=1.0)]
    cluster.scheduled = True
    op = pool.submit("gpu0", load())
    assert pool.poll() == [] and pool.pending() == 1  # held until the host answers
    cluster.placed.add("gpu0")
    done = pool.poll()
    assert [(r.op_id, r.ok) for r in done] == [(op, True)]
    assert [c for c, _ in pool.actors["gpu0"].calls if c == "apply"] == ["apply"]


def test_a_placed_host_takes_commands_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch, [node("10.0.0.1", GPU=2.0)])
    cluster.placed.add("gpu0")
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    assert pool.actors["gpu0"].opts["num_gpus"] == 1
    op = pool.submit("gpu0", load())
    assert [(r.op_id, r.ok) for r in pool.poll()] == [(op, True)]
    assert pool.status("gpu0").device == "gpu0"


def test_a_node_not_in_the_cluster_is_named_with_the_nodes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    Cluster(monkeypatch, [node("10.0.0.1", GPU=1.0), node("10.0.0.9", alive=False, GPU=1.0)])
    pool = RayWorkerPool([DeviceSpec("far", "cpu", node="10.0.0.9")])
    assert pool.actors["far"].opts["resources"] == {"node:10.0.0.9": ray_pool.NODE_SHARE}
    pool.submit("far", load())
    why = pool.poll()[0].error or ""
    assert "device 'far' is to run on Ray node '10.0.0.9', which is not in the Ray cluster" in why, why
    assert "(its nodes: 10.0.0.1)" in why and "once that node joins" in why, why  # a dead node is not there


def test_a_host_still_waiting_for_its_gpu_past_the_wait_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch, [node("10.0.0.1", GPU=1.0)])
    cluster.free = {"CPU": 4.0}  # the one GPU is held by another actor
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    pool.submit("gpu0", load())
    assert pool.poll() == [] and pool.pending() == 1  # the GPU may come free: it waits, for now
    pool._placing["gpu0"].since -= ray_pool.PLACEMENT_WAIT_S
    (result,) = pool.poll()
    why = result.error or ""
    assert result.error_code == P.NOT_AVAILABLE
    assert f"device 'gpu0' was not placed on a Ray node within {ray_pool.PLACEMENT_WAIT_S:g} s" in why, why
    assert "needs a GPU" in why and "GPU: 1, free: 0" in why, why
    cluster.placed.add("gpu0")  # the GPU came free: the next attempt goes
    op = pool.submit("gpu0", load())
    assert [(r.op_id, r.ok) for r in pool.poll()] == [(op, True)]


def test_a_host_that_is_placed_but_still_starting_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(monkeypatch, [node("10.0.0.1", GPU=1.0)])
    cluster.scheduled = True  # Ray found it a node and a worker; its constructor runs (slow imports)
    pool = RayWorkerPool([DeviceSpec("gpu0", "cuda")])
    pool._placing["gpu0"].since -= ray_pool.PLACEMENT_WAIT_S
    pool.submit("gpu0", load())
    assert pool.poll() == [] and pool.pending() == 1  # not refused: sent as before (it queues there)
    assert [c for c, _ in pool.actors["gpu0"].calls if c == "apply"] == ["apply"]


@pytest.mark.parametrize(
    ("spec", "nodes", "expected"),
    [
        (DeviceSpec("g", "cuda"), [node("a", GPU=1.0)], None),
        (
            DeviceSpec("g", "cuda"),
            [node("a", alive=False, GPU=1.0), node("b")],
            "has none (GPU: 0 on its 1 node)",
        ),
        (
            DeviceSpec("g", "cuda", node="a"),
            [node("a"), node("b", GPU=4.0)],
            "on Ray node 'a', which has none",
        ),
        (DeviceSpec("g", "cuda", node="b"), [node("a"), node("b", GPU=4.0)], None),
        (DeviceSpec("c", "cpu"), [], None),  # asks for nothing a node can lack
        (DeviceSpec("c", "cpu", node="z"), [node("a"), node("b")], "(its nodes: a, b)"),
    ],
)
def test_what_no_node_offers(spec: DeviceSpec, nodes: list[dict[str, Any]], expected: str | None) -> None:
    why = ray_pool.unplaceable(spec, nodes, "the Ray cluster at x:1")
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why and f"device {spec.name!r}" in why, why


def test_the_real_ray_has_what_the_stand_ins_stand_for() -> None:
    """The stand-ins above replace these; a Ray without them would fail here, not in production."""
    for name in ("nodes", "available_resources", "get_runtime_context", "wait"):
        assert callable(getattr(ray, name))
    from ray._private import state

    assert callable(state.actors)
    assert ray_pool._scheduled(object()) is None  # unknown: never a refusal


@pytest.mark.parametrize(
    ("address", "env", "local"),
    [
        (None, None, True),
        ("auto", None, False),
        (None, "10.0.0.1:6379", False),
        ("10.0.0.1:6379", None, False),
    ],
)
def test_the_cpu_fallback_hint_is_for_a_local_ray_that_serve_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, address: str | None, env: str | None, local: bool
) -> None:
    """Only the local Ray `serve` starts (ray.address null, no RAY_ADDRESS) is this machine's alone."""
    from manager.config import load_config
    from manager.workers_bridge import create_pool

    made: dict[str, Any] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_pool, "unreachable", lambda address: None)
    monkeypatch.setattr(ray_pool, "ensure_ray", lambda address, **kw: None)
    monkeypatch.setattr(ray_pool, "RayWorkerPool", lambda specs, **kw: made.update(kw))
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    ray_line = "" if address is None else f'ray: {{address: "{address}"}}\n'
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text().replace("devices:", f"{ray_line}devices:", 1))
    create_pool(load_config(path))
    assert made == {"local": local}
