"""`residency` command line: serve, ps, replay, tune, trace synth, measure, config schema/check, and the
admin commands on a running service (pin, unpin, preload, evict, stats, reload, events).

Errors in what the user gave (a config, a trace, a flag) are printed without a traceback and exit
with status 2, as is a service that cannot be reached; a refusal by the service (an unknown model, a
pinned one) is printed in one line and exits with status 1. `trace export` reads the service's store.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID
from rich.table import Table

from manager.config import (
    Config,
    ConfigError,
    ModelConfig,
    _printable,
    config_json_schema,
    load_config,
    load_server_settings,
    write_config_with_updates,
)
from manager.policy.factory import POLICY_NAMES
from manager.policy.stats import zone_named
from manager.policy.types import Request
from manager.replay.sim import ReplayResult, replay
from manager.replay.synth import MAX_DAYS, PROFILES, synth
from manager.replay.trace import STDIN, TraceError, read_trace, request_to_json
from manager.units import format_duration, format_size, parse_duration

err = Console(stderr=True, soft_wrap=True, emoji=False)
MAX_BAD_LINES_SHOWN = 10
MAX_REASONS_SHOWN = 5
DEFAULT_SINCE = "7d"
"""How far back `tune --from-store` reads the request log unless --since says."""
MIN_REPORT_PERIOD_S = 60.0
"""The shortest period `tune --report` plots: a holdout of one short request still shows its loads."""


UNLIMITED_WIDTH = 100_000
"""The width of stdout when it is not a terminal (a pipe, a file) and COLUMNS is not set."""


def _out() -> Console:
    """A console on stdout. On a terminal, its width; piped or written to a file, as wide as the
    lines are (rich would otherwise cut every table to 80 columns, and a model's name with it)
    unless COLUMNS sets a width."""
    out = Console(emoji=False)
    if out.is_terminal or os.environ.get("COLUMNS", "").strip():
        return out
    return Console(width=UNLIMITED_WIDTH, emoji=False)


class UsageError(Exception):
    """Bad input from the user: printed, exit 2."""


class Refused(Exception):
    """The service refused an admin command (an unknown model, a pinned one): printed, exit 1."""


def _nonfinite_at(obj: Any, where: str = "") -> str | None:
    """The path (`holdout.before.load_wait_s`) of the first NaN or infinity in `obj`, or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "the value"
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        at = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k)
        found = _nonfinite_at(v, at)
        if found:
            return found
    return None


def _print_json(obj: Any, indent: int | None = None) -> None:
    """`obj` as strict JSON on stdout. NaN and infinity are not JSON (Python would print `Infinity`):
    such a value is an error naming where it is, and nothing is printed."""
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError:
        where = _nonfinite_at(obj) or "a value"
        raise UsageError(
            f"cannot print the result as JSON: {where} is not a finite number (the inputs hold "
            "times too large to add up)"
        ) from None
    print(text)


def _check_host_port(flag: str, value: str) -> str:
    """`value` checked by the rule `server.listen` is checked by in a config; UsageError naming `flag`."""
    from manager.config_schema import check_host_port

    try:
        return check_host_port(value)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _prepare_dir(path: Path, flag: str, *, create: bool = True, for_file: str | None = None) -> None:
    """Check the folder `path` for `flag`'s output and create it (and its parents); with `create`
    False only check that it could be: nothing is made. `for_file`: the flag's value, when `path`
    is the folder of the file it names. UsageError naming `flag` and its value."""
    head = f"{flag} {for_file if for_file is not None else path}"
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"{head}: {path} is not a directory" if for_file else f"{head}: exists and is not a directory"
        )
    if not create:
        first = next((p for p in (path, *path.parents) if p.exists()), Path("."))
        if not first.is_dir():
            raise UsageError(f"{head}: {first} is not a directory")
        if not os.access(first, os.W_OK | os.X_OK):
            raise UsageError(f"{head}: the folder {first} is not writable")
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = e.filename or path
        raise UsageError(f"{head}: cannot create the folder {where}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{head}: the folder {path} is not writable")


def _not_empty(value: str, flag: str, what: str) -> str:
    """`value` unless it is empty (an unset shell variable, say): UsageError naming `flag`. An empty
    path would be the current folder, or an optional flag silently not given."""
    if not value:
        raise UsageError(f"{flag} is empty; give the path of {what}")
    return value


def _not_a_folder_name(value: str, flag: str) -> None:
    """UsageError when the path `value` names a folder by its form (`out/`, `out/.`): `Path` drops
    that, and a file of the folder's name would be written (`names_a_folder`)."""
    from manager.store.export import names_a_folder

    if names_a_folder(value):
        raise UsageError(f"{flag} {value}: names a folder (it ends in / or .): give a file")


def _prepare_out_file(value: str, flag: str, *, create: bool = True, replaced: bool = False) -> Path:
    """The file `flag` names, checked before any work is done: not empty, not a directory, its
    folder made (as `trace synth` does; with `create` False only checked) and writable, an existing
    file writable. With `replaced` (a config, written whole into a new file renamed over the one a
    link leads to), the folder checked is the link's target's, and a FIFO or a device there is
    refused: the rename would replace it (a `tune --out /dev/null` run as root, the system's).
    UsageError naming `flag`."""
    from manager.config import _not_regular

    path = Path(_not_empty(value, flag, "a file to write"))
    _not_a_folder_name(value, flag)
    if path.is_dir() or not path.name:
        raise UsageError(f"{flag} {value}: is a directory; give the path of a file to write")
    _prepare_dir(path.parent, flag, create=create, for_file=value)
    if replaced:
        real = Path(os.path.realpath(path))
        if real.parent != path.parent.resolve():  # (a link: the file written is its target)
            if not real.parent.is_dir():
                raise UsageError(
                    f"{flag} {value}: is a link to {real}, whose folder {real.parent} does not exist"
                )
            _prepare_dir(real.parent, flag, create=False, for_file=f"{value} (a link to {real})")
        try:  # (the path itself, followed: /dev/stdout to a pipe is a FIFO, its realpath unreadable)
            kind = _not_regular(os.stat(path).st_mode)
        except FileNotFoundError:
            kind = ""
        if kind:
            raise UsageError(
                f"{flag} {value}: is {kind}, not a regular file; a config is written whole into a "
                "new file renamed over it, which would replace it: give the path of a file"
            )
        if _is_stdout(value):  # (`--out /dev/stdout > file`: what it prints, then the file replaced)
            raise UsageError(
                f"{flag} {value}: is where standard output goes (what this command prints goes there "
                "too); give another file"
            )
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {value}: the file is not writable")
    if path.is_file() and not path.stat().st_mode & 0o222:  # (root may write it: its owner said no)
        raise UsageError(f"{flag} {value}: the file is read-only")
    return path


def _check_tune_outputs(a: argparse.Namespace) -> None:
    """`tune`'s outputs, checked first, not after the (long) search: a bad --out or --report fails
    now, and an --out that is one of the traces (the week of requests written over) is refused."""
    if a.report is not None:
        _not_empty(a.report, "--report", "a folder for the report")
    _prepare_out_file(a.out, "--out", create=False, replaced=True)
    for flag, value in (("--trace", a.trace), ("--holdout", a.holdout)):
        if value and value != STDIN and _same_file(a.out, value):
            raise UsageError(f"--out {a.out} is the {flag} file; give another path for the tuned config")
    if _same_file(a.out, a.config):  # (the config a person wrote, kept to compare and go back to)
        raise UsageError(
            f"--out {a.out} is the --config file; give another path for the tuned config (and copy it "
            "over once you have looked at it)"
        )
    if a.report:
        _prepare_dir(Path(a.report), "--report", create=False)
        _check_report_files(Path(a.report))
        _not_in_the_report(a.out, a.report)


def _count(n: int, one: str, many: str | None = None) -> str:
    """`n` things, in the singular for one: "1 request", "2 requests"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def _trace_name(value: str) -> str:
    """How a trace the user named is said in a title or a header (`-`: standard input)."""
    return "standard input" if value == STDIN else value


def _not_the_services_file(config: Config, out: Path) -> None:
    """UsageError when `out` is one of the files the service keeps its state in (the SQLite store
    with its -wal, -shm and .lock, the journal and its lock): the export would replace it."""
    from manager.store import StoreError
    from manager.store.sqlite import parse_sqlite_url

    theirs: list[tuple[str, str]] = []
    if config.store.url.startswith("sqlite:"):
        try:
            db = parse_sqlite_url(config.store.url)
        except StoreError:
            db = ""
        for base in {db, os.path.realpath(db)} if db else ():  # (its lock is beside the real file)
            theirs += [(base + tail, "the store's SQLite file") for tail in ("", "-wal", "-shm", ".lock")]
    if config.store.journal:
        theirs += [
            (j, "the service's request journal")
            for j in (config.store.journal, config.store.journal + ".lock")
        ]
    for path, what in theirs:
        if _same_file(str(out), path):
            raise UsageError(
                f"--out {out}: is {what} ({path}); the export would replace it: give another file"
            )


def _is_stdout(path: str) -> bool:
    """Whether `path` names the file standard output goes to (through /dev/stdout or a link)."""
    try:
        here, there = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):  # (no such file; stdout closed or not a file)
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _same_file(a: str, b: str) -> bool:
    """Whether the paths `a` and `b` name one file (through links too); a path not there yet is
    compared as a path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _not_in_the_report(out: str, report: str) -> None:
    """UsageError when `tune`'s --out is the --report folder or one of the files the report writes
    there (the tuned config would be written over by the report, or not written at all)."""
    from manager.replay.report import REPORT_FILES

    if _same_file(out, report):
        raise UsageError(f"--out {out} is the --report folder; give another path for the tuned config")
    if Path(out).name in REPORT_FILES and _same_file(str(Path(out).parent), report):
        raise UsageError(
            f"--out {out} is a file the report writes in --report {report}; give another path for the "
            "tuned config"
        )


