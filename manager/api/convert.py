"""Open Inference Protocol tensors <-> numpy arrays (the wire facts: docs/OIP_WIRE.md).

Inputs arrive as little-endian bytes in `raw_input_contents` (one entry per input, in order) or in
typed `contents`; BYTES elements are a 4-byte little-endian length followed by the bytes. BF16 has no
typed field: it comes as raw bytes only (2 per element), and, numpy having no bfloat16, decodes to
its bit patterns in a uint16 array (`BF16_CARRIER`), which a model declaring BF16 reads as such. Every
mismatch (unknown datatype, element count vs shape, raw length, a typed value outside its datatype's
range, raw and typed data both given, typed values in another datatype's field) raises InvalidRequest
naming the input and what was expected.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from manager.errors import InvalidRequest
from workers.protocol import CARRIERS, OIP_DATATYPES

BF16_CARRIER = np.dtype(CARRIERS["BF16"]).type
"""How a BF16 tensor is held in numpy, which has no bfloat16 (`ml_dtypes` is no dependency): its bit
patterns, 2 bytes per element as on the wire (uint16: `workers.protocol.CARRIERS`)."""
DTYPES: dict[str, Any] = {name: np.dtype(np_name).type for name, np_name in OIP_DATATYPES.items()} | {
    "BF16": BF16_CARRIER
}
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP16": "fp32_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}  # fmt: skip
TYPED_FIELDS = tuple(dict.fromkeys(CONTENTS_FIELD.values()))
_WIRE_INTS = {
    "int_contents": np.int32,
    "uint_contents": np.uint32,
    "int64_contents": np.int64,
    "uint64_contents": np.uint64,
}
"""The integer contents fields' own wire types: what their values are read as before the range check
(as int64, an INT8 request's values took 8 bytes each, 10x the request's size in memory)."""
MAX_ELEMENTS = 1 << 28
_LEN = struct.Struct("<I")


def _count(name: str, shape: list[int]) -> int:
    for d in shape:
        if d < 0:
            raise InvalidRequest(f"input {name!r}: shape {shape} has a negative dimension")
        if d > MAX_ELEMENTS:  # even beside a 0: numpy cannot shape an array with such dimensions
            raise InvalidRequest(
                f"input {name!r}: shape {shape} has a dimension of {d}; the limit is {MAX_ELEMENTS}"
            )
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise InvalidRequest(f"input {name!r}: shape {shape} has {n} elements; the limit is {MAX_ELEMENTS}")
    # an empty tensor's other dimensions count too: numpy cannot shape an array whose non-zero
    # dimensions multiply past its index range ([0, 2**28, 2**28, 2**28] was a ValueError, INTERNAL)
    if n == 0 and (rest := math.prod(d for d in shape if d)) > MAX_ELEMENTS:
        raise InvalidRequest(
            f"input {name!r}: shape {shape} has no elements, but its non-zero dimensions multiply to "
            f"{rest}; the limit is {MAX_ELEMENTS}"
        )
    return n


def typed_count(contents: Any) -> int:
    """How many typed values an input's `contents` holds, over all its fields."""
    return sum(len(getattr(contents, f)) for f in TYPED_FIELDS)


def decode_bytes(name: str, raw: bytes, n: int) -> np.ndarray:
    if 4 * n > len(raw):  # each element has at least its 4-byte length: refuse before any work
        raise InvalidRequest(
            f"input {name!r}: {n} BYTES elements need at least {4 * n} raw bytes, got {len(raw)}"
        )
    out, off = [], 0
    unpack = _LEN.unpack_from
    for i in range(n):
        if off + 4 > len(raw):
            raise InvalidRequest(f"input {name!r}: BYTES element {i} is cut short (raw data ended)")
        (ln,) = unpack(raw, off)
        off += 4
        if off + ln > len(raw):
            raise InvalidRequest(f"input {name!r}: BYTES element {i} claims {ln} bytes past the end")
        out.append(raw[off : off + ln])
        off += ln
    if off != len(raw):
        raise InvalidRequest(f"input {name!r}: {len(raw) - off} bytes left after {n} BYTES elements")
    return np.array(out, dtype=object)


