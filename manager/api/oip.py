"""`inference.GRPCInferenceService`: the Open Inference Protocol as Triton serves it.

Liveness/readiness, server and model metadata, infer (the request's class from its `priority`
parameter — 1 is the highest class — or a `residency_class` string parameter; its timeout from the
`timeout` parameter in microseconds (0, as in Triton: none of its own) or the call's deadline, counted
from the call's arrival, so the time its inputs take to decode is the call's too), and the
model-repository extension: index, load (= preload to the GPU tier), unload (= drop to disk).

ModelStreamInfer (tritonclient's `start_stream` / `async_stream_infer`): each request on the stream is
served as ModelInfer serves it, up to STREAM_IN_FLIGHT at once, and answered on the stream as it
ends (so answers may come in another order than their requests: a client matches them by `id`, as
with Triton); a request that fails is answered with its `error_message` (the details ModelInfer's
status would carry) and the stream goes on. A message that is not a ModelInferRequest ends the stream
with INVALID_ARGUMENT, once the requests before it are answered (one over `server.max_request_bytes`:
RESOURCE_EXHAUSTED, the same way). The call's deadline is each request's.
A slot is given back when its answer is sent, so a client that does not read its answers stops the
stream taking requests (at most STREAM_IN_FLIGHT answers wait for it): a client reads its answers
while it writes (tritonclient does, on a thread of its own); one that writes all its requests before
reading any stalls once gRPC's flow-control windows are full (large messages: about 64 of them). An
answer that cannot be sent within STREAM_SEND_LIMIT_S (10 minutes) ends the stream
DEADLINE_EXCEEDED, its requests in flight cancelled and the answers not sent dropped: a client that
reads nothing no longer holds them in the server's memory for as long as its connection lives.
When the service stops, an open stream takes no more requests and ends UNAVAILABLE once those taken
are answered.

Every model has one version, "1" ("" names it too). An infer request is checked against the model's
declared inputs and outputs before any of its data is decoded, as Triton checks it: each declared
input given once with the declared datatype, rank and fixed dimensions, no other input, and only
declared outputs asked for - INVALID_ARGUMENT naming the input, what was expected and what came. So is
a tensor parameter asking for what this server does not do (an output's `classification`, a shared-memory
region): ignored, the client would read an answer it did not ask for.

A world model (an elastic tenant: `elastic` in its config) generates frames in a world session
(`residency.v1.WorldSession/Run`), never by ModelInfer, which refuses it. So its ModelMetadata declares
no inputs and no outputs (a stock client building its request from the metadata was told to send an
`actions` tensor, then refused) and names the platform `WORLD_PLATFORM`, not its adapter's; the
index's reason for one off its device says a world session loads it. ModelReady and RepositoryIndex
answer it as any model: whether it is on its device, ready to serve (its sessions).

ModelConfig answers Triton's config cut to what this server knows: name, platform (as ModelMetadata's),
max_batch_size 0 (the declared shapes are the whole shapes a request sends; the service batches
requests itself) and the declared inputs and outputs (BYTES is Triton's TYPE_STRING). ModelStatistics
counts, per model, the ModelInfer calls answered since the service started (`InferStats`): successes
and failures (any error after the model was found, a refused request included) with their time from
arrival to answer, the queue (the wait from admission to the run: room, a cold start's load) and the
device host's compute time of each success; inference_count and execution_count are the successes (one
call on the device host each, as the service sees it); compute_input, compute_output, the cache
figures, batch_stats, memory_usage and response_stats are not measured: 0 or empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from manager.api.convert import MAX_ELEMENTS, decode_input, typed_count
from manager.api.errors import details_of, mapped, status_of
from manager.api.fastpath import caller_authorization, waited_s
from manager.api.handlers import not_a_message
from manager.api.runtime import authorization_of, call_wait_s, write_within
from manager.errors import (
    DeadlineExceeded,
    InsufficientCapacity,
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
    ResidencyError,
    Unsupported,
)
from manager.live import LiveManager, Served
from manager.live_persist import read_outcome
from manager.units import format_duration, parse_keep_alive, shown
from residency_proto.inference import grpc_service_pb2 as pb
from residency_proto.inference import grpc_service_pb2_grpc as pb_grpc

MODEL_INFER = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name["ModelInfer"]

VERSION = "0.1.0"
EXTENSIONS = [
    "model_repository",
    "model_configuration",
    "statistics",
    "schedule_policy",
    "parameters",
    "residency_class",
    "priority",
]
"""Triton's names for what is served (ModelConfig: model_configuration; ModelStatistics: statistics;
the `priority` and `timeout` parameters: schedule_policy; request parameters: parameters), then this
service's own (`residency_class`; `priority`, as it was listed before Triton's name was)."""
logger = logging.getLogger(__name__)

STREAM_IN_FLIGHT = 64
"""The requests of one ModelStreamInfer stream served at once; the next ones are read as these end."""
STREAM_SEND_LIMIT_S = 600.0
"""How long one ModelStreamInfer answer may wait to be sent (the client reads nothing: its receive
window is full) before the stream is ended DEADLINE_EXCEEDED, its requests in flight cancelled and its
answers not yet sent dropped. Without it such a client held up to STREAM_IN_FLIGHT answers (each up
to `server.max_request_bytes`) in the server's memory for as long as its connection lived. The world
stream's own limit is `server.world_idle_timeout` (10 minutes by default, as this one)."""
MAX_TIMEOUT_S = 86400.0
"""The longest a request's own `timeout` parameter may ask to wait (a day)."""
DEFAULT_TIMEOUT_S = MAX_TIMEOUT_S
"""A request with no deadline (no `timeout` parameter, or 0, and none on its call) waits as Triton's
does, without one of the server's (it was 60 s: a slow model's forward, or a cold load of minutes,
was cut off, blamed on a deadline the client never set); a day at most, its class's `max_wait` for
admission, and the client may cancel."""
VERSIONS = ("1",)
WORLD_PLATFORM = "residency/world-session"
"""A world model's ModelMetadata platform: served by `residency.v1.WorldSession/Run`, not ModelInfer
(other models' is `residency/<adapter>`)."""
WORLD_SESSION = "residency.v1.WorldSession/Run"
INLINE_DECODE_BYTES = 1 << 20
"""A request carrying more data than this is decoded in a worker thread, not on the event loop (16 MiB
of BYTES elements takes seconds of Python)."""


