"""Review 14: the weekly tuning job, hot reload and `residency measure --write-config` against real
files on disk (found by an adversarial review: each test failed before its fix)."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import manager.tuning_job as job
from manager.config import Config, load_config
from manager.reload import RestartNeeded, plan_reload
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from manager.store import open_store
from manager.tuning_job import RETRY_S, due, run_tuning, scheduled_tuning, tuning_step

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "configs" / "examples" / "home-handwritten.yaml"
LOCAL_CPU = ROOT / "configs" / "local-cpu.yaml"
HOME = ROOT / "configs" / "home.yaml"
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


class _Manager:
    """Stands in for the LiveManager (unit test only): holds a config, takes reloads."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reloaded: list[Config] = []

    def reload(self, new: Config) -> list[str]:
        self.reloaded.append(new)
        self.config = new
        return []


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[tuple[Any, float, Path]]:
    """A store holding a synthetic home week, and a config (in its own folder, `etc/`) that tunes
    it weekly with `apply: auto`."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    reqs = synth("home", days=7, seed=2)
    trace = tmp_path / "week.jsonl"
    write_trace(trace, reqs)
    store.append_requests([json.loads(line) for line in trace.read_text().splitlines()])
    (tmp_path / "etc").mkdir()
    cfg = tmp_path / "etc" / "config.yaml"
    text = HANDWRITTEN.read_text()
    cfg.write_text(text + f"tuning: {{schedule: weekly, apply: auto, out_dir: {tmp_path / 'tuning'}}}\n")
    yield store, reqs[-1].t + 1.0, cfg
    store.close()


def _leftovers(cfg: Path) -> list[Path]:
    """Temporary files a write left beside the config."""
    return [p for p in cfg.parent.iterdir() if p.name.startswith(f".{cfg.name}")]


# --- the schedule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["last_run", "failed_at"])
def test_a_record_from_a_clock_that_ran_a_year_ahead_does_not_stop_the_schedule_for_a_year(
    filled: tuple[Any, float, Path], key: str
) -> None:
    """A run made while the clock was a year ahead (a bad RTC at boot, fixed by NTP later) recorded
    that year: `now - last_run` stayed negative, and no tuning ran (nor a failure was retried) until
    the clock caught up with it. A record at most a period ahead still holds (a small step back of
    the clock does not rerun a run just made)."""
    store, now, cfg = filled
    config = load_config(cfg)
    store.put_doc("tuning", {key: now + 365 * 86400.0})
    assert due(config, store, now)
    store.put_doc("tuning", {"last_run": now + 3600.0})  # the clock stepped back an hour since
    assert not due(config, store, now)
    store.put_doc("tuning", {"last_run": 0.0, "failed_at": now + 60.0})
    assert not due(config, store, now) and due(config, store, now + 60.0 + RETRY_S)


# --- a stop during a run --------------------------------------------------------------------------


def test_a_stop_after_the_search_writes_no_proposal_no_report_no_trace(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop was looked at only by the search's replays and once the run was over: a stop that
    came during the held-out replays still wrote the proposal and the report (two replays more),
    and a stopped run left its exported request log behind."""
    store, now, cfg = filled
    config = load_config(cfg)
    stopping = [False]
    from manager.replay.tune import tune as real_tune

    def tune_then_stop(*args: Any, **kwargs: Any) -> Any:
        res = real_tune(*args, **kwargs)
        stopping[0] = True  # the service is told to stop during the held-out replays
        return res

    monkeypatch.setattr(job, "tune", tune_then_stop)
    original = cfg.read_text()
    said = scheduled_tuning(_Manager(config), cfg, store, now, lambda: stopping[0])
    assert said is not None and said.startswith("stopped")
    out_dir = Path(config.tuning.out_dir)
    assert not out_dir.exists() or not list(out_dir.rglob("*")), list(out_dir.rglob("*"))
    assert cfg.read_text() == original and store.get_doc("tuning") is None


# --- the config file it writes --------------------------------------------------------------------


