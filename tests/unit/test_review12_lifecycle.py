"""Review of the service's lifecycle (`residency serve`): start-up and stopping as a user sees them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

import manager.cli as cli
from manager.api.runtime import ServeError, add_port

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def test_ctrl_c_while_starting_is_a_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A Ctrl-C in the first second of `serve` (its imports, reading the config: before the server's
    own signal handlers are in place) printed a KeyboardInterrupt traceback of importlib frames."""

    def interrupted(path: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)
    rc = cli.main(["serve", "--config", str(tmp_path / "c.yaml"), "--in-process"])
    err = capsys.readouterr().err
    assert rc == 130
    assert "residency: interrupted" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_front_ends_start_without_grpc_fork_noise(tmp_path: Path) -> None:
    """With front ends (`configs/home.yaml` runs one), every start printed gRPC core's
    "I... fork_posix.cc:71] Other threads are currently calling into gRPC, skipping fork() handlers"
    on stderr when it started them: a line a user cannot act on. The server forks only to exec."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text() + "server: {frontends: 1}\n")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    listen = f"127.0.0.1:{_free_port()}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RESIDENCY), "serve", "--config", str(cfg), "--in-process", "--listen", listen],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "serving on" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = log.read_text()
    assert "1 gRPC front ends on" in text
    assert "fork() handlers" not in text and "fork_posix" not in text, text


def _grpc_server() -> Any:
    import grpc

    return grpc.server(futures.ThreadPoolExecutor(1))


def test_a_missing_tls_file_names_its_setting(tmp_path: Path) -> None:
    """`server.tls_key` naming a file not there said "residency: [Errno 2] No such file or directory:
    'key.pem'": neither the setting nor that it is the TLS key."""
    (tmp_path / "cert.pem").write_text("x")
    server = _grpc_server()
    with pytest.raises(ServeError, match=r"server\.tls_key '.*nokey\.pem': cannot read it: No such file"):
        add_port(server, "127.0.0.1:0", (str(tmp_path / "cert.pem"), str(tmp_path / "nokey.pem")))
    with pytest.raises(ServeError, match=r"server\.tls_cert '.*nocert\.pem': cannot read it"):
        add_port(server, "127.0.0.1:0", (str(tmp_path / "nocert.pem"), str(tmp_path / "nokey.pem")))