_DATA_TYPES: dict[str, pb.DataType] = {name: cast("pb.DataType", n) for name, n in pb.DataType.items()}


def data_type(datatype: str) -> pb.DataType:
    """An OIP datatype as Triton's config DataType (BYTES is TYPE_STRING); TYPE_INVALID for one
    Triton has not."""
    return _DATA_TYPES.get("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}", pb.TYPE_INVALID)


def _elapsed(s: float) -> str:
    """`s` seconds in a unit that shows them (a `timeout` of 1 µs was "0.000 s"): whole microseconds
    below a millisecond, milliseconds to a tenth below a second, else seconds to the millisecond."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.3f} s"


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(0, round(seconds * 1e9))

    def message(self) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=self.count, ns=self.ns)


@dataclass
class _ModelCalls:
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    last_ms: int = 0


class InferStats:
    """The ModelInfer calls answered per model (ModelStatistics), one set per manager: the servicers of
    its gRPC servers and of its front ends' fast path (`stats_of`) count into the same figures."""

    def __init__(self) -> None:
        self._models: dict[str, _ModelCalls] = {}

    def _of(self, model: str) -> _ModelCalls:
        calls = self._models.get(model)
        if calls is None:
            calls = self._models[model] = _ModelCalls()
        return calls

    def succeeded(self, model: str, took_s: float, wait_s: float, compute_s: float, now: float) -> None:
        calls = self._of(model)
        calls.success.add(took_s)
        calls.queue.add(wait_s)
        calls.compute_infer.add(compute_s)
        calls.last_ms = max(calls.last_ms, int(now * 1000))

    def failed(self, model: str, took_s: float, now: float) -> None:
        calls = self._of(model)
        calls.fail.add(took_s)
        calls.last_ms = max(calls.last_ms, int(now * 1000))

    def message(self, model: str) -> pb.ModelStatistics:
        calls = self._models.get(model) or _ModelCalls()
        n = calls.success.count
        return pb.ModelStatistics(
            name=model, version=VERSIONS[0], last_inference=calls.last_ms, inference_count=n,
            execution_count=n,
            inference_stats=pb.InferStatistics(
                success=calls.success.message(), fail=calls.fail.message(), queue=calls.queue.message(),
                compute_infer=calls.compute_infer.message(),
            ),
        )  # fmt: skip


_STATS: weakref.WeakKeyDictionary[LiveManager, InferStats] = weakref.WeakKeyDictionary()


def stats_of(manager: LiveManager) -> InferStats:
    """The ModelInfer figures of `manager`'s service (made at its first servicer); a manager that
    cannot be referenced weakly (a test's stand-in) gets figures of its own at each call."""
    try:
        stats = _STATS.get(manager)
        if stats is None:
            stats = _STATS[manager] = InferStats()
    except TypeError:
        return InferStats()
    return stats


def _one_repository(name: str) -> None:
    """Unsupported (UNIMPLEMENTED) for a `repository_name`, as Triton answers it: the service has
    one repository, its config; a call naming one acted on that one all the same."""
    if name:
        raise Unsupported(
            f"'repository_name' specification is not supported (got {shown(name, 60)}): the service has "
            "one model repository, its config file; leave repository_name empty"
        )


