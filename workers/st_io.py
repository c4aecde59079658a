"""Safetensors files read straight into their destination, and the limits to compare against.

`read_safetensors` allocates one flat destination buffer for all tensors (pinned host memory when
CUDA is present), reads the file's data region straight into it (`readinto`, the default) or copies
it from a sequential-read-ahead mapping (`method="mmap"`), and hands out zero-copy views — so the
bytes cross memory once. `bench/load_path.py` compares both: readinto reaches the raw read's speed
cold and warm; the mmap copy is as fast warm but 0.56-0.88x cold here (page faults), hence the
default. `raw_read` is the limit: a plain sequential read of the same file. `cached_fraction` tells
how much of a file the OS page cache holds (mincore), and `drop_file_cache` asks the kernel to
forget it (posix_fadvise), which is how a cold load is measured without root.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# the other dtypes the reference writer (safetensors.torch.save_file) writes, where this torch has them
# (refused as "unsupported" before: a uint32 or complex tensor made the whole checkpoint unreadable)
for _name, _attr in (
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64"),
    ("F8_E8M0", "float8_e8m0fnu"),
):  # fmt: skip
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        DTYPES[_name] = getattr(torch, _attr)
MAX_HEADER = 100 * 1024 * 1024
MAX_DIM = 2**63
CHUNK = 64 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or not what it claims to be."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    data_offset: int
    data_bytes: int
    entries: tuple[Entry, ...]
    metadata: dict[str, str]


def _count(v: object) -> bool:
    """A JSON integer >= 0 (not a bool, a float or a string)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def open_regular(p: Path, kind: str = "a safetensors file") -> Any:
    """`p` opened for reading, as a binary file; CheckpointError when it is not a regular file. A
    FIFO at the path would hold the open (and the load, and every later load of the model, behind
    it) until something wrote into it: opened without waiting (O_NONBLOCK), then refused."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "not a regular file"
            )
            raise CheckpointError(f"{p}: is {what}, not {kind}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_header(path: str | Path) -> Header:
    """Read and check a safetensors header; CheckpointError names the file and what is wrong."""
    p = Path(path)
    try:
        with open_regular(p) as f:
            return _parse(f, p)
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise _os_error(p, e) from None


def _os_error(p: Path, e: OSError | ValueError) -> CheckpointError:
    if not isinstance(e, OSError):  # open's ValueError: a name with a NUL byte
        return CheckpointError(f"{str(p)!r} is not a file name (it holds a NUL byte)")
    if isinstance(e, FileNotFoundError):
        return CheckpointError(f"{p}: no such file")
    if isinstance(e, IsADirectoryError):
        return CheckpointError(f"{p}: is a directory, not a safetensors file")
    # permission denied, an I/O error of the disk
    return CheckpointError(f"{p}: cannot be read ({e.strerror or e})")


def _parse(f: Any, p: Path) -> Header:
    """The header of the open file `f` (at its start), checked against the file's size now."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{p}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{p}: not a safetensors file (header length {n} beyond the file)")
    raw = f.read(n)
    if len(raw) < n:
        raise CheckpointError(f"{p}: file ended inside its {n}-byte header (changed while being read?)")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{p}: header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{p}: header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: __metadata__ is not a JSON object")
    data_bytes = size - 8 - n
    entries = [_entry(p, name, info, data_bytes) for name, info in doc.items()]
    # Two tensors over the same bytes (a header lying about its offsets) would load as views of one
    # another: silently wrong weights. The reference reader refuses such a file; so does this one.
    spans = sorted((e.start, e.end, e.name) for e in entries if e.end > e.start)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CheckpointError(
                f"{p}: tensors {a!r} and {b!r} overlap in the file (data offsets; a corrupt header)"
            )
        if start_b > end_a:  # bytes no tensor reads: the reference reader refuses them too
            raise CheckpointError(
                f"{p}: {start_b - end_a} bytes between tensors {a!r} and {b!r} belong to no tensor "
                "(data offsets; a corrupt header)"
            )
    covered = spans[-1][1] if spans else 0
    first = spans[0][0] if spans else 0
    if first or covered != data_bytes:  # (each would be read and held in memory for nothing)
        where = (
            f"before the first tensor: {first}" if first else f"after the last tensor: {data_bytes - covered}"
        )
        raise CheckpointError(
            f"{p}: bytes that belong to no tensor {where} of its {data_bytes}-byte data region "
            "(a corrupt header, or data appended to the file)"
        )
    return Header(8 + n, data_bytes, tuple(entries), dict(meta))


