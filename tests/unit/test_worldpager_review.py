"""worldpager fixes from review: a roll-back's stale window, the best-ranked segments kept when the
slots run short, damaged session.json / meta.json / index.json, `--plot` and `--fps` checked up front.
Real sessions on the "micro" stand-in (random weights, seeded)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager import stall
from worldpager.cli import main
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import (
    HEADER_SIZE,
    INDEX_NAME,
    META_NAME,
    SegmentLog,
    SegmentLogError,
    slot_size_for,
)
from worldpager.session import SESSION_FILE, SESSION_PRESETS, Session, read_saved_state
from worldpager.trajectory import yaw_sweep_trajectory

CFG = SESSION_PRESETS["micro"].on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16", torch.bfloat16).payload_nbytes
POSES = yaw_sweep_trajectory(9)
NEW = [Pose(0.0, 0.0, 0.0, 0.0, 180.0), Pose(0.0, 0.0, 0.0, 0.0, -150.0)]  # the client's new 5, 6


def _crash(s: Session) -> None:
    """The host dies: the transfer threads and the log stop, no close(), no session.json update."""
    s.handler.close()
    s.log.close()


def _window(model: TinyCausalWan) -> list[torch.Tensor]:
    n = int(model.kv_cache[0]["local_end_index"].item())
    return [c[name][:, :n].clone() for c in model.kv_cache for name in ("k", "v")]


# ---- 1: a roll-back, then a crash -------------------------------------------------------------------


def test_a_crash_after_a_roll_back_restores_the_new_window_and_poses(tmp_path: Path) -> None:
    model = TinyCausalWan(CFG, dtype=torch.bfloat16)  # bf16 model + bf16 codec: the log is exact
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG}
    with Session(model, log_dir=tmp_path, **opts) as a:  # a clean close at 7: window.bin of 5, 6
        a.run(POSES[:7])
    b = Session.resume(tmp_path, model, resume_at=5, **opts)  # the client never got 5, 6
    b.run(NEW)
    new_window = _window(model)
    _crash(b)
    with Session.resume(tmp_path, model, **opts) as c:
        assert c.step_index == 7 and c.window_source == "log"  # window.bin is of the old 5, 6
        assert all(torch.equal(x, y) for x, y in zip(_window(model), new_window, strict=True))
        assert c._poses == {5: NEW[0], 6: NEW[1]}


def test_old_copies_past_a_roll_back_are_never_history(tmp_path: Path) -> None:
    """Rolled back to 5, only the new 5 generated, then a crash: the old 6 is of the abandoned
    timeline, so the session continues at 6 (not 7 on the old 6), also after another clean close."""
    model = TinyCausalWan(CFG, dtype=torch.bfloat16)
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG}
    with Session(model, log_dir=tmp_path / "ref", **opts) as ref:  # the new timeline, uninterrupted
        ref.run([*POSES[:5], NEW[0]])
        ref_window = _window(model)
    with Session(model, log_dir=tmp_path / "a", **opts) as a:
        a.run(POSES[:7])
    b = Session.resume(tmp_path / "a", model, resume_at=5, **opts)
    b.step(NEW[0])
    _crash(b)
    with Session.resume(tmp_path / "a", model, **opts) as c:
        assert c.step_index == 6 and c.window_source == "log"
        assert [i.segment_id for i in c._infos] == list(range(6))
        assert all(torch.equal(x, y) for x, y in zip(_window(model), ref_window, strict=True))
        assert c._poses[5] == NEW[0]
        c.step(NEW[1])
    with Session.resume(tmp_path / "a", model, **opts) as d:  # the roll-back is remembered
        assert d.step_index == 7 and d.window_source == "checkpoint"
        assert d._poses == {5: NEW[0], 6: NEW[1]}


# ---- 2: fewer slots than wanted segments --------------------------------------------------------------


class _NewestThenOldest:
    """Fake retrieval rule: best first is the newest candidate, then the oldest ones."""

    def select(self, candidates: Sequence[SegmentInfo], query: Pose, now_frame: int, k: int) -> list[int]:
        ids = sorted(c.segment_id for c in candidates)
        return ([ids[-1], *ids[:-1]])[:k] if ids else []


def test_with_fewer_slots_than_wanted_the_best_ranked_are_kept(tmp_path: Path) -> None:
    s = Session(
        TinyCausalWan(CFG), host_budget_bytes=16 * SEG, log_dir=tmp_path, rule=_NewestThenOldest(),
        retrieval_k=2, gpu_slots=1,
    )  # fmt: skip
    with s:
        recs = s.run(yaw_sweep_trajectory(8))
    assert [r.retrieved for r in recs[4:]] == [(2,), (3,), (4,), (5,)]  # not the oldest, (0,)


def test_prepare_step_keeps_the_first_wanted_and_places_them_by_id() -> None:
    pm = PageManager(1000, 10, 2, nvme_enabled=False)
    for sid in range(5):
        pm.add_segment(sid, 10)
    plan = pm.prepare_step(0, [4, 1, 3], place_by_id=True)
    assert plan.slots == {1: 0, 4: 1} and plan.dropped == (3,)
    assert pm.prepare_step(1, [4, 1, 3]).slots == {4: 0, 1: 1}  # default: wanted order


# ---- 3: a damaged session.json ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("saved") / "s"
    assert main(["session", "--preset", "micro", "--segments", "3", "--log-dir", str(d), "--json"]) == 0
    return d


def _set(path: tuple[str, ...], value: object) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return mutate


DAMAGE = [
    (("codec",), "zstd", "codec"),
    (("metadata", "preset"), "huge", "metadata.preset"),
    (("metadata",), [1], "metadata"),
    (("next_step",), None, "next_step"),
    (("next_step",), -1, "next_step"),
    (("window", "tokens"), None, "window.tokens"),
    (("window",), 7, "window"),
    (("poses",), {"2": ["a", 1, 2, 3, 4]}, "poses"),
    (("poses",), {"2": [1, 2, 3]}, "poses"),
    (("seed",), "x", "seed"),
    (("seed",), True, "seed"),
    (("rollbacks",), [[5]], "rollbacks"),
]


@pytest.mark.parametrize(("path", "value", "field"), DAMAGE)
def test_resume_names_a_damaged_session_json_field(
    saved_session: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    path: tuple[str, ...],
    value: object,
    field: str,
) -> None:
    d = tmp_path / "s"
    shutil.copytree(saved_session, d)
    state = json.loads((d / SESSION_FILE).read_text())
    _set(path, value)(state)
    (d / SESSION_FILE).write_text(json.dumps(state))
    argv = ["session", "--resume", "--log-dir", str(d), "--segments", "1", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: ") and SESSION_FILE in err and field in err
    if field != "metadata.preset":  # the CLI's own check; the file's types are all right
        with pytest.raises(ValueError, match=rf"{SESSION_FILE}: {field.split('.')[0]}"):
            read_saved_state(d)


# ---- 4, 5: a damaged meta.json or index.json -------------------------------------------------------


def _log(d: Path, n: int = 3) -> Path:
    with SegmentLog.create(d, slot_size_for(100)) as log:
        for i in range(n):
            log.append(
                segment_id=i, frame_start=3 * i, frame_end=3 * i + 3, pose=(0, 0, 0, 0, 0), codec="bf16",
                position_state="post-rope", position=3 * i, payload=bytes([i]) * 100,
            )  # fmt: skip
    return d


def _edit(path: Path, **values: object) -> None:
    obj = json.loads(path.read_text())
    obj.update(values)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("slot_size", [0, -4096, True, "8192", 4097, 2048, 12288])
def test_a_bad_slot_size_in_meta_json_is_named(tmp_path: Path, slot_size: object) -> None:
    d = _log(tmp_path / "log")
    _edit(d / META_NAME, slot_size=slot_size)
    with pytest.raises(SegmentLogError, match=rf"{META_NAME}: slot_size"):
        SegmentLog.open(d)


def test_a_good_or_lost_meta_json_still_opens(tmp_path: Path) -> None:
    d = _log(tmp_path / "log")
    with SegmentLog.open(d) as log:
        assert log.slot_size == slot_size_for(100) and log.slots() == [0, 1, 2]
    (d / META_NAME).unlink()  # slot 0's header names the slot size
    with SegmentLog.open(d) as log:
        assert log.slot_size == slot_size_for(100) and log.slots() == [0, 1, 2]
    _edit(_log(tmp_path / "empty", 0) / META_NAME, slot_size=3 * HEADER_SIZE)  # nothing to check it by
    with SegmentLog.open(tmp_path / "empty") as log:
        assert log.slot_size == 3 * HEADER_SIZE


def test_cli_resume_names_a_bad_meta_json(
    saved_session: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "s"
    shutil.copytree(saved_session, d)
    _edit(d / META_NAME, slot_size=0)
    assert main(["session", "--resume", "--log-dir", str(d), "--segments", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: ") and META_NAME in err


@pytest.mark.parametrize("n_slots", [5, -1, 10**12])
def test_an_index_naming_more_slots_than_it_lists_is_rebuilt(tmp_path: Path, n_slots: int) -> None:
    d = _log(tmp_path / "log")
    _edit(d / INDEX_NAME, n_slots=n_slots)
    with SegmentLog.open(d) as log:
        assert log.index_state == "rebuilt" and log.slots() == [0, 1, 2]
        assert log.n_slots == 3 and log.corrupt_slots() == {}  # no phantom "missing" slots


# ---- 6: bench-stall --plot, sizing --fps ------------------------------------------------------------


def test_bench_stall_checks_the_plot_path_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run_bench(**kw: object) -> dict[str, object]:
        """Fake benchmark: must not run when the plot cannot be written."""
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(stall, "run_bench", fake_run_bench)
    assert main(["bench-stall", "--quick", "--plot", str(tmp_path / "none" / "x.png")]) == 2
    assert "--plot" in capsys.readouterr().err
    assert main(["bench-stall", "--quick", "--plot", str(tmp_path)]) == 2  # a folder
    assert "--plot" in capsys.readouterr().err


@pytest.mark.parametrize("fps", ["1e-320", "0", "-1", "inf", "nan"])
def test_sizing_refuses_an_fps_whose_durations_make_no_sense(
    fps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sizing", "--host-memory", "32GiB", "--codec", "bf16", "--fps", fps, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("worldpager: ") and "fps" in captured.err
