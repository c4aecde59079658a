"""`worldpager` command line.

    worldpager sizing --model {mg2,tiny,micro} --host-memory SIZE --codec {bf16,int8,int4}
                      [--usable 0.85] [--fps F] [--json]
    worldpager bench-stall [--quick] [--compute-s S] [--steps N] [--segment-size SIZE] [--codec C]
                           [--json] [--plot FILE.png]
    worldpager session [--preset {tiny,micro}] [--segments 150] [--host-memory 64MiB] [--codec C]
                       [--mode {prefetch,on_demand}] [--log-dir DIR [--resume [--resume-at STEP]]]
                       [--json]

Errors in what the user gave (a size, a fraction, a flag) print `worldpager: <message>` on stderr and
return 2, without a traceback; a run that fails on the machine (a session whose disk fills up) prints
`worldpager: <message>` and returns 1. Each subcommand registers itself in `build_parser` with a handler
`(args) -> int`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation, localcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from worldpager.mg2 import CODEC_BITS, DEFAULT_USABLE, PRESETS, ModelDims, sizing

if TYPE_CHECKING:  # (torch is imported only when a command needs it)
    from worldpager.session import Session

_BINARY_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DECIMAL_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS: dict[str, int] = {"": 1, "b": 1, **_BINARY_UNITS, **_DECIMAL_UNITS}
_SIZE_RE = re.compile(r"\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*")
_SIZE_HELP = "KiB/MiB/GiB/TiB (binary), kB/MB/GB/TB (decimal) or plain bytes, e.g. 32GiB, 1.5GiB, 30GB"
MAX_SIZE = 2**60
"""The largest size accepted (1,048,576 TiB), as in Residency's configs: sizes stay exact as floats
and int64s, so no arithmetic on them overflows."""
MAX_COUNT = 10**12
"""The largest count (segments, steps, k) accepted."""
MAX_COMPUTE_S = 86_400.0
"""The longest calibrated compute per step `bench-stall` accepts (a day)."""
MIN_COMPUTE_S = 0.001
"""The shortest (a millisecond): below it a sleep cannot calibrate the compute, the step's own work
(decode, re-rotation) outlasts it, and L grows without bound (1e-300 s gave L = 1e302 B/s, so every
"throttled" read ran unthrottled and no multiple of L showed a stall)."""
MIN_MULTIPLIER = 0.05
"""The smallest bandwidth `--multipliers` sweeps, as a multiple of L: each step's reads then take 20
compute times (under two minutes a sweep row at the defaults). Below it a sweep ran for hours
(1e-4), or failed with a traceback (1e-300: a sleep past the platform's time_t)."""


def _shown(text: object) -> str:
    """``repr`` of a given string (``str`` of a number), cut short when long: a value of hundreds of
    digits stays readable in a message."""
    if isinstance(text, str) and len(text) <= 40:
        return repr(text)
    shown = str(text)
    return shown if len(shown) <= 40 else f"{shown[:24]}... ({len(shown)} characters)"


class UsageError(Exception):
    """Bad input from the user: printed as `worldpager: <message>`, exit status 2."""


class RunError(Exception):
    """A run that failed on the machine (a full or vanished disk): printed as `worldpager: <message>`,
    exit status 1."""


def parse_size(text: str) -> int:
    """Bytes in a size such as "32GiB", "512MiB", "1.5GiB", "30GB", "4096" or "4096B".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (kB, MB, GB, TB) powers of
    1000; unit names are case-insensitive. A fractional size is rounded down to whole bytes. Raises
    ValueError unless the result is at least one byte and at most `MAX_SIZE`.
    """
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"bad size {_shown(text)}: expected a number and a unit ({_SIZE_HELP})")
    unit = m["unit"].lower()
    if unit not in _UNITS:
        raise ValueError(f"bad size {_shown(text)}: unknown unit {m['unit']!r} (expected {_SIZE_HELP})")
    too_big = f"bad size {_shown(text)}: expected at most {MAX_SIZE:,} bytes (1,048,576 TiB)"
    try:
        num = Decimal(m["num"])
        if num > MAX_SIZE:  # (before multiplying: a huge number of digits must not overflow Decimal)
            raise ValueError(too_big)
        with localcontext(prec=len(m["num"]) + 20):  # exact: the default 28 digits rounded up
            value = int(num * _UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise ValueError(f"bad size {_shown(text)}: expected a number and a unit ({_SIZE_HELP})") from None
    if value < 1:
        raise ValueError(f"bad size {_shown(text)}: expected at least 1 byte")
    if value > MAX_SIZE:
        raise ValueError(too_big)
    return value


def _float_arg(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a number") from None


# ---- sizing ---------------------------------------------------------------------------------------


def _scaled(n: int, base: int, units: Sequence[str]) -> str:
    value, i = float(n), 0
    while value >= base and i < len(units) - 1:
        value, i = value / base, i + 1
    return f"{value:,.1f} {units[i]}"


def _fmt_bytes(n: int) -> str:
    if n < 1000:
        return f"{n:,} B"
    decimal = _scaled(n, 1000, ("B", "kB", "MB", "GB", "TB"))
    binary = _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    return f"{n:,} B ({decimal}, {binary})"


def _fmt_seconds(s: float) -> str:
    return f"{s:,.2f} s ({s / 60:,.2f} min)"


def _sizing_text(model: str, dims: ModelDims, host_bytes: int, r: dict[str, Any]) -> str:
    seconds = f"{r['segment_seconds']:g} s at {r['fps']:g} fps"
    shape = f"{dims.layers} layers, dim {dims.dim}, {dims.tokens_per_segment} tokens/segment"
    rows = [
        ("model", f"{model} ({shape})"),
        ("codec", f"{r['codec']} ({r['bits_per_value']:g} bits/value)"),
        ("segment", _fmt_bytes(r["segment_bytes"])),
        ("segment video", f"{dims.video_frames_per_segment} frames = {seconds}"),
        ("host memory", _fmt_bytes(host_bytes)),
        ("host budget", f"{_fmt_bytes(r['host_budget_bytes'])} = {r['usable'] * 100:g} % usable"),
        ("segments in host", f"{r['segments_in_host']:,}"),
        ("memory", _fmt_seconds(r["memory_seconds"])),
        ("positional horizon", _fmt_seconds(r["positional_horizon_s"])),
        ("", f"(backbone RoPE table: {dims.rope_table_frames} latent frames)"),
        ("action horizon", _fmt_seconds(r["action_positional_horizon_s"])),
        ("", f"(action-module RoPE table: {dims.action_rope_table_frames} latent frames)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_sizing(args: argparse.Namespace) -> int:
    """`worldpager sizing`: how many segments (and seconds of video) a host budget holds."""
    try:
        host_bytes = parse_size(args.host_memory)
    except ValueError as e:
        raise UsageError(f"--host-memory: {e}") from None
    usable = _float_arg("--usable", args.usable)
    if not 0 < usable <= 1:  # (nan fails too)
        raise UsageError(f"--usable {_shown(args.usable)}: expected a fraction of the host budget in (0, 1]")
    dims = PRESETS[args.model]
    if args.fps is not None:
        try:
            dims = dataclasses.replace(dims, fps=_float_arg("--fps", args.fps))
        except ValueError as e:
            raise UsageError(f"--fps {_shown(args.fps)}: {e}") from None
    try:
        result = sizing(dims, host_bytes, args.codec, usable)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not all(math.isfinite(v) for v in result.values() if isinstance(v, float)):
        # a tiny (e.g. denormal) --fps: the durations overflow, and JSON has no infinity
        raise UsageError(f"--fps {args.fps}: too small, the durations overflow (expected frames per second)")
    if args.json:
        print(json.dumps(result))
    else:
        print(_sizing_text(args.model, dims, host_bytes, result))
    return 0


def _add_sizing(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "sizing",
        help="segment size, host-memory capacity and positional horizons",
        description="How many KV segments (and seconds of video) fit in a host-memory budget.",
    )
    p.add_argument("--model", choices=sorted(PRESETS), default="mg2", help="model dimensions (default mg2)")
    p.add_argument("--host-memory", required=True, metavar="SIZE", help=f"host budget: {_SIZE_HELP}")
    p.add_argument("--codec", required=True, choices=list(CODEC_BITS), help="how segment KV is stored")
    p.add_argument(
        "--usable",
        default=str(DEFAULT_USABLE),
        metavar="FRACTION",
        help=f"share of the budget that holds segments, in (0, 1] (default {DEFAULT_USABLE})",
    )
    p.add_argument(
        "--fps",
        default=None,
        metavar="F",
        help="video frame rate (default: the model's, 16 = Wan's native rate; MG2's exporter uses 12)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_sizing)


# ---- bench-stall ----------------------------------------------------------------------------------


def _positive(
    flag: str,
    text: str,
    kind: type[int] | type[float],
    maximum: float | None = None,
    minimum: float | None = None,
) -> float:
    """A positive finite number (a whole one for ``kind`` int), at least ``minimum`` when given and at
    most ``maximum`` (ints: `MAX_COUNT` by default); UsageError naming ``flag`` otherwise."""
    if maximum is None and kind is int:
        maximum = MAX_COUNT
    expected = "a positive whole number" if kind is int else "a positive finite number"
    if minimum is not None:
        expected += f" >= {minimum:g}" + (" and" if maximum is not None else "")
    if maximum is not None:
        expected += f" <= {maximum:,g}" if kind is float else f" <= {int(maximum):,}"
    try:
        value = kind(text)
    except ValueError:  # (also an int of more digits than Python converts)
        raise UsageError(f"{flag} {_shown(text)}: expected {expected}") from None
    finite = kind is int or math.isfinite(value)  # (isfinite overflows on a huge int)
    too_small = minimum is not None and value < minimum
    if not (value > 0 and finite) or too_small or (maximum is not None and value > maximum):
        raise UsageError(f"{flag} {_shown(text)}: expected {expected}")
    return value


def _plot_file(path: str) -> str:
    """The file a plot asked for as ``path`` is written to: matplotlib adds ".png" to a name without
    a suffix (the name said, before, was not the file written)."""
    return path if Path(path).suffix else f"{path}.png"


def _check_plot_path(path: str) -> None:
    """UsageError unless a plot can be written to ``path`` (its folder exists, the file can be
    written there, and matplotlib is there); an empty one (an unset shell variable) is refused, not
    taken for no plot. Checked before the benchmark runs: after it, its results went with it."""
    if not path:
        raise UsageError("--plot is empty: give the file to draw the plot in")
    parent = Path(path).parent
    try:
        if not parent.is_dir():
            raise UsageError(f"--plot {path}: no folder {str(parent)!r}")
        if Path(path).is_dir():
            raise UsageError(f"--plot {path}: a folder, expected a file name")
        target = Path(_plot_file(path))
        if target.is_dir():
            raise UsageError(f"--plot {path}: {target} is a folder")
        # writable, asked without touching it (no file made or opened: a link, a FIFO, a file another
        # process writes are left as they are): a read-only file or folder is said now, not after
        # the sweep
        if os.path.lexists(target):
            if target.is_file() and not os.access(target, os.W_OK):
                raise UsageError(f"--plot {path}: {target} cannot be written (permission denied)")
        elif not os.access(target.parent, os.W_OK | os.X_OK):
            raise UsageError(
                f"--plot {path}: no file can be made in {str(target.parent)!r} (permission denied)"
            )
    except OSError as e:  # (a name too long for the file system)
        raise UsageError(f"--plot {path}: {e.strerror or e}") from None
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise UsageError(f"--plot {path}: needs matplotlib ({e})") from None
    kinds = FigureCanvasBase.get_supported_filetypes()  # (what savefig takes from a name's suffix)
    suffix = Path(path).suffix[1:].lower()
    if suffix and suffix not in kinds:  # (refused now: after the run, its results were lost with it)
        raise UsageError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; give a name ending in one of "
            f"{', '.join('.' + k for k in sorted(kinds))} (none: .png)"
        )


def _size_arg(text: str | None, opts: dict[str, Any]) -> str:
    return text if text is not None else f"{opts['segment_bytes']}B (the default)"


def _check_bandwidths(opts: dict[str, Any]) -> None:
    """UsageError naming --compute-s / --multipliers when a swept bandwidth (multiplier x L) is 0 or
    infinite as a float (L = bytes fetched per step / compute time per step)."""
    from worldpager import stall

    limit = stall.limit_bytes_per_s(opts["segment_bytes"], opts["codec"], opts["k"], opts["compute_s"])
    if not 0 < limit < math.inf:
        raise UsageError(
            f"--compute-s {opts['compute_s']:g}: the bandwidth limit L (bytes per step / compute time) "
            "is not a finite positive number; use a larger --compute-s"
        )
    for m in opts.get("multipliers", stall.DEFAULT_MULTIPLIERS):
        if not 0 < m * limit < math.inf:
            raise UsageError(
                f"--multipliers {m:g}: {m:g} x L (L = {limit:g} bytes/s) is not a finite positive bandwidth"
            )


def _check_bench_room(args: argparse.Namespace, opts: dict[str, Any]) -> None:
    """UsageError naming --segment-size when the benchmark's segments cannot fit the memory available
    (the address-space limit included) or the temporary folder's free disk space."""
    import resource
    import shutil
    import tempfile

    import psutil

    from worldpager import stall

    memory, disk = stall.bench_needs(opts["segment_bytes"], opts["codec"], opts["segments"], opts["k"])
    available = int(psutil.virtual_memory().available)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:  # ulimit -v
        available = min(available, max(0, soft - int(psutil.Process().memory_info().vms)))
    size = _size_arg(args.segment_size, opts)
    if memory > available:
        raise UsageError(
            f"--segment-size {size}: the benchmark needs about {_fmt_bytes(memory)} of memory "
            f"({opts['segments']} segments in RAM plus buffers), only {_fmt_bytes(available)} is "
            "available; use a smaller --segment-size or fewer --segments"
        )
    folder = tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if disk > free:
        raise UsageError(
            f"--segment-size {size}: the benchmark's segment log needs about {_fmt_bytes(disk)} of "
            f"disk in {folder}, only {_fmt_bytes(free)} is free; use a smaller --segment-size or "
            "fewer --segments"
        )


def cmd_bench_stall(args: argparse.Namespace) -> int:
    """`worldpager bench-stall`: stall vs throttled NVMe bandwidth, prefetch vs on-demand."""
    from worldpager import stall  # torch: imported only when needed
    from worldpager.segment_log import SegmentLogError

    opts: dict[str, Any] = dict(stall.QUICK if args.quick else stall.DEFAULTS)
    if args.compute_s is not None:
        opts["compute_s"] = _positive("--compute-s", args.compute_s, float, MAX_COMPUTE_S, MIN_COMPUTE_S)
    if args.steps is not None:
        opts["steps"] = int(_positive("--steps", args.steps, int))
    if args.segments is not None:
        opts["segments"] = int(_positive("--segments", args.segments, int))
    if args.segment_size is not None:
        try:
            opts["segment_bytes"] = parse_size(args.segment_size)
        except ValueError as e:
            raise UsageError(f"--segment-size: {e}") from None
    if args.codec is not None:
        opts["codec"] = args.codec
    if args.k is not None:
        opts["k"] = int(_positive("--k", args.k, int))
    if args.multipliers is not None:
        opts["multipliers"] = [
            _positive("--multipliers", m, float, minimum=MIN_MULTIPLIER) for m in args.multipliers.split(",")
        ]
    if opts["segments"] < 4 * opts["k"]:
        why = "so that every retrieved segment misses host"
        if args.segments is None:  # the user gave --k only: name it, not a flag they never typed
            given = "--quick" if args.quick else "default"
            raise UsageError(
                f"--k {opts['k']}: needs at least {4 * opts['k']} segments (4 x --k) in the log ({why}); "
                f"it has {opts['segments']} by {given}: give --segments {4 * opts['k']} or more"
            )
        raise UsageError(
            f"--segments {opts['segments']}: expected at least 4 x --k = {4 * opts['k']} ({why})"
        )
    _check_bandwidths(opts)
    _check_bench_room(args, opts)
    if args.plot is not None:  # checked before the benchmark runs, not after
        _check_plot_path(args.plot)
    try:
        result = stall.run_bench(**opts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except (MemoryError, RuntimeError) as e:  # torch's CPU allocator fails with a RuntimeError
        if isinstance(e, RuntimeError) and "allocat" not in str(e):
            raise
        raise UsageError(
            f"--segment-size {_size_arg(args.segment_size, opts)}: out of memory building the "
            f"benchmark's segments ({e}); use a smaller --segment-size or fewer --segments"
        ) from None
    except (SegmentLogError, OSError) as e:  # a full or unwritable temporary folder
        raise UsageError(f"bench-stall: cannot write the benchmark's segment log: {e}") from None
    failed = _write_plot(result, args.plot) if args.plot else None
    print(json.dumps(result) if args.json else stall.text_table(result))  # (never lost with a plot)
    if not args.json and "plot" in result:  # (said as the README says; in --json, its "plot" key)
        print(f"plot: {result['plot']}")
    if failed is not None:
        raise RunError(failed)
    return 0


def _write_plot(result: dict[str, Any], path: str) -> str | None:
    """The plot of `result` written (its file in `result["plot"]`); what went wrong, if it failed."""
    from worldpager import stall

    target = _plot_file(path)
    try:
        stall.plot(result, target)
    except (OSError, ImportError, ValueError) as e:  # (the disk filled up meanwhile, say)
        return f"--plot {path}: {e}; the results are above"
    result["plot"] = target
    return None


def _add_bench_stall(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "bench-stall",
        help="stall vs NVMe bandwidth: prefetch vs on-demand (real files, throttled reads)",
        description="Every retrieved segment comes from NVMe through a bandwidth throttle; bandwidths "
        "sweep around L = bytes fetched per step / compute time per step.",
    )
    p.add_argument("--quick", action="store_true", help="a few-second run (for tests)")
    p.add_argument(
        "--compute-s",
        default=None,
        metavar="S",
        help=f"calibrated compute per step, {MIN_COMPUTE_S:g} to {MAX_COMPUTE_S:,g} s (default 0.2)",
    )
    p.add_argument("--steps", default=None, metavar="N", help="measured steps per mode and bandwidth")
    p.add_argument("--segments", default=None, metavar="N", help="segments in the log (>= 4k)")
    p.add_argument("--segment-size", default=None, metavar="SIZE", help="payload per segment (default 1MiB)")
    p.add_argument("--codec", default=None, choices=["bf16", "int8", "int4"], help="payload codec")
    p.add_argument("--k", default=None, metavar="K", help="segments retrieved per step (default 2)")
    p.add_argument("--multipliers", default=None, metavar="M,M,..", help="bandwidths as multiples of L")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a stall-vs-bandwidth plot")
    p.set_defaults(fn=cmd_bench_stall)


# ---- session --------------------------------------------------------------------------------------


def _why_unsaved(log_dir: str) -> str:
    """Why `read_saved_state` found no saved session in `log_dir`: its session.json is missing, cannot
    be read, is not JSON, or is not a saved session of this version."""
    from worldpager.segment_log import read_small_text
    from worldpager.session import SESSION_FILE

    path = Path(log_dir) / SESSION_FILE
    try:
        text = read_small_text(path)
    except FileNotFoundError:
        return f"no {SESSION_FILE}"
    except (OSError, ValueError) as e:  # (a folder of that name, no permission, not UTF-8)
        return f"{path} cannot be read: {getattr(e, 'strerror', None) or e}"
    try:
        json.loads(text)
    except (ValueError, RecursionError) as e:
        return f"{path} is damaged: not JSON ({e})"
    return f"{path} is not a session this version saved (its format or version differs)"


def _resume_settings(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--resume: the preset and codec to run (the saved session's unless given; UsageError when the
    saved session is missing, damaged, or ran another preset)."""
    from worldpager.session import SESSION_FILE, SESSION_PRESETS, read_saved_state
    from worldpager.session_store import config_dict

    preset, codec = args.preset, args.codec
    if not args.log_dir:
        raise UsageError("--resume needs --log-dir (the saved session's directory)")
    try:
        saved = read_saved_state(args.log_dir)
    except ValueError as e:  # a damaged session.json: named, not a traceback
        raise UsageError(f"--resume: {e}") from None
    if saved is None:
        raise UsageError(f"--resume: no saved session in {args.log_dir} ({_why_unsaved(args.log_dir)})")
    saved_preset = (saved.get("metadata") or {}).get("preset")
    named = isinstance(saved_preset, str) and saved_preset in SESSION_PRESETS
    if saved_preset is not None and not named:
        raise UsageError(
            f"--resume: {Path(args.log_dir) / SESSION_FILE}: metadata.preset is {_shown(saved_preset)}, "
            f"expected one of {', '.join(SESSION_PRESETS)}"
        )
    if preset is not None and saved_preset is not None and preset != saved_preset:
        raise UsageError(f"--preset {preset}: the saved session ran --preset {saved_preset}")
    if saved_preset is None:  # saved without one (a world session, a Session of one's own)
        ran_as = [n for n, cfg in SESSION_PRESETS.items() if config_dict(cfg.on_the_fly()) == saved["config"]]
        saved_preset = ran_as[0] if ran_as else None
        if saved_preset is None:
            raise UsageError(
                f"--resume: the session saved in {args.log_dir} ran a model that is none of the "
                f"presets ({', '.join(SESSION_PRESETS)}): resume it with the program that made it"
            )
        if preset is not None and preset != saved_preset:
            raise UsageError(f"--preset {preset}: the saved session ran --preset {saved_preset}")
    saved_codec = saved.get("codec")
    if codec is not None and saved_codec is not None and codec != saved_codec:
        raise UsageError(f"--codec {codec}: the saved session ran --codec {saved_codec} (leave --codec out)")
    seed, saved_seed = getattr(args, "seed", None), saved.get("seed")
    if seed is not None and saved_seed is not None and seed != saved_seed:
        raise UsageError(f"--seed {seed}: the saved session ran --seed {saved_seed} (leave --seed out)")
    return preset or saved_preset, codec or saved_codec


def _resume_at(args: argparse.Namespace) -> int | None:
    """--resume-at: the step to continue the saved session at, at the latest (None: where it stopped);
    UsageError without --resume, or for what is not a whole number in [0, MAX_COUNT]."""
    if args.resume_at is None:
        return None
    if not args.resume:
        raise UsageError("--resume-at needs --resume (it continues a saved session at that step)")
    try:
        step = int(args.resume_at)
    except ValueError:
        step = -1
    if not 0 <= step <= MAX_COUNT:
        raise UsageError(
            f"--resume-at {_shown(args.resume_at)}: expected a whole number in [0, {MAX_COUNT:,}]"
        )
    return step


def _host_budget(args: argparse.Namespace, host_memory: int, cap: int, seg_bytes: int) -> int:
    """The host tier's budget in bytes; UsageError when it cannot hold what one step needs there: the
    next step's retrieval set (protected while it is prepared) and the new segment. With less, new
    segments would go straight to the log and retrieved ones find no room to be read back.
    In ``prefetch`` mode the next step's set is read back while the running step still holds its
    own, so with fewer than 2k + 1 segments a retrieved segment may find no room and the step
    attends to fewer than on_demand would (counted in ``retrieval_unavailable``): a warning says so."""
    budget = min(host_memory, cap * seg_bytes) if cap else host_memory
    if budget < seg_bytes:
        raise UsageError(f"--host-memory {args.host_memory} is smaller than one segment ({seg_bytes} bytes)")
    need = args.retrieval_k + 1
    if budget // seg_bytes < need:
        given = f"--host-memory {args.host_memory}"
        if cap and cap * seg_bytes < host_memory:
            given = f"--host-segments {cap}"
        raise UsageError(
            f"{given}: the host tier holds {budget // seg_bytes} segment(s) of {seg_bytes} B; "
            f"--retrieval-k {args.retrieval_k} needs at least {need} (the next step's "
            f"{args.retrieval_k} retrieved segments and the new one): give at least {need * seg_bytes} bytes"
        )
    overlap = 2 * args.retrieval_k + 1  # the running step's set, the next one's, the new segment
    if args.mode == "prefetch" and args.retrieval_k and budget // seg_bytes < overlap:
        print(
            f"worldpager: warning: the host tier holds {budget // seg_bytes} segment(s) of {seg_bytes} B; "
            f"prefetch with --retrieval-k {args.retrieval_k} needs {overlap} (the running step's "
            f"{args.retrieval_k} retrieved segments, the next step's and the new one) to read back every "
            f"retrieved segment: with less a step may attend to fewer (see retrieval_unavailable); give "
            f"at least {overlap * seg_bytes} bytes",
            file=sys.stderr,
        )
    return budget


def _larger_preset_hint(preset: str, codec: str) -> str:
    """The preset with larger segments to suggest (its count per 64 MiB under ``codec``), or "" when
    ``preset`` already has the largest."""
    from worldpager.layout import SegmentLayout
    from worldpager.session import SESSION_PRESETS

    def seg(name: str) -> int:
        return SegmentLayout.from_config(SESSION_PRESETS[name].on_the_fly(), codec).payload_nbytes

    larger = [n for n in SESSION_PRESETS if seg(n) > seg(preset)]
    if not larger:
        return ""
    name = max(larger, key=seg)
    per_64 = (64 << 20) // seg(name)
    return (
        f" or a preset with larger segments (--preset {name}: {per_64} segments per 64 MiB "
        f"with --codec {codec})"
    )


def _no_read_back(
    result: dict[str, Any], budget: int, seg_bytes: int, total: int, preset: str, codec: str
) -> str:
    """Why no step read from NVMe (the CLI's ``read_back``), truthful about a resume's read-back;
    the hint names a larger preset only when there is one, with its count for ``codec``."""
    held = f"{budget // seg_bytes} segments of {seg_bytes} B"
    if result["resume_bytes_read"]:  # the reopening read saved segments back; no step did
        return (
            f"on resume only: {result['resume_bytes_read']} B of saved segments read back from the log "
            f"when the session reopened; no step read from NVMe after that ({held} in host)"
        )
    fits = budget // seg_bytes >= total
    why = "the host budget holds the whole session" if fits else "every revisit found its segment in host"
    return f"none: {why} ({held}); use a smaller --host-memory{_larger_preset_hint(preset, codec)}"


def _corrupt_slots(events: Sequence[object], log_file: Path) -> list[dict[str, Any]]:
    """The log slots a session found corrupt, each once: on reopening (`CorruptSlot`, segment None)
    and when a step read one back (a `Corrupt` event with its segment); one warning line each on
    stderr, naming the file and the slot."""
    from worldpager.page_types import Corrupt
    from worldpager.session import CorruptSlot

    found: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, CorruptSlot):
            found.append({"file": str(log_file), "slot": e.slot, "segment": None, "reason": e.reason})
        elif isinstance(e, Corrupt):
            reason = e.reason or "failed its check"
            found.append({"file": str(log_file), "slot": e.slot, "segment": e.seg_id, "reason": reason})
    for c in found:
        where = f"slot {c['slot']}" if c["slot"] is not None else "no slot"
        if c["segment"] is not None:
            where += f" (segment {c['segment']})"
        print(f"worldpager: warning: {c['file']}: {where}: {c['reason']} (never used)", file=sys.stderr)
    return found


def _host_segments_cap(text: str) -> int:
    """--host-segments: 0 (however spelled: "00", " 0") is no cap, else a positive whole number."""
    try:
        if int(text) == 0:
            return 0
    except ValueError:
        pass  # (named by _positive)
    return int(_positive("--host-segments", text, int))


def _check_log_dir(value: str) -> None:
    """--log-dir: UsageError when it is empty (an unset shell variable: the session would have run in
    a temporary folder and been deleted), or a file, or under a file."""
    if not value:
        raise UsageError("--log-dir is empty: give the folder to keep the session in")
    path = Path(value)
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"--log-dir {value}: is a file, expected a folder")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise UsageError(f"--log-dir {value}: {parent} is a file, not a folder")
                break
    except OSError as e:  # (a name too long for the file system)
        raise UsageError(f"--log-dir {value}: {e.strerror or e}") from None


def _os_error(e: OSError, log_dir: Path, resume: bool) -> str:
    """What the system refused of the session's folder, said with --log-dir and the file, not as
    Python's "[Errno 2] No such file or directory: 'D/segments.wplog'"."""
    from worldpager.segment_log import LOG_NAME

    name = Path(e.filename).name if e.filename else ""
    if resume and isinstance(e, FileNotFoundError) and name == LOG_NAME:
        return f"--resume: {log_dir} holds a saved session but no {LOG_NAME} (its log is missing)"
    what = f" ({name})" if name and Path(e.filename) != log_dir else ""
    return f"--log-dir {log_dir}: {e.strerror or e}{what}"


def _run_steps(session: Session, segments: int, kept_in: Path | None) -> None:
    """Run ``segments`` steps of ``session`` on its trajectory, then close (save) it; RunError naming
    the step or the save that failed on the machine (e.g. a full disk), never a traceback."""
    from worldpager.segment_log import SegmentLogError
    from worldpager.trajectory import yaw_sweep

    first = session.step_index
    failed: str | None = None
    try:
        for pose in itertools.islice(yaw_sweep(seed=session.seed), first, first + segments):
            session.step(pose)  # (not run(): that would collect every step's record)
    except (OSError, SegmentLogError) as e:
        failed = f"step {session.step_index} failed: {e}"
    finally:
        try:
            session.close()  # saves the session (session.json, window.bin) for --resume
        except (OSError, SegmentLogError) as e:
            failed = failed or f"saving the session when it closed failed: {e}"
    if failed is not None:
        kept = f"; the segments its log holds stay in {kept_in}" if kept_in is not None else ""
        raise RunError(f"session: {failed}{kept}")


def cmd_session(args: argparse.Namespace) -> int:
    """`worldpager session`: a real stand-in session through GPU buffers, host and the NVMe log."""
    import tempfile

    from worldpager.layout import SegmentLayout
    from worldpager.model import TinyCausalWan
    from worldpager.segment_log import LOG_NAME, LogFullError, SegmentLogError, is_disk_full
    from worldpager.session import SESSION_PRESETS, Session, WindowLostError

    try:
        host_memory = parse_size(args.host_memory)
    except ValueError as e:
        raise UsageError(f"--host-memory: {e}") from None
    segments = int(_positive("--segments", args.segments, int))
    cap = _host_segments_cap(args.host_segments)
    warmup = args.warmup_segments
    if warmup is not None and warmup < 0:
        raise UsageError(f"--warmup-segments {warmup}: expected a number >= 0")
    if not 0 <= args.retrieval_k <= MAX_COUNT:
        raise UsageError(
            f"--retrieval-k {_shown(args.retrieval_k)}: expected a whole number in [0, {MAX_COUNT:,}]"
        )
    throttle = None
    if args.read_bandwidth is not None:
        try:
            throttle = float(parse_size(args.read_bandwidth))
        except ValueError as e:
            raise UsageError(f"--read-bandwidth: {e}") from None
    if args.log_dir is not None:
        _check_log_dir(args.log_dir)
    resume_at = _resume_at(args)
    preset, codec = _resume_settings(args) if args.resume else (args.preset, args.codec)
    preset, codec = preset or "tiny", codec or "bf16"
    cfg = SESSION_PRESETS[preset].on_the_fly()
    try:
        seg_bytes = SegmentLayout.from_config(cfg, codec).payload_nbytes
    except ValueError as e:
        raise UsageError(str(e)) from None
    budget = _host_budget(args, host_memory, cap, seg_bytes)
    model = TinyCausalWan(cfg)
    opts: dict[str, Any] = {
        "host_budget_bytes": budget, "mode": args.mode, "retrieval_k": args.retrieval_k,
        "throttle_bps": throttle, "warmup_segments": warmup, "codec": codec, "seed": args.seed,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        if args.log_dir is not None:
            log_dir = Path(args.log_dir)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wp-session-"))) / "log"
        try:
            if args.resume:
                session = Session.resume(log_dir, model, resume_at=resume_at, **opts)
            else:
                session = Session(model, log_dir=log_dir, metadata={"preset": preset}, **opts)
        except FileExistsError as e:  # a new session over a saved one, or someone's files: never written over
            if e.filename is not None and Path(e.filename).name == LOG_NAME:
                raise UsageError(
                    f"--log-dir {log_dir}: holds a saved session ({e.filename} exists); continue it "
                    "with --resume, or give an empty or new folder"
                ) from None
            raise UsageError(
                f"--log-dir {log_dir}: already holds {e.filename}, which a new session would write "
                "over; give an empty or new folder (or --resume the session saved there)"
            ) from None
        except WindowLostError as e:  # the step it can continue at, said as this command's flag
            from worldpager.segment_log import LOG_NAME

            _corrupt_slots(e.events, log_dir / LOG_NAME)  # (said once: retired, they are not found again)
            raise UsageError(
                f"{e.reason}; {e.hint(f'--resume --resume-at {e.resume_at}', e.resume_at)}"
            ) from None
        except (ValueError, OSError, SegmentLogError) as e:
            if isinstance(e, LogFullError) or is_disk_full(e):  # the machine's failure, not the user's
                raise RunError(f"session: {e}") from None
            if isinstance(e, OSError) and not isinstance(e, SegmentLogError):
                raise UsageError(_os_error(e, log_dir, args.resume)) from None
            raise UsageError(str(e)) from None
        _run_steps(session, segments, log_dir if args.log_dir else None)
        result = session.summary()
    table, action_table = (
        SESSION_PRESETS[preset].rope_table_frames,
        SESSION_PRESETS[preset].action_rope_table_frames,
    )
    frames = session.step_index * cfg.frames_per_block  # latent frames generated, restored ones included
    result["preset"] = preset
    result["positional_table_frames"] = table  # what MG2's fixed tables would allow; run on the fly
    result["action_table_frames"] = action_table
    result["positions"] = "on-the-fly"
    result["tables_passed_x"] = {
        "self_attn": round(frames / table, 2) if table else None,
        "action": round(frames / action_table, 2) if action_table else None,
    }
    result["host_memory_bytes"] = host_memory
    result["host_segments_cap"] = cap
    result["host_segments"] = budget // seg_bytes
    result["total_segments"] = session.step_index
    result["log_dir"] = str(log_dir) if args.log_dir else None
    result["corrupt_slots"] = _corrupt_slots(session.events, log_dir / LOG_NAME)
    if not result["nvme_bytes_read"]:
        result["read_back"] = _no_read_back(result, budget, seg_bytes, session.step_index, preset, codec)
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in result.items()))
    return 0


def _add_session(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "session",
        help="run a stand-in session through all tiers (GPU buffers, host, NVMe log); save / resume",
        description="Generates N segments with an MG2-shaped stand-in (on-the-fly positions, far past "
        "its 16/40-frame tables) on a yaw-sweep trajectory whose revisits read segments back from the "
        "NVMe log. The host tier's budget is --host-memory. With --log-dir the session is kept there "
        "(segment log, index, session.json, rolling window) and --resume continues it.",
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "micro"],
        default=None,
        help="stand-in size (default tiny: 3.4 MiB segments, 18 per 64 MiB; micro: 36 KiB segments, "
        "the unit tests' model); --resume: the saved session's",
    )
    p.add_argument("--segments", default="150", metavar="N", help="segments (blocks) to generate (150)")
    p.add_argument(
        "--host-memory", default="64MiB", metavar="SIZE", help=f"host budget (64MiB): {_SIZE_HELP}"
    )
    p.add_argument(
        "--host-segments",
        default="0",
        metavar="K",
        help="also cap the host tier at K segments (default 0 = no cap: the budget is --host-memory)",
    )
    p.add_argument(
        "--codec", default=None, choices=["bf16", "int8", "int4"], help="how segments are stored (bf16)"
    )
    p.add_argument("--mode", default="prefetch", choices=["prefetch", "on_demand"], help="transfer mode")
    p.add_argument("--retrieval-k", type=int, default=2, metavar="K", help="segments retrieved per step")
    p.add_argument("--read-bandwidth", default=None, metavar="SIZE", help="throttle NVMe reads to SIZE/s")
    p.add_argument(
        "--warmup-segments",
        type=int,
        default=None,
        metavar="W",
        help="steps before the RSS baseline (default: until the retrieval buffers first fill, >= 2)",
    )
    p.add_argument("--log-dir", default=None, metavar="DIR", help="keep the session in DIR (default: temp)")
    p.add_argument("--resume", action="store_true", help="continue the session saved in --log-dir")
    p.add_argument(
        "--resume-at",
        default=None,
        metavar="STEP",
        help="with --resume: continue at STEP at the latest (the segments from it on are generated "
        "again; a resume that cannot restore the saved session names the step to give)",
    )
    p.add_argument("--seed", type=int, default=None, help="trajectory and input seed (0; --resume: saved)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_session)


# ---- parser ---------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise UsageError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="worldpager", description="WorldPager: tiered KV memory for MG2 world-model sessions.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_sizing(sub)
    _add_bench_stall(sub)
    _add_session(sub)
    return p


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C is, so that the command's `with` blocks run (its temporary folders
    removed, its session closed and saved)."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: bad input is one line and exit 2, a failure of the machine exit 1, an
    interrupt (Ctrl-C, SIGTERM) one line and 130 or 143, its temporary folders removed."""
    import signal
    import threading

    held = None
    if threading.current_thread() is threading.main_thread():
        held = signal.signal(signal.SIGTERM, _raise_stopped)
    args: argparse.Namespace | None = None
    real_stdout = sys.stdout
    sys.stdout = _Stdout(real_stdout)
    try:
        args = build_parser().parse_args(argv)
        rc: int = args.fn(args)
        sys.stdout.flush()  # (what a block-buffered stdout holds fails here, not at the exit)
        return rc
    except KeyboardInterrupt as e:
        # not imported here: an interrupt while torch is still being imported (the first seconds)
        # failed importing it again, half loaded, with a traceback; not loaded, no step has run
        store = sys.modules.get("worldpager.session_store")
        kept = getattr(args, "log_dir", None)
        saved = False
        if store is not None and kept is not None and kept != "":
            with contextlib.suppress(OSError):  # (none: no step)
                saved = (Path(kept) / store.SESSION_FILE).is_file()
        where = f"; the steps it ran are kept in {kept} (continue with --resume)" if saved else ""
        name = "SIGTERM" if isinstance(e, _Stopped) else "SIGINT"
        print(f"worldpager: interrupted ({name}){where}", file=sys.stderr)
        return 143 if isinstance(e, _Stopped) else 130
    except UsageError as e:
        print(f"worldpager: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"worldpager: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # its reader stopped reading (`| head`): quietly, as `residency` does
        with contextlib.suppress(OSError):  # (and no second error when Python flushes at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except _StdoutFailed as e:  # standard output full (> /dev/full, a full disk): one line, as `residency`
        print(f"worldpager: cannot write standard output: {e.error}", file=sys.stderr)
        with contextlib.suppress(OSError):  # (no second error when Python flushes what it holds at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), real_stdout.fileno())
        return 2
    finally:
        sys.stdout = real_stdout
        if held is not None:
            signal.signal(signal.SIGTERM, held)


class _StdoutFailed(Exception):
    """Writing standard output failed (`_Stdout`): not a machine failure of the command itself."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Stdout:
    """`sys.stdout` while `main` runs: a write or flush that fails (a full disk, `> /dev/full`) is
    `_StdoutFailed`, told apart from another OSError of the command (exit 1); a closed pipe stays
    BrokenPipeError (exit 141, quietly)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def write(self, text: str) -> int:
        try:
            return int(self._real.write(text))
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutFailed(e) from None

    def flush(self) -> None:
        try:
            self._real.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutFailed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


if __name__ == "__main__":
    sys.exit(main())
