"""Review of `residency tune` / `replay` / `trace` and the tuning report: the policy tune judges by,
the period the report covers, and the report's time axis over periods shorter than a day."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from manager.cli import main
from manager.replay.synth import DEFAULT_START, synth
from manager.replay.trace import write_trace

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"


def lines(path: Path, *objs: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


def test_tune_judges_by_the_configs_policy_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = HOME.read_text(encoding="utf-8")
    assert "\n  name: residency\n" in text
    config = tmp_path / "lru.yaml"
    config.write_text(text.replace("\n  name: residency\n", "\n  name: lru-keepalive\n"), encoding="utf-8")
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synth("home", 2, 1))
    args = ["tune", "--config", str(config), "--trace", str(trace), "--json"]
    args += ["--out", str(tmp_path / "o.yaml")]

    assert main(args) == 0
    fig = json.loads(capsys.readouterr().out)
    # the service runs the config's policy (and its own tuning job tunes for it): so does the CLI
    assert fig["search"]["before"]["policy"] == "lru-keepalive"
    assert fig["holdout"]["after"]["policy"] == "lru-keepalive"

    assert main([*args, "--policy", "gdsf"]) == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["search"]["before"]["policy"] == "gdsf"
    assert fig["holdout"]["before"]["policy"] == "gdsf"


def test_tune_report_covers_a_session_that_ends_the_holdout(tmp_path: Path) -> None:
    t0 = DEFAULT_START + 14 * 3600.0  # Monday 14:00
    trace = lines(
        tmp_path / "t.jsonl",
        {"t": t0 - 86400.0, "model": "llm", "busy_s": 5},
        {"t": t0 - 43200.0, "model": "llm", "busy_s": 5},
    )
    holdout = lines(
        tmp_path / "h.jsonl",
        {"t": t0, "model": "world", "busy_s": 3 * 3600.0, "kind": "session"},
        {"t": t0 + 60.0, "model": "llm", "busy_s": 5},
    )
    report = tmp_path / "rep"
    args = ["tune", "--config", str(HOME), "--trace", str(trace), "--holdout", str(holdout)]
    assert main([*args, "--out", str(tmp_path / "o.yaml"), "--report", str(report), "--json"]) == 0
    page = (report / "index.html").read_text(encoding="utf-8")
    # the replay's figures run to the session's end (17:00), and so do the plots: not to the arrival
    # of the last request (14:01), which left the session's lease out of the memory plot
    assert "Replay period Mon 2026-11-02 14:00 – Mon 2026-11-02 17:00" in page


@pytest.mark.parametrize("span_s", [45.0, 3600.0, 7.5 * 3600.0, 86399.0])
def test_report_axis_under_a_day_is_labelled_with_clock_times(span_s: float) -> None:
    import matplotlib.pyplot as plt

    from manager.replay.report import DAY, _day_axis, _xlabel

    t0 = DEFAULT_START + 16.2 * 3600.0  # no midnight and no noon in the shorter periods
    fig, ax = plt.subplots()
    try:
        _day_axis(ax, t0, t0 + span_s)
        labels = [lab.get_text() for lab in ax.get_xticklabels()]
        ticks = list(ax.get_xticks())
    finally:
        plt.close(fig)
    assert 3 <= len(labels) <= 13 and all(labels)
    assert all(0.0 <= x <= span_s / DAY for x in ticks)
    assert _xlabel(t0, t0 + span_s) == "time of day (UTC wall clock)"
    assert _xlabel(t0, t0 + DAY) == "days since start (UTC)"
    if span_s == 7.5 * 3600.0:
        assert labels[0] == "Mon 17:00" and labels[-1] == "Mon 23:00"


def test_trace_synth_out_under_a_file_is_refused_plainly_before_generating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import manager.cli as cli

    def no_synth(*_a: object) -> None:
        raise AssertionError("generated before --out was checked")

    monkeypatch.setattr(cli, "synth", no_synth)
    a_file = tmp_path / "f.jsonl"
    a_file.write_text("", encoding="utf-8")
    assert main(["trace", "synth", "--days", "1", "--out", str(a_file / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"--out {a_file / 'x.jsonl'}: {a_file} is not a directory" in err
    assert "File exists" not in err
    assert main(["trace", "synth", "--days", "1", "--out", str(tmp_path)]) == 2
    assert "is a directory; give the path of a file to write" in capsys.readouterr().err


def test_trace_synth_out_into_a_missing_folder_makes_it(tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir" / "w.jsonl"
    assert main(["trace", "synth", "--days", "1", "--seed", "3", "--out", str(out)]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(synth("home", 1, 3))


def test_the_objective_weighs_the_highest_class_tail_whatever_its_name() -> None:
    """Found in review: the objective read the p99 of a class named `realtime`, so a config whose top
    class had another name lost its tail term. Classes come highest first in `wait_p99_s`."""
    from manager.replay.sim import ReplayResult
    from manager.replay.tune import objective

    home = ReplayResult("residency", load_wait_s=5.0, wait_p99_s={"realtime": 0.5, "interactive": 2.0})
    urgent = ReplayResult("residency", load_wait_s=5.0, wait_p99_s={"urgent": 0.5, "normal": 2.0})
    assert objective(home) == objective(urgent) == pytest.approx(5.0 + 10.0 * 0.5)
    assert objective(ReplayResult("residency", load_wait_s=5.0)) == 5.0  # no classes: no tail


def test_a_config_tuned_again_gets_one_tuning_line_not_a_stack(tmp_path: Path) -> None:
    """Found in review: each tuning prepended its line above the last one's (one more a week)."""
    from manager.config import load_config, write_config_with_updates

    once, twice = tmp_path / "once.yaml", tmp_path / "twice.yaml"
    write_config_with_updates(
        HOME, once, {"image": {"keep_alive": "45m"}}, None, "Tuned by `residency tune` A"
    )
    write_config_with_updates(
        once, twice, {"image": {"keep_alive": "1h"}}, None, "Tuned by `residency tune` B"
    )
    text = twice.read_text(encoding="utf-8")
    assert text.startswith("# Tuned by `residency tune` B\n")
    assert "residency tune` A" not in text
    assert text.count("# ") == HOME.read_text(encoding="utf-8").count("# ") + 1  # the user's comments stay
    assert next(m for m in load_config(twice).models if m.name == "image").keep_alive == 3600.0
    proposal = tmp_path / "p.yaml"
    write_config_with_updates(twice, proposal, {}, None, "Proposed by the service's tuning on X")
    assert proposal.read_text(encoding="utf-8").splitlines()[:2] == [
        "# Proposed by the service's tuning on X",
        HOME.read_text(encoding="utf-8").splitlines()[0],
    ]


