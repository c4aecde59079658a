"""The Open Inference Protocol surface as stock clients use it (16th review: manager/api/oip.py,
convert.py); each test failed before its fix.

Real components: the service's gRPC server on a free port over in-process device hosts, with a real
safetensors-module model over its checkpoint file that declares a rank-4 input of free dimensions
(an image batch's shape) beside a rank-1 one, and two outputs; a second model over the same
checkpoint stays on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import types
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from manager.api.convert import decode_input
from manager.api.server import build_server
from manager.config import load_config
from manager.errors import InvalidRequest
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from residency_proto.inference import grpc_service_pb2 as pb
from workers.st_io import write_safetensors

FACTORIES = "residency_review16_oip_factories"
INFER = "/inference.GRPCInferenceService/ModelInfer"
HUGE = 2**28  # convert.MAX_ELEMENTS: the largest dimension a request may have


class _Grid(nn.Module):
    """Inputs `x` (FP32, rank 4, every dimension free) and `w` (FP32, rank 1); outputs `y` (x scaled)
    and `n` (w scaled)."""

    residency_inputs = (("x", "FP32", (-1, -1, -1, -1)), ("w", "FP32", (-1,)))
    residency_outputs = (("y", "FP32", (-1, -1, -1, -1)), ("n", "FP32", (-1,)))

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.scale, w * self.scale


CONFIG = """
devices:
  - {{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}}
host: {{memory: 4GiB, reserve: 1GiB}}
classes:
  - {{name: interactive}}
models:
  - {{name: grid, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.05, host: 0.01}}, pin: true,
     source: {{factory: "{mod}:grid", path: "{tmp}/grid.safetensors"}}}}
  - {{name: spare, class: interactive, adapter: safetensors-module, device: cpu0, memory: 1MiB,
     load_seconds: {{disk: 0.05, host: 0.01}}, prewarm: false,
     source: {{factory: "{mod}:grid", path: "{tmp}/grid.safetensors"}}}}
server: {{listen: "127.0.0.1:0"}}
store: {{url: "sqlite:///{tmp}/state.db", journal: "{tmp}/requests.journal"}}
"""


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """One service for the module, its event loop on a thread; the tests call it with blocking
    clients."""
    tmp = tmp_path_factory.mktemp("oip16")
    mod = types.ModuleType(FACTORIES)
    mod.grid = _Grid  # type: ignore[attr-defined]
    sys.modules[FACTORIES] = mod
    write_safetensors(_Grid().state_dict(), tmp / "grid.safetensors")
    (tmp / "c.yaml").write_text(CONFIG.format(mod=FACTORIES, tmp=tmp))
    cfg = load_config(tmp / "c.yaml")
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()

    async def start() -> int:
        pool = create_pool(cfg, in_process=True)
        stack.callback(pool.close)
        manager = LiveManager(cfg, pool)
        server, bound, _ = await build_server(cfg, manager)
        stack.push_async_callback(manager.stop)
        stack.push_async_callback(server.stop, None)
        await server.start()
        await manager.start()
        return bound

    bound = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield bound
    asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()
    sys.modules.pop(FACTORIES, None)


def infer(port: int, request: pb.ModelInferRequest) -> tuple[str, str, pb.ModelInferResponse | None]:
    """(status code name, details, response) of one ModelInfer call."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(INFER)
        try:
            body = call(request.SerializeToString(), timeout=60)
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", None
    return "OK", "", pb.ModelInferResponse.FromString(body)


def grid(x_shape: list[int], w: int = 2) -> pb.ModelInferRequest:
    """A request with zeros for `x` of `x_shape` and `w` of `w` elements, as raw bytes."""
    r = pb.ModelInferRequest(model_name="grid", id="g-1")
    r.inputs.add(name="x", datatype="FP32", shape=x_shape)
    r.inputs.add(name="w", datatype="FP32", shape=[w])
    r.raw_input_contents.append(np.zeros(int(np.prod(x_shape)), np.float32).tobytes())
    r.raw_input_contents.append(np.zeros(w, np.float32).tobytes())
    return r


# ---------------------------------------------------------------------------------------------------
# The fix: an empty tensor whose other dimensions multiply past numpy's range was INTERNAL


class TestAnEmptyTensorOfHugeDimensions:
    """A shape with a 0 and several large dimensions ([0, 2**28, 2**28, 2**28]) passed every check
    (each dimension within the limit, no elements), then numpy refused to shape the empty array
    ("array is too big"): a ValueError, answered INTERNAL "ModelInfer: internal error" with a
    traceback in the server log. Now INVALID_ARGUMENT naming the input, its shape and the limit;
    an empty tensor of ordinary dimensions still decodes."""

    @pytest.mark.parametrize(
        ("datatype", "typed"),
        [(d, False) for d in ("FP32", "BOOL", "BF16", "BYTES")]
        + [(d, True) for d in ("FP32", "BOOL", "BYTES")],
    )
    def test_decoding_refuses_it_by_name(self, datatype: str, typed: bool) -> None:
        shape = [0, HUGE, HUGE, HUGE]
        raw, contents = (None, pb.InferTensorContents()) if typed else (b"", None)
        with pytest.raises(InvalidRequest) as e:  # was: ValueError, array is too big
            decode_input("x", datatype, shape, raw, contents)
        msg = str(e.value)
        assert "input 'x'" in msg and str(shape) in msg and f"the limit is {HUGE}" in msg

    def test_ordinary_empty_tensors_still_decode(self) -> None:
        assert decode_input("x", "FP32", [0, 2**14, 2**14], b"", None).shape == (0, 2**14, 2**14)
        assert decode_input("x", "BYTES", [3, 0], b"", None).shape == (3, 0)

    def test_the_service_answers_invalid_argument(self, port: int) -> None:
        code, details, _ = infer(port, grid([0, HUGE, HUGE, HUGE]))
        assert code == "INVALID_ARGUMENT", details  # was: INTERNAL
        assert "input 'x'" in details and "[0, 268435456, 268435456, 268435456]" in details

    def test_the_service_still_serves_an_empty_batch(self, port: int) -> None:
        code, details, resp = infer(port, grid([0, 3, 4, 4]))
        assert code == "OK", details
        assert resp is not None
        assert [(o.name, list(o.shape)) for o in resp.outputs] == [("y", [0, 3, 4, 4]), ("n", [2])]
        assert resp.raw_output_contents[0] == b""