def _check_report_files(folder: Path) -> None:
    """The report's files in `folder` can be written (none is a folder, none read-only): checked
    before `tune`'s search, so the tuned config is not written and then the report refused."""
    from manager.replay.report import REPORT_FILES

    for name in REPORT_FILES:
        path = folder / name
        if path.is_dir():
            raise UsageError(f"--report {folder}: {path} is a directory; the report writes a file there")
        if path.exists() and not os.access(path, os.W_OK):
            raise UsageError(f"--report {folder}: {path} is not writable")


def _load_trace(
    path: str, config: Config, strict: bool, flag: str | None = None
) -> tuple[list[Request], int]:
    """The valid requests of the trace `path` and how many bad lines were skipped. `flag` (the
    option that named `path`) prefixes the errors about the file as a whole: `tune` reads two."""
    head = f"{flag} {path}" if flag else path
    if flag:
        _not_empty(path, flag, "a trace file")
    try:
        res = read_trace(
            path,
            strict=strict,
            known_models=config.model_names(),
            known_classes=[c.name for c in config.classes],
        )
    except TraceError as e:
        if e.line or not flag:  # a bad line says "path:line:" as the contract has it
            raise
        raise UsageError(f"{head}: {e.reason}") from None
    path = res.path or path  # (standard input is named `<stdin>`, as a --strict error names it)
    for line, reason in res.bad_lines[:MAX_BAD_LINES_SHOWN]:
        # a reason quotes the user's text ("model": "[/x]"): escaped, it is printed, not parsed as markup
        err.print(f"[yellow]skipped[/] {escape(f'{path}:{line}: {reason}')}", highlight=False)
    if len(res.bad_lines) > MAX_BAD_LINES_SHOWN:
        err.print(
            f"[yellow]skipped[/] {len(res.bad_lines) - MAX_BAD_LINES_SHOWN} more bad lines", highlight=False
        )
    if res.bad_lines:
        err.print(
            f"{path}: {len(res.bad_lines)} bad line(s) skipped (--strict makes them fatal)",
            highlight=False,
            markup=False,
        )
        if len(res.bad_lines) > MAX_BAD_LINES_SHOWN:  # what the lines not printed were skipped for
            _print_reasons(res.bad_lines)
        if not res.requests:  # not a trace at all (a config given as --trace, say): nothing to replay
            raise UsageError(f"{head}: no valid request line (all {len(res.bad_lines)} lines are bad)")
    return res.requests, len(res.bad_lines)


_OUT_OF_ORDER = re.compile(r"out of time order: t=\S+ after (t=\S+ \(line \d+\))")


def _reason_kind(reason: str) -> str:
    """A bad line's reason as the summary counts it: lines out of time order behind one line (far in
    the future, or the first of a file in reverse) are one reason naming that line, not one each by
    their own times ("44 for 44 other reasons" hid it)."""
    return _OUT_OF_ORDER.sub(r"out of time order: earlier than \1", reason)


def _print_reasons(bad_lines: list[tuple[int, str]]) -> None:
    """The bad lines' reasons with how many lines each, the commonest MAX_REASONS_SHOWN first (a
    trace for another home: every model the config lacks is named, not only the first one's)."""
    counts = Counter(_reason_kind(reason) for _line, reason in bad_lines).most_common()
    err.print("by reason:", highlight=False, markup=False)
    for reason, n in counts[:MAX_REASONS_SHOWN]:
        err.print(f"{n:6d}  {reason}", highlight=False, markup=False)
    rest = counts[MAX_REASONS_SHOWN:]
    if rest:
        n_rest = sum(n for _r, n in rest)
        err.print(f"{n_rest:6d}  for {len(rest)} other reasons", highlight=False, markup=False)


def _replay_all(config: Config, reqs: list[Request], policies: Sequence[str], bad: int) -> list[ReplayResult]:
    out = []
    show = len(reqs) * len(policies) > 20_000 and err.is_terminal
    with Progress(console=err, transient=True, disable=not show) as prog:
        for p in policies:
            task = prog.add_task(f"replay {p}", total=len(reqs))

            def tick(i: int, n: int, task: TaskID = task) -> None:
                prog.update(task, completed=i)

            r = replay(config, reqs, p, progress=tick)
            prog.update(task, completed=len(reqs))
            r.bad_lines = bad
            out.append(r)
    return out


def _table(results: list[ReplayResult], title: str, names: list[str] | None = None) -> Table:
    classes = list(results[0].wait_p99_s) if results else []
    t = Table(title=title)
    t.add_column("figure")
    for name in names or [r.policy for r in results]:
        t.add_column(name, justify="right")
    rows: list[tuple[str, list[Any]]] = [
        ("requests", [r.requests for r in results]),
        ("served", [r.served for r in results]),
        ("rejected", [r.rejected for r in results]),
        ("cold starts", [r.cold_starts for r in results]),
        ("load wait s", [f"{r.load_wait_s:.1f}" for r in results]),
        # a class's name is the config's text, not markup (`[/rt]` would be parsed, and fail)
        *[(escape(f"p99 {c} s"), [f"{r.wait_p99_s.get(c, 0.0):.2f}" for r in results]) for c in classes],
        ("evictions", [r.evictions for r in results]),
        ("thrash", [r.thrash for r in results]),
        ("budget violations", [r.budget_violations for r in results]),
        ("prewarm loads", [r.prewarm_loads for r in results]),
        ("wasted loads", [r.wasted_loads for r in results]),
    ]
    for name, vals in rows:
        t.add_row(name, *[str(v) for v in vals])
    return t


def cmd_replay(a: argparse.Namespace) -> int:
    config = load_config(a.config)
    reqs, bad = _load_trace(a.trace, config, a.strict, "--trace")
    if not reqs:  # an export of a quiet hour, say: figures of no request would read as a result
        raise UsageError(f"{a.trace}: no request to replay (the file is empty, or has only blank lines)")
    if a.json:
        r = _replay_all(config, reqs, [a.policy or config.policy.name], bad)[0]
        _print_json(r.to_json())
        return 0
    policies = [a.policy] if a.policy else list(POLICY_NAMES)
    results = _replay_all(config, reqs, policies, bad)
    _out().print(_table(results, escape(f"{_trace_name(a.trace)} through {a.config}")))
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    if not 0 < a.days <= MAX_DAYS:
        raise UsageError(f"--days must be between 1 and {MAX_DAYS} (ten years), got {a.days}")
    if a.seed < 0:  # Python seeds its generator with |seed|: -1 would silently repeat seed 1's week
        raise UsageError(f"--seed must be 0 or more, got {a.seed}")
    if a.profile not in PROFILES:  # before --out's folder is made
        raise UsageError(f"unknown profile {a.profile!r} (known: {', '.join(sorted(PROFILES))})")
    try:  # (before --out's folder is made, as the profile)
        zone = zone_named(a.timezone) if a.timezone is not None else None
    except ValueError as e:
        raise UsageError(f"--timezone: {e}") from None
    to_stdout = a.out == "-"  # as the shell's tools take it (a file named "-" is ./-)
    if not to_stdout:
        _prepare_out_file(a.out, "--out")  # a bad --out is said plainly, before the (long) generation
    try:
        reqs = synth(a.profile, a.days, a.seed, zone=zone)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if to_stdout:
        sys.stdout.writelines(request_to_json(r) + "\n" for r in reqs)
        sys.stdout.flush()
        n = len(reqs)
    else:
        from manager.store.export import write_trace_file

        try:  # whole or not at all: a full disk leaves a file that was there as it was
            n = write_trace_file(Path(a.out), reqs)
        except BrokenPipeError:  # --out /dev/stdout, its reader gone: main ends quietly
            raise
        except OSError as e:  # the disk filled up, say: the flag and the system's words, one line
            kept = "; the file is unchanged" if Path(a.out).is_file() else "; nothing was written"
            raise UsageError(f"--out {a.out}: {e.strerror or e}{kept}") from None
    err.print(
        f"wrote {_count(n, 'request')} ({_count(a.days, 'day')}, profile {a.profile}, seed {a.seed}"
        f"{'' if a.timezone is None else f', time zone {a.timezone}'}) to "
        f"{'standard output' if to_stdout else a.out}",
        highlight=False,
        markup=False,
    )
    return 0


def cmd_schema(a: argparse.Namespace) -> int:
    _print_json(config_json_schema(), indent=2)
    return 0


def _check_tls_pair(config_path: str, c: Config) -> None:
    """UsageError, in `serve`'s words (its own check, `read_tls`), when server.tls_cert and tls_key
    are files `serve` would refuse: one it cannot read, or not a PEM certificate and its key."""
    if not (c.server.tls_cert and c.server.tls_key):
        return
    from manager.api.runtime import ServeError, read_tls

    try:
        read_tls(c.server.tls_cert, c.server.tls_key)
    except ServeError as e:
        raise UsageError(f"{config_path}: {e}") from None


def _warn_relative_store(config_path: str, c: Config) -> None:
    """The warning, on stderr, for a sqlite store.url whose relative path reads as an absolute one
    (`config check` and `serve`)."""
    from manager.store.sqlite import relative_path_warning

    warning = relative_path_warning(c.store.url)
    if warning:
        err.print(f"{config_path}: warning: {warning}", highlight=False, markup=False)