def test_a_file_with_no_valid_request_line_is_not_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a README walk-through: `--trace configs/home.yaml` (arguments swapped) skipped every
    line and printed a table of zeros with exit 0. A missing file said `nope.jsonl:0:`."""
    assert main(["replay", "--config", str(HOME), "--trace", str(HOME)]) == 2
    err = capsys.readouterr().err
    assert "no valid request line" in err and "bad line(s) skipped" in err
    assert main(["replay", "--config", str(HOME), "--trace", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl: no such file" in err and ":0:" not in err
    half = lines(tmp_path / "half.jsonl", {"t": DEFAULT_START, "model": "llm", "busy_s": 1})
    with half.open("a", encoding="utf-8") as f:
        f.write("not json\n")
    assert main(["replay", "--config", str(HOME), "--trace", str(half), "--json"]) == 0  # one good line
    assert json.loads(capsys.readouterr().out)["requests"] == 1


def test_config_check_refuses_what_serve_would_refuse_to_listen_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a README walk-through: `config check` passed a config listening on 0.0.0.0 with no
    token variable, which `serve` then refused; a token variable that is not set went unnoticed."""
    text = HOME.read_text(encoding="utf-8")
    lan = tmp_path / "lan.yaml"
    lan.write_text(text.replace('listen: "127.0.0.1:50051"', 'listen: "0.0.0.0:50051"'), encoding="utf-8")
    assert main(["config", "check", str(lan)]) == 2
    assert "beyond loopback but server.auth_token_env is null" in capsys.readouterr().err
    named = tmp_path / "named.yaml"
    named.write_text(
        lan.read_text(encoding="utf-8").replace("auth_token_env: null", "auth_token_env: RES_TEST_TOKEN"),
        encoding="utf-8",
    )
    monkeypatch.delenv("RES_TEST_TOKEN", raising=False)
    assert main(["config", "check", str(named)]) == 0  # the variable may be set where it serves
    assert "warning: server.auth_token_env names $RES_TEST_TOKEN, which is not set" in capsys.readouterr().err
    monkeypatch.setenv("RES_TEST_TOKEN", "s3cret")
    assert main(["config", "check", str(named)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_config_check_warns_of_a_model_the_pins_leave_no_room_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: the config's room check counts higher classes' reservations but not pinned
    models, so a model that can never load passed `config check`, and every request for it was then
    refused. It stays a valid config (a pin may be lifted at run time); the check says so."""
    cfg = tmp_path / "pinned.yaml"
    ls = "load_seconds: {disk: 1, cached: 1, host: 1}"
    cfg.write_text(
        "devices:\n  - {name: gpu0, kind: cuda, index: 0, memory: 10GiB, reserve: 2GiB}\n"
        "host: {memory: 32GiB, reserve: 4GiB}\n"
        "classes:\n  - {name: realtime}\n  - {name: interactive}\n"
        "models:\n"
        f"  - {{name: a, class: realtime, adapter: torchscript, device: gpu0, memory: 6GiB, pin: true, {ls}, "
        "source: {path: a.pt}}\n"
        f"  - {{name: b, class: interactive, adapter: torchscript, device: gpu0, memory: 4GiB, {ls}, "
        "source: {path: b.pt}}\n",
        encoding="utf-8",
    )
    assert main(["config", "check", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "warning: models[1] (b): model 'b' needs 4GiB" in err and "more than 2GiB" in err
    assert "models[0]" not in err
    assert main(["config", "check", str(HOME)]) == 0
    assert "warning" not in capsys.readouterr().err