def test_an_edit_saved_while_the_run_went_on_is_not_overwritten(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run wrote its tuned values into the file as it found it at the end: a keep-alive the user
    set in the file while the run went on (tuned against the old one) was replaced by the tuned one,
    and the service hot-reloaded that. Now a file that changed under the run is left alone: nothing
    written, nothing applied, said; the proposal stays for the user to read."""
    store, now, cfg = filled
    manager = _Manager(load_config(cfg))
    real_run = job.run_tuning
    edited: list[str] = []

    def run_with_an_edit_meanwhile(*args: Any, **kwargs: Any) -> Any:
        out = real_run(*args, **kwargs)
        name, fields = next(iter(out.model_updates.items()))
        assert "keep_alive" in fields
        text = cfg.read_text()
        line = next(i for i, s in enumerate(text.splitlines()) if s.strip() == f"- name: {name}")
        lines = text.splitlines(keepends=True)
        k = next(i for i in range(line, len(lines)) if lines[i].strip().startswith("keep_alive:"))
        lines[k] = lines[k].split("keep_alive:")[0] + "keep_alive: 7h   # the user's own, saved now\n"
        cfg.write_text("".join(lines))
        edited.append("".join(lines))
        return out

    monkeypatch.setattr(job, "run_tuning", run_with_an_edit_meanwhile)
    with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
        out = tuning_step(manager, cfg, store, now)
    assert out.better and out.proposal is not None and out.proposal.is_file()
    assert cfg.read_text() == edited[0]  # the user's edit, whole
    assert manager.reloaded == []  # the tuned values, chosen against the old file, are not applied
    assert "not applied" in out.reason and f"{cfg} changed while the run went on" in out.reason
    assert str(out.proposal) in out.reason and f"{cfg} changed" in caplog.text
    assert not _leftovers(cfg)
    doc = store.get_doc("tuning")
    assert doc is not None and not doc["applied"] and doc["last_run"] == now


def test_a_read_only_config_is_not_rewritten_and_the_service_goes_on(
    filled: tuple[Any, float, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A config made read-only (chmod a-w) was replaced all the same: a rename needs only the
    folder's write permission. Now it is not written, a warning says why, and the tuned values are
    applied to the running service until a restart (as for any file that cannot be written)."""
    store, now, cfg = filled
    original = cfg.read_text()
    cfg.chmod(0o444)
    manager = _Manager(load_config(cfg))
    with caplog.at_level(logging.WARNING, logger="manager.tuning_job"):
        out = tuning_step(manager, cfg, store, now)
    assert out.better and cfg.read_text() == original and (cfg.stat().st_mode & 0o777) == 0o444
    assert f"not written into {cfg}: the file is read-only" in out.reason
    assert "a restart reverts it" in out.reason and len(manager.reloaded) == 1
    assert f"not written into {cfg}: the file is read-only" in caplog.text
    assert not _leftovers(cfg)


def test_a_config_in_a_read_only_folder_is_not_rewritten_and_the_error_names_the_folder(
    filled: tuple[Any, float, Path],
) -> None:
    """A read-only folder said `Permission denied: '.config.yaml.tuned'` (a file the user never
    made), and as root the folder's mode was not looked at at all: the file was replaced."""
    store, now, cfg = filled
    original = cfg.read_text()
    cfg.parent.chmod(0o555)
    try:
        manager = _Manager(load_config(cfg))
        out = tuning_step(manager, cfg, store, now)
        assert out.better and cfg.read_text() == original
        assert (
            f"its folder {cfg.parent} is not writable" in out.reason and "a restart reverts it" in out.reason
        )
        assert not _leftovers(cfg)
    finally:
        cfg.parent.chmod(0o755)


def test_the_proposal_of_a_private_config_stays_private(filled: tuple[Any, float, Path]) -> None:
    """`previous.yaml` kept a 0600 config's mode, but the proposal beside it (the same config, a
    store url's password included) was written 0644."""
    store, now, cfg = filled
    cfg.chmod(0o600)
    out = run_tuning(load_config(cfg), cfg, store, now)
    assert out.proposal is not None and (out.proposal.stat().st_mode & 0o777) == 0o600


@AS_ROOT
def test_a_config_the_service_does_not_own_keeps_its_owner(filled: tuple[Any, float, Path]) -> None:
    """Run as root, the service replaced a user's config by a file of its own: root's, which the
    user (0644) could no longer edit."""
    store, now, cfg = filled
    os.chown(cfg, 4321, 4322)
    cfg.chmod(0o640)
    manager = _Manager(load_config(cfg))
    out = tuning_step(manager, cfg, store, now)
    assert out.better and "applied" in out.reason and "not written" not in out.reason
    st = cfg.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4321, 4322, 0o640)
    assert load_config(cfg) == manager.config