def _not_beside(c: Config, never: dict[str, str], held: ModelConfig) -> list[ModelConfig]:
    """The models on `held`'s device that can never be loaded while `held` stays (at its weights and
    its minimum lease): the engine's own fit rule with `held` counted as pinned (one that can never
    fit at all, `never`, is warned of on its own)."""
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy

    engine = Engine(c, create_policy("residency"))
    engine.models[held.name].pinned = True
    engine.recheck_fit()
    return [
        x
        for x in c.models
        if x.device == held.device and x is not held and not never[x.name] and engine.never_fits[x.name]
    ]


def _forever_blocks(c: Config, never: dict[str, str]) -> list[str]:
    """`config check`'s warnings of unpinned models kept `forever` whose room other models' requests can
    never take (their class may not evict, or is lower): once such a model is loaded, a model that
    cannot fit beside it never loads there, and its requests wait until their class's max_wait (or for
    good) and are refused. And of a world model (elastic) that a model cannot fit beside during a
    session (busy: no one may evict it), whose requests wait for the session's end."""
    out = []
    rank = {cls.name: i for i, cls in enumerate(c.classes)}
    may_evict = [cls.may_evict for cls in c.classes]
    for i, f in enumerate(c.models):
        if f.pin or (f.keep_alive != math.inf and f.elastic is None):
            continue
        beside = _not_beside(c, never, f)  # (one engine's fit rule serves both warnings)
        if f.keep_alive == math.inf:
            blocked = [
                x.name for x in beside if not may_evict[rank[x.class_]] or rank[x.class_] > rank[f.class_]
            ]
            if blocked:
                out.append(
                    f"models[{i}] ({f.name}): keep_alive: forever without a pin: once it is loaded, "
                    f"{', '.join(blocked)} can never load on {f.device} beside it (their classes may not "
                    "evict it): their requests wait for room that never comes, refused at their class's "
                    "max_wait or their deadline; pin it, give it a finite keep_alive, or make room"
                )
        if f.elastic is not None:
            usable = next(d.usable for d in c.devices if d.name == f.device)
            if f.memory + f.elastic.max > usable:
                out.append(
                    f"models[{i}] ({f.name}): elastic.max {format_size(f.elastic.max)} and its "
                    f"{format_size(f.memory)} are more than {f.device} can hold ({format_size(usable)} "
                    f"usable): its lease never grows past {format_size(max(usable - f.memory, 0))}"
                )
            blocked = [x.name for x in beside]
            if blocked:
                out.append(
                    f"models[{i}] ({f.name}): during one of its sessions ({format_size(f.memory)} and a "
                    f"lease of at least {format_size(f.elastic.min)}, busy: no one may evict it) "
                    f"{', '.join(blocked)} cannot load on {f.device}: their requests wait for the session's "
                    "end (give their classes a max_wait, or make room)"
                )
    return out


def cmd_check(a: argparse.Namespace) -> int:
    from manager.api.server import is_loopback

    c = load_config(a.config)
    env = c.server.auth_token_env
    if not env and not is_loopback(c.server.listen):  # `serve` refuses it: said now, as an error
        raise UsageError(
            f"{a.config}: server.listen {c.server.listen!r} is beyond loopback but server.auth_token_env "
            "is null: `residency serve` refuses to listen there without a bearer token (name the "
            "environment variable that will hold it)"
        )
    metrics = c.server.metrics_listen
    if not env and metrics and not is_loopback(metrics):  # `serve` refuses it too
        raise UsageError(
            f"{a.config}: server.metrics_listen {metrics!r} is beyond loopback but server.auth_token_env "
            "is null: `residency serve` refuses to serve metrics there without a bearer token (scrapers "
            "send it), or listen on loopback"
        )
    _check_tls_pair(a.config, c)
    _warn_relative_store(a.config, c)
    if env and env in os.environ and not os.environ[env].strip():
        err.print(
            f"{a.config}: warning: server.auth_token_env names ${env}, which is set but empty here "
            "(`residency serve` refuses to start with it)",
            highlight=False,
            markup=False,
        )
    elif env and not os.environ.get(env):
        where = (
            "and `serve` would refuse to listen beyond loopback"
            if not is_loopback(c.server.listen)
            else "and `serve` would refuse to serve metrics beyond loopback"
            if metrics and not is_loopback(metrics)
            else ("and admin calls would need no token")
        )
        err.print(
            f"{a.config}: warning: server.auth_token_env names ${env}, which is not set here ({where})",
            highlight=False,
            markup=False,
        )
    else:  # a token `serve` refuses (a space at an end, a newline): `serve`'s own rule, said now
        from manager.api.runtime import ServeError
        from manager.api.server import auth_token

        try:
            auth_token(c)
        except ServeError as e:
            err.print(
                f"{a.config}: warning: `residency serve` would refuse to start here: {e}",
                highlight=False,
                markup=False,
            )
    from manager.policy.engine import Engine
    from manager.policy.factory import create_policy

    never = Engine(c, create_policy("residency")).never_fits  # the engine's own rule (any policy's)
    for i, m in enumerate(c.models):
        if never[m.name]:
            err.print(
                f"{a.config}: warning: models[{i}] ({m.name}): {never[m.name]}: every request for it "
                "will be refused while these pins and reservations stand",
                highlight=False,
                markup=False,
            )
    for warning in _forever_blocks(c, never):
        err.print(f"{a.config}: warning: {warning}", highlight=False, markup=False)
    cpus = [d for d in c.devices if d.kind == "cpu"]
    both = sum(d.memory for d in cpus) + c.host.usable
    if cpus and both > c.host.memory:
        on = ", ".join(f"{d.name} {format_size(d.memory)}" for d in cpus)
        err.print(
            f"{a.config}: warning: devices ({on}) of kind cpu hold their models in host RAM, and the host "
            f"tier may use {format_size(c.host.usable)} of it beside them: "
            f"{format_size(both)} of a {format_size(c.host.memory)} "
            "host.memory, so keeping to the budgets does not keep RAM from running out: split host.memory "
            "between them (a larger host.reserve, or smaller cpu devices)",
            highlight=False,
            markup=False,
        )
    for i, cls in enumerate(c.classes[:-1]):  # (the lowest class's reserve holds nothing back: none is below)
        runs = {m.device for m in c.models if m.class_ == cls.name}
        idle = [repr(d.name) for d in c.devices if d.kind == "cuda" and cls.reserve and d.name not in runs]
        if idle:
            err.print(
                f"{a.config}: warning: classes[{i}] ({cls.name}): its reserve of {format_size(cls.reserve)} "
                f"is held on {', '.join(idle)} too, where no {cls.name} model runs: the lower classes' "
                f"models there may not use it (only requests of class {cls.name} or higher can)",
                highlight=False,
                markup=False,
            )
    if c.policy.name == "oracle":
        err.print(
            f"{a.config}: warning: policy.name: 'oracle' sees every request of a trace in advance: "
            "`residency replay` and `tune` run it, `residency serve` refuses it",
            highlight=False,
            markup=False,
        )
    # the result on stdout (`config check FILE && ...`, or its line captured); warnings and errors on stderr
    print(
        f"{a.config}: ok ({_count(len(c.devices), 'device')}, {_count(len(c.classes), 'class', 'classes')}, "
        f"{_count(len(c.models), 'model')})"
    )
    return 0


def _export(config: Config, since: str, out: Path | TextIO) -> int:
    """Write the store's requests of the last `since` to `out`, a file or a stream (user errors as
    UsageError; a BrokenPipeError, its reader gone, as it is).

    Read-only: a store that does not exist yet is an error, never created (a mistyped path in the
    config must not become a new, empty store)."""
    import time

    from manager.store import StoreError, open_store
    from manager.store.export import check_out_path, export_trace, parse_since

    try:
        seconds = parse_since(since)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        if isinstance(out, Path):
            check_out_path(out)
    except IsADirectoryError:
        raise UsageError(f"--out {out}: is a directory; give the path of a file to write") from None
    if isinstance(out, Path):
        _not_the_services_file(config, out)
    skipped: list[StoreError] = []
    try:
        store = open_store(config.store.url, create=False)
        try:
            n = export_trace(store, seconds, time.time(), out, skipped=skipped)
        finally:
            store.close()
    except StoreError as e:
        raise UsageError(str(e)) from None
    except BrokenPipeError:
        raise
    except OSError as e:
        raise UsageError(f"--out {out if isinstance(out, Path) else '-'}: {e.strerror or e}") from None
    if skipped:  # the rest is exported, as a trace file's bad lines are skipped
        first = skipped[0]
        err.print(
            f"skipped {len(skipped)} damaged request record(s) in the store (first: {first}); "
            "repair or delete them to read them",
            highlight=False,
            markup=False,
        )
    return n


