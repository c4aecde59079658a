"""The SQLite store and `trace export` on what an operator meets (review 13): `--out -` to standard
output and a reader that stops reading, a store the exporting user may only read, a store that is
another program's database, and time ranges at the edges."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from manager.cli import main
from manager.replay.trace import read_trace
from manager.store import StoreError, open_store

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
HOME_STORE = 'url: "sqlite:///.residency/state.db"'


def config_with_store(tmp_path: Path, db: Path) -> Path:
    text = HOME.read_text(encoding="utf-8")
    assert HOME_STORE in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(HOME_STORE, f'url: "sqlite:///{db}"', 1), encoding="utf-8")
    return path


def store_with(db: Path, n: int, *, t0: float | None = None) -> list[float]:
    """A store at `db` holding `n` requests one second apart, the last a minute ago; their times."""
    t0 = time.time() - 60 - n if t0 is None else t0
    times = [t0 + i for i in range(n)]
    with closing(open_store(f"sqlite:///{db}")) as s:
        s.append_requests([{"t": t, "model": "voice", "busy_s": 0.4} for t in times])
    return times


# --- trace export --out - -------------------------------------------------------------------------


def test_export_out_dash_writes_the_trace_to_standard_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out -` wrote a file named "-" in the current folder (as `trace synth --out -` did)."""
    db = tmp_path / "state.db"
    store_with(db, 3)
    cfg = config_with_store(tmp_path, db)
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "export", "--config", str(cfg), "--out", "-"]) == 0
    out, err = capsys.readouterr()
    assert not (tmp_path / "-").exists() and not list(tmp_path.glob(".*partial"))
    assert [json.loads(line)["model"] for line in out.splitlines()] == ["voice"] * 3
    assert "wrote 3 requests to standard output" in err


def test_export_out_dot_slash_dash_is_still_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state.db"
    store_with(db, 2)
    cfg = config_with_store(tmp_path, db)
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "export", "--config", str(cfg), "--out", "./-"]) == 0
    assert capsys.readouterr().out == ""
    assert len(read_trace(tmp_path / "-", strict=True).requests) == 2


@pytest.mark.parametrize("out", ["-", "/dev/stdout"])
def test_an_export_whose_reader_stops_reading_ends_quietly(tmp_path: Path, out: str) -> None:
    """`trace export --out /dev/stdout | head -1` ended "residency: --out /dev/stdout: Broken pipe",
    exit 2, for a reader that had all it wanted."""
    db = tmp_path / "state.db"
    store_with(db, 20_000)  # more than a pipe's buffer holds
    cfg = config_with_store(tmp_path, db)
    residency = Path(sys.executable).parent / "residency"
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {residency} trace export --config {cfg} --out {out} | head -1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert json.loads(done.stdout)["model"] == "voice"
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as the shell's tools end


# --- a store the exporting user may only read -----------------------------------------------------


def as_other_user(fn: Callable[[], Any]) -> Any:
    """`fn()` run as a user who may read the store but not write it or its folder: as root (which
    file permissions do not stop), in a forked child that became `nobody`; otherwise here. Returns
    what it returned, or the text of the exception it raised."""

    def call() -> Any:
        try:
            return fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    if os.geteuid() != 0:
        return call()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but this call, then out without pytest's clean-up
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with os.fdopen(w, "w") as f:
                json.dump(call(), f)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text
    return json.loads(text)


