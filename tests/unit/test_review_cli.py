"""The command line on the inputs a review found it mishandled: `trace export` onto links, FIFOs and
folders and from a store that is not there, config values too large to print or to use, flags that
must follow the config's own rules, outputs checked before the work, traces too short to split,
trace lines that give a field twice or a year-long request, report axes over decades, `ps --json`."""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import manager.cli as cli
from manager.cli import main
from manager.config import load_config
from manager.policy.types import Request
from manager.replay.synth import synth
from manager.replay.trace import MAX_BUSY_S, parse_line, read_trace, write_trace
from manager.store import open_store
from residency_proto.v1 import residency_pb2

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
HOME_STORE = 'url: "sqlite:///.residency/state.db"'


def config_with(tmp_path: Path, old: str, new: str, name: str = "c.yaml") -> Path:
    text = HOME.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


def config_with_store(tmp_path: Path, db: Path) -> Path:
    return config_with(tmp_path, HOME_STORE, f'url: "sqlite:///{db}"')


def store_with(db: Path, reqs: list[Request]) -> None:
    store = open_store(f"sqlite:///{db}")
    try:
        store.append_requests([{"t": r.t, "model": r.model, "busy_s": r.busy_s} for r in reqs])
    finally:
        store.close()


def recent(n: int) -> list[Request]:
    now = time.time()
    return [Request(t=now - 3600 + i, model="voice", busy_s=0.4) for i in range(n)]


# --- trace export: where the file goes ----------------------------------------------------------


def test_export_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store_with(db, recent(3))
    target = tmp_path / "real.jsonl"
    target.write_text("old\n", encoding="utf-8")
    target.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target.name)
    assert (
        main(["trace", "export", "--config", str(config_with_store(tmp_path, db)), "--out", str(link)]) == 0
    )
    assert link.is_symlink() and os.readlink(link) == target.name
    assert len(read_trace(target, strict=True).requests) == 3
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the replaced file keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "link.jsonl", "real.jsonl", "state.db"]


def test_export_into_a_fifo_writes_it_and_leaves_it_a_fifo(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store_with(db, recent(2))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")), daemon=True)
    reader.start()
    assert (
        main(["trace", "export", "--config", str(config_with_store(tmp_path, db)), "--out", str(fifo)]) == 0
    )
    reader.join(10)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [json.loads(line)["model"] for line in got[0].splitlines()] == ["voice", "voice"]
    assert not list(tmp_path.glob(".*partial"))


def test_export_to_a_directory_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    store_with(db, recent(1))
    cfg = config_with_store(tmp_path, db)
    out = tmp_path / "dir"
    out.mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["trace", "export", "--config", str(cfg), "--out", str(out)]) == 2
    assert f"--out {out}: is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("cmd", ["export", "tune"])
def test_a_read_only_command_does_not_create_a_missing_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    db = tmp_path / "store_new" / "state.db"  # mistyped: never recorded to
    cfg = config_with_store(tmp_path, db)
    out = tmp_path / "out"
    if cmd == "export":
        args = ["trace", "export", "--config", str(cfg), "--out", str(out)]
    else:
        args = ["tune", "--config", str(cfg), "--from-store", "--out", str(out)]
    assert main(args) == 2
    assert f"no store at {db} (nothing recorded yet?)" in capsys.readouterr().err
    assert not (tmp_path / "store_new").exists() and not out.exists()


# --- tune --from-store leaves no temporary folder -----------------------------------------------


def test_tune_from_store_removes_its_temporary_folder_on_success_and_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    db = tmp_path / "state.db"
    store_with(db, recent(1))  # one request: too short to split, the run fails
    cfg = config_with_store(tmp_path, db)
    out = tmp_path / "t.yaml"
    assert main(["tune", "--config", str(cfg), "--from-store", "--out", str(out)]) == 2
    assert "trace too short to split" in capsys.readouterr().err
    assert list(tmp.iterdir()) == []
    reqs = synth("home", 1, 1)
    shift = time.time() - 600 - reqs[-1].t
    store_with(db, [Request(t=r.t + shift, model=r.model, busy_s=r.busy_s) for r in reqs])
    assert main(["tune", "--config", str(cfg), "--from-store", "--out", str(out), "--json"]) == 0
    assert out.exists() and list(tmp.iterdir()) == []