def _param(p: Any) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def check_version(model: str, version: str) -> None:
    """An empty version (the model's latest) or one of `VERSIONS`; any other is not found, as Triton
    answers it."""
    if version and version not in VERSIONS:
        raise ModelNotFound(f"model {model!r} has no version {version!r}; versions: {', '.join(VERSIONS)}")


def is_world(m: Any) -> bool:
    """Whether engine model `m` is a world model (an elastic tenant), served only in world sessions."""
    return m.cfg.elastic is not None


def _spec_str(t: Any) -> str:
    return f"{t.name} ({t.datatype} {list(t.shape)})"


STREAM_WRAP_BYTES = 64
"""What a ModelStreamInfer message adds to the response it carries, at most: its field's tag and
length (6 bytes) and Triton's `triton_final_response` flag (29): a response this much under
`server.max_request_bytes` still goes out in one message."""


def _final_flag_asked(request: pb.ModelInferRequest) -> bool:
    """tritonclient's `enable_empty_final_response`: the client waits for an answer flagged
    `triton_final_response` (Triton flags every answer of a model that is not decoupled)."""
    p = request.parameters.get("triton_enable_empty_final_response")
    return p is not None and _param(p) is True


def _stream_error(
    request: pb.ModelInferRequest, details: str, limit: int | None = None
) -> pb.ModelStreamInferResponse:
    """A failed request's answer on a ModelStreamInfer stream (Triton's: its `error_message`), naming
    the request it answers. Within `limit` bytes (gRPC's send limit, `server.max_request_bytes`): the
    answer repeats the request's id and model name, so a request near the limit made an answer past
    it, and gRPC ended the whole stream (RESOURCE_EXHAUSTED), losing the requests after it. What does
    not fit is cut: the id first (one that long is no one's key to match by), then the message, then
    the model name (each said cut by "…")."""
    answer = pb.ModelStreamInferResponse(
        error_message=details,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )
    if limit is None:
        return answer
    room = limit - STREAM_WRAP_BYTES
    r = answer.infer_response
    for get, put in (
        (lambda: r.id, lambda v: setattr(r, "id", v)),
        (lambda: answer.error_message, lambda v: setattr(answer, "error_message", v)),
        (lambda: r.model_name, lambda v: setattr(r, "model_name", v)),
    ):
        over = answer.ByteSize() - room
        if over <= 0:
            break
        text = get()
        keep = max(0, len(text.encode()) - over - 8)  # (8: the "…" and a varint length that shrinks)
        put(text.encode()[:keep].decode(errors="ignore") + "…")
    return answer


