"""Open Inference Protocol tensors <-> numpy arrays (the wire facts: docs/OIP_WIRE.md).

Inputs arrive as little-endian bytes in `raw_input_contents` (one entry per input, in order) or in
typed `contents`; BYTES elements are a 4-byte little-endian length followed by the bytes. Every
mismatch (unknown datatype, element count vs shape, raw length) raises InvalidRequest naming the
input and what was expected.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from manager.errors import InvalidRequest
from workers.protocol import OIP_DATATYPES

DTYPES: dict[str, Any] = {name: np.dtype(np_name).type for name, np_name in OIP_DATATYPES.items()}
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP16": "fp32_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}  # fmt: skip
MAX_ELEMENTS = 1 << 28


def _count(name: str, shape: list[int]) -> int:
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"input {name!r}: shape {shape} has a negative dimension")
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise InvalidRequest(f"input {name!r}: shape {shape} has {n} elements; the limit is {MAX_ELEMENTS}")
    return n


def decode_bytes(name: str, raw: bytes, n: int) -> np.ndarray:
    out, off = [], 0
    for i in range(n):
        if off + 4 > len(raw):
            raise InvalidRequest(f"input {name!r}: BYTES element {i} is cut short (raw data ended)")
        (ln,) = struct.unpack_from("<I", raw, off)
        off += 4
        if off + ln > len(raw):
            raise InvalidRequest(f"input {name!r}: BYTES element {i} claims {ln} bytes past the end")
        out.append(raw[off : off + ln])
        off += ln
    if off != len(raw):
        raise InvalidRequest(f"input {name!r}: {len(raw) - off} bytes left after {n} BYTES elements")
    return np.array(out, dtype=object)


def decode_input(name: str, datatype: str, shape: list[int], raw: bytes | None, contents: Any) -> np.ndarray:
    """One input tensor as a numpy array of its shape."""
    n = _count(name, shape)
    if datatype == "BYTES":
        arr = (
            decode_bytes(name, raw, n)
            if raw is not None
            else np.array(list(contents.bytes_contents), dtype=object)
        )
    elif datatype in DTYPES:
        dt = np.dtype(DTYPES[datatype]).newbyteorder("<")
        if raw is not None:
            if len(raw) != n * dt.itemsize:
                raise InvalidRequest(
                    f"input {name!r}: {len(raw)} raw bytes, expected {n * dt.itemsize} "
                    f"({n} x {datatype} for shape {shape})"
                )
            arr = np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="))
        else:
            arr = np.array(list(getattr(contents, CONTENTS_FIELD[datatype])), dtype=DTYPES[datatype])
    else:
        raise InvalidRequest(
            f"input {name!r}: unsupported datatype {datatype!r}; use one of BYTES, {', '.join(DTYPES)}"
        )
    if arr.size != n:
        raise InvalidRequest(f"input {name!r}: {arr.size} elements given, shape {shape} needs {n}")
    return arr.reshape(shape)