def _typed(name: str, datatype: str, values: Any) -> np.ndarray:
    """Typed contents as `datatype`'s array; a value the datatype cannot hold (UINT8 300, FP16 1e6)
    is the client's error, not a silent wrap or an overflow."""
    dt = np.dtype(DTYPES[datatype])

    def read(as_type: Any) -> np.ndarray:  # fromiter: about twice as fast as np.array(list(values))
        return np.fromiter(values, dtype=as_type, count=len(values))

    if dt.kind in "iu":
        wide = read(_WIRE_INTS[CONTENTS_FIELD[datatype]])
        info = np.iinfo(dt)
        out = (wide < info.min) | (wide > info.max)
        if out.any():
            raise InvalidRequest(
                f"input {name!r}: {datatype} contents hold {wide[out][0]}, outside {datatype}'s range "
                f"{info.min}..{info.max}"
            )
        return wide.astype(dt)
    if datatype == "FP16":
        wide = read(np.float32)
        with np.errstate(over="ignore"):
            arr = wide.astype(dt)
        out = np.isinf(arr) & np.isfinite(wide)
        if out.any():
            raise InvalidRequest(
                f"input {name!r}: FP16 contents hold {wide[out][0]}, beyond FP16's range (+-65504)"
            )
        return arr
    return read(dt)


def _check_bool_bytes(name: str, raw: bytes) -> None:
    """OIP's BOOL is one byte per element, 0 or 1: another byte decodes to a bool that kernels may
    read as that byte (refused before the request is admitted, and before a load for it)."""
    bad = np.flatnonzero(np.frombuffer(raw, np.uint8) > 1)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequest(
            f"input {name!r}: BOOL element {i} is the byte {raw[i]}; a BOOL element is the byte 0 "
            "(false) or 1 (true)"
        )


def decode_input(name: str, datatype: str, shape: list[int], raw: bytes | None, contents: Any) -> np.ndarray:
    """One input tensor as a numpy array of its shape."""
    n = _count(name, shape)
    if raw is not None and contents is not None and typed_count(contents):
        raise InvalidRequest(
            f"input {name!r}: has both raw_input_contents and typed contents; send its data in one of them"
        )
    if datatype not in DTYPES and datatype != "BYTES":
        raise InvalidRequest(
            f"input {name!r}: unsupported datatype {datatype!r}; use one of BYTES, {', '.join(DTYPES)}"
        )
    if raw is None and datatype == "BF16" and (n or (contents is not None and typed_count(contents))):
        # InferTensorContents has no 16-bit float field: fp32_contents would be rounded here, unasked
        raise InvalidRequest(
            f"input {name!r}: BF16 has no typed contents field; send its data in raw_input_contents "
            "(2 bytes per element, little-endian)"
        )
    if raw is None and datatype != "BF16":  # typed contents: the field and the count first
        field = CONTENTS_FIELD[datatype]
        given = len(getattr(contents, field))
        # values in another field would be dropped unread (an input's values are in one field)
        stray = next(((f, k) for f in TYPED_FIELDS if f != field and (k := len(getattr(contents, f)))), None)
        where = (
            ""
            if stray is None
            else f"contents.{stray[0]} holds {stray[1]} value{'s' if stray[1] != 1 else ''}, but {datatype} "
            f"values go in contents.{field}"
        )
        if given != n:
            raise InvalidRequest(
                f"input {name!r}: {given} elements given in contents.{field}, shape {shape} needs {n}"
                + (f" ({where})" if where else "")
            )
        if where:
            raise InvalidRequest(f"input {name!r}: {where}")
    if datatype == "BYTES":
        arr = (
            decode_bytes(name, raw, n)
            if raw is not None
            else np.array(list(contents.bytes_contents), dtype=object)
        )
    else:
        dt = np.dtype(DTYPES[datatype]).newbyteorder("<")
        if raw is not None:
            if len(raw) != n * dt.itemsize:
                raise InvalidRequest(
                    f"input {name!r}: {len(raw)} raw bytes, expected {n * dt.itemsize} "
                    f"({n} x {datatype} for shape {shape})"
                )
            if datatype == "BOOL":
                _check_bool_bytes(name, raw)
            arr = np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="))
        elif datatype == "BF16":  # no elements (refused above otherwise)
            arr = np.zeros(0, BF16_CARRIER)
        else:
            arr = _typed(name, datatype, getattr(contents, CONTENTS_FIELD[datatype]))
    return arr.reshape(shape)