def test_an_unusable_tls_pair_is_not_called_a_port_in_use(
    tmp_path: Path, tls_pair: tuple[Path, Path]
) -> None:
    """A cert/key that is not one (an empty file, a key of another certificate) made gRPC print three
    "E... ssl_transport_security" lines and `serve` say "cannot listen on '127.0.0.1:0' (address in use
    or not available)": the user looked for another server on the port."""
    cert, key = tls_pair
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    locked, locked_cert = tmp_path / "locked.pem", tmp_path / "locked-cert.pem"  # a passphrase on the key
    subprocess.run(
        ["openssl", "genrsa", "-aes256", "-passout", "pass:secret", "-out", str(locked), "2048"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "req", "-x509", "-new", "-key", str(locked), "-passin", "pass:secret",
         "-subj", "/CN=localhost", "-days", "1", "-out", str(locked_cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    pairs = [(empty, empty), (cert, empty), (cert, other), (locked_cert, locked)]
    for pair in ((str(c), str(k)) for c, k in pairs):
        with pytest.raises(ServeError, match="are not a PEM certificate and its private key"):
            add_port(_grpc_server(), "127.0.0.1:0", pair)
    server = _grpc_server()
    assert add_port(server, "127.0.0.1:0", (str(cert), str(key))) > 0  # the right pair still binds
    server.stop(None)


def test_an_unopenable_journal_is_said_without_errno(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`store.journal` where no file can be: "residency: [Errno 2] store.journal '…': cannot open the
    request journal: …" (the OSError's number before the sentence that already says it all)."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text('store: {journal: "/proc/no-such-process/requests.journal"}\n' + CONFIG.read_text())
    rc = cli.main(["serve", "--config", str(cfg), "--in-process", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "residency: store.journal '/proc/no-such-process/requests.journal': cannot open the request journal"
        in err
    )
    assert "[Errno" not in err and "Traceback" not in err


def test_an_unusable_tls_pair_is_said_before_the_store_and_ray_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The TLS pair was first read when the gRPC server was built: after the store had opened and
    Ray had started (seconds, and Ray's own output) for a start that was bound to fail."""
    import asyncio

    import manager.store
    import manager.workers_bridge
    from manager.api.server import serve
    from manager.config import load_config

    def too_late(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("started before the TLS pair was checked")

    monkeypatch.setattr(manager.store, "open_store", too_late)
    monkeypatch.setattr(manager.workers_bridge, "create_pool", too_late)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    base = load_config(CONFIG)
    tls = {"listen": "127.0.0.1:0", "tls_cert": str(empty), "tls_key": str(empty)}
    config = base.model_copy(update={"server": base.server.model_copy(update=tls)})
    with pytest.raises(ServeError, match="are not a PEM certificate and its private key"):
        asyncio.run(serve(config, in_process=True))


class _Reloads:
    """Stands in for `reload_from_file_on_loop` and the manager it is given (unit test only): counts
    reloads, raising the errors it is told to first."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.calls = 0
        self.published: list[tuple[str, str]] = []

    async def reload(self, manager: Any, path: str) -> list[str]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return []

    def _publish(self, kind: str, model: str, detail: str, device: str, t: float) -> None:
        self.published.append((kind, detail))

    def clock(self) -> float:
        return time.time()


def test_the_config_watcher_sees_a_same_time_change_and_outlives_a_failed_reload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The watcher compared the file's mtime only: a symlink re-pointed to a file with the same time
    (`cp -p`, `touch -r`, an unpacked archive) was never reloaded. And a reload raising anything but
    a ResidencyError ended the watcher task, silently: no later edit was ever reloaded."""
    import asyncio

    import manager.api.admin
    from manager.api.server import watch_config

    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text(CONFIG.read_text())
    two.write_text(CONFIG.read_text() + "\n# edited\n")
    os.utime(two, ns=(one.stat().st_atime_ns, one.stat().st_mtime_ns))  # the same time
    link = tmp_path / "cfg.yaml"
    link.symlink_to(one.name)
    fake = _Reloads([RuntimeError("a bug in a reload")])
    monkeypatch.setattr(manager.api.admin, "reload_from_file_on_loop", fake.reload)

    async def body() -> None:
        task = asyncio.create_task(watch_config(fake, str(link), every_s=0.01))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        link.unlink()
        link.symlink_to(two.name)  # re-pointed: same mtime, another file
        for _ in range(200):
            if fake.calls:
                break
            await asyncio.sleep(0.01)
        assert fake.calls == 1, "a same-time change was not seen"
        two.write_text(CONFIG.read_text() + "\n# edited again\n")
        for _ in range(200):
            if fake.calls == 2:
                break
            await asyncio.sleep(0.01)
        assert not task.done(), "the watcher ended with the failed reload"
        assert fake.calls == 2
        task.cancel()

    asyncio.run(body())
    assert fake.published and fake.published[0][0] == "config_rejected"


def test_a_listen_given_on_the_command_line_outlives_a_reload_of_the_file(tmp_path: Path) -> None:
    """`serve --listen` set the running config's `server.listen`; the first hot reload (an edit, the
    watcher, a tuning write-back) put the file's back in the running config and said
    "server.listen (at the next restart)", which was not so: the next start takes --listen again."""
    from live_helpers import run

    from manager.api.admin import reload_from_file
    from manager.config import load_config

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text())
    base = load_config(cfg)
    config = base.model_copy(update={"server": base.server.model_copy(update={"listen": "127.0.0.1:0"})})

    async def body(lm: Any) -> None:
        lm.server_overrides = {"listen": "127.0.0.1:0"}
        cfg.write_text(
            CONFIG.read_text().replace(
                "policy: {name: residency}", "policy: {name: residency, default_keep_alive: 7m}"
            )
        )
        changes = reload_from_file(lm, str(cfg))
        assert lm.config.server.listen == "127.0.0.1:0"  # was the file's
        assert not [c for c in changes if c.startswith("server.listen")], changes
        assert lm.config.policy.default_keep_alive == 420.0  # the edit itself is taken

    run(config, body)