# ---------------------------------------------------------------------------------------------------
# The fix: raw data for some inputs and typed contents for another was refused naming no input


class TestRawForSomeInputsTypedForOthers:
    """Triton's rule is raw data for every input or for none. A request that gave one input typed
    contents and the others raw data was refused "1 raw_input_contents for 2 inputs": no model, no
    input, nor the rule it broke. Now the details name the model, the inputs, the rule, and the
    input whose data is typed."""

    def test_the_input_with_typed_contents_is_named(self, port: int) -> None:
        r = grid([1, 1, 1, 2])
        del r.raw_input_contents[1]
        r.inputs[1].contents.fp32_contents.extend([1.0, 2.0])
        code, details, _ = infer(port, r)
        assert code == "INVALID_ARGUMENT", details
        assert "model 'grid': 1 raw_input_contents for 2 inputs ('x', 'w')" in details  # was: neither
        assert "one entry per input" in details and "input 'w' has typed contents" in details

    def test_an_input_without_data_is_said_by_the_rule(self, port: int) -> None:
        r = grid([1, 1, 1, 2])
        del r.raw_input_contents[1]  # tritonclient: an InferInput whose data was never set
        code, details, _ = infer(port, r)
        assert code == "INVALID_ARGUMENT", details
        assert "1 raw_input_contents for 2 inputs ('x', 'w')" in details
        assert "one entry per input" in details and "typed contents beside" not in details


# ---------------------------------------------------------------------------------------------------
# The fix: RepositoryIndex said "UNLOADED", no state of Triton's


class TestRepositoryIndexStates:
    """A model off the GPU was listed with the state "UNLOADED" and no reason. Triton's states are
    UNKNOWN, READY, UNAVAILABLE, LOADING and UNLOADING, and it lists an unloaded model UNAVAILABLE
    with the reason "unloaded": a client matching those states met one it did not know. Now the
    same, the reason saying the tier that holds the model."""

    def test_an_unloaded_model_is_unavailable_unloaded(self, port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex")
            index = pb.RepositoryIndexResponse.FromString(call(b"", timeout=30))
            ready = pb.RepositoryIndexResponse.FromString(
                call(pb.RepositoryIndexRequest(ready=True).SerializeToString(), timeout=30)
            )
        spare = next(m for m in index.models if m.name == "spare")
        assert (spare.version, spare.state) == ("1", "UNAVAILABLE")  # was: "UNLOADED"
        assert spare.reason.startswith("unloaded") and "disk" in spare.reason  # was: ""
        assert {m.state for m in index.models} <= {"READY", "LOADING", "UNAVAILABLE"}
        assert "spare" not in {m.name for m in ready.models}


# ---------------------------------------------------------------------------------------------------
# The fix: an unknown `residency_class` was found only once the inputs were decoded, not named as the
# parameter


class TestAnUnknownResidencyClass:
    """A `residency_class` parameter naming no class was refused "unknown class 'bogus'" by the
    manager, after the request's inputs were decoded (a large request's seconds of work for
    nothing, and a fault in its data said instead). Now it is refused with the other parameters,
    before any data is decoded, naming the parameter and the classes."""

    @pytest.mark.parametrize("name", ["bogus", ""])
    def test_refused_naming_the_parameter(self, port: int, name: str) -> None:
        r = grid([1, 1, 1, 2])
        r.parameters["residency_class"].string_param = name
        code, details, _ = infer(port, r)
        assert code == "INVALID_ARGUMENT", details
        assert details == f"parameter 'residency_class': unknown class {name!r}; classes: interactive"

    def test_before_the_inputs_are_decoded(self, port: int) -> None:
        r = grid([1, 1, 1, 2])
        r.raw_input_contents[0] = b"\0" * 3  # a fault in the data, which decoding would find
        r.parameters["residency_class"].string_param = "bogus"
        code, details, _ = infer(port, r)
        assert code == "INVALID_ARGUMENT", details
        assert "parameter 'residency_class'" in details  # was: "input 'x': 3 raw bytes, expected 8"

    def test_a_known_class_is_served(self, port: int) -> None:
        r = grid([1, 1, 1, 2])
        r.parameters["residency_class"].string_param = "interactive"
        assert infer(port, r)[:2] == ("OK", "")
