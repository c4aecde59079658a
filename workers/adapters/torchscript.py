"""TorchScript models (`adapter: torchscript`, `source: {path: model.pt}`), and silero-vad.

The host tier holds the archive's bytes; materialize deserializes it straight onto the device
(`deserialize`, with `map_location`: a traced module's tensor constants live in its graph, where
`Module.to` never moves them); demote serializes the module back into bytes.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import io
import os
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers import protocol as P
from workers.adapters.base import Adapter, AdapterError, HostCopy, one_line
from workers.adapters.safetensors_module import _compute_dtype
from workers.measure import Phases, tensor_bytes
from workers.st_io import CheckpointError, open_regular

MAX_RANK = 8
"""The most dimensions `source.input_shape` / `output_shape` may declare."""


class TorchScriptAdapter(Adapter):
    """A TorchScript archive; one FP32 input `input`, one FP32 output `output`: the tensor its forward
    returns, or the first of a tuple it returns. Their shapes are `source.input_shape` and
    `source.output_shape` (lists of dimensions, -1 for any: `[-1, 3, 224, 224]` for a batch of
    images), by default `[-1, -1]` (a batch of vectors): an archive's forward does not say its
    ranks, and ModelInfer checks each request against the declared one. An archive whose float
    parameters share one other dtype (saved in fp16, bf16 or fp64) is given the input in that dtype."""

    name = "torchscript"
    batchable = True

    def path(self) -> Path:
        return Path(self.source_str("path"))

    def disk_paths(self) -> list[Path]:
        return [self.path()]

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("input", "FP32", self._shape("input_shape"))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("output", "FP32", self._shape("output_shape"))]

    def _shape(self, key: str) -> tuple[int, ...]:
        """`source.<key>` as a shape, `(-1, -1)` when not given; BAD_CHECKPOINT naming the model and
        the key when it is not a list of 1 to MAX_RANK dimensions, each positive or -1."""
        v = self.source_value(key)
        if v is None:
            return (-1, -1)
        ok = isinstance(v, list | tuple) and 1 <= len(v) <= MAX_RANK
        if not ok or not all(type(d) is int and (d == -1 or d > 0) for d in v):
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {self.spec.name!r}: source.{key} must be a list of 1 to {MAX_RANK} dimensions, each "
                f"positive or -1 (any), like [-1, 3, 224, 224]; got {v!r}",
            )
        return tuple(v)

    def read(self, ph: Phases) -> HostCopy:
        self.inputs(), self.outputs()  # a bad declared shape fails the load, naming it
        path = self.path()
        with ph.phase("read"):
            try:
                # the size is the open file's (fstat), and the read is from that file: a file renamed
                # over the path between a stat of the path and its open was read at the size of the
                # other one (cut short, or a short read); one rewritten in place is seen by its stat
                # (opened without waiting: a FIFO held the load, and every later one, for good)
                with open_regular(path, "a TorchScript archive") as f:
                    before = os.fstat(f.fileno())
                    blob = torch.empty(before.st_size, dtype=torch.uint8)
                    got = _read_into(f, memoryview(blob.numpy()).cast("B"))  # type: ignore[arg-type]
                    more = f.read(1)
                    after = os.fstat(f.fileno())
            except CheckpointError as e:  # not a regular file (a FIFO, a device)
                raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {e}") from None
            except FileNotFoundError:
                raise AdapterError(
                    P.MISSING_CHECKPOINT, f"model {self.spec.name!r}: {path}: no such file"
                ) from None
            except IsADirectoryError:
                raise AdapterError(
                    P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {path} is a directory"
                ) from None
            except OSError as e:  # permission denied, an I/O error of the disk, a name too long
                raise AdapterError(
                    P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {path}: cannot be read ({e.strerror or e})"
                ) from None
            except ValueError:  # (INTERNAL before, not naming the file)
                raise AdapterError(
                    P.BAD_CHECKPOINT,
                    f"model {self.spec.name!r}: {str(path)!r} is not a file name (it holds a NUL byte)",
                ) from None
            if got != before.st_size or more or _changed(before, after):
                raise AdapterError(
                    P.BAD_CHECKPOINT,
                    f"model {self.spec.name!r}: {path}: changed while being read ({before.st_size} "
                    f"bytes when opened, {after.st_size} after its read); try again",
                )
        return HostCopy(blob=blob)

    def check_host_copy(self, host: HostCopy, ph: Phases) -> None:
        """The bytes read for the host tier are a TorchScript archive (a zip holding a pickled module
        and its code), read from its directory without deserializing it: a file that is not one was
        held in host RAM, said loaded, and failed only at its promote."""
        assert host.blob is not None
        with ph.phase("deserialize"):
            try:
                with zipfile.ZipFile(io.BufferedReader(_BlobReader(host.blob))) as z:
                    names = z.namelist()
            except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
                why = f"not a zip archive ({e})"
            else:
                ok = any(n.endswith("/data.pkl") for n in names) and any("/code/" in n for n in names)
                why = "" if ok else "a zip archive without a pickled module and its code (data.pkl, code/)"
            if why:
                raise AdapterError(
                    P.BAD_CHECKPOINT,
                    f"model {self.spec.name!r}: {self.path()}: not a TorchScript archive: {why}",
                )

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        assert host.blob is not None
        with ph.phase("deserialize"):
            try:
                with warnings.catch_warnings():  # torch 2.13 marks TorchScript deprecated; it still loads
                    warnings.simplefilter("ignore")
                    data = io.BytesIO(host.blob.numpy().tobytes())
                    module = torch.jit.load(data, map_location=self.device)  # type: ignore[no-untyped-call]
            except Exception as e:  # the file read is named (a message naming the model only before)
                raise AdapterError(
                    P.BAD_CHECKPOINT,
                    f"model {self.spec.name!r}: {self.path()}: not a TorchScript archive: {e}",
                ) from None
            module.eval()
        with ph.phase("to_device"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies map_location queued
        return module

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        with ph.phase("to_device"):
            buf = io.BytesIO()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.jit.save(runnable, buf)
            data = buf.getbuffer()
            blob = torch.empty(len(data), dtype=torch.uint8)
            blob.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            del data
        return HostCopy(blob=blob)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """A call of the module: what it raises on its input is BAD_INPUT naming the model, in one line.

        An error raised inside the TorchScript interpreter (a `raise` or `assert` in the scripted
        code: `torch.jit.Error`, which is not a RuntimeError, as torch's own errors there are) carries
        the interpreter's traceback of the model's source; the client is told its last line only."""
        try:
            yield
        except (RuntimeError, ValueError, TypeError, IndexError, torch.jit.Error) as e:
            raise AdapterError(
                P.BAD_INPUT, f"model {self.spec.name!r}: inference failed: {one_line(e)}"
            ) from None

    def runnable_bytes(self, runnable: Any) -> int:
        # a traced module's tensors captured as constants live in its graphs, not in its parameters or
        # buffers: such a model was measured (and written to the config) as taking 0 bytes
        return tensor_bytes([*runnable.parameters(), *runnable.buffers(), *_graph_constants(runnable)])

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = self.input_array(inputs, self.inputs()[0])
        t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32), device=self.device)
        compute = _compute_dtype(runnable)
        if compute is not None and compute != t.dtype:
            # an archive saved in fp16, bf16 or fp64 failed every request BAD_INPUT ("mat1 and mat2 must
            # have the same dtype"), though FP32 is all it declares: its input goes in as its weights'
            # dtype, as a safetensors-module's does, and its output comes back as FP32
            t = t.to(compute)
        with torch.inference_mode(), self.calling():
            y = runnable(t)
        first = y[0] if isinstance(y, tuple | list) and y else y  # (output, extras...): its first, as
        if not isinstance(first, torch.Tensor):  # safetensors-module takes one declared output
            # a dict or None failed INTERNAL with a bare AttributeError (and a traceback) every request
            raise AdapterError(
                P.INTERNAL,
                f"model {self.spec.name!r}: the TorchScript module returned {type(y).__name__}"
                f"{'' if first is y else f' of {type(first).__name__}, ...'}; this adapter serves one "
                "tensor as 'output' (a tensor, or a tuple whose first item is one)",
            )
        if first.is_complex():  # `.float()` below kept its real part alone (a warning in the log)
            raise AdapterError(P.INTERNAL, P.complex_output(self.spec.name, "output", first.dtype))
        want = self.outputs()[0]
        if not want.fits(first.shape):  # (undeclared: the default [-1, -1], as its metadata says)
            says = (
                f"source.output_shape declares {list(want.shape)} (-1: any)"
                if self.has_source("output_shape")
                else f"source.output_shape is not set, and the default is {list(want.shape)} "
                f"(rank {len(want.shape)}): set it to the shape the module returns"
            )
            raise AdapterError(
                P.INTERNAL,
                f"model {self.spec.name!r}: the TorchScript module returned output of shape "
                f"{list(first.shape)}; {says}",
            )
        return {"output": first.detach().float().cpu().numpy()}


class _BlobReader(io.RawIOBase):
    """A seekable read-only file over a uint8 tensor's bytes (no copy of them)."""

    def __init__(self, blob: torch.Tensor) -> None:
        super().__init__()
        self._view = memoryview(blob.numpy()).cast("B")  # type: ignore[arg-type]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(b)]
        memoryview(b).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _read_into(f: Any, view: memoryview) -> int:
    """Read the open file `f` into `view` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _changed(before: os.stat_result, after: os.stat_result) -> bool:
    """The open file was written to between two of its stats (its size or modification time)."""
    return (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns)


def _graph_constants(module: Any) -> list[torch.Tensor]:
    """The tensor constants in the graphs of a TorchScript module's methods (and its submodules')."""
    out: list[torch.Tensor] = []
    try:
        for sub in module.modules():
            c = getattr(sub, "_c", None)
            if c is None:
                continue
            for name in c._method_names():
                for node in c._get_method(name).graph.findAllNodes("prim::Constant"):
                    if node.hasAttribute("value") and node.kindOf("value") == "t":
                        out.append(node.t("value"))
    except (AttributeError, RuntimeError):  # not a TorchScript module this torch can walk: params only
        return out
    return out


SILERO_CHUNK = 512
SILERO_RATE = 16000


class SileroVadAdapter(TorchScriptAdapter):
    """silero-vad, the real voice-activity model shipped in its PyPI package (loads offline).

    Input `audio`: FP32 [N], mono 16 kHz samples (N a multiple of 512; at most 60 s). Output
    `speech_prob`: FP32 [N / 512], the speech probability of each 32 ms chunk. The model is stateful
    across chunks; its state is reset at the start of each request.
    """

    name = "silero-vad"
    batchable = False  # stateful across chunks: one stream per call
    MAX_SAMPLES = 60 * SILERO_RATE

    def path(self) -> Path:
        if self.has_source("path"):
            return Path(self.source_str("path"))
        threads = torch.get_num_threads()
        try:
            return Path(str(importlib.resources.files("silero_vad.data").joinpath("silero_vad.jit")))
        except ModuleNotFoundError:
            raise AdapterError(
                P.MISSING_CHECKPOINT,
                f"model {self.spec.name!r}: the silero-vad package is not installed (pip install silero-vad)",
            ) from None
        finally:
            # importing silero_vad calls torch.set_num_threads(1) for the whole process: every other
            # model on a CPU device host would run on one core from then on
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def inputs(self) -> list[P.TensorSpec]:
        return [
            P.TensorSpec(
                "audio", "FP32", (-1,), items=(1, self.MAX_SAMPLES), multiple_of=SILERO_CHUNK, finite=True,
                unit="samples", about="PCM samples in [-1, 1] (mono, 16 kHz)",
            )
        ]  # fmt: skip

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("speech_prob", "FP32", (-1,))]

    def warmup(self, runnable: Any) -> None:
        try:
            self.infer(runnable, {"audio": np.zeros(SILERO_CHUNK, dtype=np.float32)})
        except Exception as e:  # another TorchScript archive (no reset_states, another signature)
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {self.spec.name!r}: {self.path()}: not a silero-vad model (its warm-up failed: "
                f"{getattr(e, 'message', None) or e!r})",
            ) from None

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # a positive multiple of SILERO_CHUNK samples, at most MAX_SAMPLES, each finite
        a = self.input_array(inputs, self.inputs()[0])
        x = torch.as_tensor(np.ascontiguousarray(a, dtype=np.float32), device=self.device)
        probs = []
        with torch.inference_mode(), self.calling():
            runnable.reset_states()
            for chunk in x.view(-1, SILERO_CHUNK):
                probs.append(runnable(chunk.unsqueeze(0), SILERO_RATE).reshape(()))
        out = torch.stack(probs).float().cpu().numpy()
        lost = np.flatnonzero(~np.isfinite(out))
        if lost.size:  # (finite samples far outside [-1, 1] overflow the model: its answer is NaN)
            raise AdapterError(
                P.BAD_INPUT,
                f"model {self.spec.name!r}: input 'audio' has samples up to {float(np.abs(a).max()):.3g} "
                f"in magnitude, and the model's answer from chunk {int(lost[0])} on is not a number; "
                "expected PCM samples in [-1, 1]",
            )
        return {"speech_prob": out}