# --- tune and measure check their outputs first -------------------------------------------------


@pytest.fixture
def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the search ran before the outputs were checked")

    monkeypatch.setattr("manager.replay.tune.tune", refuse)


@pytest.fixture
def day_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "day.jsonl"
    write_trace(trace, synth("home", 1, 2))
    return trace


def test_tune_report_onto_a_file_is_refused_before_the_search(
    tmp_path: Path, day_trace: Path, no_search: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rfile = tmp_path / "rfile"
    rfile.write_text("hello\n", encoding="utf-8")
    out = tmp_path / "o.yaml"
    args = [
        "tune",
        "--config",
        str(HOME),
        "--trace",
        str(day_trace),
        "--out",
        str(out),
        "--report",
        str(rfile),
    ]
    assert main(args) == 2
    assert f"--report {rfile}: exists and is not a directory" in capsys.readouterr().err
    assert not out.exists() and rfile.read_text(encoding="utf-8") == "hello\n"


def test_tune_out_onto_a_directory_is_refused_before_the_search(
    tmp_path: Path, day_trace: Path, no_search: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", "--config", str(HOME), "--trace", str(day_trace), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: is a directory" in capsys.readouterr().err


def test_tune_out_under_a_file_is_refused_before_the_search(
    tmp_path: Path, day_trace: Path, no_search: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = day_trace / "o.yaml"  # the "folder" is the trace file
    assert main(["tune", "--config", str(HOME), "--trace", str(day_trace), "--out", str(out)]) == 2
    assert f"--out {out}:" in capsys.readouterr().err


def test_measure_write_config_is_checked_and_its_folder_made_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import manager.measure as measure

    calls: list[object] = []
    monkeypatch.setattr(measure, "measure_all", lambda *a: calls.append(a) or [])
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    bad = afile / "m.yaml"
    assert main(["measure", "--config", str(HOME), "--write-config", str(bad)]) == 2
    assert f"--write-config {bad}:" in capsys.readouterr().err
    assert calls == []
    assert main(["measure", "--config", str(HOME), "--write-config", str(tmp_path)]) == 2
    assert f"--write-config {tmp_path}: is a directory" in capsys.readouterr().err
    assert calls == []
    new = tmp_path / "newdir" / "m.yaml"
    assert main(["measure", "--config", str(HOME), "--write-config", str(new), "--json"]) == 0
    assert len(calls) == 1 and load_config(new).model_names() == load_config(HOME).model_names()


# --- tune: a trace too short to split -----------------------------------------------------------


@pytest.mark.parametrize("same_t", [False, True])
def test_tune_on_a_trace_too_short_to_split_says_so(
    tmp_path: Path, no_search: None, capsys: pytest.CaptureFixture[str], same_t: bool
) -> None:
    reqs = [Request(t=1793577600.0, model="voice", busy_s=0.4)] * (5 if same_t else 1)
    trace = tmp_path / "short.jsonl"
    write_trace(trace, reqs)
    assert (
        main(["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(tmp_path / "o.yaml")]) == 2
    )
    msg = capsys.readouterr().err
    assert "trace too short to split into search and holdout" in msg
    assert f"({len(reqs)} request(s) over 0 s); give --holdout or a longer trace" in msg


def test_tune_help_says_what_the_holdout_default_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the last 2 days of --trace" in help_text and "last 30% of its time span" in help_text


# --- flags follow the config's rules ------------------------------------------------------------


@pytest.mark.parametrize("value", ["127.0.0.1:99999", "127.0.0.1:５００５１", "127.0.0.1", ":50051", ""])
def test_serve_listen_is_checked_like_server_listen(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("served on a bad --listen")

    monkeypatch.setattr("manager.api.server.serve", refuse)
    assert main(["serve", "--config", str(HOME), "--listen", value]) == 2
    assert "--listen: expected host:port with a port 0-65535" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["127.0.0.1:99999", "127.0.0.1:５００５１", "nohost"])
def test_ps_target_is_checked_like_server_listen(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("called a bad --target")

    monkeypatch.setattr("manager.api.client.list_models", refuse)
    assert main(["ps", "--target", value]) == 2
    assert "--target: expected host:port with a port 0-65535" in capsys.readouterr().err


# --- config values too large to print or to use --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("9" * 5000, "c.yaml:42: a number of more than 4300 digits"),
        (
            "0x" + "f" * 5000,
            "c.yaml:42: models[0].memory: expected a size of at most 1024PiB, got an integer",
        ),
        (
            "0b" + "1" * 20000,
            "c.yaml:42: models[0].memory: expected a size of at most 1024PiB, got an integer",
        ),
    ],
)
def test_a_huge_integer_in_a_config_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, expected: str
) -> None:
    cfg = config_with(tmp_path, "memory: 1200MiB", f"memory: {value}")
    assert main(["config", "check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err) < 500


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("load_seconds: {disk: 7.0, cached: 2.8, host: 1.0}",
         "load_seconds: {disk: 1.0e+308, host: 1.0e+308}",
         "models[2].load_seconds.disk: expected a value less than or equal to 86400"),
        ("thrash_window: 10m", "thrash_window: 99999999999999999999w",
         "policy.thrash_window: expected a duration of at most 3650d"),
        ("keep_alive: forever", "keep_alive: 1e308", "'forever' for no expiry"),
        (HOME_STORE, "url: 'sqlite:///'", "store.url: no database file in the url"),
        (HOME_STORE, "url: 'redis://:hunter2@nohost:abc/0'", "store.url: the port must be a number 0-65535"),
        (HOME_STORE, "url: 'redis://notahost:６３７９/0'", "store.url: the port must be a number 0-65535"),
        (HOME_STORE, "url: 'redis://h:6379/x'", "store.url: the database must be a number"),
        ('listen: "127.0.0.1:50051"', 'listen: "127.0.0.1:５００５１"', "server.listen: expected host:port"),
    ],
)  # fmt: skip
def test_config_check_refuses_what_would_fail_when_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, expected: str
) -> None:
    cfg = config_with(tmp_path, old, new)
    assert main(["config", "check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "hunter2" not in err


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://:pw@[::1]:6380/2?prefix=home", "redis://h"]
)
def test_config_check_still_takes_good_redis_urls(tmp_path: Path, url: str) -> None:
    assert load_config(config_with(tmp_path, HOME_STORE, f"url: '{url}'")).store.url == url


def test_config_error_of_a_huge_value_is_short() -> None:
    from manager.units import parse_size

    with pytest.raises(ValueError, match="an integer of about 6021 digits"):
        parse_size(16**5000)


# --- JSON is JSON --------------------------------------------------------------------------------


def test_a_non_finite_figure_is_an_error_naming_it_not_invalid_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(cli.UsageError, match=r"holdout\.before\.wait_p99_s\.realtime is not a finite number"):
        cli._print_json({"holdout": {"before": {"wait_p99_s": {"realtime": math.inf}}}})
    with pytest.raises(cli.UsageError, match=r"models\[1\] is not a finite number"):
        cli._print_json({"models": [1.0, math.nan]})
    assert capsys.readouterr().out == ""


def test_a_year_long_request_is_a_bad_line_so_replay_json_stays_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"t": 1764547200.0, "model": "voice", "busy_s": 0.4}\n'
        '{"t": 1764547201.0, "model": "voice", "busy_s": 1.7e308}\n',
        encoding="utf-8",
    )
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert out["requests"] == 1 and out["bad_lines"] == 1
    assert f"t.jsonl:2: 'busy_s' must be at most {MAX_BUSY_S:.0f} s (a year)" in captured.err
    assert parse_line(f'{{"t": 1, "model": "m", "busy_s": {MAX_BUSY_S}}}', 1).busy_s == MAX_BUSY_S


# --- trace lines that give a field twice ---------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"t": 1, "model": "voice", "model": "llm", "busy_s": 0.4}', "model"),
        ('{"t": 1, "model": "voice", "busy_s": 0.4, "client": "a:b", "t": 2}', "t"),  # a ':' in a value
        ('{"t" : 1, "model":"voice","busy_s":0.4,"busy_s":0.5}', "busy_s"),
    ],
)
def test_a_trace_line_with_a_field_twice_is_bad_naming_it(tmp_path: Path, line: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"duplicate field {field!r}"):
        parse_line(line, 1)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "model": "voice", "busy_s": 0.1}\n' + line + "\n", encoding="utf-8")
    res = read_trace(trace)
    assert len(res.requests) == 1 and res.bad_lines[0][0] == 2 and field in res.bad_lines[0][1]


