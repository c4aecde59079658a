"""Request traces as JSON Lines (the ▶ request-trace contract in docs/ARCHITECTURE.md).

One request per line, in time order::

    {"t":1793577600.0,"model":"voice","busy_s":0.4}
    {"t":1793577601.2,"model":"world","busy_s":5400.0,"kind":"session","client":"world-app"}
    {"t":1793577700.0,"model":"llm","busy_s":2.1,"keep_alive":3600}

`keep_alive` (optional, an extension of the contract) is the request's own keep-alive, as Ollama's:
seconds, a duration ("10m"), "forever", or a negative number (forever); null is absent.

Primitives, in the order a trace meets them:
  parse_line      - one line -> Request, or ValueError with a reason a person can act on.
  read_trace      - a file -> TraceReadResult (good requests plus the bad lines, numbered);
                    strict=True raises TraceError on the first bad line instead.
  request_to_json - Request -> one compact line (t and busy_s rounded to milliseconds).
  write_trace     - Requests -> a file.

Notes:
  A field given twice on one line (`"model": "voice", "model": "llm"`) makes the line bad, as a
  duplicate key does in a config: JSON would silently keep the last one.
  busy_s is at most MAX_BUSY_S (a year): a larger one is a broken exporter, and sums of times near
  float's limits become infinity in the replay's figures.
  Line numbers are 1-based and count blank lines (which are skipped silently), so they match what an
  editor shows. A line whose `t` is earlier than the previous good line's is bad: replay needs time
  order, and silently re-sorting would hide a broken exporter.
  A line longer than MAX_LINE_CHARS is bad and is never held whole (a whole trace as one JSON array,
  as `jq -sc` writes it). A file whose first NOT_A_TRACE_AFTER non-blank lines hold no JSON object is
  not a trace (a model checkpoint, a CSV log, text in UTF-16): `read_trace` stops there with a
  TraceError for the file as a whole, instead of counting its lines one by one for minutes. A
  shorter file with NUL bytes and no JSON object (a UTF-16 trace, as Windows PowerShell's `>`
  writes one) is refused the same way at its end, rather than as "not valid JSON" on every line.
  The path "-" is standard input (as the shell's tools take it, and as `trace synth --out -` writes
  to standard output; a file named "-" is ./-), read as UTF-8 with the same checks; its errors name
  it STDIN_NAME. Standard input can be read once: a second `read_trace("-")` finds it at its end.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from manager.policy.types import Request
from manager.units import parse_keep_alive, shown

__all__ = [
    "ALLOWED_FIELDS",
    "KINDS",
    "MAX_BUSY_S",
    "MAX_LINE_CHARS",
    "NOT_A_TRACE_AFTER",
    "STDIN",
    "STDIN_NAME",
    "ExportStopped",
    "TraceError",
    "TraceReadResult",
    "keep_alive_json",
    "keep_alive_of_json",
    "parse_line",
    "read_trace",
    "request_to_json",
    "write_trace",
]

ALLOWED_FIELDS: tuple[str, ...] = ("t", "model", "busy_s", "class", "kind", "client", "keep_alive")
MAX_T = 1e11
"""The latest `t` accepted (the year 5138 in Unix seconds): a larger one is almost surely in
milliseconds, and times near float's limits break the replay's arithmetic."""
MAX_BUSY_S = 365 * 86400.0
"""The longest `busy_s` accepted (a year; a world-model session is hours)."""
KINDS: frozenset[str] = frozenset({"infer", "session"})
MAX_LINE_CHARS = 1 << 20
"""The longest line read, in characters (a request is a line of about a hundred)."""
NOT_A_TRACE_AFTER = 1000
"""With no JSON object in a file's first this many non-blank lines, it is not a trace."""
STDIN = "-"
"""The path `read_trace` reads standard input for."""
STDIN_NAME = "<stdin>"
"""What errors about standard input call it (TraceError.path, TraceReadResult.path)."""
_ALLOWED_SET = frozenset(ALLOWED_FIELDS)


class ExportStopped(Exception):
    """An export of requests into a trace ended early because its caller's `stop` said so (the
    service stopping, say): nothing was written to a regular file."""