@AS_ROOT
def test_a_config_whose_owner_cannot_be_kept_is_not_taken_from_its_owner(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service that may write a config but not give a file to its owner (not root; the folder
    shared with a group) replaced it by one of its own. Now it is not written, and says so."""
    store, now, cfg = filled
    original = cfg.read_text()
    os.chown(cfg, 4321, 4322)

    def not_permitted(path: Any, uid: int, gid: int, **kwargs: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chown", not_permitted)  # as a service that is not root
    out = tuning_step(_Manager(load_config(cfg)), cfg, store, now)
    assert cfg.read_text() == original and cfg.stat().st_uid == 4321
    assert f"not written into {cfg}" in out.reason and "belongs to uid 4321" in out.reason
    assert not _leftovers(cfg)


def test_the_new_config_is_on_disk_before_it_replaces_the_old(
    filled: tuple[Any, float, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuned file was renamed over the config without being synced: a power cut soon after
    could leave the config empty (the rename reached the disk, the data not yet)."""
    store, now, cfg = filled
    synced: set[tuple[int, int]] = set()
    renamed: list[bool] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        if Path(dst) == cfg:
            st = os.stat(src)
            renamed.append((st.st_dev, st.st_ino) in synced)
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tuning_step(_Manager(load_config(cfg)), cfg, store, now)
    assert out.better and "not written" not in out.reason and renamed == [True]


# --- hot reload -----------------------------------------------------------------------------------


def test_a_reload_refused_for_a_restart_names_what_changed() -> None:
    """A reload that shrank a device, or changed the host's memory, was refused with "devices
    changed" (which device? which field?); a removed model as "models added [] or removed [...]"."""
    base = load_config(HOME)
    devices = [
        d.model_copy(update={"memory": d.memory // 2}) if d.name == "gpu0" else d for d in base.devices
    ]
    with pytest.raises(RestartNeeded, match=r"device 'gpu0': memory changed \(24GiB -> 12GiB\)"):
        plan_reload(base, base.model_copy(update={"devices": devices}))
    host = base.model_copy(update={"host": base.host.model_copy(update={"memory": base.host.memory // 2})})
    with pytest.raises(RestartNeeded, match=r"host memory changed \(\d+GiB -> \d+GiB\)"):
        plan_reload(base, host)
    with pytest.raises(RestartNeeded) as e:
        plan_reload(base, base.model_copy(update={"models": base.models[:-1]}))
    assert str(e.value) == "models removed ['photos']"
    more = base.model_copy(
        update={"devices": [*base.devices, base.devices[0].model_copy(update={"name": "x"})]}
    )
    with pytest.raises(RestartNeeded, match=r"devices added \['x'\]"):
        plan_reload(base, more)


# --- `residency measure --write-config` -----------------------------------------------------------


def _measures() -> list[Any]:
    from manager.measure import ModelMeasure

    mm = ModelMeasure("voice", "silero-vad", "cpu0", "cpu0", footprint_bytes=2_500_000)
    mm.transitions = {
        "disk->gpu(cold)": {"total_s": 0.2},
        "disk->gpu(cached)": {"total_s": 0.1},
        "host->gpu": {"total_s": 0.05},
    }
    return [mm]


def test_measured_figures_written_into_the_config_itself_never_leave_half_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--write-config` naming the config itself truncated it and wrote it in place: a disk that
    filled up mid-write left half a config (a running service's watcher could even hot-reload a
    truncated one)."""
    from manager.measure import write_measured_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text(LOCAL_CPU.read_text())
    original = cfg.read_text()
    real_open = Path.open

    class HalfWritten:
        """A file that takes half of what is written, then says the disk is full (a stand-in)."""

        def __init__(self, f: Any, path: Path) -> None:
            self.f, self.path = f, path

        def __enter__(self) -> HalfWritten:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: str) -> int:
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    def disk_full(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(self, mode, *args, **kwargs)
        return HalfWritten(f, self) if "w" in mode else f

    monkeypatch.setattr(Path, "open", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_measured_config(cfg, cfg, _measures())
    monkeypatch.undo()
    assert cfg.read_text() == original and not _leftovers(cfg)
    write_measured_config(cfg, cfg, _measures())  # the space freed: written whole
    assert load_config(cfg).models[0].memory == 2_500_000
    comments = [s.strip() for s in original.splitlines() if s.strip().startswith("# A home")]
    assert comments and comments[0] in cfg.read_text()


def test_measured_figures_keep_a_symlink_and_a_private_configs_mode(tmp_path: Path) -> None:
    """A new `--write-config` file of a 0600 config was written 0644 (the store url's password
    readable by all); a symlinked one keeps its link (its target is written) and its own mode."""
    from manager.measure import write_measured_config

    src = tmp_path / "c.yaml"
    src.write_text(LOCAL_CPU.read_text())
    src.chmod(0o600)
    fresh = tmp_path / "out" / "measured.yaml"
    fresh.parent.mkdir()
    write_measured_config(src, fresh, _measures())
    assert (fresh.stat().st_mode & 0o777) == 0o600 and load_config(fresh).models[0].memory == 2_500_000
    real = tmp_path / "real.yaml"
    real.write_text(LOCAL_CPU.read_text())
    real.chmod(0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to(real.name)
    write_measured_config(src, link, _measures())
    assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o640
    assert load_config(real).models[0].memory == 2_500_000 and not _leftovers(real)


def test_a_stop_after_the_search_ends_the_run_before_its_held_out_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search looked at `stop` before each replay, but the two held-out replays after it (a week
    each) ran whatever: a service stopping then waited for them. Now they look too."""
    import manager.replay.tune as tune_mod

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "home.yaml")
    reqs = synth("home", 3, 5)
    search, holdout = tune_mod.split_holdout(reqs)
    real = tune_mod.replay
    calls = {"n": 0}

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_mod, "replay", counting)
    tune_mod.tune(config, search, holdout)
    in_search = calls["n"] - 2  # the search's replays, then the held-out two
    calls["n"] = 0
    with pytest.raises(tune_mod.TuningStopped):
        tune_mod.tune(config, search, holdout, stop=lambda: calls["n"] >= in_search)
    assert calls["n"] == in_search  # neither held-out replay ran


def test_a_reload_needing_a_restart_names_the_file(tmp_path: Path) -> None:
    """The admin ReloadConfig's refusal for a restart said what changed but not which file."""
    from live_helpers import local_config, run

    from manager.api.admin import reload_from_file
    from manager.errors import InvalidRequest

    config = local_config(tmp_path, ("voice",))
    path = tmp_path / "changed.yaml"
    text = (Path(__file__).resolve().parents[2] / "configs" / "local-cpu.yaml").read_text()
    path.write_text(text.replace("memory: ", "memory: 1", 1))  # a device's size: a restart

    async def body(lm: Any) -> None:
        with pytest.raises(InvalidRequest) as e:
            reload_from_file(lm, str(path))
        assert str(e.value).startswith(f"config not reloaded: {path}: ")
        assert str(e.value).endswith("restart the service to apply it")

    run(config, body)


@pytest.mark.parametrize("cmd", ["tune", "measure"])
def test_a_read_only_output_file_is_refused_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    """`tune --out` and `measure --write-config` naming a read-only file (a user's `chmod a-w`):
    run as root, the check before the work passed (root may write it), and the file was then
    replaced (tune) or refused only after the measuring (measure). Refused first now, as the
    service's tuning job refuses it."""
    from manager.cli import main

    out = tmp_path / "tuned.yaml"
    out.write_text("# mine\n")
    out.chmod(0o444)
    home = Path(__file__).resolve().parents[2] / "configs"
    if cmd == "tune":
        trace = tmp_path / "t.jsonl"
        write_trace(trace, synth("home", 3, 1))
        args = ["tune", "--config", str(home / "home.yaml"), "--trace", str(trace), "--out", str(out)]
    else:
        args = ["measure", "--config", str(home / "local-cpu.yaml"), "--write-config", str(out)]
    assert main(args) == 2
    assert f"{out}: the file is read-only" in capsys.readouterr().err
    assert out.read_text() == "# mine\n"