def test_colons_inside_values_are_not_duplicates() -> None:
    r = parse_line('{"t": 1, "model": "voice", "busy_s": 0.4, "client": "http://a:1/x", "class": "c:d"}', 1)
    assert r.client == "http://a:1/x" and r.cls == "c:d"


# --- report axes over long spans ----------------------------------------------------------------


@pytest.mark.parametrize(
    "span_days", [1, 7, 31, 32, 90, 200, 400, 365 * 10, 365 * 56, (1e11 - 1.7e9) / 86400]
)
def test_report_axes_have_a_bounded_number_of_marks(span_days: float) -> None:
    import matplotlib.pyplot as plt

    from manager.replay.report import DAY, MAX_DATE_MARKS, MAX_DAY_MARKS, _day_axis, date_marks

    t0 = 0.0 if span_days > 365 * 50 else 1.7e9
    t1 = t0 + span_days * DAY
    fig, ax = plt.subplots()
    try:
        _day_axis(ax, t0, t1)
        assert 1 <= len(ax.get_xticks()) <= max(MAX_DAY_MARKS, MAX_DATE_MARKS) + 1
    finally:
        plt.close(fig)
    if span_days > MAX_DAY_MARKS:
        marks, _fmt = date_marks(t0, t1)
        assert 1 <= len(marks) <= MAX_DATE_MARKS and all(t0 <= t <= t1 for t in marks)


