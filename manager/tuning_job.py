"""The weekly loop, built in: export the request log from the store, tune, write the proposal and its
report, and say whether it beats the running config on the most recent days (held out from the search).

`run_tuning` is what `tuning.schedule` runs inside the service (and what `residency tune --from-store`
does by hand). Applying is the caller's business: with `tuning.apply: auto`, and only when `better` is
true, the service writes the tuned fields into its config file (the file it replaced is kept beside the
proposal, as `previous.yaml`), so that they outlive a restart, and hot-reloads it: both or neither
(a tuned config the service's reload would refuse - its plan, or the pinned models at the sizes their
device hosts measured, as `LiveManager.check_reload` finds, changing nothing - is not written; one the
reload refuses all the same, the service having changed between the check and the reload, is taken out
of the file again, unless it was edited meanwhile). A run that fails is recorded and tried again after
`RETRY_S`, not at every check of the schedule.

The config file is written whole or not at all (`write_config_atomically`): a reload or an editor
never reads half of it, a symlink keeps pointing at it, its mode and owner are kept, and a file that
changed while the run went on (a user's edit) is not overwritten.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from manager.config import Config, ConfigError, load_config, write_config_with_updates
from manager.reload import TunedHold, entry_values, held_updates
from manager.replay.sim import replay
from manager.replay.trace import ExportStopped, read_trace
from manager.replay.tune import (
    MIN_MODEL_REQUESTS,
    LiveSizes,
    Measured,
    TuningStopped,
    as_measured,
    objective,
    split_holdout,
    tune,
)
from manager.store.base import CorruptDocument
from manager.store.export import export_trace

PERIOD_S = {"daily": 86400.0, "weekly": 7 * 86400.0}
RETRY_S = 3600.0
"""A scheduled run that failed is tried again after this long."""
logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TuningOutcome:
    proposal: Path | None
    report: Path | None
    requests: int
    changes: list[str] = field(default_factory=list)
    better: bool = False
    holdout_before: dict[str, Any] | None = None
    holdout_after: dict[str, Any] | None = None
    reason: str = ""
    model_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    class_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What the search's data left out (`tune`'s thin-data warnings: models with too few requests,
    kept as configured, or less than a day searched): logged, recorded and said in the event."""