def _load_store_trace(config: Config, since: str, strict: bool) -> list[Request]:
    """The store's requests of the last `since`, through a trace file in a temporary folder that is
    removed whatever happens."""
    import tempfile

    from manager.store.base import store_location

    with tempfile.TemporaryDirectory(prefix="residency-tune-") as tmp:
        out = Path(tmp) / "requests.jsonl"
        n = _export(config, since, out)
        err.print(
            f"tuning on {n} requests of the last {since} from {store_location(config.store.url)}",
            highlight=False,
            markup=False,
        )
        try:
            res = read_trace(out, known_classes=[c.name for c in config.classes])
        except TraceError as e:  # (named as the store's log: the temporary file is gone by now)
            raise UsageError(f"the store's request log: {e.reason}") from None
    names = set(config.model_names())
    reqs = [r for r in res.requests if r.model in names]
    if len(reqs) < len(res.requests):  # the log keeps them; tuning is for the models configured now
        gone = sorted({r.model for r in res.requests} - names)
        err.print(
            f"left out {len(res.requests) - len(reqs)} logged requests of models no longer in the "
            f"config: {', '.join(gone[:MAX_REASONS_SHOWN])}{', …' if len(gone) > MAX_REASONS_SHOWN else ''}",
            highlight=False,
            markup=False,
        )
    if res.bad_lines:  # a class renamed since, say: counted (fatal with --strict), never a temp file named
        line, reason = res.bad_lines[0]
        what = f"{len(res.bad_lines)} logged requests the replay cannot take (record {line}: {reason})"
        if strict:
            raise UsageError(f"the store's request log: {what}")
        err.print(f"[yellow]skipped[/] {escape(what)}", highlight=False)
    return reqs


def _store_measured(config: Config) -> dict[str, tuple[int, dict[str, float]]] | None:
    """The footprints and load seconds the service measured, from the statistics it saved in its store
    (`saved_measurements`), which `tune --from-store`'s replays take as the service's own tuning does;
    None when there are none to read (the store holds no statistics yet, or cannot give them: said,
    and the config's estimates are used)."""
    from manager.live_persist import saved_measurements
    from manager.store import StoreError, open_store

    try:
        store = open_store(config.store.url, create=False)
        try:
            doc = store.get_doc("stats")
        finally:
            store.close()
    except StoreError as e:  # (CorruptDocument too: an unreadable snapshot is the service's to set aside)
        err.print(
            f"the statistics saved in the store could not be read ({e}); tuning with the config's "
            "sizes and load times",
            highlight=False,
            markup=False,
        )
        return None
    measured = saved_measurements(config, doc)
    if measured:
        err.print(
            f"tuning with the sizes and load times the service measured ({', '.join(sorted(measured))}), "
            "as its scheduled tuning does",
            highlight=False,
            markup=False,
        )
    return measured or None


def _write_tuned(config: str, out: str, res: Any, header: str, read: bytes) -> None:
    """The tuned config at `out`, whole or not at all (`out` may be the config itself, which a
    running service watches), with the config's mode; UsageError naming --out when it is not, and
    naming --config when it no longer holds `read` (what the search was measured on: an edit saved
    meanwhile would go into `out` unmeasured, and its "was" notes would speak of the edit)."""
    from manager.tuning_job import NotWritable, write_config_atomically

    def write(tmp: Path) -> Config:
        try:
            now = Path(config).read_bytes()
        except OSError as e:
            now = str(e).encode()
        if now != read:
            raise UsageError(
                f"--config {config} changed while tune ran (saved meanwhile): the search measured it as "
                f"it was, so --out {out} was not written; run tune again"
            )
        return write_config_with_updates(
            Path(config), tmp, res.model_updates, res.class_updates, header, note_changes=True
        )

    try:
        write_config_atomically(Path(out), write, mode=Path(config).stat().st_mode & 0o7777)
    except NotWritable as e:
        raise UsageError(f"--out {out}: not written: {e.why}") from None
    except ValueError as e:  # a YAML share the tuned fields cannot be written through (said how)
        raise UsageError(f"--out {out}: not written: {e}") from None


def cmd_tune(a: argparse.Namespace) -> int:
    from manager.replay.tune import MIN_MODEL_REQUESTS, split_holdout, tune

    config = load_config(a.config)  # (it refuses a FIFO, a device, a file too large, by name)
    try:  # what the search measures: --out is written only if the file still holds it
        read = Path(a.config).read_bytes()
    except OSError:
        read = b""  # (gone since: --out is not written, said then)
    a.policy = a.policy or config.policy.name  # the policy the config runs, as the service's tuning job
    # an empty value (an unset shell variable) is said, not taken as the flag not given
    if not a.from_store and a.trace is None:
        raise UsageError("give --trace FILE, or --from-store to tune on the service's request log")
    if a.from_store and a.trace is not None:  # one would be ignored: which was tuned on?
        raise UsageError(f"--trace {a.trace} and --from-store: give one of them, not both")
    if a.since is not None and not a.from_store:
        raise UsageError(f"--since {a.since}: only with --from-store (--trace tunes on the whole file)")
    a.since = DEFAULT_SINCE if a.since is None else a.since
    if a.holdout is not None:
        _not_empty(a.holdout, "--holdout", "a trace file")
    if a.trace == STDIN and a.holdout == STDIN:  # one standard input: the holdout would find it empty
        raise UsageError(
            "--trace - and --holdout -: both read standard input, which holds one trace; give one of "
            "them as a file"
        )
    _check_tune_outputs(a)
    bad = 0  # the trace's lines skipped
    if a.from_store:
        from manager.store.base import store_location

        reqs = _load_store_trace(config, a.since, a.strict)
        measured = _store_measured(config)
        a.trace = f"the store's last {a.since} ({store_location(config.store.url)})"
    else:
        reqs, bad = _load_trace(a.trace, config, a.strict, "--trace")
    holdout_bad = bad  # (split from the same trace: its lines skipped)
    if not a.from_store:
        measured = None  # a trace file: the config's estimates (its machine is the config's)
    if a.holdout:
        search, (holdout, holdout_bad) = reqs, _load_trace(a.holdout, config, a.strict, "--holdout")
        search = _outside_holdout(a, search, holdout)
    else:
        search, holdout = split_holdout(reqs)
    if not search and reqs:
        span = reqs[-1].t - reqs[0].t
        raise UsageError(
            f"{a.trace}: trace too short to split into search and holdout ({len(reqs)} request(s) over "
            f"{span:g} s); give --holdout or a longer trace"
        )
    if not search:
        raise UsageError(f"{a.trace}: no valid requests to tune on")
    if a.holdout and not holdout:
        raise UsageError(f"--holdout {a.holdout}: no valid requests to judge the result on")
    shown = holdout or search  # what the report replays (one request will do: see _report)
    # the inputs are good: the folders are made now, before the search (as `trace synth` does)
    _prepare_out_file(a.out, "--out")
    if a.report:
        _prepare_dir(Path(a.report), "--report")
    with Progress(console=err, transient=True, disable=not err.is_terminal) as prog:
        task = prog.add_task("tuning", total=None)
        res = tune(
            config,
            search,
            holdout,
            policy=a.policy,
            progress=lambda s: prog.update(task, description=s),
            min_requests=MIN_MODEL_REQUESTS,  # a model with fewer is left as configured, and named
            measured=measured,
        )
    for w in res.warnings:  # thin data: said whatever the output's form, on stderr (the file's name
        # printable: a byte that is not UTF-8, or a control character, as its escape, as in the header)
        named = escape(_printable(_trace_name(a.trace)))
        err.print(f"[yellow]{named}: warning:[/] {escape(w)}", highlight=False)
    header = (
        f"Tuned by `residency tune` from {a.config} on {_trace_name(a.trace)} ({len(search)} requests); "
        f"{len(res.changes)} change(s): {'; '.join(res.changes) or 'none'}"
    )
    _count_bad_lines(res, bad, holdout_bad)
    _write_tune_files(a, config, res, shown, header, read, measured)
    fig: dict[str, Any] = {
        "out": a.out,
        "evaluations": res.evaluations,
        "changes": res.changes,
        "search": {"before": res.search_before.to_json(), "after": res.search_after.to_json()},
        "warnings": res.warnings,
    }
    if res.holdout_before is not None and res.holdout_after is not None:
        fig["holdout"] = {"before": res.holdout_before.to_json(), "after": res.holdout_after.to_json()}
    if a.report:
        fig["report"] = str(Path(a.report) / "index.html")
    if a.json:
        _print_json(fig)
    else:
        which = "holdout" if "holdout" in fig else "search"
        before = res.holdout_before if res.holdout_before else res.search_before
        after = res.holdout_after if res.holdout_after else res.search_after
        title = f"{which} trace, policy {a.policy}: before vs after tuning"
        _out().print(_table([before, after], title, names=["before", "after"]))
        err.print(
            f"wrote {a.out}; changes: {'; '.join(res.changes) or 'none'}", highlight=False, markup=False
        )
    return 0


def _outside_holdout(a: argparse.Namespace, search: list[Request], holdout: list[Request]) -> list[Request]:
    """`tune`'s search requests less those within the --holdout's span (its first to its last
    arrival): days the result is judged on are not searched on (a holdout cut from the same week
    was searched and then judged, its before/after figures no test of the tuning). Said on stderr;
    UsageError when nothing is left to search."""
    if not search or not holdout:
        return search
    first, last = holdout[0].t, holdout[-1].t
    kept = [r for r in search if not first <= r.t <= last]
    if len(kept) == len(search):
        return search
    span = f"{_utc(first)} to {_utc(last)}"
    if not kept:
        raise UsageError(
            f"--holdout {a.holdout} spans {span}, which holds every request of --trace "
            f"{_trace_name(a.trace)}: nothing is left to search; give a holdout of other days (or no "
            "--holdout: the trace's last days are held out)"
        )
    err.print(
        f"[yellow]--holdout {escape(_printable(a.holdout))}: warning:[/] it spans {span}, and "
        f"{len(search) - len(kept)} of the {len(search)} requests of --trace fall in it: the search "
        "leaves them out (the result is judged on days it was not tuned on)",
        highlight=False,
    )
    return kept