class TraceError(Exception):
    """A trace that cannot be used: `path`, 1-based `line` (0 for the file as a whole), `reason`."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


@dataclass
class TraceReadResult:
    """What `read_trace` found: the good `requests` in file order and the `bad_lines` it skipped."""

    requests: list[Request]
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    path: str = ""


def _show(v: object) -> str:
    """repr, cut short: a reason is one line even when the value is a 5 kB string."""
    return shown(v, 60)


def _is_number(v: object) -> bool:
    # bool is an int subclass; `true` is not a time.
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(obj: dict[str, Any], key: str) -> float:
    if key not in obj:
        raise ValueError(f"missing field {key!r}")
    v = obj[key]
    if _is_number(v):
        try:
            f = float(v)
        except OverflowError:  # a huge JSON integer
            f = math.inf
        if math.isfinite(f) and f >= 0:
            return f
    raise ValueError(f"{key!r} must be a finite number ≥ 0, got {_show(v)}")


def _optional_str(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if v is None or isinstance(v, str):
        return v
    raise ValueError(f"{key!r} must be a string, got {_show(v)}")


def _known(what: str, value: str, known: Collection[str]) -> None:
    if value not in known:
        raise ValueError(f"unknown {what} {_show(value)} (known: {', '.join(sorted(known))})")


def parse_line(
    text: str,
    line_no: int,
    known_models: Collection[str] | None = None,
    known_classes: Collection[str] | None = None,
) -> Request:
    """Parse one trace line into a `Request`.

    Args:
        text: the line (surrounding whitespace is fine).
        line_no: its 1-based number. Reasons do not repeat it (callers prefix "path:line:"), so
            equal problems on different lines read the same and can be grouped.
        known_models / known_classes: when given, names outside them are rejected.

    Raises:
        ValueError: with a one-line reason naming the field and the offending value.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _NotAnObject(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _NotAnObject("not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise _NotAnObject(f"not valid JSON ({e})") from None
    # Each key is followed by a ':', so a line with no more ':' than fields has no key twice; only
    # the rare line with more (a ':' inside a string, a nested object) is parsed again to check.
    if type(obj) is dict and text.count(":") > len(obj):
        _check_duplicate_fields(text)
    return parse_object(obj, known_models, known_classes)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateField(f"duplicate field {_show(key)} (each field may appear once)")
            seen.add(key)
    return obj


class _DuplicateField(ValueError):
    pass


class _NotAnObject(ValueError):
    """A line that holds no JSON object at all (what a file that is not a trace is made of)."""


def _check_duplicate_fields(text: str) -> None:
    """ValueError naming the first field that `text` (valid JSON) gives twice in one object."""
    try:
        json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateField:
        raise
    except (ValueError, RecursionError):  # pragma: no cover - parsed once already
        pass


def parse_object(
    obj: object,
    known_models: Collection[str] | None = None,
    known_classes: Collection[str] | None = None,
) -> Request:
    """`parse_line` for a line already decoded from JSON (or for a dict that JSON would give back
    unchanged: str keys; str, int, float values)."""
    if not isinstance(obj, dict):
        raise _NotAnObject(f"not a JSON object (got {type(obj).__name__})")
    extra = obj.keys() - _ALLOWED_SET
    if extra:
        names = ", ".join(_show(k) for k in sorted(extra))
        raise ValueError(f"unknown field {names} (allowed: {', '.join(ALLOWED_FIELDS)})")
    t = _number(obj, "t")
    if "model" not in obj:
        raise ValueError("missing field 'model'")
    model = obj["model"]
    if not isinstance(model, str) or not model:
        raise ValueError(f"'model' must be a non-empty string, got {_show(model)}")
    if t > MAX_T:
        raise ValueError(f"'t' must be Unix seconds ≤ 1e11, got {_show(obj['t'])} (milliseconds?)")
    busy_s = _number(obj, "busy_s")
    if busy_s > MAX_BUSY_S:
        raise ValueError(f"'busy_s' must be at most {MAX_BUSY_S:.0f} s (a year), got {_show(obj['busy_s'])}")
    kind = obj.get("kind")
    if kind is None:  # null is absent, as for class and client
        kind = "infer"
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"'kind' must be one of 'infer', 'session', got {_show(kind)}")
    cls = _optional_str(obj, "class")
    client = _optional_str(obj, "client")
    keep_alive = _keep_alive(obj.get("keep_alive"))
    if known_models is not None:
        _known("model", model, known_models)
    if known_classes is not None and cls is not None:
        _known("class", cls, known_classes)
    return Request(t=t, model=model, busy_s=busy_s, cls=cls, kind=kind, client=client, keep_alive=keep_alive)


def keep_alive_json(seconds: float, digits: int | None = None) -> float | str:
    """A keep-alive in seconds as a trace line, a request record and the journal write it: forever
    (infinity, which JSON lacks) as "forever"; `digits`: rounded to so many decimals."""
    if math.isinf(seconds):
        return "forever"
    return seconds if digits is None else round(seconds, digits)


def keep_alive_of_json(v: float | str | None) -> float | None:
    """`keep_alive_json`'s value (as a normalized record holds it) back in seconds; None: absent."""
    return None if v is None else math.inf if v == "forever" else float(v)


def _keep_alive(v: object) -> float | None:
    """The request's own keep-alive (null: absent, the config's holds)."""
    if v is None:
        return None
    if not isinstance(v, int | float | str):
        raise ValueError(f"'keep_alive' must be seconds, a duration or 'forever', got {_show(v)}")
    try:
        return parse_keep_alive(v, bounded=False)  # (logged by any release: read as it was written)
    except ValueError as e:
        raise ValueError(f"'keep_alive': {e}") from None


def read_trace(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    known_models: Collection[str] | None = None,
    known_classes: Collection[str] | None = None,
) -> TraceReadResult:
    """Read a JSONL trace.

    Returns:
        The good requests (in file order, which is time order) and the bad lines as
        (line number, reason).

    Raises:
        TraceError: the file cannot be read or is not a trace (line 0), or `strict` and a line is bad.
    """
    stdin = isinstance(path, str) and path == STDIN  # (a PathLike "-" too is ./-, as Path("-") is)
    p = STDIN_NAME if stdin else str(path)
    models = frozenset(known_models) if known_models is not None else None
    classes = frozenset(known_classes) if known_classes is not None else None
    result = TraceReadResult(requests=[], bad_lines=[], path=p)
    last_t, last_line = -math.inf, 0
    objects = False  # has a line held a JSON object yet?
    nul = False  # has a line before the first object held a NUL character?
    with _open_stdin() if stdin else _open(p) as f, _read_errors(p):
        for line_no, text in enumerate(_lines(f), start=1):
            if line_no == 1 and text is not None:
                text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
            if text is not None and not text.strip():
                continue
            try:
                if text is None:
                    raise _NotAnObject(_TOO_LONG)
                r = parse_line(text, line_no, models, classes)
                if r.t < last_t:
                    # the line it follows named: one line far in the future makes all after it late
                    raise ValueError(f"out of time order: t={r.t} after t={last_t} (line {last_line})")
            except ValueError as e:
                if strict:  # (a binary file's first line: what the file is, not only the column)
                    at_start = not objects and text is not None and "\x00" in text
                    raise TraceError(p, line_no, str(e) + (_BINARY if at_start else "")) from None
                result.bad_lines.append((line_no, str(e)))
                if objects or not isinstance(e, _NotAnObject):
                    objects = True
                    continue
                nul = nul or (text is not None and "\x00" in text)
                if len(result.bad_lines) >= NOT_A_TRACE_AFTER:
                    raise TraceError(p, 0, _not_a_trace(result.bad_lines[0], nul)) from None
                continue
            objects = True
            last_t, last_line = r.t, line_no
            result.requests.append(r)
    if nul and not objects:  # a short binary file (a UTF-16 trace): said as a whole, as a long one
        raise TraceError(p, 0, _not_a_trace(result.bad_lines[0], nul, len(result.bad_lines)))
    return result


@contextmanager
def _open(p: str) -> Iterator[TextIO]:
    """The file `p` as UTF-8 text (a byte that is not UTF-8 read as U+FFFD, so the line it is on
    is bad, not the file), closed at the end; TraceError (line 0) when it cannot be opened."""
    try:
        f = open(p, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        raise TraceError(p, 0, "no such file") from None
    except OSError as e:
        raise TraceError(p, 0, e.strerror or str(e)) from None
    with f:
        yield f


@contextmanager
def _open_stdin() -> Iterator[TextIO]:
    """Standard input as `_open` reads a file: its bytes decoded as UTF-8 whatever the locale's
    encoding, lines ended by \\n, \\r\\n or \\r. Left open (the process's, not ours): the reader
    over its bytes is detached, not closed. A terminal is refused, not waited on for a trace
    typed by hand (the command would seem to hang)."""
    stream = sys.stdin
    if stream is None:  # (started with no standard input at all)
        raise TraceError(STDIN_NAME, 0, "there is no standard input to read a trace from")
    try:
        tty = stream.isatty()
    except (OSError, ValueError):  # closed
        tty = False
    if tty:
        raise TraceError(
            STDIN_NAME,
            0,
            "standard input is a terminal; pipe a trace into it (`residency trace synth --out - | ...`) "
            "or give the trace's file",
        )
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text stream with no bytes beneath it: read as it is
        yield stream
        return
    f = io.TextIOWrapper(buffer, encoding="utf-8", errors="replace")
    try:
        yield f
    finally:
        with suppress(ValueError):  # (the buffer closed under us)
            f.detach()


@contextmanager
def _read_errors(p: str) -> Iterator[None]:
    """An error reading `p` after it opened (a folder given as standard input, a disk's I/O
    error) as TraceError for the file as a whole, not a traceback."""
    try:
        yield
    except OSError as e:
        raise TraceError(p, 0, f"cannot be read: {e.strerror or e}") from None


_TOO_LONG = f"line longer than {MAX_LINE_CHARS} characters (a trace is JSON Lines: one request per line)"


def _lines(f: TextIO) -> Iterator[str | None]:
    """The lines of `f`, each at most MAX_LINE_CHARS long: None for a longer one, which is read
    past in pieces, never held whole."""
    while text := f.readline(MAX_LINE_CHARS):
        if len(text) < MAX_LINE_CHARS or text.endswith("\n"):
            yield text
            continue
        while (more := f.readline(MAX_LINE_CHARS)) and not more.endswith("\n"):
            pass
        yield None


_BINARY = "; the file holds NUL bytes: a binary file, or text in UTF-16 (a trace is UTF-8 JSON Lines)"


def _not_a_trace(first: tuple[int, str], nul: bool, lines: int | None = None) -> str:
    """Why a file is not a trace; `lines`: how many non-blank lines it has, when it ended before
    NOT_A_TRACE_AFTER of them."""
    line, reason = first
    which = f"first {NOT_A_TRACE_AFTER} lines" if lines is None else f"{lines} non-blank line(s)"
    what = f"not a request trace: none of its {which} is a JSON object"
    return f"{what} (line {line}: {reason}){_BINARY if nul else ''}"


def request_to_json(r: Request) -> str:
    """One compact line: t, model, busy_s, then class/kind/client/keep_alive only where not the
    default (a keep-alive of forever as "forever")."""
    obj: dict[str, object] = {"t": round(r.t, 3), "model": r.model, "busy_s": round(r.busy_s, 3)}
    if r.cls is not None:
        obj["class"] = r.cls
    if r.kind != "infer":
        obj["kind"] = r.kind
    if r.client is not None:
        obj["client"] = r.client
    if r.keep_alive is not None:
        obj["keep_alive"] = keep_alive_json(r.keep_alive, digits=3)
    return json.dumps(obj, separators=(",", ":"))


def write_trace(path: str | os.PathLike[str], requests: Iterable[Request], mode: str = "w") -> int:
    """Write requests as JSONL (parent folders are created; `mode` "a" appends). Returns how many
    were written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open(mode, encoding="utf-8") as f:
        return write_requests(f, requests)


def write_requests(f: IO[str], requests: Iterable[Request]) -> int:
    """Write requests as JSONL lines to the open text file `f`; returns how many were written."""
    n = 0
    for r in requests:
        f.write(request_to_json(r) + "\n")
        n += 1
    return n
