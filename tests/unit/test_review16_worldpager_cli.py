"""Review 16: `worldpager session --resume` on a saved session whose metadata names no preset (a world
session, a Session of one's own) or a damaged one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worldpager.cli import main
from worldpager.model import TinyCausalWan
from worldpager.retrieval import Pose
from worldpager.session import SESSION_PRESETS, Session
from worldpager.trajectory import yaw_sweep_trajectory


def _saved_micro(log_dir: Path, metadata: dict[str, object]) -> None:
    model = TinyCausalWan(SESSION_PRESETS["micro"].on_the_fly())
    with Session(model, host_budget_bytes=1 << 20, log_dir=log_dir, metadata=metadata) as s:
        s.step(Pose(0.0, 0.0, 0.0, 0.0, 0.0))


def test_resume_finds_the_preset_of_a_session_saved_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved_micro(tmp_path / "s", {"model": "world"})
    assert main(["session", "--log-dir", str(tmp_path / "s"), "--resume", "--segments", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["preset"], out["first_segment"], out["segments"]) == ("micro", 1, 1)
    rc = main(
        ["session", "--log-dir", str(tmp_path / "s"), "--resume", "--preset", "tiny", "--segments", "1"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "--preset tiny: the saved session ran --preset micro" in err and "Traceback" not in err


def test_resume_names_a_session_of_no_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _saved_micro(tmp_path / "s", {})
    path = tmp_path / "s" / "session.json"
    state = json.loads(path.read_text())
    state["config"]["layers"] = 3
    path.write_text(json.dumps(state))
    assert main(["session", "--log-dir", str(tmp_path / "s"), "--resume", "--segments", "1"]) == 2
    assert "ran a model that is none of the presets (tiny, micro)" in capsys.readouterr().err


@pytest.mark.parametrize("preset", [["micro"], {"a": 1}])
def test_resume_names_a_metadata_preset_that_is_no_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: object
) -> None:
    _saved_micro(tmp_path / "s", {"preset": "micro"})
    path = tmp_path / "s" / "session.json"
    state = json.loads(path.read_text())
    state["metadata"]["preset"] = preset
    path.write_text(json.dumps(state))
    assert main(["session", "--log-dir", str(tmp_path / "s"), "--resume", "--segments", "1"]) == 2
    err = capsys.readouterr().err
    assert "session.json: metadata.preset is" in err and "expected one of tiny, micro" in err


def test_prefetch_with_a_host_tier_under_2k_plus_1_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """Found in review: a host tier of k+1 segments (the least the CLI takes) leaves prefetch no room
    to read the next step's set back while the running step holds its own: steps attended to fewer
    segments than on_demand would, silently."""
    base = ["session", "--preset", "micro", "--segments", "1", "--json"]
    warned = {}
    for mode, cap in (("prefetch", "3"), ("on_demand", "3"), ("prefetch", "5")):
        assert main([*base, "--mode", mode, "--host-segments", cap]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["retrieval_unavailable"] == 0
        warned[mode, cap] = err
    assert "prefetch with --retrieval-k 2 needs 5" in warned["prefetch", "3"]
    assert "give at least 184320 bytes" in warned["prefetch", "3"]
    assert warned["on_demand", "3"] == warned["prefetch", "5"] == ""


def test_a_session_counts_the_wanted_segments_it_could_not_attend_to(tmp_path: Path) -> None:
    model = TinyCausalWan(SESSION_PRESETS["micro"].on_the_fly())
    with Session(model, host_budget_bytes=3 * 36864, log_dir=tmp_path / "s", trim_memory=False) as s:
        s.run(yaw_sweep_trajectory(16))
    unavailable = s.summary()["retrieval_unavailable"]
    assert isinstance(unavailable, int) and unavailable > 0  # prefetch: no room to read step 13's set back
