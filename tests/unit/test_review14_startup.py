"""Review of `residency serve`'s start-up: a stop signal before Ray's start.

`serve`'s own handlers run on its event loop, which does not run while start-up's first steps (the
listen check, the token, the TLS pair, the request journal and the store's opening) and Ray's start
block it: a SIGINT or SIGTERM in those first steps was acted on only once Ray had started (seconds,
minutes), and then undone again. Now such a signal ends start-up there, before Ray's start: one line
and the signal's exit status (128 + its number), as for a signal during Ray's start; what had been
opened (the journal, the store) is closed.

Unit tests never start Ray: `ray.init` is stood in for by a function that records its call (the rest
of the start is the real one: `create_pool`, `ensure_ray`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import ray

import manager.api.server as server
import manager.cli as cli
import manager.store as store_mod

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def _config(tmp_path: Path) -> Path:
    """local-cpu.yaml with its store and request journal in `tmp_path` (a local Ray: no address)."""
    extra = f'store: {{url: "sqlite:///{tmp_path / "state.db"}", journal: "{tmp_path / "requests.jsonl"}"}}\n'
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text().replace("devices:", f"{extra}devices:", 1))
    return path


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`cli.main(["serve", ...])` in this process: its cwd, and the variable it sets, kept here."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.fixture
def ray_starts(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The calls of `ray.init` (Ray's start): recorded, then refused, so that no test goes on to serve."""
    calls: list[dict[str, Any]] = []

    def start(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise RuntimeError("Ray's start (a stand-in)")

    monkeypatch.setattr(ray, "init", start)
    return calls


@pytest.fixture
def handlers_kept() -> Any:
    """The process's stop-signal handlers, as they were before the test (a test's serve changes them)."""
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    held = {s: signal.getsignal(s) for s in stops}
    yield
    for s, h in held.items():
        signal.signal(s, signal.SIG_DFL if h is None else h)


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_while_the_store_opens_ends_start_up_before_ray_starts(
    signum: signal.Signals,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_starts: list[dict[str, Any]],
    cli_env: None,
    handlers_kept: None,
) -> None:
    """The signal comes while the store is being opened (within `open_store`, as a Redis server that is
    slow to answer keeps it there): Ray's start is never called, one line says why, the exit status is
    the signal's, and the journal, opened before, is let go."""
    real = store_mod.open_store
    opened: list[Any] = []

    def open_store(url: str, **kwargs: Any) -> Any:
        opened.append(real(url, **kwargs))
        os.kill(os.getpid(), signum)
        return opened[-1]

    monkeypatch.setattr(store_mod, "open_store", open_store)
    rc = cli.main(["serve", "--config", str(_config(tmp_path)), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert ray_starts == []  # Ray's start was never called
    assert rc == 128 + signum
    assert err.strip().splitlines()[-1] == f"residency: stopped during start-up ({signum.name})"
    assert "Traceback" not in err
    assert len(opened) == 1  # (interrupted within the open: what it had made goes with it)
    # the journal was let go: another start may take it
    from manager.journal import RequestJournal

    RequestJournal(tmp_path / "requests.jsonl").close()


def test_a_signal_while_the_store_answers_its_first_call_closes_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_starts: list[dict[str, Any]],
    cli_env: None,
    handlers_kept: None,
) -> None:
    """A signal in `refused()` (a Redis store's first call to its server): the store, open by then, is
    closed as start-up ends."""
    real = store_mod.open_store
    opened: list[Any] = []

    def open_store(url: str, **kwargs: Any) -> Any:
        s = real(url, **kwargs)
        opened.append(s)
        asking = s.refused

        def refused() -> str | None:
            os.kill(os.getpid(), signal.SIGTERM)
            return asking()

        monkeypatch.setattr(s, "refused", refused)
        return s

    monkeypatch.setattr(store_mod, "open_store", open_store)
    rc = cli.main(["serve", "--config", str(_config(tmp_path)), "--listen", "127.0.0.1:0"])
    assert rc == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == "residency: stopped during start-up (SIGTERM)"
    assert ray_starts == []
    assert opened[0].ping() is False


def test_a_signal_during_the_listen_check_ends_start_up_before_the_store_opens(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ray_starts: list[dict[str, Any]],
    cli_env: None,
    handlers_kept: None,
) -> None:
    real = server.probe_listen
    opens: list[str] = []

    def probe_listen(listen: str) -> Any:
        got = real(listen)
        os.kill(os.getpid(), signal.SIGINT)
        return got

    monkeypatch.setattr(server, "probe_listen", probe_listen)
    monkeypatch.setattr(store_mod, "open_store", lambda url, **kw: opens.append(url))
    rc = cli.main(["serve", "--config", str(_config(tmp_path)), "--listen", "127.0.0.1:0"])
    assert rc == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines()[-1] == "residency: stopped during start-up (SIGINT)"
    assert ray_starts == []
    assert opens == []


def test_serves_handlers_are_back_after_the_steps_before_ray(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cli_env: None,
    handlers_kept: None,
) -> None:
    """Past the steps before Ray, a signal is `serve`'s own again (its event loop's): one after Ray's
    start stops it as before, with the one line and the signal's status, after the pool is made."""
    import manager.workers_bridge as bridge

    real = bridge.create_pool
    made: list[Any] = []

    def create(config: Any, **kwargs: Any) -> Any:
        made.append(real(config, in_process=True))
        os.kill(os.getpid(), signal.SIGTERM)
        return made[-1]

    monkeypatch.setattr(bridge, "create_pool", create)
    rc = cli.main(["serve", "--config", str(_config(tmp_path)), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "residency: stopped during start-up (SIGTERM)"
    assert len(made) == 1


def test_the_steps_before_ray_hold_signals_only_on_the_main_thread() -> None:
    """Python runs signal handlers on the main thread only (and only there may they be set): on another
    thread the steps run as they are, with no handler changed."""
    held = signal.getsignal(signal.SIGTERM)
    seen: list[Any] = []

    def run() -> None:
        with server._stop_signals_end_start_up():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [held]


def test_a_signal_within_the_steps_before_ray_is_stopped_at_start_up(handlers_kept: None) -> None:
    with pytest.raises(server.StoppedAtStartUp) as e, server._stop_signals_end_start_up():
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(10**6):  # (the handler runs between two bytecodes of this thread)
            pass
        pytest.fail("the signal did not end the steps")
    assert e.value.signum == signal.SIGHUP
    assert str(e.value) == "stopped during start-up (SIGHUP)"


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX signals")