@pytest.fixture
def shared_dir(tmp_path: Path) -> Any:
    """A folder others may read but not write (as /var/lib/residency is to an operator), reachable
    by `nobody` (pytest's own temporary folders are private to their owner)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="residency-ro-") as d:
        path = Path(d)
        path.chmod(0o755)
        yield path
        path.chmod(0o755)


def read_all(url: str) -> list[float] | str:
    def read() -> list[float]:
        with closing(open_store(url, create=False)) as s:
            return [r["t"] for r in s.requests(0)]

    return as_other_user(read)  # type: ignore[no-any-return]


def test_a_store_the_user_may_only_read_exports_when_the_service_is_stopped(shared_dir: Path) -> None:
    """With the service stopped (no -wal, no -shm beside the file) a user who may read the store but
    not write its folder got "cannot open the database: attempt to write a readonly database"; the
    code said a read-only user could export it."""
    db = shared_dir / "state.db"
    times = store_with(db, 3, t0=1000.0)
    db.chmod(0o644)
    if os.geteuid() != 0:
        shared_dir.chmod(0o555)
    assert sorted(p.name for p in shared_dir.iterdir()) == ["state.db"]
    assert read_all(f"sqlite:///{db}") == times
    assert sorted(p.name for p in shared_dir.iterdir()) == ["state.db"]  # nothing left behind


def test_a_store_the_user_may_only_read_exports_while_the_service_writes(shared_dir: Path) -> None:
    """The service running: its newest records are in the -wal file, which the reader must see."""
    db = shared_dir / "state.db"
    store_with(db, 2, t0=1000.0)
    script = (
        "import sqlite3, sys\n"
        f"c = sqlite3.connect({str(db)!r})\n"
        "c.execute('PRAGMA journal_mode=WAL')\n"
        "with c:\n"
        "    c.execute(\"INSERT INTO requests (t, model, busy_s) VALUES (1002.0, 'voice', 0.4)\")\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        for p in shared_dir.iterdir():
            p.chmod(0o644)
        if os.geteuid() != 0:
            shared_dir.chmod(0o555)
        assert (shared_dir / "state.db-wal").stat().st_size > 0
        assert read_all(f"sqlite:///{db}") == [1000.0, 1001.0, 1002.0]
    finally:
        shared_dir.chmod(0o755)
        writer.communicate("", timeout=30)


def test_a_killed_services_log_the_reader_cannot_open_is_refused_not_skipped(shared_dir: Path) -> None:
    """A -wal file left by a killed service holds records the main file lacks: a reader who cannot
    open it must not export the file without them."""
    db = shared_dir / "state.db"
    store_with(db, 1, t0=1000.0)
    wal = shared_dir / "state.db-wal"
    script = (
        "import os, sqlite3\n"
        f"c = sqlite3.connect({str(db)!r})\n"
        "c.execute('PRAGMA journal_mode=WAL')\n"
        "with c:\n"
        "    c.execute(\"INSERT INTO requests (t, model, busy_s) VALUES (1001.0, 'voice', 0.4)\")\n"
        "os._exit(0)\n"  # killed: no checkpoint, the -wal file stays
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    (shared_dir / "state.db-shm").unlink()
    assert wal.stat().st_size > 0
    for p in shared_dir.iterdir():
        p.chmod(0o644)
    if os.geteuid() != 0:
        shared_dir.chmod(0o555)
    got = read_all(f"sqlite:///{db}")
    assert isinstance(got, str) and got.startswith("StoreError") and "state.db-wal" in got, got


# --- a store url that names another program's database ---------------------------------------------


@pytest.mark.parametrize("cmd", ["export", "tune"])
def test_a_read_only_command_leaves_another_programs_database_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    """`store.url` naming another program's SQLite file (webui.db, say): `trace export` wrote the
    store's tables into it and set its user_version, which such programs read for their migrations."""
    db = tmp_path / "webui.db"
    with closing(sqlite3.connect(db)) as other, other:
        other.execute("CREATE TABLE chat (id INTEGER PRIMARY KEY, title TEXT)")
        other.execute("INSERT INTO chat (title) VALUES ('hello')")
    before = db.read_bytes()
    cfg = config_with_store(tmp_path, db)
    out = tmp_path / "week.jsonl"
    if cmd == "export":
        args = ["trace", "export", "--config", str(cfg), "--out", str(out)]
    else:
        args = ["tune", "--config", str(cfg), "--from-store", "--out", str(out)]
    assert main(args) == 2
    assert f"{db} holds no residency store" in capsys.readouterr().err
    assert db.read_bytes() == before and not out.exists()
    with closing(sqlite3.connect(db)) as other:
        assert other.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [("chat",)]


# --- redis urls: passwords as password tools make them --------------------------------------------


@pytest.mark.parametrize(
    ("url", "user", "password", "shown"),
    [
        ("redis://:AbC/dEf+==@cache:6380/2", None, "AbC/dEf+==", "redis://:***@cache:6380/2"),  # base64
        ("redis://:pa#ss@cache:6380/2", None, "pa#ss", "redis://:***@cache:6380/2"),
        ("redis://app:pa?ss@cache:6380/2", "app", "pa?ss", "redis://app:***@cache:6380/2"),
        ("redis://:x@y/z@cache:6380/2", None, "x@y/z", "redis://:***@cache:6380/2"),
        ("redis://:p%40ss@cache:6380/2", None, "p@ss", "redis://:***@cache:6380/2"),
    ],
)
def test_a_redis_password_with_url_characters_is_the_password(
    url: str, user: str | None, password: str, shown: str
) -> None:
    """A password from `openssl rand -base64` (with "/", "+", "=") or holding "#" or "?" was taken
    for the url's path, fragment or port: "the port must be a number" or "the database must be a
    number, got 'dEf+==@cache:6380/2'", which showed the rest of the password."""
    from manager.store.redis import parse_redis_url

    u = parse_redis_url(url)
    assert (u.host, u.port, u.db, u.username, u.password, u.prefix) == (
        "cache", 6380, 2, user, password, "residency",
    )  # fmt: skip
    assert u.display == shown


def test_a_bad_redis_url_never_shows_part_of_the_password() -> None:
    with pytest.raises(StoreError) as e:
        open_store("redis://:Ab@Cd/eFgh@cache:6380/x")  # a bad database number, after the password
    assert "eFgh" not in str(e.value) and "Cd" not in str(e.value)
    assert "the database must be a number, like redis://HOST:PORT/0, got 'x'" in str(e.value)
