"""Review 17: an output in a big-endian dtype keeps its datatype.

`encode_output` looked the OIP datatype up by the dtype's text, which for a big-endian array is
'>i4', not 'int32': an INT32 (or UINT64, FP16, ...) output held big-endian (read from a file with
numpy's '>' dtypes, say) went to the client as FP32, its values converted, its datatype not the
one the model declares. It goes as its own datatype now, its bytes little-endian as OIP sends them.
"""

from __future__ import annotations

import numpy as np
import pytest

from workers import protocol as P


@pytest.mark.parametrize(
    ("dtype", "datatype", "values"),
    [
        (">i4", "INT32", [-2, 7]),
        (">u8", "UINT64", [2**64 - 1, 0]),
        (">i8", "INT64", [-(2**63), 2**63 - 1]),
        (">f2", "FP16", [1.5, -65504.0]),
        (">f4", "FP32", [0.25, -3.0]),
        (">f8", "FP64", [1e300, -0.5]),
        (">u2", "UINT16", [65535, 1]),
    ],
)
def test_a_big_endian_output_keeps_its_datatype(dtype: str, datatype: str, values: list[float]) -> None:
    a = np.array(values, dtype=dtype)
    entry = P.encode_output(a)
    assert entry[:2] == (datatype, (2,))
    assert entry[2] == a.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert P.output_array(entry).tolist() == a.tolist()


def test_a_native_output_is_unchanged() -> None:
    a = np.array([[1, 2], [3, 4]], dtype=np.int32)
    assert P.encode_output(a) == ("INT32", (2, 2), a.astype("<i4").tobytes())
