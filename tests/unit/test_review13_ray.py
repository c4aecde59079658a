"""Review of `residency serve`'s Ray start: an unreachable `ray.address`, and a stop signal while Ray
starts.

* An address where nothing answers made `serve` sit in Ray's own connection retries for minutes,
  saying nothing; now a TCP connection to it, before `ray.init`, says at once why not, naming
  `ray.address`.
* `ray.init` installs a SIGTERM handler of its own that exits at once (`sys.exit(signum)`): a SIGTERM
  in the first seconds of a local start ended the process with status 15 and no word, and SIGINT or
  SIGHUP waited for the whole start, then ended it with status 0 and no word either.

Unit tests never start Ray: the in-process tests stand `ray.init` in with a function that does what
Ray's start does here (installs a SIGTERM handler like Ray's, starts a child process like Ray's GCS,
and blocks). The test with a real local Ray, in a `residency serve` subprocess, is
`tests/integration/test_ray_local_start.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import pytest
import ray

import manager.cli as cli
from manager.config import load_config
from manager.workers_bridge import create_pool
from workers import ray_pool

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def _closed_port() -> int:
    """A local port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, address: str | None) -> Path:
    """local-cpu.yaml with `ray.address` set, its store in `tmp_path`."""
    ray_line = "" if address is None else f'ray: {{address: "{address}"}}\n'
    store = f'store: {{url: "sqlite:///{tmp_path / "state.db"}"}}\n'
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text().replace("devices:", f"{ray_line}{store}devices:", 1))
    return path


@pytest.fixture
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_ray_address: None) -> None:
    """`cli.main(["serve", ...])` in this process: its cwd, and the variable it sets, kept here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")


# ---- an unreachable ray.address -------------------------------------------------------------------


@pytest.fixture
def unanswering() -> Iterator[str]:
    """host:port of a local listener whose queue of connections is full: the kernel drops further
    connection requests, so a connect there times out (as to a host that does not answer)."""
    listener = socket.socket()
    queued: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(16):
            try:
                queued.append(socket.create_connection(address, timeout=0.5))
            except TimeoutError:
                yield f"127.0.0.1:{address[1]}"
                return
        pytest.skip("this kernel answered every connection to a full listen queue")
    finally:
        for s in [*queued, listener]:
            s.close()


def test_an_address_nothing_listens_on_is_refused(no_ray_address: None) -> None:
    port = _closed_port()
    assert ray_pool.unreachable(f"127.0.0.1:{port}") == (
        f"cannot connect to 127.0.0.1:{port}: connection refused (is Ray running there?)"
    )
    assert ray_pool.unreachable(f"ray://127.0.0.1:{port}") == (  # a Ray client address: its host:port
        f"cannot connect to 127.0.0.1:{port}: connection refused (is Ray running there?)"
    )


def test_an_address_that_does_not_answer_times_out(unanswering: str, no_ray_address: None) -> None:
    assert ray_pool.unreachable(unanswering, timeout_s=0.5) == (
        f"cannot connect to {unanswering}: no answer within 0.5 s"
    )


def test_an_address_that_answers_and_those_ray_finds_itself_are_not_refused(no_ray_address: None) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        assert ray_pool.unreachable(f"127.0.0.1:{port}") is None
        assert ray_pool.unreachable(f"ray://localhost:{port}") is None
    assert ray_pool.unreachable(None) is None  # a local Ray is started
    assert ray_pool.unreachable("auto") is None  # Ray looks for one (and says so when it finds none)


def test_a_host_name_that_cannot_be_one_is_said(no_ray_address: None) -> None:
    assert ray_pool.unreachable("ray://bad..name:10001") == (
        "cannot connect to bad..name:10001: 'bad..name' is not a valid host name"
    )


def test_ray_address_from_the_environment_is_the_one_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray joins RAY_ADDRESS in place of null or "auto": that is the address that must answer."""
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    why = ray_pool.unreachable("auto")
    assert why is not None
    assert why.startswith(f"cannot connect to 127.0.0.1:{port} (RAY_ADDRESS '127.0.0.1:{port}', from the")
    assert why.endswith("connection refused (is Ray running there?)")
    assert ray_pool.unreachable(None) == why
    other = _closed_port()  # an address the config gives is the one joined
    assert ray_pool.unreachable(f"127.0.0.1:{other}") == (
        f"cannot connect to 127.0.0.1:{other}: connection refused (is Ray running there?)"
    )