def _entry(p: Path, name: str, info: Any, data_bytes: int) -> Entry:
    """The header's entry of tensor `name`, checked against the file's data region."""
    try:
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{p}: tensor {name!r}: malformed entry") from None
    # a size past int64 fails in torch (a zero-sized tensor passes the size check below)
    if not isinstance(info["shape"], list) or not all(_count(d) and d < MAX_DIM for d in shape):
        raise CheckpointError(
            f"{p}: tensor {name!r}: shape {info['shape']!r} is not a list of sizes >= 0 (and < 2**63)"
        )
    if not (_count(start) and _count(end)):
        raise CheckpointError(f"{p}: tensor {name!r}: data offsets {[start, end]!r} are not integers >= 0")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{p}: tensor {name!r}: unsupported dtype {dtype!r}")
    numel = span = 1
    for d in shape:
        numel *= int(d)
        span *= max(int(d), 1)
    if span >= MAX_DIM:  # (torch multiplies the sizes, a zero among them too: past int64 it fails)
        raise CheckpointError(f"{p}: tensor {name!r}: shape {info['shape']!r}: its sizes multiply past 2**63")
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if not (0 <= start <= end <= data_bytes) or end - start != numel * itemsize:
        raise CheckpointError(
            f"{p}: tensor {name!r}: data offsets {start}..{end} do not fit its shape or the file "
            f"(data region {data_bytes} bytes; truncated?)"
        )
    return Entry(name, dtype, shape, int(start), int(end))


def _views(buf: torch.Tensor, header: Header) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for e in header.entries:
        raw = buf[e.start : e.end]
        dt = DTYPES[e.dtype]
        try:
            t = raw.view(dt)
        except RuntimeError:  # misaligned offset: copy this one tensor into aligned memory
            t = raw.clone().view(dt)
        out[e.name] = t.reshape(e.shape)
    return out


def read_safetensors(
    path: str | Path, *, pin: bool = False, method: str = "read"
) -> tuple[dict[str, torch.Tensor], Header]:
    """All tensors of a safetensors file, read once into one owned (optionally pinned) buffer.

    `method="read"` (default) reads straight into the buffer; `method="mmap"` copies from a mapping
    (for the load-path benchmark only: as with any mapping, a file cut short while it is copied ends
    the process with SIGBUS, which Python cannot catch, where a read sees the short file and says so).
    The returned tensors are views into that buffer; they stay valid after the file is closed.
    """
    p = Path(path)
    try:
        # one open for the header and the data: a file replaced in between (renamed over) is not read
        # at the other version's offsets; one rewritten in place meanwhile is seen by its stat
        with open_regular(p) as f:
            before = os.fstat(f.fileno())
            header = _parse(f, p)
            buf = torch.empty(header.data_bytes, dtype=torch.uint8, pin_memory=pin)
            if header.data_bytes:
                if method == "mmap":
                    _copy_mmap(f.fileno(), header, buf)
                else:
                    f.seek(header.data_offset)
                    _readinto(f, buf, p)
            after = os.fstat(f.fileno())
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise _os_error(p, e) from None
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise CheckpointError(f"{p}: changed while being read (written to meanwhile); try again")
    return _views(buf, header), header


def _copy_mmap(fd: int, header: Header, buf: torch.Tensor) -> None:
    # One thread copies in file order: a multi-threaded copy faults a cold mapping at distant
    # offsets at once and defeats the kernel's sequential read-ahead (measured: 0.7x raw vs 1.0x).
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    try:
        mm.madvise(mmap.MADV_SEQUENTIAL)
        src = np.frombuffer(mm, dtype=np.uint8, count=header.data_bytes, offset=header.data_offset)
        dst = buf.numpy()
        for off in range(0, header.data_bytes, CHUNK):
            end = min(off + CHUNK, header.data_bytes)
            dst[off:end] = src[off:end]
        del src
    finally:
        mm.close()


def _readinto(f: Any, buf: torch.Tensor, path: str | Path) -> int:
    """Fill `buf` from `f` (read from `path`, which errors name: `f` may be opened from a descriptor)."""
    view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
    got = 0
    while got < len(view):
        n = f.readinto(view[got : got + CHUNK])
        if not n:
            raise CheckpointError(f"{path}: file ended after {got} of {len(view)} data bytes")
        got += n
    return got


def raw_read(path: str | Path) -> int:
    """Read a whole file sequentially into one preallocated buffer: the speed limit of any loader."""
    with open(path, "rb") as f:  # sized through the open file: what was sized is what is read
        buf = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        return _readinto(f, buf, path)


def drop_file_cache(path: str | Path) -> None:
    """Ask the kernel to drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc: Any = None


def cached_fraction(path: str | Path) -> float | None:
    """Share of a file's pages in the OS page cache (mincore), or None where it cannot be read."""
    global _libc
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if size == 0:
        return 1.0
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
    if not _libc:
        return None
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError:  # unreadable: the read that follows says why
        return None
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            # a file system without mmap (ENODEV: some FUSE and network mounts), or a file cut to 0
            # bytes meanwhile: not known, rather than a raise that failed the load reading it
            return None
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            addr = ctypes.addressof(anchor)
            vec = (ctypes.c_ubyte * pages)()
            rc = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
            del anchor
            if rc != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            mm.close()


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors with the reference writer (used by tests, benches and the demo models)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
