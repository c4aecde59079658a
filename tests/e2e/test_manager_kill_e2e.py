"""`residency serve` SIGKILLed under load and started again on the same config and store.

The device hosts must outlive the manager, so the service joins a Ray head started by the test
(`ray start --head`, `ray.address` in the config). With `ray.address: null` the service starts a
local Ray in its own process, and Ray ties that local cluster's daemons to the process that started
it (kernel fate sharing): a killed manager takes the local cluster, detached actors included, with
it. There the restarted manager starts on fresh, empty hosts and its recorded intents load back what
was resident (the unit tests cover that path).

Only the manager's own process is killed (`Popen.kill`, not its process group: the client threads,
the Ray head and its actor workers are elsewhere anyway). Asserted after the restart: the device
host is the same actor and process (reattached, not recreated); voice, which it still holds, is
adopted without a load and answers the first request warm; embed, which the host lost while no
manager ran, is loaded back because its recorded intent says gpu; an intent for a model the config
no longer has is ignored, with a log line; every request answered OK before the kill is in the
request log (the journal replays what the store had not yet got); statistics count them too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import tritonclient.grpc as tc

from manager.store import open_store
from residency_proto.v1 import residency_pb2, residency_pb2_grpc

from .conftest import CONFIG, PRIVATE_RAY, ROOT, Server, free_port
from .test_serve_e2e import voice_input

PROBE = """
import json, sys, time, ray
from workers import protocol as P
for attempt in range(60):  # the head may still be starting
    try:
        ray.init(address=sys.argv[1], namespace="residency", log_to_driver=False)
        break
    except ConnectionError:
        time.sleep(0.5)
out = {}
if sys.argv[2] == "status":
    h = ray.get_actor("residency-device-cpu0")
    for name in sys.argv[3:]:  # the host loses these, as if it had restarted
        r = ray.get(h.apply.remote(P.Drop(name), "drill-drop-" + name), timeout=60)
        assert r.ok, r.error
    st = ray.get(h.status.remote(), timeout=60)
    out = {"actor": h._actor_id.hex(), "pid": st.pid, "started_at": st.started_at,
           "models": {n: [m.tier, m.inferences] for n, m in st.models.items()}}
print(json.dumps(out))
"""


def probe(head: str, what: str = "status", *drop: str) -> dict[str, Any]:
    """Connect to the head as a separate Ray driver; with "status", read the device host (dropping
    `drop` first)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, head, what, *drop],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, **PRIVATE_RAY},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def models(target: str) -> dict[str, Any]:
    with grpc.insecure_channel(target) as ch:
        listed = residency_pb2_grpc.ResidencyStub(ch).List(residency_pb2.ListRequest(), timeout=30)
    return {m.name: m for m in listed.models}


def scrape(metrics: str) -> str:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def load_total(scrape_text: str, model: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scrape_text.splitlines()
        if line.startswith("residency_loads_total{") and f'model="{model}"' in line
    )


def test_a_killed_manager_reattaches_its_device_hosts_and_loses_no_request(
    start_server: Callable[..., Server], head_node: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    metrics = f"127.0.0.1:{free_port()}"
    text = (
        CONFIG.read_text()
        .replace("policy: {name: residency}", "policy: {name: lru-keepalive}")  # preloads nothing itself
        .replace(
            "devices:", f'ray: {{address: "{head_node}"}}\nserver: {{metrics_listen: "{metrics}"}}\ndevices:'
        )
    )
    probe(head_node, "connect")  # the head answers
    server = start_server(url, config_text=text, env=PRIVATE_RAY)
    with grpc.insecure_channel(server.target) as ch:  # the admin's preload: embed's intent is gpu
        residency_pb2_grpc.ResidencyStub(ch).Preload(residency_pb2.PreloadRequest(name="embed"), timeout=120)

    # load from three client threads; the manager is killed while they run
    ok = [0, 0, 0]
    stop = threading.Event()

    def client(i: int) -> None:
        c = tc.InferenceServerClient(server.target)
        try:
            while not stop.is_set():
                c.infer("voice", [voice_input()], client_timeout=30)
                ok[i] += 1
        except Exception:
            pass  # the manager is gone
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    # (each thread served a few: one slow to connect on a loaded machine would still be at 0)
    while (sum(ok) < 60 or min(ok) < 5) and all(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, f"the load did not get going: {ok}"
        time.sleep(0.01)
    server.proc.kill()  # SIGKILL, the manager's process only
    server.proc.wait(30)
    stop.set()
    for t in threads:
        t.join(60)
    served = sum(ok)
    assert all(n > 0 for n in ok), ok

    # no manager runs: the device host lives on; it loses embed; the store names a retired model
    before = probe(head_node, "status", "embed")
    assert before["models"]["voice"][0] == "gpu" and before["models"]["voice"][1] >= served
    assert "embed" not in before["models"]
    store = open_store(url)
    store.set_intent("retired", "gpu")
    store.close()

    restart = time.time()
    server = start_server(url, config_text=text, env=PRIVATE_RAY)
    c = tc.InferenceServerClient(server.target)
    first = c.infer("voice", [voice_input()]).get_response()
    c.close()
    assert first.parameters["residency_cold"].bool_param is False  # adopted: no load, no wait
    deadline = time.monotonic() + 60
    while models(server.target)["embed"].tier != "gpu":  # loaded back: its recorded intent
        assert time.monotonic() < deadline, "embed was not loaded back"
        time.sleep(0.1)
    after = probe(head_node)
    assert (after["actor"], after["pid"], after["started_at"]) == (
        before["actor"], before["pid"], before["started_at"],
    )  # the same actor, the same process: reattached, not recreated  # fmt: skip
    assert after["models"]["voice"] == ["gpu", before["models"]["voice"][1] + 1]
    assert after["models"]["embed"][0] == "gpu"
    scraped = scrape(metrics)
    assert load_total(scraped, "voice") == 0 and load_total(scraped, "embed") == 1
    log = server.log.read_text()
    assert "recorded intent gpu for retired ignored: the model is not configured" in log

    # every request answered before the kill is in the request log; statistics count them
    store = open_store(url)
    try:
        voice = [r for r in store.requests(0) if r["model"] == "voice"]
    finally:
        store.close()
    arrivals = {r["t"] for r in voice if r["t"] < restart}  # (a batch the kill logged twice: once)
    # at most one request per client was in flight at the kill: served, logged, never answered
    assert served <= len(arrivals) <= served + len(threads), (served, len(arrivals))
    assert int(models(server.target)["voice"].requests) >= served + 1
    assert server.stop() == 0
