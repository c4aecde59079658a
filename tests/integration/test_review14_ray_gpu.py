"""A device host no real Ray node can take is said at once (unit tests, with stand-ins for Ray's API:
`tests/unit/test_review14_ray_gpu.py`).

- `residency serve --no-cpu-fallback` on a machine without a GPU (CUDA_VISIBLE_DEVICES="" here, so the
  same on a machine with one): the CUDA device's actor asked a local Ray without GPUs for one and was
  never scheduled; every model stayed `loading` and each request ended DEADLINE_EXCEEDED with no
  cause. Now one error line at the start, UNAVAILABLE at once naming the device, the missing GPU and
  the CPU fallback, and `ps` shows it as each model's last error.
- On a real cluster (the session's, 2 logical GPUs): a device on a node not in it is refused at once;
  one whose GPUs another actor holds is refused once it waited past PLACEMENT_WAIT_S, and takes the
  next attempt once they come free.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from residency_proto.inference import grpc_service_pb2 as oip
from residency_proto.inference import grpc_service_pb2_grpc as oip_grpc
from workers import protocol as P
from workers import ray_pool
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def _gpu_config(tmp_path: Path) -> Path:
    """local-cpu.yaml with its device a CUDA one, its store in `tmp_path`."""
    text = CONFIG.read_text().replace("{name: cpu0, kind: cpu,", "{name: gpu0, kind: cuda,", 1)
    text = text.replace("device: cpu0", "device: gpu0")
    store = f'store: {{url: "sqlite:///{tmp_path / "state.db"}"}}\n'
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("devices:", f"{store}devices:", 1))
    return path


def test_serve_without_cpu_fallback_on_a_ray_without_a_gpu_says_so_at_once(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for Ray nor torch, on any machine
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RESIDENCY), "serve", "--config", str(_gpu_config(tmp_path)), "--no-cpu-fallback",
             "--listen", "127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while "serving on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        # (the port serve took: one picked before it starts its local Ray could be taken by Ray's own)
        serving = re.search(r"serving on 127\.0\.0\.1:(\d+) ", log.read_text())
        assert serving, log.read_text()[-3000:]
        port = int(serving[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = oip.ModelInferRequest(model_name="voice")
            req.inputs.add(name="audio", datatype="FP32", shape=[512])
            req.raw_input_contents.append(np.zeros(512, np.float32).tobytes())
            with pytest.raises(grpc.RpcError) as e:
                stub = oip_grpc.GRPCInferenceServiceStub(ch)  # type: ignore[no-untyped-call]
                stub.ModelInfer(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        why = e.value.details() or ""
        assert "device 'gpu0' needs a GPU, and the Ray cluster at " in why, why
        assert "has none (GPU: 0 on its 1 node)" in why, why
        assert "serve without --no-cpu-fallback to run it on the CPU" in why, why
        ps = subprocess.run(
            [str(RESIDENCY), "ps", "--target", f"127.0.0.1:{port}", "--json"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert ps.returncode == 0, ps.stderr
        models = {m["name"]: m for m in json.loads(ps.stdout)["models"]}
        assert "device 'gpu0' needs a GPU" in models["voice"]["last_error"], models["voice"]
        errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "device 'gpu0' needs a GPU" in errors[0], log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what its Ray left (its session)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _results(pool: RayWorkerPool, ops: list[str], timeout: float) -> dict[str, P.CommandResult]:
    got: dict[str, P.CommandResult] = {}
    deadline = time.monotonic() + timeout
    while not set(ops) <= set(got) and time.monotonic() < deadline:
        got.update({r.op_id: r for r in pool.poll()})
        time.sleep(0.05)
    assert set(ops) <= set(got), f"no result for {set(ops) - set(got)} within {timeout} s"
    return got


def test_a_real_cluster_refuses_what_it_cannot_place_until_it_can(
    ray_actors: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr(ray_pool, "PLACEMENT_WAIT_S", 3.0)

    @ray.remote(num_gpus=2, num_cpus=0)
    class Holder:  # holds both of the session cluster's GPUs
        def ready(self) -> bool:
            return True

    holder = Holder.remote()  # type: ignore[attr-defined]
    try:
        ray.get(holder.ready.remote(), timeout=60)
        pool = RayWorkerPool(
            [DeviceSpec("r14-gpu", "cuda"), DeviceSpec("r14-far", "cpu", node="10.255.0.9")],
            namespace=TEST_NAMESPACE,
        )
        ray_actors.append(pool)
        far = pool.submit("r14-far", P.Drop("m"))
        (r,) = _results(pool, [far], 10).values()
        assert (r.ok, r.error_code) == (False, P.NOT_AVAILABLE)
        assert "device 'r14-far' is to run on Ray node '10.255.0.9', which is not in the Ray cluster" in (
            r.error or ""
        ), r.error
        held = pool.submit("r14-gpu", P.Drop("m"))
        (r,) = _results(pool, [held], 60).values()
        assert (r.ok, r.error_code) == (False, P.NOT_AVAILABLE), r
        assert "device 'r14-gpu' was not placed on a Ray node within 3 s" in (r.error or ""), r.error
        assert "GPU: 2, free: 0" in (r.error or ""), r.error
    finally:
        ray.kill(holder)
    deadline = time.monotonic() + 120  # its GPUs free: the host is placed, starts, and answers
    while True:
        op = pool.submit("r14-gpu", P.Drop("m"))
        (r,) = _results(pool, [op], 120).values()
        if r.boot_id or time.monotonic() > deadline:  # (set by the host: its answer, not a refusal)
            break
        time.sleep(1.0)
    assert r.boot_id, r
    # the host's own answer: without CUDA it refuses every command itself, naming that
    assert r.ok or "is a CUDA device but CUDA is not available" in (r.error or ""), r