def run_tuning(
    config: Config,
    config_path: Path,
    store: Any,
    now: float | None = None,
    stop: Callable[[], bool] | None = None,
    held: TunedHold | None = None,
    live: LiveSizes | None = None,
    *,
    measured: Measured | None = None,
) -> TuningOutcome:
    """One run, its files under `tuning.out_dir`. `stop` ends it (TuningStopped) at its next replay
    or before its next file. A stopped or failed run leaves nothing: the folder it made is removed
    (a failed run is tried again each `RETRY_S`, and each left its exported request log behind);
    a config file edited while the search went on fails it (ConfigChanged), no proposal written.
    `held`: the tuned settings the running `config` holds that its file could not take: the
    proposal (the file with the run's updates) has them too, so that it is the running config.
    `live` and `measured`: the service's measured sizes and pins, and sizes and load times (`tune`'s)."""
    now = time.time() if now is None else now
    began = _bytes(config_path)  # the file the run tunes (its proposal is written from it)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    out_dir = Path(config.tuning.out_dir) / stamp
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(config, config_path, store, now, stamp, out_dir, stop, held or {}, live, began, measured)
    except BaseException:
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _stopped(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise TuningStopped("the tuning run was stopped (the service is stopping)")


def _run(
    config: Config,
    config_path: Path,
    store: Any,
    now: float,
    stamp: str,
    out_dir: Path,
    stop: Callable[[], bool] | None,
    held: TunedHold,
    live: LiveSizes | None = None,
    began: bytes | None = None,
    measured: Measured | None = None,
) -> TuningOutcome:
    trace = out_dir / "requests.jsonl"
    damaged: list[Any] = []  # (StoreError: a damaged stored row, left out of the export)
    try:
        n = export_trace(store, config.tuning.since, now, trace, stop, damaged)  # (weeks: stops too)
    except ExportStopped as e:  # the run's stop, met in its export: the run is stopped
        raise TuningStopped(str(e)) from e
    names = {m.name for m in config.models}
    try:
        read = read_trace(trace, strict=False, known_classes=[c.name for c in config.classes])
    finally:  # read, it goes: a copy of the request log per run, kept, grew without bound and outlived
        trace.unlink(missing_ok=True)  # the store's `request_log_retention`
        for older in out_dir.parent.glob("*/requests.jsonl"):  # (the copies earlier releases kept)
            with contextlib.suppress(OSError):
                older.unlink()
        logger.info("%s: read and removed (a run keeps its proposal and report only)", trace)
    reqs = [r for r in read.requests if r.model in names]
    skipped: list[str] = []
    if damaged:  # the rest is tuned on (a damaged row failed every run, retried each hour for good)
        skipped.append(f"skipped {len(damaged)} damaged request record(s) in the store (first: {damaged[0]})")
    if read.bad_lines:  # a class renamed since, say: left out and said, as `tune --from-store` does
        line, why = read.bad_lines[0]
        skipped.append(
            f"skipped {len(read.bad_lines)} logged requests the replay cannot take (record {line}: {why})"
        )
        # (replayed, each would count as a rejection of its model, and the model as never asked for)
    search, holdout = split_holdout(reqs)
    if not search or not holdout:
        for w in skipped:
            logger.warning("scheduled tuning: %s", w)
        reason = f"{n} requests logged: too few days to tune and hold out"
        return TuningOutcome(None, None, n, reason=reason, warnings=skipped)
    res = tune(
        config, search, holdout, policy=config.policy.name, stop=stop, min_requests=MIN_MODEL_REQUESTS,
        live=live, measured=measured,
    )  # fmt: skip
    _stopped(stop)  # (the held-out replays, after the search, do not look)
    warnings = [*skipped, *res.warnings]
    for w in warnings:
        logger.warning("scheduled tuning: %s", w)
    # the settings the running config holds over its file go into the proposal (and into the file,
    # where the run's outcome is written there) beneath the run's own updates
    model_updates, class_updates = (
        _under(held, "models", res.model_updates),
        _under(held, "classes", res.class_updates),
    )
    proposal = out_dir / "proposed.yaml"
    header = f"Proposed by the service's tuning on {stamp} from {len(search)} requests; changes: " + (
        "; ".join(res.changes) or "none"
    )
    mode = config_path.stat().st_mode & 0o7777  # a private config's proposal is as private

    def write(tmp: Path) -> Config:
        # from the file the run tuned: an edit saved while it searched was measured by no replay (it
        # went into the proposal, which said "better" of a config it had never seen): the run fails,
        # and is tried again after RETRY_S on the file as it is then
        if began is not None and _bytes(config_path) != began:
            raise ConfigChanged(
                f"{config_path} changed while the run went on: no proposal is written (the run tuned "
                "the file as it was); the next run tunes the file as it is"
            )
        return write_config_with_updates(
            config_path, tmp, model_updates, class_updates, header, note_changes=True
        )

    write_config_atomically(proposal, write, mode=mode)
    report = _report(out_dir / "report", config, res, holdout, stop, measured)
    _stopped(stop)
    before, after = res.holdout_before, res.holdout_after
    assert before is not None and after is not None
    better = bool(res.changes) and objective(after) < objective(before)
    why = "beats the running config on the held-out days" if better else "no improvement on the held-out days"
    return TuningOutcome(
        proposal, report, n, list(res.changes), better, before.to_json(), after.to_json(), why,
        model_updates, class_updates, warnings,
    )  # fmt: skip


def _under(held: TunedHold, section: str, updates: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`updates` over the tuned values `held` has for `section`'s entries."""
    out = held_updates(held, section)
    for name, fields in updates.items():
        out.setdefault(name, {}).update(fields)
    return out


def _report(
    out: Path,
    config: Config,
    res: Any,
    reqs: list[Any],
    stop: Callable[[], bool] | None = None,
    measured: Measured | None = None,
) -> Path | None:
    """The held-out days' report, over the period until the last request ends (as `residency tune
    --report`); None when that period is empty (every request at one instant, none busy). `stop` is
    looked at before each replay. `measured`: the machine the run's verdict replayed (`as_measured`),
    which the report's replays and sizes are of too."""
    from manager.policy.stats import home_hours
    from manager.replay.report import report_period, write_report

    t0, t1 = report_period(reqs)
    if t1 <= t0:
        return None
    _stopped(stop)
    ran = as_measured(config, measured)
    before = replay(ran, reqs, config.policy.name, record=True)
    _stopped(stop)
    after = replay(as_measured(res.config, measured), reqs, config.policy.name, record=True)
    _stopped(stop)
    notes = [f"change: {c}" for c in res.changes] or ["no change beat the running config"]
    notes += [f"warning: {w}" for w in res.warnings]
    return write_report(
        out, before=before, after=after, t_start=t0, t_end=t1,
        model_weights={m.name: m.memory for m in ran.models}, notes=notes,
        title="Residency tuning report (held-out days)",
        model_devices={m.name: m.device for m in config.models}, hours=home_hours(config.policy.timezone),
    )  # fmt: skip


def due(config: Config, store: Any, now: float) -> bool:
    """Whether the schedule says a tuning run is due (the last run's time is kept in the store); a run
    that failed is tried again `RETRY_S` after its failure. A record that cannot be read (not JSON, or
    times that are not numbers) counts as no record: the next run writes a good one. A recorded time
    ahead of `now` (the clock was set back since) counts by its distance from `now`."""
    period = PERIOD_S.get(config.tuning.schedule)
    if period is None:
        return False
    doc = _record(store)
    # A time recorded ahead of `now` was taken while the clock ran ahead (set back since): as far
    # ahead as behind counts as as long ago, so a clock a year ahead once does not stop the schedule
    # for a year, and a small step back does not run again a run just made.
    failed = _seconds(doc, "failed_at")
    if failed is not None and abs(now - failed) < RETRY_S:
        return False
    return bool(abs(now - (_seconds(doc, "last_run") or 0.0)) >= period)


def _record(store: Any) -> dict[str, Any]:
    """The store's tuning record ({} when there is none, or when the store answers but the record is
    corrupt: a run rewrites it). A store that does not answer raises."""
    try:
        return store.get_doc("tuning") or {}
    except CorruptDocument:
        return {}


def _seconds(doc: dict[str, Any], key: str) -> float | None:
    """`doc[key]` when it is a finite number (a time in Unix seconds), else None."""
    v = doc.get(key)
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _keep_copy(src: Path, dst: Path) -> bytes:
    """`src`'s bytes into `dst` with `src`'s file mode (a 0600 config stays private in its copy), never
    through a symlink at `dst` (OSError); returns the bytes kept."""
    data, mode = src.read_bytes(), src.stat().st_mode & 0o7777
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # (a copy left by an earlier run keeps its own mode otherwise)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return data


class ConfigChanged(Exception):
    """The config file no longer holds what its writer read from it: someone saved it meanwhile."""


class NotWritable(OSError):
    """A file left as it was, and why (`path`: the file; `why`: what stopped the write)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def _replaceable(dst: Path, target: Path) -> os.stat_result | None:
    """`target`'s stat (None: not there yet) when a new file may be renamed over it; NotWritable
    naming `dst` when not: not a regular file (the rename would replace a FIFO, a device), read-only,
    or its folder missing (a dangling link's) or not writable."""
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise NotWritable(dst, f"{target} is not a regular file (a FIFO, a device, a folder)")
    if st is not None and (not st.st_mode & 0o222 or not os.access(target, os.W_OK)):
        raise NotWritable(dst, "the file is read-only")
    try:
        fst = os.stat(target.parent)
    except FileNotFoundError:
        raise NotWritable(dst, f"its folder {target.parent} does not exist") from None
    if not fst.st_mode & 0o222 or not os.access(target.parent, os.W_OK | os.X_OK):
        raise NotWritable(dst, f"its folder {target.parent} is not writable")
    return st


def write_config_atomically(
    dst: Path,
    write: Callable[[Path], T],
    *,
    mode: int | None = None,
    expected: bytes | None = None,
) -> T:
    """Replace `dst` whole, or leave it as it was: `write(tmp)` fills a temporary file beside the
    file `dst` names (created private; a symlink at `dst` is kept, its target replaced), which is
    given `dst`'s mode and owner (`mode` for a new file), synced and renamed over it, so a reload,
    an editor or a power cut never meets half a config. Returns what `write` returned.

    NotWritable when the file is read-only (its mode, though root could write it), its folder is
    not writable, its owner cannot be kept (a service that is not root, writing a user's file
    through a group's permission, would take it from them) or the write failed (a disk full), the
    file unchanged; ConfigChanged, nothing written, when `expected` (the bytes the caller read) is
    not what the file holds, before or after the write."""
    target = Path(os.path.realpath(dst))
    folder = target.parent
    st = _replaceable(dst, target)

    def unchanged() -> None:
        if expected is None:
            return
        try:
            now = target.read_bytes()
        except OSError:
            now = None
        if now != expected:
            raise ConfigChanged(f"{dst} changed while the run went on")

    unchanged()
    fd, name = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")  # 0600
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            result = write(tmp)
            if st is not None:
                mode = st.st_mode & 0o7777
                if (st.st_uid, st.st_gid) != (os.stat(tmp).st_uid, os.stat(tmp).st_gid):
                    try:
                        os.chown(tmp, st.st_uid, st.st_gid)
                    except OSError:
                        raise NotWritable(
                            dst,
                            f"the file belongs to uid {st.st_uid} (gid {st.st_gid}), and this process "
                            "cannot give them the new file that would replace it",
                        ) from None
            if mode is not None:
                os.chmod(tmp, mode)  # (after chown, which may clear set-id bits)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # on disk before the rename: a power cut leaves the old file or the new
            finally:
                os.close(fd)
            unchanged()
            os.replace(tmp, target)
        except ConfigError as e:
            if e.file == str(tmp):  # the result's own check: said of the file it would have been
                e.file = str(dst)
            raise
        except OSError as e:
            if isinstance(e, NotWritable):
                raise
            what = e.strerror or str(e)
            if e.filename and Path(e.filename) != tmp:  # (the temporary file's name says nothing)
                what += f": {e.filename}"
            raise NotWritable(dst, f"not written ({what}); the file is unchanged") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk (best effort)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return result


def write_back(config_path: Path, outcome: TuningOutcome, expected: bytes | None = None) -> str:
    """Write the tuned fields into the config file itself, whole or not at all (comments, mode,
    owner and a symlink kept; the replaced file kept as `previous.yaml` beside the proposal).
    Returns "" when written, else why not. ConfigChanged (nothing written) when `expected`, the
    file's bytes when the run began, is not what it holds: a user's edit is not overwritten."""
    written = _write_tuned(config_path, outcome, expected)
    return written if isinstance(written, str) else ""


@dataclass
class _Written:
    """What `_write_tuned` put in the config file: the config it holds now, and its bytes before
    (as `previous.yaml` keeps them) and after."""

    config: Config
    before: bytes
    after: bytes


class _Refused(Exception):
    """The running service would refuse the tuned config (`check`): the file was not written."""


def _check_reload(manager: Any, new: Config) -> None:
    """Raise what the service's reload of `new` would raise, changing nothing: the manager's
    `check_reload` (every check its reload makes, the pinned models at the footprints their device
    hosts measured included; the service's view, `_ReloadOnLoop`, runs it on the event loop and
    raises CheckNotAnswered when that does not answer). A manager with no `check_reload` (a stand-in)
    is checked by the reload's plan alone."""
    from manager.reload import plan_reload

    check = getattr(manager, "check_reload", None)
    if callable(check):
        check(new)
    else:
        plan_reload(manager.config, new)


def _write_tuned(
    config_path: Path,
    outcome: TuningOutcome,
    expected: bytes | None = None,
    check: Callable[[Config], object] | None = None,
) -> _Written | str:
    """`write_back`, returning what was written, or why not (a str). `check(tuned config)` is
    called before the file is replaced: what it raises, as `_Refused`, leaves the file untouched
    (and `previous.yaml` unwritten)."""
    assert outcome.proposal is not None
    target = Path(os.path.realpath(config_path))  # a symlinked config stays a symlink
    previous = outcome.proposal.parent / "previous.yaml"

    def write(tmp: Path) -> _Written:
        new = write_config_with_updates(
            target, tmp, outcome.model_updates, outcome.class_updates, note_changes=True
        )
        if check is not None:
            try:
                check(new)
            except Exception as e:
                raise _Refused(str(e)) from e
        return _Written(new, _keep_copy(target, previous), tmp.read_bytes())

    try:
        return write_config_atomically(config_path, write, expected=expected)
    except NotWritable as e:
        return f"not written into {config_path}: {e.why}"
    except (OSError, ValueError, ConfigError) as e:  # ConfigError: the file was broken meanwhile
        return f"not written into {config_path}: {e}"


def _put_back(config_path: Path, written: _Written) -> str:
    """The config file as it was before the job wrote it (its mode, owner and symlink kept), only
    if it still holds what the job wrote: an edit saved since is never overwritten. Says what
    became of it."""
    try:
        write_config_atomically(
            config_path, lambda tmp: tmp.write_bytes(written.before), expected=written.after
        )
    except ConfigChanged:
        return f"{config_path} was edited since the tuning wrote it: the edit is kept"
    except OSError as e:
        why = e.why if isinstance(e, NotWritable) else str(e)
        return f"{config_path} could not be put back ({why}): it holds the refused tuned values"
    return f"{config_path} put back as it was"


def tuning_step(
    manager: Any, config_path: Path, store: Any, now: float, stop: Callable[[], bool] | None = None
) -> TuningOutcome:
    """One scheduled run: tune, record it in the store, and apply it when `apply: auto` and better
    (written into the config file and hot-reloaded, both or neither; when the file cannot be
    written, the tuned fields alone are applied to the running config, so an edit hot-reloaded while
    the run went on is kept, as the file keeps it; when the file changed while the run went on,
    nothing: `_apply`)."""
    config: Config = manager.config
    try:  # the file as the run begins: an edit saved while it goes on is not overwritten
        began: bytes | None = Path(config_path).read_bytes()
    except OSError:
        began = None
    if began is not None:  # the proposal is written from the file: one that does not load (an edit
        load_config(config_path)  # the reload refused) fails the run now, not after a whole search
    # its measured sizes and pins (`tune`'s `live`), read where the manager's thread reads them: the
    # service hands a proxy that reads them on its event loop (`_ReloadOnLoop`), which has no engine
    sizes = getattr(manager, "live_sizes", None)
    engine = getattr(manager, "engine", None)
    if callable(sizes):
        live: dict[str, tuple[int, bool]] | None = sizes()
    else:
        live = {n: (m.weights, m.pinned) for n, m in engine.models.items()} if engine is not None else None
    # and what it measured of its models' sizes and load times, which the run's replays take
    read_measured = getattr(manager, "measured", None)
    if callable(read_measured):
        measured: Measured | None = read_measured()
    elif engine is not None:
        measured = {n: (m.weights, m.cost.as_dict()) for n, m in engine.models.items()}
    else:
        measured = None
    held = getattr(manager, "tuning_overrides", None)
    outcome = run_tuning(config, config_path, store, now, stop, held, live, measured=measured)
    _stopped(stop)  # the service is stopping: nothing is written or reloaded now
    applied = False
    if outcome.better and config.tuning.apply == "auto" and outcome.proposal is not None:
        applied = _apply(manager, config_path, outcome, began)
    store.put_doc(
        "tuning",
        {
            "last_run": now, "proposal": str(outcome.proposal) if outcome.proposal else None,
            "report": str(outcome.report) if outcome.report else None, "changes": outcome.changes,
            "better": outcome.better, "applied": applied, "reason": outcome.reason,
            "requests": outcome.requests,
            "holdout_before": outcome.holdout_before, "holdout_after": outcome.holdout_after,
            "warnings": outcome.warnings,
        },
    )  # fmt: skip
    return outcome


def _apply(manager: Any, config_path: Path, outcome: TuningOutcome, began: bytes | None) -> bool:
    """Write a better run's tuned fields into the config file and hot-reload it (said in
    `outcome.reason`); whether they were applied. The file and the running service agree after:
    a tuned config the service would refuse (`_check_reload`: a restart needed, or pins that do not
    fit at their measured sizes) is not written, and one the reload refuses all the same (the
    service changed since the check) is taken out of the file again, unless the file was edited
    meanwhile (each with a warning). A file that cannot be written gets the tuned fields applied to
    the running config alone (a restart reverts them); a file that changed since the run began
    (`began`: its bytes then) is left to its editor, nothing applied."""
    from pydantic import ValidationError

    from manager.reload import CheckNotAnswered, RestartNeeded
    from manager.replay.tune import with_settings

    assert outcome.proposal is not None
    running = manager.config
    try:  # what the reload would refuse is found before the file is written
        written = _write_tuned(config_path, outcome, began, check=lambda new: _check_reload(manager, new))
    except ConfigChanged as e:  # tuned against the file as it was: its edit is neither undone nor mixed
        outcome.reason += f"; not applied: {e} (the proposal: {outcome.proposal})"
        logger.warning("scheduled tuning: %s", outcome.reason)
        return False
    except _Refused as e:
        if isinstance(e.__cause__, CheckNotAnswered):  # the service was busy, not against it: a failed
            raise e.__cause__ from None  # run, tried again after RETRY_S (not a period later)
        outcome.reason += (
            f"; not applied: the service would refuse it ({e}); {config_path} left as it was "
            f"(the proposal: {outcome.proposal})"
        )
        logger.warning("scheduled tuning: %s", outcome.reason)
        return False
    unwritten = written if isinstance(written, str) else ""
    if unwritten:
        logger.warning("scheduled tuning: %s (the service goes on)", unwritten)
    try:
        if isinstance(written, _Written):
            new = written.config  # what the file holds (not read again: an edit since is not it)
            _reload_written(manager, new, outcome)
        else:  # not the proposal, made from the config as it was when the run began
            new = with_settings(manager.config, outcome.model_updates, outcome.class_updates)
            _reload_holding(manager, running, new, outcome)
    except TimeoutError:  # the reload did not answer: it may still be applied, so the file stays
        where = (
            f"written into {config_path}" if isinstance(written, _Written) else "not written into the file"
        )
        outcome.reason += (
            f"; {where}, but the service did not answer its reload in time: it may still take it (the log "
            f"says how its reload ends; the proposal: {outcome.proposal})"
        )
        logger.warning("scheduled tuning: %s", outcome.reason)
        return False
    except Exception as e:
        refused = isinstance(e, ConfigError | RestartNeeded | ValidationError)  # else a bug: raised
        if isinstance(written, _Written) and manager.config is running:  # not taken: the file follows
            back = _put_back(config_path, written)
            outcome.reason += (
                f"; not applied: the service refused it ({e}); {back} (the proposal: {outcome.proposal})"
            )
            logger.warning("scheduled tuning: %s", outcome.reason)
        elif refused:
            outcome.reason += f"; not applied: {e}"
        if not refused:
            raise  # (recorded as a failed run, tried again later)
        return False
    outcome.reason += "; applied" + (f", but {unwritten}: a restart reverts it" if unwritten else "")
    return True


def _tuned_fields(outcome: TuningOutcome) -> set[tuple[str, str, str]]:
    """The fields this run tuned, as `LiveManager.tuning_overrides` names them."""
    return {
        (section, name, key)
        for section, updates in (("models", outcome.model_updates), ("classes", outcome.class_updates))
        for name, fields in updates.items()
        for key in fields
    }


def _reload_written(manager: Any, new: Config, outcome: TuningOutcome) -> None:
    """Reload `manager` to `new`, the file as this run wrote it: a value an earlier run could not
    write (held over the file since) goes for each field this run wrote, even where the file's value
    did not change (the run found the file's value better): the file and the service agree again."""
    held: TunedHold | None = getattr(manager, "tuning_overrides", None)
    if not held:
        manager.reload(new)
        return
    tuned = _tuned_fields(outcome)
    manager.reload(new, hold={k: v for k, v in held.items() if k not in tuned})


def _reload_holding(manager: Any, running: Config, new: Config, outcome: TuningOutcome) -> None:
    """Reload `manager` to `new`, the tuned settings its config file could not take, which it then
    holds over the file's reloads (`LiveManager.tuning_overrides`): each with the field's value in
    the file (in `running` where it held none of that field yet), and only where it differs."""
    held: TunedHold | None = getattr(manager, "tuning_overrides", None)
    if held is None:  # a manager that holds none
        manager.reload(new)
        return
    was, now = entry_values(running), entry_values(new)
    hold = dict(held)
    for section, updates in (("models", outcome.model_updates), ("classes", outcome.class_updates)):
        for name, fields in updates.items():
            for key, value in fields.items():
                field = (section, name, key)
                in_file = hold[field][0] if field in hold else was.get(field)
                hold.pop(field, None)
                if now.get(field) != in_file:
                    hold[field] = (in_file, value)
    manager.reload(new, hold=hold)


@dataclass
class ScheduleMemo:
    """What the schedule's loop remembers between its checks beside the store's record: when it last
    tried a run that the store could not record (a store that reads and does not write - a Redis at
    maxmemory, a full disk - or is down), so that it is tried again after RETRY_S, not at each check."""

    unrecorded_at: float | None = None


def scheduled_tuning(
    manager: Any,
    config_path: Path,
    store: Any,
    now: float,
    stop: Callable[[], bool] | None = None,
    memo: ScheduleMemo | None = None,
) -> str | None:
    """What the service's schedule runs at each check: a tuning run when one is due (None when none
    is). Never raises: a failure (the store down, the output folder not writable, a bug) is recorded,
    when the store allows, and tried again after `RETRY_S`; when the store cannot record it, `memo`
    (the loop's, kept between checks) holds the time instead. `stop` (the service stopping) ends a
    run at its next replay, recording nothing. Returns what to say of the run."""
    if memo is not None and memo.unrecorded_at is not None and abs(now - memo.unrecorded_at) < RETRY_S:
        return None
    try:
        if not due(manager.config, store, now):
            return None
        out = tuning_step(manager, config_path, store, now, stop)
    except TuningStopped as e:
        return f"stopped: {e}"
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        try:
            doc = _record(store)
            store.put_doc("tuning", {**doc, "failed_at": now, "error": why})
        except Exception:
            if memo is not None:
                memo.unrecorded_at = now
            return f"failed ({why}); the store could not record it: retried in {RETRY_S / 3600:g} h"
        if memo is not None:
            memo.unrecorded_at = None
        return f"failed ({why}); retried in {RETRY_S / 3600:g} h"
    if memo is not None:
        memo.unrecorded_at = None
    said = f"{out.reason}; changes: {', '.join(out.changes) or 'none'}; proposal: {out.proposal}"
    return said + "".join(f"; warning: {w}" for w in out.warnings)