def _utc(t: float) -> str:
    """A Unix time as a UTC date and time to the minute (a trace's times are true Unix times)."""
    try:
        return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):  # (a time past the calendar's years: said as it is)
        return f"t={t:g}"


def _count_bad_lines(res: Any, bad: int, holdout_bad: int) -> None:
    """`tune`'s replay figures carry the lines of their trace that were skipped (`bad`: --trace's,
    `holdout_bad`: --holdout's), as `replay --json` counts them."""
    for r in (res.search_before, res.search_after):
        r.bad_lines = bad
    for r in (res.holdout_before, res.holdout_after):
        if r is not None:
            r.bad_lines = holdout_bad


def _write_tune_files(
    a: argparse.Namespace,
    config: Config,
    res: Any,
    shown: list[Request],
    header: str,
    read: bytes,
    measured: dict[str, tuple[int, dict[str, float]]] | None = None,
) -> None:
    """`tune`'s report (--report) and then its tuned config (--out): a report that cannot be written
    (a full disk) leaves --out as it was, and says so naming --report and the file. `read`: the
    config file's bytes the search measured (`_write_tuned`)."""
    if a.report:
        try:
            _report(a, config, res, shown, measured)
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise UsageError(
                f"--report {a.report}: {e.strerror or e}{where}; the report was not written (its files "
                f"there are as they were), nor --out {a.out}"
            ) from None
        except (ValueError, RuntimeError) as e:  # matplotlib's own refusal of a text or a figure
            raise UsageError(
                f"--report {a.report}: a plot could not be drawn ({' '.join(str(e).split())[:300]}); the "
                f"report was not written (its files there are as they were), nor --out {a.out}"
            ) from None
    _write_tuned(a.config, a.out, res, header, read)


def _report(
    a: argparse.Namespace,
    config: Config,
    res: Any,
    reqs: list[Request],
    measured: dict[str, tuple[int, dict[str, float]]] | None = None,
) -> None:
    """`tune --report`: `measured` (with --from-store), the machine the verdict replayed (`as_measured`),
    which the report's replays and sizes are of too."""
    from manager.policy.stats import home_hours
    from manager.replay.report import report_period, write_report
    from manager.replay.tune import as_measured

    ran = as_measured(config, measured)
    before = replay(ran, reqs, a.policy, record=True)
    after = replay(as_measured(res.config, measured), reqs, a.policy, record=True)
    weights = {m.name: m.memory for m in ran.models}
    t0, t1 = report_period(reqs) if reqs else (0.0, 1.0)
    # a holdout of a moment (one request; requests of busy_s 0 at one instant span no time at all)
    # is shown over at least a minute from its first arrival: the loads it started, not nothing
    t1 = max(t1, t0 + MIN_REPORT_PERIOD_S)
    notes = [f"change: {c}" for c in res.changes] or ["no change beat the running config"]
    notes += [f"warning: {w}" for w in res.warnings]
    write_report(
        Path(a.report), before=before, after=after, t_start=t0, t_end=t1, model_weights=weights, notes=notes,
        model_devices={m.name: m.device for m in config.models}, hours=home_hours(config.policy.timezone),
    )  # fmt: skip