def test_create_pool_says_an_unreachable_ray_address_before_starting_ray(
    tmp_path: Path, no_ray_address: None
) -> None:
    """(`ray.init` raises in unit tests: had it been called, the error would be that one.)"""
    port = _closed_port()
    config = load_config(_config(tmp_path, f"127.0.0.1:{port}"))
    with pytest.raises(ray_pool.RayUnreachable) as e:
        create_pool(config)
    assert str(e.value) == (
        f"ray.address '127.0.0.1:{port}': cannot connect to 127.0.0.1:{port}: "
        "connection refused (is Ray running there?)"
    )
    assert isinstance(e.value, ConnectionError)  # (what a caller joining a head still starting retries)


def test_serve_with_an_unreachable_ray_address_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_env: None
) -> None:
    port = _closed_port()
    config = _config(tmp_path, f"127.0.0.1:{port}")
    rc = cli.main(["serve", "--config", str(config), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        f"residency: ray.address '127.0.0.1:{port}': cannot connect to 127.0.0.1:{port}: "
        "connection refused (is Ray running there?)"
    )
    assert "Traceback" not in err


# ---- a stop signal while Ray starts ----------------------------------------------------------------


def _ray_like_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(signum)  # what ray.init installs (ray/_private/worker.py, init)


class RayLikeStart:
    """Stands in for `ray.init` of a local Ray: installs Ray's kind of SIGTERM handler, starts a
    child process (its "GCS"), then, when given a signal, sends it to this process, and blocks as
    Ray's start does while its node comes up."""

    def __init__(self, send: int | None = None) -> None:
        self.send = send
        self.children: list[subprocess.Popen[bytes]] = []

    def __call__(self, **kwargs: Any) -> None:
        signal.signal(signal.SIGTERM, _ray_like_sigterm)
        self.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        if self.send is not None:
            os.kill(os.getpid(), self.send)
            time.sleep(60)  # Ray's node coming up; the signal ends this at once

    def end(self) -> None:
        for proc in self.children:
            proc.kill()
            proc.wait()  # (a child psutil reaped already reads as ended)


@pytest.fixture
def shutdowns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append(1))
    return seen


def test_the_signal_handlers_from_before_are_back_after_rays_start(
    monkeypatch: pytest.MonkeyPatch, shutdowns: list[int], no_ray_address: None
) -> None:
    """`serve`'s handlers stop it cleanly; Ray's SIGTERM handler, left in place, would exit at once."""
    start = RayLikeStart()
    monkeypatch.setattr(ray, "init", start)

    def ours(signum: int, frame: FrameType | None) -> None:
        pass

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    held = {s: signal.getsignal(s) for s in stops}
    try:
        for s in stops:
            signal.signal(s, ours)
        ray_pool.ensure_ray(None)
        assert {s: signal.getsignal(s) for s in stops} == dict.fromkeys(stops, ours)
    finally:
        for s, h in held.items():
            signal.signal(s, h)
        start.end()
    assert shutdowns == []  # a start that went through is not shut down


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_ray_starts_stops_serve_with_one_line(
    signum: signal.Signals,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    shutdowns: list[int],
    cli_env: None,
) -> None:
    """SIGTERM: Ray's handler exited with status 15 and no word. SIGINT and SIGHUP: they waited for the
    whole start, and `serve` then ended with status 0 and no word. Now each stops the start at once:
    Ray is shut down, the processes its start began are ended, one line says why, and the exit
    status is the signal's (128 + its number, as a shell reports a process a signal ended)."""
    start = RayLikeStart(send=signum)
    monkeypatch.setattr(ray, "init", start)
    try:
        began = time.monotonic()
        rc = cli.main(["serve", "--config", str(_config(tmp_path, None)), "--listen", "127.0.0.1:0"])
        took = time.monotonic() - began
        err = capsys.readouterr().err
        assert rc == 128 + signum
        assert err.strip().splitlines()[-1] == f"residency: stopped during start-up ({signum.name})"
        assert "Traceback" not in err
        assert took < 30  # did not wait for the start to end
        assert len(shutdowns) == 1
        assert not psutil.pid_exists(start.children[0].pid)  # the "GCS" was ended (and reaped)
    finally:
        start.end()


def test_a_signal_after_rays_start_but_before_ready_is_said_too(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cli_env: None,
) -> None:
    """A signal that comes after Ray's start, while the rest starts, was taken by the event loop and
    `serve` ended with status 0, saying nothing."""
    import manager.workers_bridge as bridge

    real = bridge.create_pool

    def create(config: Any, **kwargs: Any) -> Any:
        pool = real(config, in_process=True)
        os.kill(os.getpid(), signal.SIGTERM)  # `serve`'s handler sets its stop (on its event loop)
        return pool

    monkeypatch.setattr(bridge, "create_pool", create)
    rc = cli.main(["serve", "--config", str(_config(tmp_path, None)), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "residency: stopped during start-up (SIGTERM)"
    assert "serving on" not in err