class _NotReading(Exception):
    """A ModelStreamInfer answer could not be sent within `waited_s` seconds: the client reads none."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(waited_s)
        self.waited_s = waited_s


async def _stream_ended(reader: asyncio.Future[bool], context: Any) -> None:
    """The request stream ended: OK when the client closed it; UNAVAILABLE when the service stops
    (the requests taken before are answered); a message that was not a request (or the stream
    broken) ends the call with its status."""
    try:
        stopped = await reader
    except ResidencyError as e:
        await context.abort(status_of(e), details_of(e))
    if stopped:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "the service is stopping: this stream takes no more requests (those it took were answered)",
        )


def check_class_claim(
    admin: Callable[[str], bool] | None,
    classes: list[str],
    m: Any,
    cls: str | None,
    authorization: str | None,
    asker: str,
    instead: str,
) -> None:
    """PermissionDenied when `asker` ("a request", "a session") asks class `cls` above its model `m`'s
    own while the service has an admin token (`admin`: whether a header holds it; None without one)
    and the call does not carry it: any app on the network could otherwise evict the voice models by
    naming the top class for its own model. Lowering its class, or asking its own, needs nothing;
    without a token (loopback) anything goes. `instead`: what to leave out, said in the message."""
    if admin is None or cls is None or cls not in classes:
        return  # (an unknown class is refused where it is read, naming it)
    if classes.index(cls) < m.rank and not admin(authorization or ""):
        raise PermissionDenied(
            f"model {m.name!r}: class {cls!r} is above its own ({classes[m.rank]!r}); {asker} asks a "
            f"higher class only with the admin token (authorization: Bearer <token>): send it, or "
            f"{instead}"
        )


def _keep_alive(request: pb.ModelInferRequest) -> float | None:
    """The request's own `keep_alive` parameter (Ollama's: how long the model stays loaded after this
    request), in seconds, inf for forever; None when absent. A string_param takes a duration ("10m",
    "0"), "forever", or a negative number ("-1": forever); an int64/uint64/double_param takes seconds
    (negative: forever). Anything else is refused by name."""
    if "keep_alive" not in request.parameters:
        return None
    v = _param(request.parameters["keep_alive"])
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise InvalidRequest(
            f"parameter 'keep_alive' must be a duration (string_param: '10m', '0', 'forever', '-1') or "
            f"seconds (int64_param, uint64_param or double_param), got {shown(v, 40)}"
        )
    try:
        return parse_keep_alive(v)
    except ValueError as e:
        raise InvalidRequest(f"parameter 'keep_alive': {e}") from None


def _check_parameters(model: str, where: str, tensor: Any) -> None:
    """An input's or a requested output's parameters: INVALID_ARGUMENT for those asking for what this
    server does not do (Triton's classification extension, shared-memory regions); others are the
    model's business, ignored as Triton ignores them."""
    for key in sorted(tensor.parameters):
        if key.startswith("shared_memory_"):
            instead = (
                "in raw_input_contents" if where == "input" else "from the response's raw_output_contents"
            )
            raise InvalidRequest(
                f"model {model!r} {where} {tensor.name!r}: parameter {key!r}: shared memory is not supported "
                f"by this server (it serves no SystemSharedMemory or CudaSharedMemory call); its data goes "
                f"{instead}"
            )
        if key == "classification" and where == "output":
            raise InvalidRequest(
                f"model {model!r} output {tensor.name!r}: parameter 'classification' (tritonclient's "
                "class_count): the classification extension is not supported by this server; ask for the "
                "output without it and rank its values yourself"
            )


def _over_items(request: pb.ModelInferRequest, declared: Sequence[Any]) -> str | None:
    """An input declaring more items than its model takes (`TensorSpec.items`' upper bound: 256 texts
    for the embedding model), said before its data is decoded: a request of a few MiB declaring
    millions of 2-byte texts cost ten times its size in memory, and seconds of CPU, to decode before
    the count refused it. (Other count problems are said after decoding, as before: a shape its data
    does not fill is said as that first.)"""
    specs = {s.name: s for s in declared}
    for t in request.inputs:
        spec = specs.get(t.name)
        if spec is None or spec.items is None or spec.items[1] is None or not len(t.shape):
            continue
        if any(d < 0 or d > MAX_ELEMENTS for d in t.shape):
            continue  # (a shape no tensor can have: said as that, by its decoding, before any data is read)
        if t.shape[0] > spec.items[1]:
            return str(spec.count_problem(list(t.shape)))
    return None


def check_request(request: pb.ModelInferRequest, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """The request's input names, datatypes and shapes and its requested outputs against the model's
    declared TensorSpecs (shape -1: any size); the element counts are checked as the data decodes."""
    model = request.model_name
    declared = {t.name: t for t in inputs}
    seen: set[str] = set()
    for t in request.inputs:
        spec = declared.get(t.name)
        if spec is None:
            raise InvalidRequest(
                f"model {model!r} has no input {t.name!r}; its inputs: "
                + (", ".join(_spec_str(s) for s in inputs) or "none")
            )
        if t.name in seen:
            raise InvalidRequest(f"model {model!r}: input {t.name!r} is given more than once")
        seen.add(t.name)
        if t.datatype != spec.datatype:
            raise InvalidRequest(
                f"model {model!r} input {t.name!r}: datatype {t.datatype!r}, expected {spec.datatype!r}"
            )
        shape = list(t.shape)
        if not spec.fits(shape):
            raise InvalidRequest(
                f"model {model!r} input {t.name!r}: shape {shape}, expected {list(spec.shape)} (-1: any)"
            )
    missing = [s for s in inputs if s.name not in seen]
    if missing:
        raise InvalidRequest(f"model {model!r}: missing input {', '.join(_spec_str(s) for s in missing)}")
    known = {t.name for t in outputs}
    unknown = [o.name for o in request.outputs if o.name not in known]
    if unknown:
        raise InvalidRequest(
            f"model {model!r} has no output {', '.join(map(repr, unknown))}; its outputs: "
            + (", ".join(t.name for t in outputs) or "none")
        )
    for t in request.inputs:
        _check_parameters(model, "input", t)
    for o in request.outputs:
        _check_parameters(model, "output", o)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        manager: LiveManager,
        describe: Any,
        max_response_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        stopping: asyncio.Event | None = None,
    ) -> None:
        self.manager = manager
        self.stopping = stopping if stopping is not None else asyncio.Event()
        """Set when the service stops: open ModelStreamInfer streams take no more requests and end
        (UNAVAILABLE) once those taken are answered, instead of holding the stop for its grace."""
        self.describe = describe  # model name -> (inputs, outputs) TensorSpecs, awaited
        self.classes = [c.name for c in manager.config.classes]
        self.max_response_bytes = max_response_bytes  # gRPC's send limit (server.max_request_bytes)
        self.clock = clock  # a call's time spent here (decoding its inputs) before its admission
        self.stats = stats_of(manager)
        self.stream_send_limit_s = STREAM_SEND_LIMIT_S
        """How long a ModelStreamInfer answer may wait to be sent (STREAM_SEND_LIMIT_S)."""
        self.admin: Callable[[str], bool] | None = None
        """Whether an `authorization` header holds the admin token (`AuthInterceptor.allows`); None
        when the service has none (loopback: every request may ask any class)."""

    @mapped
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @mapped
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.manager.started)

    @mapped
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        """Whether the model serves now. An unknown model or version is not ready, answered OK as
        Triton answers it (`InferenceServer::ModelIsReady`), so a stock client's `is_model_ready`
        returns False rather than raising; ModelMetadata and ModelInfer say NOT_FOUND with the names."""
        known = request.name in self.manager.engine.models
        if not known or (request.version and request.version not in VERSIONS):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.manager.serving(request.name))

    @mapped
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="residency", version=VERSION, extensions=EXTENSIONS)

    async def _declared(self, name: str, version: str) -> tuple[str, Sequence[Any], Sequence[Any]]:
        """A model's platform and its declared inputs and outputs (TensorSpecs), as ModelMetadata and
        ModelConfig answer them; NOT_FOUND for an unknown model or version."""
        m = self.manager._model(name)
        check_version(name, version)
        if is_world(m):  # ModelInfer refuses it: no tensors to build a request from
            return WORLD_PLATFORM, (), ()
        inputs, outputs = await self.describe(name)
        return f"residency/{m.cfg.adapter}", inputs, outputs

    @mapped
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        platform, inputs, outputs = await self._declared(request.name, request.version)
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name,
            versions=list(VERSIONS),
            platform=platform,
            inputs=[meta(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in inputs],
            outputs=[meta(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in outputs],
        )

    @mapped
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        """Triton's model config, cut to what this server knows (see the module's docstring)."""
        platform, inputs, outputs = await self._declared(request.name, request.version)
        return pb.ModelConfigResponse(
            config=pb.ModelConfig(
                name=request.name,
                platform=platform,
                max_batch_size=0,
                input=[
                    pb.ModelInput(name=t.name, data_type=data_type(t.datatype), dims=list(t.shape))
                    for t in inputs
                ],
                output=[
                    pb.ModelOutput(name=t.name, data_type=data_type(t.datatype), dims=list(t.shape))
                    for t in outputs
                ],
            )
        )

    @mapped
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        """One model's figures (`InferStats`), or every configured model's when no name is given (in
        the config's order, those never asked for with zeros), as Triton answers."""
        if request.name:
            self.manager._model(request.name)
            check_version(request.name, request.version)
            names = [request.name]
        else:
            names = list(self.manager.engine.models)
        return pb.ModelStatisticsResponse(model_stats=[self.stats.message(n) for n in names])

    def _class_of(self, request: pb.ModelInferRequest) -> str | None:
        params = request.parameters
        if not params:
            return None
        classes = self.classes
        if "residency_class" in params:
            cls = _param(params["residency_class"])
            if not isinstance(cls, str):
                raise InvalidRequest(
                    "parameter 'residency_class' must be a string (string_param) naming a class, got "
                    f"{shown(cls, 40)}; classes: {', '.join(classes)}"
                )
            if cls not in classes:  # said before its inputs are decoded, naming the parameter
                raise InvalidRequest(
                    f"parameter 'residency_class': unknown class {shown(cls, 40)}; classes: "
                    + ", ".join(classes)
                )
            return cls
        if "priority" in params:
            p = _param(params["priority"])
            if not isinstance(p, int) or isinstance(p, bool) or p < 0:
                raise InvalidRequest(f"parameter 'priority' must be a non-negative integer, got {p!r}")
            # 0, or a level above the classes: the model's own class (Triton's default priority level)
            return None if p == 0 or p > len(classes) else classes[p - 1]
        return None

    def _timeout(self, request: pb.ModelInferRequest, left: float | None) -> float:
        """The request's own `timeout` parameter (Triton's: whole microseconds; 0, as absent, is no
        timeout of its own), else the call's deadline, else DEFAULT_TIMEOUT_S. A malformed one is
        refused by name (it was ignored), and none outlasts the call's deadline or MAX_TIMEOUT_S
        (nor the class's max_wait, which admission keeps)."""
        by_call = DEFAULT_TIMEOUT_S if left is None else max(float(left) - 0.05, 0.01)
        if "timeout" not in request.parameters:
            return by_call
        us = _param(request.parameters["timeout"])
        if not isinstance(us, int) or isinstance(us, bool) or us < 0:
            raise InvalidRequest(
                f"parameter 'timeout' must be a positive integer of microseconds (int64 or uint64), or 0 "
                f"for no timeout of its own, got {shown(us, 40)}"
            )
        if us == 0:  # Triton's "no timeout": the call's deadline (or the default) still holds
            return by_call
        own = min(us / 1e6, MAX_TIMEOUT_S)
        return own if left is None else min(own, by_call)

    def _inputs(self, request: pb.ModelInferRequest, declared: Sequence[Any] = ()) -> dict[str, np.ndarray]:
        """The inputs decoded, and checked against the `declared` TensorSpecs' limits (the model's own:
        how many items, finite numbers, UTF-8 text), so a request its model refuses is refused before its
        admission: it neither loads the model nor counts as its demand."""
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(request.inputs):
            # Triton's rule: raw data for every input or for none (it cannot say whose entry is missing)
            typed = [t.name for t in request.inputs if typed_count(t.contents)]
            raise InvalidRequest(
                f"model {request.model_name!r}: {len(raw)} raw_input_contents for {len(request.inputs)} "
                f"inputs ({', '.join(repr(t.name) for t in request.inputs)}); raw_input_contents holds "
                "every input's data, one entry per input in their order, or none (each input's data then "
                "in its typed contents)"
                + (
                    ""
                    if not typed
                    else f": input {typed[0]!r} has typed contents beside raw data"
                    if len(typed) == 1
                    else f": inputs {', '.join(map(repr, typed))} have typed contents beside raw data"
                )
            )
        too_many = _over_items(request, declared)  # said before decoding (see there)
        if too_many:
            raise InvalidRequest(f"model {request.model_name!r}: {too_many}")
        out = {}
        for i, t in enumerate(request.inputs):
            try:
                out[t.name] = decode_input(
                    t.name, t.datatype, list(t.shape), raw[i] if raw else None, t.contents
                )
            except InvalidRequest as e:  # (as the checks before it do: on a stream, whose request it was)
                raise InvalidRequest(f"model {request.model_name!r} {e}") from None
        for spec in declared:  # (after decoding: a shape its data does not fill is said as that first)
            a = out.get(spec.name)
            if a is not None and (problem := spec.count_problem(a.shape) or spec.value_problem(a)):
                raise InvalidRequest(f"model {request.model_name!r}: {problem}")
        return out

    async def _decoded(
        self, request: pb.ModelInferRequest, declared: Sequence[Any] = ()
    ) -> dict[str, np.ndarray]:
        """The inputs as arrays, their values checked (`_inputs`); a large request's off the event loop,
        which would stall every other call meanwhile (the thread still shares the GIL, but the loop
        gets its turns)."""
        size = sum(len(r) for r in request.raw_input_contents)
        size += 8 * sum(typed_count(t.contents) for t in request.inputs)
        if size > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(self._inputs, request, declared)
        return self._inputs(request, declared)

    def _left(self, model: str, timeout_s: float, arrived: float) -> float:
        """What is left of the call's `timeout_s` (from its arrival) now that its inputs are decoded;
        DEADLINE_EXCEEDED, before the call is admitted or counted, when decoding took it all."""
        spent = max(0.0, self.clock() - arrived)
        if spent >= timeout_s:
            raise DeadlineExceeded(
                f"model {model!r}: receiving and decoding the request's inputs took {_elapsed(spent)}, "
                f"past its timeout ({_elapsed(timeout_s)}: its `timeout` parameter or the call's deadline); "
                "it was not run"
            )
        return timeout_s - spent

    @mapped
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        caller_authorization.set(authorization_of(context))
        return await self.infer(request, context.time_remaining())

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """An async generator (as `add_servicer` registers stream handlers) that yields nothing: its
        answers are written with `context.write`, each send bounded by `stream_send_limit_s` (an async
        generator's `yield` cannot be given a time limit)."""
        await self._stream(requests, context)
        return
        yield  # (never reached: it makes this an async generator)

    async def _stream(self, requests: AsyncIterator[pb.ModelInferRequest], context: Any) -> None:
        # the headers first, on their own: with the first answer they were one batch, held with it by a
        # client that reads nothing, and the status that ends its stream could not be sent after it
        await context.send_initial_metadata(())
        caller_authorization.set(authorization_of(context))  # (its requests' tasks copy the context)
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        room = asyncio.Semaphore(STREAM_IN_FLIGHT)
        serving: set[asyncio.Task[None]] = set()

        async def serve(request: pb.ModelInferRequest) -> None:
            try:
                answer = pb.ModelStreamInferResponse(
                    infer_response=await self.infer(request, context.time_remaining(), stream=True)
                )
            except ResidencyError as e:
                answer = _stream_error(request, details_of(e), self.max_response_bytes)
            except Exception:
                logger.exception("ModelStreamInfer: a request failed")
                why = "ModelStreamInfer: internal error (see the server log)"
                answer = _stream_error(request, why, self.max_response_bytes)
            if _final_flag_asked(request):  # Triton's: each answer of a non-decoupled model is final
                answer.infer_response.parameters["triton_final_response"].bool_param = True
            answers.put_nowait(answer)

        async def read() -> bool:
            """Take requests until the client closes its side (False) or the service stops (True)."""
            it = aiter(requests)
            stop = asyncio.ensure_future(self.stopping.wait())
            following: asyncio.Future[pb.ModelInferRequest] | None = None
            try:
                while True:
                    await room.acquire()  # given back once an answer is sent, not merely made
                    following = asyncio.ensure_future(anext(it))
                    # (gRPC may end a read cancelled under it with StopAsyncIteration, not CancelledError:
                    # marked read, as nothing awaits it then)
                    following.add_done_callback(read_outcome)
                    await asyncio.wait((following, stop), return_when=asyncio.FIRST_COMPLETED)
                    if not following.done():  # stopping: no more requests are taken
                        following.cancel()
                        return True
                    try:
                        request = following.result()
                    except StopAsyncIteration:
                        return False
                    task = asyncio.ensure_future(serve(request))
                    serving.add(task)
                    task.add_done_callback(serving.discard)
            finally:  # (a message that was not a request, or one over server.max_request_bytes, too:
                # the read raises its refusal, and those before it are answered first)
                stop.cancel()
                if following is not None and not following.done():  # the call ended under it
                    following.cancel()
                if serving:
                    await asyncio.wait(set(serving))
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        reader.add_done_callback(read_outcome)  # (its error is the status's; unread when the stream ends
        # otherwise, e.g. a refused message that a client reading nothing sent: asyncio would log it)
        try:
            while (answer := await answers.get()) is not None:
                await self._send(context, answer)
                room.release()
            await _stream_ended(reader, context)
        except _NotReading as e:
            reader.cancel()
            cancelled = sum(not t.done() for t in serving)
            for task in serving:  # (a cancelled one puts no answer)
                task.cancel()
            dropped = 0
            while not answers.empty():
                dropped += answers.get_nowait() is not None  # (None: the end of the requests)
            took = format_duration(e.waited_s)
            logger.info("ModelStreamInfer: the client read no answer for %s: its stream ended", took)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"ModelStreamInfer: the client read no answer for {took} (an answer could not be sent "
                f"within that time): the stream is ended, {cancelled} requests in flight cancelled and "
                f"{dropped} answers not sent dropped",
            )
        finally:
            reader.cancel()
            for task in serving:  # the client went away: its requests are not waited for
                task.cancel()

    async def _send(self, context: Any, answer: pb.ModelStreamInferResponse) -> None:
        """Write `answer` to the stream; _NotReading when gRPC's flow control held it past
        `stream_send_limit_s` (the write is then cancelled: it stays queued in gRPC, and reaches a
        client that reads again, as the status after it does)."""
        if not await write_within(context, answer, self.stream_send_limit_s):
            raise _NotReading(self.stream_send_limit_s)

    async def infer_raw(self, raw: bytes, seconds_left: float | None) -> tuple[int, str, bytes]:
        """ModelInfer for a gRPC front end (`manager.api.fastpath`): request bytes in, (status code,
        details, response bytes) out, errors mapped to status codes as the gRPC method maps them."""
        arrived = self.clock() - waited_s.get()  # its way from the front end, and parsing it, too
        try:
            request = pb.ModelInferRequest.FromString(raw)
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], not_a_message(MODEL_INFER, e), b""
        try:
            resp = await self.infer(request, seconds_left, arrived=arrived)
        except ResidencyError as e:
            return status_of(e).value[0], details_of(e), b""
        return 0, "", resp.SerializeToString()

    async def infer(
        self,
        request: pb.ModelInferRequest,
        seconds_left: float | None,
        *,
        arrived: float | None = None,
        stream: bool = False,
    ) -> pb.ModelInferResponse:
        """Serve one request. `seconds_left`: the call's deadline, as it stood at `arrived` (this
        servicer's clock; now when None); the request's timeout counts from then. `stream`: its
        answer goes out in a ModelStreamInfer message (STREAM_WRAP_BYTES more)."""
        arrived = self.clock() if arrived is None else arrived
        m = self.manager._model(request.model_name)
        try:
            resp, served = await self._serve(m, request, seconds_left, arrived, stream)
        except BaseException:  # its failures counted (ModelStatistics), whatever ended it
            self.stats.failed(request.model_name, self.clock() - arrived, self.manager.clock())
            raise
        self.stats.succeeded(
            request.model_name,
            self.clock() - arrived,
            served.wait_s,
            served.result.seconds,
            self.manager.clock(),
        )
        return resp

    async def _serve(
        self, m: Any, request: pb.ModelInferRequest, seconds_left: float | None, arrived: float, stream: bool
    ) -> tuple[pb.ModelInferResponse, Served]:
        check_version(request.model_name, request.model_version)
        if is_world(m):  # refused before admission: it would be loaded (evicting others)
            raise InvalidRequest(
                f"model {request.model_name!r} is a world model: it generates frames in a world session "
                f"({WORLD_SESSION}), not by ModelInfer"
            )
        declared_in, declared_out = await self.describe(request.model_name)
        check_request(request, declared_in, declared_out)
        timeout_s = self._timeout(request, seconds_left)
        cls = self._class_of(request)
        check_class_claim(
            self.admin, self.classes, m, cls, caller_authorization.get(), "a request",
            "leave `priority`/`residency_class` out",
        )  # fmt: skip
        keep_alive = _keep_alive(request)
        inputs = await self._decoded(request, declared_in)
        timeout_s = self._left(request.model_name, timeout_s, arrived)
        served = await self.manager.infer(
            request.model_name, inputs, cls=cls, timeout_s=timeout_s, keep_alive=keep_alive
        )
        wanted = {o.name for o in request.outputs}
        resp = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSIONS[0], id=request.id)
        # a device host labels a BF16 output (its bit patterns in uint16) BF16 itself; an older host's
        # result (carriers_labelled False) says UINT16, relabelled here from the declared outputs
        bf16: set[str] = set()
        if not served.result.carriers_labelled:
            bf16 = {t.name for t in declared_out if t.datatype == "BF16"}
        for name, (dtype, shape, raw) in served.result.outputs.items():
            if wanted and name not in wanted:
                continue
            if dtype == "UINT16" and name in bf16:  # the bytes are the same: only the label was wrong
                dtype = "BF16"
            resp.outputs.add(name=name, datatype=dtype, shape=list(shape))
            resp.raw_output_contents.append(raw)
        resp.parameters["residency_wait_s"].double_param = served.wait_s
        resp.parameters["residency_cold"].bool_param = served.cold
        limit = self.max_response_bytes
        if limit is not None and stream:  # (the stream's message holds it: gRPC refused one that
            limit -= STREAM_WRAP_BYTES  # fitted on its own, ending the whole stream)
        if limit is not None and (size := resp.ByteSize()) > limit:
            where = (
                f"in a stream's answer ({limit} bytes: server.max_request_bytes less its wrapping)"
                if stream
                else f"in one message (server.max_request_bytes: {limit})"
            )
            raise InsufficientCapacity(
                f"model {request.model_name!r}: the response is {size} bytes, more than this server sends "
                f"{where}; send fewer items per request"
                + (", or ask only for the outputs you need" if not wanted and len(resp.outputs) > 1 else "")
            )
        return resp, served

    @mapped
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        """Each model's state in Triton's words (READY, LOADING, UNAVAILABLE: a model off the GPU is
        UNAVAILABLE "unloaded", as Triton says it, with the tier that holds it, or goes to)."""
        _one_repository(request.repository_name)
        resp = pb.RepositoryIndexResponse()
        for name, live in self.manager.live.items():
            ready = self.manager.serving(name)
            if request.ready and not ready:
                continue
            if ready:
                state, reason = "READY", ""
            elif live.error:
                state, reason = "UNAVAILABLE", live.error
            elif live.loads_pending or name in self.manager._held_loads:  # (an abandoned load held)
                state, reason = "LOADING", ""
            else:  # "UNLOADED" was no state of Triton's: a client matching its states met an unknown one
                # (a world model's ModelInfer is refused, never loading it)
                by = (
                    f"a world session, {WORLD_SESSION},"
                    if is_world(self.manager.engine.models[name])
                    else "a request"
                )
                # the tier the books hold it in: where an unload under way takes it, not where it was
                tier = self.manager.engine.models[name].tier.name.lower()
                state, reason = "UNAVAILABLE", f"unloaded (in the {tier} tier; {by} loads it)"
            resp.models.add(name=name, version="1", state=state, reason=reason)
        return resp

    @mapped
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        _one_repository(request.repository_name)
        self.manager._model(request.model_name)
        if request.parameters:  # Triton's `config` override and `file:` contents: taken, they would be
            # ignored, and the client would believe the model now runs with them
            names = ", ".join(repr(k) for k in sorted(request.parameters))
            raise InvalidRequest(
                f"RepositoryModelLoad of {request.model_name!r}: parameters are not supported (got {names}); "
                "a model's configuration and files come from the service's config file (edit it, then "
                "residency.v1.Residency/ReloadConfig): a load only brings the configured model onto its GPU"
            )
        await self.manager.preload(request.model_name, "gpu", call_wait_s(context.time_remaining()))
        return pb.RepositoryModelLoadResponse()

    @mapped
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        _one_repository(request.repository_name)
        self.manager.evict(request.model_name, "disk")  # (an unknown one: NOT_FOUND naming the models)
        return pb.RepositoryModelUnloadResponse()