# --- ps --json ------------------------------------------------------------------------------------


def test_ps_json_is_snake_case_with_numbers_and_every_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    resp = residency_pb2.ListResponse(
        models=[
            residency_pb2.ModelStatus(
                name="voice", tier="gpu", pinned=True, bytes=2**40, keep_alive_left_s=-1,
                load_seconds=residency_pb2.LoadSeconds(disk=3.0, host=0.4),
            ),
            residency_pb2.ModelStatus(name="llm", tier="disk"),
        ]
    )  # fmt: skip
    monkeypatch.setattr("manager.api.client.list_models", lambda *a, **k: resp)
    assert main(["ps", "--target", "127.0.0.1:50051", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    fields = {
        "name", "tier", "device", "class_name", "pinned", "bytes", "last_used", "keep_alive_left_s",
        "load_seconds", "lease_bytes", "requests", "adapter", "last_error", "keep_alive_s", "keep_alive_from",
    }  # fmt: skip
    assert all(set(m) == fields for m in models)
    voice, llm = models
    assert voice["bytes"] == 2**40 and voice["pinned"] is True and voice["keep_alive_left_s"] == -1
    assert voice["load_seconds"] == {"disk": 3.0, "cached": 0.0, "host": 0.4}
    assert llm["pinned"] is False and llm["bytes"] == 0 and llm["last_error"] == ""
