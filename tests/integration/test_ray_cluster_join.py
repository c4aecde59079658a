"""Multi-node plumbing on one machine: a device placed on a named node, and a manager process that
joins an existing Ray cluster (`ray.address: HOST:PORT`) started with `ray start --head`.

Ray 2.60 turns token authentication on by default; a real home cluster shares the token between its
nodes (copy ~/.ray/auth_token or set RAY_AUTH_TOKEN). This test's private head and the process that
joins it run with RAY_AUTH_MODE=disabled, so they do not touch the session's token file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import ray

from workers import protocol as P
from workers.pool import DeviceSpec
from workers.ray_pool import RayWorkerPool

from .conftest import TEST_NAMESPACE
from .ray_head import PRIVATE_RAY

ROOT = Path(__file__).resolve().parents[2]


def test_a_device_named_on_a_node_is_placed_there(ray_actors: list[object]) -> None:
    node = ray.util.get_node_ip_address()
    pool = RayWorkerPool([DeviceSpec("node-cpu0", "cpu", node=node)], namespace=TEST_NAMESPACE)
    ray_actors.append(pool)
    op = pool.submit("node-cpu0", P.Load(P.ModelSpec("voice", "silero-vad")))
    deadline = time.monotonic() + 120
    results: list[P.CommandResult] = []
    while not results and time.monotonic() < deadline:
        results = pool.poll()
        time.sleep(0.02)
    assert [(r.op_id, r.ok) for r in results] == [(op, True)]
    assert pool.status("node-cpu0").node == node
    assert pool.infer("node-cpu0", "voice", {"audio": np.zeros(512, np.float32)}).ok


def test_a_manager_joins_an_existing_cluster(head_node: str, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        (ROOT / "configs" / "local-cpu.yaml")
        .read_text()
        .replace("devices:", f'ray: {{address: "{head_node}"}}\ndevices:')
    )
    script = textwrap.dedent(f"""
        import json, time, numpy as np, ray
        from manager.config import load_config
        from manager.workers_bridge import create_pool, model_specs
        from workers import protocol as P
        config = load_config({str(config)!r})
        for attempt in range(20):  # the head may still be starting
            try:
                pool = create_pool(config)
                break
            except ConnectionError:
                ray.shutdown()
                time.sleep(1)
        op = pool.submit("cpu0", P.Load(model_specs(config)["voice"]))
        done = []
        while not done:
            done = pool.poll(); time.sleep(0.02)
        ok = pool.infer("cpu0", "voice", {{"audio": np.zeros(512, np.float32)}}).ok
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        gcs = ray.get_runtime_context().gcs_address
        print(json.dumps({{"load_ok": done[0].ok, "infer_ok": ok, "gcs": gcs, "nodes": nodes}}))
        pool.shutdown_actors()
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, **PRIVATE_RAY},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["load_ok"] and got["infer_ok"]
    assert got["gcs"].endswith(head_node.split(":")[1])  # joined the head we started, not a new local Ray
