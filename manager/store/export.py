"""`residency trace export`: a time range of the store's request log back into a ▶ trace file.

Primitives, in the order the command uses them:
  parse_since  - "7d", "36h", "90m", "45s", "1h30m" or plain seconds -> seconds (ValueError naming
                 the text otherwise); `manager.units.parse_duration` does the parsing.
  export_trace - requests with now - since_s <= t < now -> a JSON Lines trace written with
               `manager.replay.trace.write_trace` (so only t, model, busy_s, class, kind, client,
               t and busy_s rounded to ms); the service extras (wait_s, outcome, source) are dropped,
               and so are the records of requests that never ran (`NEVER_RAN`: refused, unserved).
               `out` may be an open text stream instead of a path (`--out -`: standard output).

A regular file is written to a temporary sibling of its own (a new file, so two exports at once do
not mix, and a link left beside the target is never written through) and renamed into place, so a
failed export (an unreachable or corrupt store) never leaves a half-written trace behind. A symlink
is followed: the file it points to is replaced, the link stays. An existing target that is not a
regular file (a FIFO, /dev/stdout, a device) is written to directly, never replaced; a directory is
refused before anything is created.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO

from manager.policy.types import Request
from manager.replay.trace import ExportStopped, write_requests, write_trace
from manager.store.base import NEVER_RAN, Store, StoreError, record_keep_alive, store_location
from manager.units import parse_duration

__all__ = ["check_out_path", "export_trace", "names_a_folder", "parse_since", "write_trace_file"]

logger = logging.getLogger(__name__)


def parse_since(text: str) -> float:
    """Seconds in `text`: `7d`, `36h`, `90m`, `45s`, `1h30m`, `1w` or a plain number of seconds.

    Raises:
        ValueError: naming `text`, when it is not a duration.
    """
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(
            f"--since: expected a duration like '7d', '36h', '90m', '45s' or seconds, got {text!r}"
        ) from None


STOP_EVERY = 1000
"""An export given `stop` asks it once per this many records."""


def _trace_requests(
    store: Store,
    since: float,
    until: float,
    stop: Callable[[], bool] | None = None,
    skipped: list[StoreError] | None = None,
) -> Iterator[Request]:
    on_corrupt = skipped.append if skipped is not None else None
    for i, rec in enumerate(store.requests(since, until, on_corrupt=on_corrupt)):
        if stop is not None and i % STOP_EVERY == 0 and stop():
            raise ExportStopped("the export was stopped (the service is stopping)")
        if rec.get("outcome") in NEVER_RAN:
            # demand that never ran (refused, unserved) is the statistics' (a kill's catch-up), not a
            # trace's: replayed, a refusal is a request served (a second world session queued behind
            # the first for its whole length), each client retry another arrival, and a load that
            # failed one that works; the tuning would weigh phantom demand
            continue
        yield Request(
            t=rec["t"],
            model=rec["model"],
            busy_s=rec["busy_s"],
            cls=rec.get("class"),
            kind=rec.get("kind", "infer"),
            client=rec.get("client"),
            keep_alive=record_keep_alive(rec),
        )


def names_a_folder(value: str) -> bool:
    """Whether the path `value` names a folder by its form: it ends in a separator (``out/``), or in
    ``.`` or ``..`` (``out/.``). `Path` drops those (``Path("x/").name`` is "x"), so a file named "x"
    would be written, or replace one."""
    return value.endswith(("/", os.sep)) or os.path.basename(value) in (".", "..")


def check_out_path(out: Path) -> None:
    """Raise IsADirectoryError when `out` (followed through symlinks) is a directory (or has no
    file name), before anything is read or created. (A path given as text that names a folder by
    its form, `out/`, is the caller's to refuse: `names_a_folder`; a Path has lost that form.)"""
    out = Path(out)
    if out.is_dir() or not out.name:
        raise IsADirectoryError(errno.EISDIR, "is a directory; give the path of a file", str(out))


def _via_proc(path: Path) -> bool:
    """True when `path` reaches its file through /proc (/dev/stdout, /dev/fd/1, /proc/self/fd/1):
    a link the kernel follows to an already open file, whose name must not be replaced."""
    p = Path(os.path.abspath(path))
    for _ in range(40):
        parent = Path(os.path.realpath(p.parent))
        if parent.parts[1:2] == ("proc",):
            return True
        p = parent / p.name
        if not p.is_symlink():
            return False
        p = Path(os.path.abspath(parent / os.readlink(p)))
    return False  # a symlink loop: opening it reports that


def export_trace(
    store: Store,
    since_s: float,
    now: float,
    out: Path | TextIO,
    stop: Callable[[], bool] | None = None,
    skipped: list[StoreError] | None = None,
) -> int:
    """Write the requests of [now - since_s, now) to `out` as a trace; return how many. `stop` (the
    service stopping, for its tuning job) is asked every `STOP_EVERY` records: when it says so, the
    export ends with ExportStopped (a regular file is then left as it was). `skipped`: a damaged
    stored row (or Redis entry) is left out and its error appended there, and the export goes on, as
    a trace file's bad lines are skipped (without it, the export fails naming the row).

    `out` an open text stream (standard output for `--out -`): the lines are written to it as they
    are read, and it is flushed (a store that fails part way leaves the lines before it written).
    `out`'s parent folders are created. A symlink is followed: the file it points to is replaced,
    the link is kept. An existing regular file is replaced only when the export succeeds (its
    permission bits kept). An existing FIFO or device is written to directly, never replaced, and
    so is a file reached through /proc (`/dev/stdout` redirected to a file: appended to).

    Raises:
        StoreError: the store cannot be read (nothing is written to a regular file).
        ExportStopped: `stop` said so (nothing is written to a regular file).
        IsADirectoryError: `out` is a directory (nothing is created).
        OSError: `out` cannot be written (BrokenPipeError: its reader stopped reading).
    """
    if not isinstance(out, str | os.PathLike):
        n = write_requests(out, _trace_requests(store, now - since_s, now, stop, skipped))
        out.flush()
        logger.info("exported %s requests from %s to a stream", n, store_location(store.url))
        return n
    out = Path(out)
    check_out_path(out)
    n = write_trace_file(out, _trace_requests(store, now - since_s, now, stop, skipped))
    logger.info("exported %s requests from %s to %s", n, store_location(store.url), out)
    return n


def write_trace_file(out: Path, requests: Iterable[Request]) -> int:
    """Write `requests` as a trace to the file `out` (its parent folders made): an existing regular
    file is replaced only once every line is written (its permission bits kept), so a full disk, an
    interrupt or a failing source leaves it as it was and never a cut-off trace; a symlink's target
    is replaced, the link kept; a FIFO or device is written to directly, and a file reached through
    /proc (`/dev/stdout` redirected to a file) appended to. How many were written."""
    try:
        st: os.stat_result | None = os.stat(out)  # through symlinks, as open() goes
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        n = write_trace(out, requests)  # a FIFO, a terminal, /dev/null: never replaced
    elif st is not None and _via_proc(out):
        n = write_trace(out, requests, mode="a")  # an open file (`--out /dev/stdout > f`): not truncated
    else:
        real = Path(os.path.realpath(out))  # a symlink's target is replaced, not the link
        real.parent.mkdir(parents=True, exist_ok=True)
        # a new file of its own (O_EXCL), never one a link left there points to, nor another export's
        tmp = real.with_name(f".{real.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # (the umask's)
        try:
            with open(fd, "w", encoding="utf-8") as f:
                n = write_requests(f, requests)
            if st is not None:
                shutil.copymode(real, tmp)
            os.replace(tmp, real)
        finally:
            tmp.unlink(missing_ok=True)
    return n