def cmd_measure(a: argparse.Namespace) -> int:
    from manager import measure

    config = load_config(a.config)
    names = {m.name for m in config.models}
    unknown = [n for n in a.model or [] if n not in names]
    if unknown:
        raise UsageError(f"--model {unknown[0]}: not in {a.config} (models: {', '.join(sorted(names))})")
    if a.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if a.write_config is not None:  # checked (and its folder made) before measuring, not after
        _prepare_out_file(a.write_config, "--write-config", replaced=True)
    results = measure.measure_all(config, a.model or None, a.repeats)
    failed = [r.name for r in results if not r.ok]
    unwritten = ""
    if a.write_config is not None and failed and not a.allow_missing:
        # (a file that held an earlier run's measurements would get the config's estimates back for
        # the models that failed: written only when --allow-missing says the others are wanted)
        unwritten = (
            f"--write-config {a.write_config}: not written: {_count(len(failed), 'model')} could not be "
            f"measured ({', '.join(failed)}); --allow-missing writes the others' measurements"
        )
    elif a.write_config is not None:
        measure.write_measured_config(Path(a.config), Path(a.write_config), results)
        for note in measure.reordered(results, config):  # (a load time written other than measured)
            err.print(
                f"residency: --write-config {a.write_config}: {note}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    if a.json:
        _print_json(measure.as_json(results), indent=2)
    else:
        out = _out()
        out.print(_measure_table(results))
        for r in results:  # under the table, whole (a table cell would cut it to the column's width)
            if not r.ok:
                out.print(f"{r.name}: {r.error}", highlight=False, markup=False, soft_wrap=True)
            elif r.cold_was_cached:
                out.print(
                    f"{r.name}: its files stayed in the OS page cache (tmpfs, or mapped elsewhere): its "
                    "cold load is a page-cache load, and --write-config keeps the config's disk estimate",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
    if unwritten:
        err.print(f"residency: {unwritten}", highlight=False, markup=False, soft_wrap=True)
    return 0 if all(r.ok for r in results) or a.allow_missing else 1


def _measure_table(results: list[Any]) -> Table:
    t = Table(title="Measured load times per transition (median seconds)")
    for col in ("model", "transition", "total", "read", "deser.", "to-dev", "warm", "MiB"):
        t.add_column(col, justify="left" if col in ("model", "transition") else "right", no_wrap=True)
    for r in results:
        if not r.ok:
            t.add_row(escape(r.name), "[red]could not load (below)[/red]", *[""] * 6)
            continue
        for i, (k, x) in enumerate(r.transitions.items()):
            phases = [
                f"{x[p]:.3f}" for p in ("total_s", "read_s", "deserialize_s", "to_device_s", "warmup_s")
            ]
            label = escape([r.name, _mib(r.footprint_bytes), r.measured_on][i]) if i < 3 else ""
            t.add_row(label, k, *phases, f"{x['bytes'] / 2**20:.1f}", end_section=i == len(r.transitions) - 1)
    return t


def _stopped_during_start_up(signum: int) -> int:
    """One line for a stop signal during `serve`'s start, its exit status 128 + `signum`. The process
    ends: no library's INFO lines at its exit (torch's FakeTensor cache statistics, an import the
    signal cut short, were logged as the service's log level let them)."""
    import logging

    logging.disable(logging.INFO)
    err.print(
        f"residency: stopped during start-up ({signal.Signals(signum).name})", highlight=False, markup=False
    )
    return 128 + signum


def cmd_serve(a: argparse.Namespace) -> int:
    from workers.signals import StopSignal, stop_signals_raise  # (light: no torch, no Ray)

    try:
        # from before `serve`'s heavy imports (torch, Ray), a stop signal (SIGTERM always; SIGINT and
        # SIGHUP unless the process was started with them ignored) stops its start as one does once
        # its own handlers are in place (they replace these): it killed the process without a word
        # (SIGTERM) or was a KeyboardInterrupt
        with stop_signals_raise():
            return _serve(a)
    except StopSignal as e:  # before serve's own handlers were in place: as for a signal after
        return _stopped_during_start_up(e.signum)
    except KeyboardInterrupt:  # a Ctrl-C not handled as a stop signal (not expected)
        err.print("residency: interrupted", highlight=False, markup=False)
        return 130


def _serve(a: argparse.Namespace) -> int:
    import asyncio
    import logging

    from manager.api.runtime import ServeError, event_loop_factory, quiet_grpc_fork

    quiet_grpc_fork()  # before gRPC starts (manager.api.server imports it)
    from manager.api.admin import file_identity
    from manager.api.server import StoppedAtStartUp, serve
    from manager.store import StoreError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seen = file_identity(a.config)  # before it is read: an edit saved from now on is reloaded
    config = load_config(a.config)
    if a.listen is not None:
        from pydantic import ValidationError

        from manager.config import ServerConfig

        _check_host_port("--listen", a.listen)
        try:  # model_copy(update=...) would skip validation: the server section is validated again
            server = ServerConfig.model_validate({**config.server.model_dump(), "listen": a.listen})
        except ValidationError as e:
            raise UsageError(f"--listen {a.listen}: {e.errors(include_url=False)[0]['msg']}") from None
        config = config.model_copy(update={"server": server})
    _warn_relative_store(a.config, config)

    from manager.workers_bridge import cuda_missing_here

    fallback = (
        frozenset(cuda_missing_here(config, in_process=a.in_process)) if a.cpu_fallback else frozenset()
    )
    for name in sorted(fallback):
        err.print(
            f"residency: CUDA is not available on this machine: device {name!r} runs its models on the CPU "
            "(its configured budget is kept; --no-cpu-fallback turns this off)",
            highlight=False,
            markup=False,
        )

    from manager.store.base import store_location

    store = store_location(config.store.url)  # (a relative SQLite path with the file it opened)

    def ready(port: int) -> None:
        host = config.server.listen.rpartition(":")[0]
        err.print(
            f"residency: serving on {host}:{port} (config {a.config}), store {store}",
            highlight=False,
            markup=False,
        )

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(
                serve(
                    config,
                    config_path=a.config,
                    in_process=a.in_process,
                    cpu_fallback=fallback,
                    ready=ready,
                    server_overrides={"listen": a.listen} if a.listen is not None else None,
                    config_seen=seen,
                )
            )
    except StoppedAtStartUp as e:  # a signal before it was ready: one line, as for Ctrl-C at start
        return _stopped_during_start_up(e.signum)
    except (ServeError, StoreError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # a file or socket it cannot have: its own words, without "[Errno N]"
        if e.strerror and e.errno is not None and str(e).startswith(f"[Errno {e.errno}] "):
            raise UsageError(str(e).removeprefix(f"[Errno {e.errno}] ")) from None
        raise
    return 0


@dataclass(frozen=True)
class _Connection:
    """Where and how the admin commands (and `ps`) reach the service: its address, the bearer token
    (and the variable it came from), the TLS certificate to trust (None: plaintext); `cert_names`:
    the host names and addresses that certificate holds (as far as they can be read); `listen`: the
    config's wildcard `server.listen` that `target` dials on loopback (None: not one)."""

    target: str
    token: str | None
    token_env: str | None
    root_cert: bytes | None
    cert_names: tuple[str, ...] = ()
    listen: str | None = None


def _cert_names(path: str) -> tuple[str, ...]:
    """The DNS names and IP addresses the certificate in the PEM file `path` holds (its first one, a
    server's own in a chain), as TLS matches them against the name dialled: its subjectAltName
    entries, else its common name when that looks like a host name; () when they cannot be read
    (the standard library's decoder, private to `ssl`, missing or refusing the file)."""
    import importlib

    decode = getattr(importlib.import_module("_ssl"), "_test_decode_cert", None)
    try:
        cert = decode(path) if decode is not None else {}
    except Exception:  # a file that is not a certificate: gRPC's check names that (check_root_cert)
        return ()
    if not isinstance(cert, dict):
        return ()
    sans = tuple(str(v) for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "IP Address"))
    if sans:
        return sans
    common = [str(v) for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    return tuple(c for c in common if c and " " not in c)


def _wildcard_host(listen: str) -> str | None:
    """The host of `listen` when it is a wildcard address (0.0.0.0, ::, [::]: every address of this
    machine, which a client cannot dial by that name over TLS), else None."""
    import ipaddress

    host = listen.rpartition(":")[0].strip("[]")
    try:
        return host if ipaddress.ip_address(host).is_unspecified else None
    except ValueError:
        return None


def _loopback_for(host: str, tls: bool, names: tuple[str, ...]) -> str:
    """The loopback host to dial a service listening on the wildcard `host` by: over TLS, a loopback
    name its certificate holds (`localhost` first, which reaches IPv4 and IPv6 listeners alike, then
    127.0.0.1 or ::1; `localhost` when it holds none: the failure then says to give --target); in
    plaintext, the loopback address of the wildcard's family."""
    v6 = ":" in host
    if tls:
        held = {n.lower().removesuffix(".") for n in names}
        for candidate, shown in (("localhost", "localhost"), ("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")):
            if candidate in held:
                return shown
        return "localhost"
    return "[::1]" if v6 else "127.0.0.1"


def _connection(a: argparse.Namespace) -> _Connection:
    """The service's address, token and TLS certificate from --target, --token-env, --tls-cert, and
    --config for what they leave out (its server.listen, auth_token_env, tls_cert); UsageError for a
    bad value. A wildcard server.listen (0.0.0.0, ::) is dialled on loopback (`_loopback_for`): the
    service is on this machine, and TLS checks its certificate against the name dialled; a --target
    is dialled as given."""
    # (its server section alone: a mistake elsewhere in the file is the service's to refuse)
    server = load_server_settings(a.config) if a.config else None
    if a.target is not None:
        _check_host_port("--target", a.target)
    target = a.target or (server.listen if server else "127.0.0.1:50051")
    # the config's TLS certificate and token variable are the defaults: a TLS server speaks only TLS
    cert_path = a.tls_cert or (server.tls_cert if server else None)
    root_cert = None
    names: tuple[str, ...] = ()
    if cert_path:
        try:
            root_cert = Path(cert_path).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read the TLS certificate {cert_path}: {e.strerror or e}") from None
        names = _cert_names(cert_path)
    listen = None
    wildcard = _wildcard_host(target) if a.target is None and server is not None else None
    if wildcard is not None:
        listen = target
        target = f"{_loopback_for(wildcard, root_cert is not None, names)}:{target.rpartition(':')[2]}"
    token_env = a.token_env or (server.auth_token_env if server else None)
    token = os.environ.get(token_env) if token_env else None
    if a.token_env and token is None:
        raise UsageError(f"--token-env {a.token_env}: no such environment variable")
    return _Connection(target, token, token_env, root_cert, names, listen)


def _hostname_hint(conn: _Connection) -> str:
    """What to do when TLS refused the service's certificate for the name dialled: give --target
    with a name the certificate holds (those it holds, when they can be read)."""
    host, _, port = conn.target.rpartition(":")
    names = [n for n in conn.cert_names if "*" not in n]  # (a wildcard name is no host to dial)
    dial = f"[{names[0]}]" if names and ":" in names[0] else names[0] if names else "HOST"
    why = (
        f"server.listen {conn.listen} is every address of the service's machine, so this dialled "
        f"{host} on loopback, a name its TLS certificate does not hold"
        if conn.listen
        else f"its TLS certificate does not hold the name {host}"
    )
    if conn.cert_names:
        return f" ({why}; it holds {', '.join(conn.cert_names)}: give --target {dial}:{port})"
    return f" ({why}: give --target HOST:{port} with a name the certificate holds)"


def _client_error(e: Any, conn: _Connection, *, refusals: bool = False) -> Exception:
    """The ClientError `e` as what the command line says: a Refused (exit 1) when the service itself
    refused the call and `refusals`, else a UsageError (exit 2: it could not be reached, it wants a
    token, the token or certificate cannot be sent), naming why no token was sent when it wanted one,
    and what to do when TLS refused the certificate for the name dialled (`_hostname_hint`)."""
    hint = ""
    if e.code == "UNAUTHENTICATED" and conn.token is None:  # say why no token was sent
        hint = (
            f" (no token was sent: ${conn.token_env} is not set here)"
            if conn.token_env
            else " (no token was sent: name its variable with --token-env, or give --config)"
        )
    elif conn.root_cert is not None and "Hostname Verification Check failed" in str(e):
        hint = _hostname_hint(conn)
    if refusals and e.answered and e.code != "UNAUTHENTICATED":
        return Refused(f"{e}")
    return UsageError(f"{e}{hint}")


def _shown_duration(s: float) -> str:
    """`s` seconds as `ps` shows a time: whole seconds as the config writes a duration (`4m12s`,
    `2h`, `0s`), a negative one (the service's word for no end) as `forever`."""
    if math.isnan(s):
        return "-"
    if s < 0 or math.isinf(s):
        return "forever"
    return format_duration(round(s))


def cmd_ps(a: argparse.Namespace) -> int:
    from manager.api.client import ClientError, as_dict, list_models

    conn = _connection(a)
    target = conn.target
    try:
        resp = list_models(target, conn.token, root_cert=conn.root_cert)
    except ClientError as e:
        raise _client_error(e, conn) from None
    if a.json:
        _print_json(as_dict(resp), indent=2)
        return 0
    t = Table(title=escape(f"Residency on {target}"))
    for col in (
        "model",
        "tier",
        "device",
        "class",
        "pin",
        "MiB",
        "lease MiB",  # an elastic model's KV lease (the world model's), beside its weights
        "keep-alive",  # the window in force, and whose word it is (pin, request, config, policy)
        "keep-alive left",
        "last use",
        "load s (disk/cached/host)",
    ):
        t.add_column(col, overflow="fold")  # a name too long for the terminal wraps, never cut
    import time as _time

    for m in resp.models:
        left = _shown_duration(m.keep_alive_left_s) if m.keep_alive_left_s else "-"
        keep = (  # (an older server sends no keep_alive_from)
            f"{_shown_duration(m.keep_alive_s)} ({m.keep_alive_from})" if m.keep_alive_from else "-"
        )
        ago = max(0.0, _time.time() - m.last_used)  # (the server's clock may be ahead: manager.clock)
        last = f"{_shown_duration(ago)} ago" if m.last_used else "never"
        ls = m.load_seconds
        names = [escape(x) for x in (m.name, m.tier, m.device, m.class_name)]  # the server's text, not markup
        lease = f"{m.lease_bytes / 2**20:.1f}" if m.lease_bytes else ""  # none: not elastic (or none held)
        t.add_row(*names, "yes" if m.pinned else "", f"{m.bytes / 2**20:.1f}", lease, escape(keep),
                  left, last, f"{ls.disk:.3f}/{ls.cached:.3f}/{ls.host:.3f}")  # fmt: skip
    console = _out()
    console.print(t)
    for m in resp.models:  # whole, one line each (the terminal wraps it), as `measure` prints its errors
        if m.last_error:
            console.print(
                f"{m.name}: last load failed: {m.last_error}", highlight=False, markup=False, soft_wrap=True
            )
    return 0


def _admin(a: argparse.Namespace, method: str, request: Any, timeout_s: float | None = None) -> Any:
    """The service's answer to the admin call `method` with `request`, reached as `ps` reaches it;
    Refused (exit 1) when the service refuses it, UsageError (exit 2) when it cannot be made."""
    from manager.api.client import ADMIN_TIMEOUT_S, ClientError, admin_call

    conn = _connection(a)
    try:
        return admin_call(
            conn.target, conn.token, method, request, timeout_s or ADMIN_TIMEOUT_S, root_cert=conn.root_cert
        )
    except ClientError as e:
        raise _client_error(e, conn, refusals=True) from None


def _model_arg(a: argparse.Namespace) -> str:
    """The MODEL argument, not empty (an unset shell variable)."""
    if not a.model:
        raise UsageError("MODEL is empty; give the name of a configured model (`residency ps` lists them)")
    name: str = a.model
    return name


def _said(text: str) -> str:
    """The service's `text` on one line (a model's error may hold newlines)."""
    return " ".join(text.splitlines())


def _model_result(a: argparse.Namespace, status: Any, what: str) -> int:
    """One line for the model `status` the service answered with after `what` (pinned, preloaded to
    gpu...), or its JSON with --json."""
    from manager.api.client import as_dict

    if a.json:
        _print_json(as_dict(status))
        return 0
    where = f"{status.tier} on {status.device}" if status.device else status.tier
    line = f"{status.name}: {what} (now {where})"
    if status.last_error:
        line += f"; its last load failed: {_said(status.last_error)}"
    print(line)
    return 0


def cmd_pin(a: argparse.Namespace) -> int:
    from residency_proto.v1 import residency_pb2 as pb

    status = _admin(a, "Pin", pb.ModelRequest(name=_model_arg(a)))
    return _model_result(a, status, "pinned")


def cmd_unpin(a: argparse.Namespace) -> int:
    from residency_proto.v1 import residency_pb2 as pb

    status = _admin(a, "Unpin", pb.ModelRequest(name=_model_arg(a)))
    return _model_result(a, status, "unpinned")


def _preload_wait(text: str) -> float:
    """`preload --timeout`: a duration (`90`, `10m`, `1h`), more than 0 and at most a day."""
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise UsageError(f"--timeout {text!r}: {e}") from None
    if not 0 < seconds <= 86_400:
        raise UsageError(f"--timeout {text!r}: expected more than 0 s and at most a day (1d)")
    return seconds


def cmd_preload(a: argparse.Namespace) -> int:
    from manager.api.client import PRELOAD_TIMEOUT_S
    from residency_proto.v1 import residency_pb2 as pb

    wait = PRELOAD_TIMEOUT_S if a.timeout is None else _preload_wait(a.timeout)
    status = _admin(a, "Preload", pb.PreloadRequest(name=_model_arg(a), tier=a.tier), wait)
    # a model already on the GPU asked into host RAM stays (a preload never moves one down)
    done = (
        "already on the gpu, kept there"
        if a.tier == "host" and status.tier == "gpu"
        else f"preloaded to {a.tier}"
    )
    return _model_result(a, status, done)


def cmd_evict(a: argparse.Namespace) -> int:
    from residency_proto.v1 import residency_pb2 as pb

    status = _admin(a, "Evict", pb.EvictRequest(name=_model_arg(a), to=a.to))
    if status.tier == a.to or a.json:
        return _model_result(a, status, f"evicted to {a.to}")
    if status.tier == "loading" and a.to == "host":  # its move to host RAM is still unconfirmed
        return _model_result(
            a, status, "on its way to host RAM (`residency ps` says loading until it is there)"
        )
    # a model serving requests (or a world session, or loading for them) goes when they end
    return _model_result(
        a, status, f"goes to {a.to} when its requests end (`residency events` says when: evict_deferred)"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_stats(a: argparse.Namespace) -> int:
    from manager.api.client import as_dict
    from residency_proto.v1 import residency_pb2 as pb

    s = _admin(a, "Stats", pb.StatsRequest())
    if a.json:
        _print_json(as_dict(s))
        return 0
    line = (
        f"requests {s.requests}, cold starts {s.cold_starts}, load wait {s.load_wait_s:.3f} s, "
        f"evictions {s.evictions}, thrash {s.thrash}, rejected {s.rejected}, errors {s.errors}, "
        f"failed runs {s.failed_runs}, cancelled {s.cancelled}, "
        f"budget violations {s.budget_violations}"
    )
    if s.wait_p99_s:
        line += "; wait p99: " + ", ".join(f"{c} {w:.3f} s" for c, w in sorted(s.wait_p99_s.items()))
    if s.resident_bytes:
        line += "; resident: " + ", ".join(f"{d} {_mib(b)}" for d, b in sorted(s.resident_bytes.items()))
    print(line)
    return 0


def cmd_reload(a: argparse.Namespace) -> int:
    from manager.api.client import as_dict
    from residency_proto.v1 import residency_pb2 as pb

    r = _admin(a, "ReloadConfig", pb.ReloadConfigRequest())
    if a.json:
        _print_json(as_dict(r))
    else:
        print(
            f"config reloaded from {_said(r.path)}: {_said(r.message)}"
            if r.path
            else f"config reloaded: {_said(r.message)}"
        )
    if a.config and r.path and not _same_config(a.config, r.path, r.sha256):
        # --config says how to reach the service; it reads its own file (the one `serve` was given)
        raise Refused(
            f"{_said(a.config)} was not read: the service serves {_said(r.path)} and read that file again "
            f"(--config only says how to reach the service). To serve {_said(a.config)}, copy it over "
            f"{_said(r.path)} (the service reads its file again when it changes) or restart "
            f"`residency serve --config {_said(a.config)}`"
        )
    return 0


def _same_config(mine: str, served: str, served_sha256: str) -> bool:
    """Whether the config file `mine` is the one the service read again (`served`, its path there):
    the same file here, or the same bytes (a service in a container or on another host reads its
    own copy at another path)."""
    import hashlib

    if os.path.realpath(mine) == os.path.realpath(served):
        return True
    try:
        with open(mine, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == served_sha256
    except OSError:
        return False


def _event_line(ev: Any) -> str:
    """One event on one line: its local time, kind, model, device and detail."""
    import datetime

    try:
        when = datetime.datetime.fromtimestamp(ev.t).isoformat(sep=" ", timespec="milliseconds")
    except (OverflowError, OSError, ValueError):  # a time no calendar holds: the number itself
        when = f"{ev.t:.3f}"
    parts = [when, ev.kind or "-", ev.model or "-"]
    if ev.device:
        parts.append(f"on {ev.device}")
    line = " ".join(_said(p) for p in parts)
    return f"{line}: {_said(ev.detail)}" if ev.detail else line


def cmd_events(a: argparse.Namespace) -> int:
    from manager.api.client import ClientError, as_dict, watch_events

    conn = _connection(a)
    events = watch_events(conn.target, conn.token, root_cert=conn.root_cert)
    try:
        for ev in events:
            if a.json:
                _print_json(as_dict(ev))
            else:
                print(_event_line(ev))
            sys.stdout.flush()  # each event as it comes, to a pipe too
    except ClientError as e:
        raise _client_error(e, conn, refusals=True) from None
    except KeyboardInterrupt:  # Ctrl-C: how one stops following the events, as `serve` is stopped
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):  # (a second Ctrl-C while the call is cancelled)
            events.close()
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    _not_empty(a.out, "--out", "a file to write")  # not ".", the folder an empty path is
    _not_a_folder_name(a.out, "--out")
    to_stdout = a.out == "-"  # as `trace synth --out -` (a file named "-" is ./-)
    n = _export(load_config(a.config), a.since, sys.stdout if to_stdout else Path(a.out))
    where = "standard output" if to_stdout else a.out
    err.print(f"wrote {_count(n, 'request')} to {where}", highlight=False, markup=False)
    return 0


def _version() -> str:
    """The installed package's version (pyproject.toml's), or "unknown" when run from a source tree
    that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("residency")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _connection_args(p: argparse.ArgumentParser) -> None:
    """The options that say where the service is and how to reach it (`ps` and the admin commands)."""
    p.add_argument("--config", help="the service's config: its server.listen, auth_token_env and tls_cert")
    p.add_argument(
        "--target",
        help="host:port of the server (default: the config's server.listen, a wildcard one (0.0.0.0, [::]) "
        "dialled on loopback; else 127.0.0.1:50051)",
    )
    p.add_argument(
        "--token-env",
        help="environment variable holding the admin bearer token (default: the config's auth_token_env)",
    )
    p.add_argument(
        "--tls-cert", help="PEM certificate of a TLS server, to trust (default: the config's server.tls_cert)"
    )


ADMIN_EXITS = (
    "Exit status: 0 done, 1 the service refused it (its reason is printed), 2 a usage error or the "
    "service cannot be reached."
)


def _admin_parsers(sub: Any) -> None:
    """The admin commands: residency.v1.Residency's calls on a running service."""

    def admin(name: str, help: str, fn: Any, *, model: str | None = None, json_help: str = "") -> Any:
        p = sub.add_parser(name, help=help, description=f"{help[0].upper()}{help[1:]}. {ADMIN_EXITS}")
        if model:
            p.add_argument("model", metavar="MODEL", help=model)
        _connection_args(p)
        p.add_argument(
            "--json", action="store_true", help=json_help or "print the service's answer as one JSON object"
        )
        p.set_defaults(fn=fn)
        return p

    admin("pin", "pin a model: loaded when there is room, never evicted", cmd_pin, model="the model to pin")
    admin("unpin", "unpin a model (its keep-alive applies again)", cmd_unpin, model="the model to unpin")
    pre = admin(
        "preload", "load a model into a tier ahead of its requests", cmd_preload, model="the model to load"
    )
    pre.add_argument(
        "--tier",
        choices=("gpu", "host"),
        default="gpu",
        help="gpu: ready to run (default); host: held in host RAM, a fast promote away",
    )
    pre.add_argument(
        "--timeout",
        metavar="DURATION",
        default=None,
        help="how long to wait for the confirmed load (default 150s; e.g. 10m for a big model's cold "
        "load from disk): past it, exit 1 with DEADLINE_EXCEEDED and the load goes on",
    )
    ev = admin(
        "evict", "demote a model to host RAM or drop it to disk", cmd_evict, model="the model to evict"
    )
    ev.add_argument(
        "--to",
        choices=("host", "disk"),
        default="disk",
        help="disk: drop it (default); host: keep it in host RAM (a model in use goes when its requests end)",
    )
    admin("stats", "the service's counters: requests, cold starts, waits, evictions, thrash", cmd_stats)
    admin(
        "reload",
        "make the service read its own config file (the one `serve` was given) again and apply what changed; "
        "exit 1 when --config names another file",
        cmd_reload,
    )
    admin(
        "events",
        "follow the residency events (loads, evictions, lease changes...), one line each, until Ctrl-C",
        cmd_events,
        json_help="one JSON object per line (JSON Lines) instead of text",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="residency", description="Decides which models stay resident.")
    p.add_argument("--version", action="version", version=f"residency {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    r = sub.add_parser("replay", help="replay a request trace through the policies")
    r.add_argument(
        "--config", required=True, help="config file (YAML); `residency config check` validates one"
    )
    r.add_argument("--trace", required=True, help="request trace (JSON Lines); - reads standard input")
    r.add_argument("--policy", choices=POLICY_NAMES, help="one policy (default: all side by side)")
    r.add_argument(
        "--json", action="store_true", help="one JSON object (the config's policy unless --policy)"
    )
    r.add_argument("--strict", action="store_true", help="a bad trace line is fatal")
    r.set_defaults(fn=cmd_replay)

    t = sub.add_parser("tune", help="tune keep-alives, prewarm and class reservations by replay")
    t.add_argument("--config", required=True, help="the config to start from (YAML)")
    t.add_argument("--trace", help="request trace (JSON Lines; - reads standard input); or --from-store")
    t.add_argument("--from-store", action="store_true", help="tune on the service's request log (store.url)")
    t.add_argument("--since", help=f"with --from-store: how far back (default {DEFAULT_SINCE})")
    t.add_argument(
        "--out", required=True, help="where to write the tuned config (comments kept; not the input file)"
    )
    from manager.replay.tune import HOLDOUT_DAYS

    t.add_argument(
        "--holdout",
        help=f"trace to judge the result on (default: the last {HOLDOUT_DAYS:g} days of --trace, held "
        f"out from the search; the last 30%% of its time span when it spans less than "
        f"{2 * HOLDOUT_DAYS:g} days)",
    )
    t.add_argument("--report", help="directory for an HTML report with plots")
    t.add_argument(
        "--policy", choices=POLICY_NAMES, help="policy to tune for (default: the config's policy.name)"
    )
    t.add_argument("--json", action="store_true", help="one JSON object: before/after on the holdout")
    t.add_argument("--strict", action="store_true", help="a bad trace line is fatal")
    t.set_defaults(fn=cmd_tune)

    tr = sub.add_parser("trace", help="request traces").add_subparsers(
        dest="trace_cmd", required=True, metavar="{synth,export}"
    )
    s = tr.add_parser("synth", help="a synthetic home week")
    s.add_argument("--profile", default="home", help=f"one of: {', '.join(PROFILES)}")
    s.add_argument("--days", type=int, default=7, help="how many days (default 7)")
    s.add_argument(
        "--seed", type=int, default=0, help="random seed: the same seed, the same trace (default 0)"
    )
    s.add_argument(
        "--timezone",
        metavar="ZONE",
        help="the home's time zone, an IANA name (Europe/Berlin): its habits keep to that wall clock, "
        "summer time included (default: UTC's; replay it with the same policy.timezone)",
    )
    s.add_argument("--out", required=True, help="trace file to write (JSON Lines); - writes standard output")
    s.set_defaults(fn=cmd_synth)
    ex = tr.add_parser("export", help="the served requests of a time range, from the service's store")
    ex.add_argument("--config", required=True, help="the service's config (its store.url is read)")
    ex.add_argument("--since", default="7d", help="how far back, e.g. 7d, 36h (default 7d)")
    ex.add_argument("--out", required=True, help="trace file to write (JSON Lines); - writes standard output")
    ex.set_defaults(fn=cmd_export)

    sv = sub.add_parser("serve", help="run the service (gRPC: Open Inference Protocol + residency.v1)")
    sv.add_argument(
        "--config", required=True, help="config file (YAML); `residency config check` validates one"
    )
    sv.add_argument(
        "--listen", help="host:port to listen on (overrides server.listen; port 0 = any free port)"
    )
    sv.add_argument(
        "--in-process", action="store_true", help="run the device hosts in this process instead of Ray actors"
    )
    sv.add_argument(
        "--no-cpu-fallback",
        dest="cpu_fallback",
        action="store_false",
        help="without CUDA here, do not run the CUDA devices' models on the CPU (they answer UNAVAILABLE)",
    )
    sv.set_defaults(fn=cmd_serve)

    ps = sub.add_parser(
        "ps", help="what a running server holds: tier, bytes, KV lease, keep-alive, load times"
    )
    _connection_args(ps)
    ps.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ps.set_defaults(fn=cmd_ps)
    _admin_parsers(sub)

    m = sub.add_parser("measure", help="measure real load times per transition of the configured models")
    m.add_argument(
        "--config", required=True, help="config file (YAML); `residency config check` validates one"
    )
    m.add_argument("--model", action="append", help="only this model (repeatable)")
    m.add_argument("--repeats", type=int, default=3, help="measurements per transition (default 3)")
    m.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    m.add_argument(
        "--write-config", help="write a copy of the config with the measured load_seconds and memory"
    )
    m.add_argument("--allow-missing", action="store_true", help="exit 0 even if some models cannot load here")
    m.set_defaults(fn=cmd_measure)

    c = sub.add_parser("config", help="config files").add_subparsers(
        dest="config_cmd", required=True, metavar="{schema,check}"
    )
    c.add_parser("schema", help="print the JSON Schema of config files").set_defaults(fn=cmd_schema)
    ck = c.add_parser("check", help="validate a config file")
    ck.add_argument("config", help="config file (YAML) to validate")
    ck.set_defaults(fn=cmd_check)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line's status. As the program (`argv` None: the `residency` script), a `serve` that
    stopped with a model's load (`--in-process`, abandoned at the stop), describe or inference still
    running in this process ends the process here (`_exit_past_abandoned`)."""
    args = build_parser().parse_args(argv)
    rc = _run(args)
    if argv is None and args.fn is cmd_serve:
        _exit_past_abandoned(rc)
    return rc


def _exit_past_abandoned(rc: int) -> None:
    """When the in-process device hosts `serve` stopped left a load (or promote, or another command)
    still running (abandoned past the stop's grace: a factory or a read that hangs), or a describe
    (a model's factory run to read its inputs and outputs) still runs, or an inference (a world step)
    that the stop abandoned on its thread (`manager.api.server.abandoned_calls`: a forward that never
    returns), the process ends now with `rc`, by `os._exit`, after what a normal exit does first
    (non-daemon threads joined, atexit handlers run: the log's handlers flushed) and stdout and
    stderr flushed: the interpreter's finalization is skipped, which that daemon thread, inside a
    model's native code (torch), can abort (SIGABRT, "terminate called without an active
    exception"), losing the exit status and the last lines. One line in the log names what still
    ran (`workers.pool.left_running`, `abandoned_calls`). Without such a thread (Ray's device hosts
    run in their own processes), nothing happens here: the interpreter ends as usual."""
    pool = sys.modules.get("workers.pool")  # (not imported: no device host ran in this process)
    left: list[str] = pool.left_running() if pool is not None else []
    server = sys.modules.get("manager.api.server")  # the inferences (world steps) its stop abandoned
    left = sorted(left + (server.abandoned_calls() if server is not None else []))
    if not left:
        return
    import atexit
    import logging
    import threading

    logging.getLogger(__name__).warning(
        "the service stopped (exit status %d) with what its stop abandoned still running: %s; the process "
        "ends now, without the interpreter's finalization (which a thread inside a model's native code "
        "can abort)", rc, "; ".join(left),
    )  # fmt: skip
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit does first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()  # the log's handlers flushed and closed (logging.shutdown) among them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed or broken one: nothing more to say there)
            stream.flush()
    os._exit(rc)


def _run(args: argparse.Namespace) -> int:
    try:
        rc: int = args.fn(args)
        sys.stdout.flush()  # (what a block-buffered stdout holds fails here, said, not at the exit)
        return rc
    except KeyboardInterrupt:  # Ctrl-C in a replay or a tune: one line, not a traceback (serve has its own)
        err.print("residency: interrupted", highlight=False, markup=False)
        return 128 + signal.SIGINT
    except ConfigError as e:
        err.print(str(e), highlight=False, markup=False)
    except TraceError as e:
        hint = " (--strict makes a bad line fatal; without it bad lines are skipped)" if e.line else ""
        err.print(
            f"{e}{hint}",
            highlight=False,
            markup=False,
        )
    except UsageError as e:
        err.print(f"residency: {e}", highlight=False, markup=False)
    except Refused as e:  # the service said no (an unknown model, a pinned one): not a usage error
        err.print(f"residency: {e}", highlight=False, markup=False)
        return 1
    except BrokenPipeError:  # its reader stopped reading (`| head`): quietly, as the shell's tools do
        with contextlib.suppress(OSError):  # (and no second error when Python flushes at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:
        err.print(f"residency: {e}", highlight=False, markup=False)
        with contextlib.suppress(OSError):  # (a full stdout: no second error when Python flushes at exit)
            sys.stdout.flush()
    return 2


if __name__ == "__main__":
    sys.exit(main())
