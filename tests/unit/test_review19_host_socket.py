"""Review 19: a device host's data-channel socket left after a clean stop (user walkthrough).

A host ends without a word (Ray's kill, or the local Ray `serve` started, shut down by the stop: a
SIGKILL, no `ChannelServer.close`), so its socket stayed in the channel's directory until a later
host's start removed it. Now the stop removes the sockets of the hosts it ended
(`workers.channel.remove_host_sockets`, called by `serve` once the local Ray is shut down: its
end-to-end test is tests/integration/test_review19_host_socket.py). A socket still listened on is
never removed. The hosts here are real `ChannelServer`s, one in a process of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.channel import ChannelServer, remove_host_sockets

HOST = """
import sys, threading
from workers.channel import ChannelServer
server = ChannelServer(object(), "review19-host")
print(server.path, flush=True)
threading.Event().wait()
"""


@pytest.fixture
def top() -> Iterator[Path]:
    """A short temporary directory of its own (the channel's directory is made in it)."""
    with tempfile.TemporaryDirectory(prefix="r19s", dir="/tmp") as d:
        yield Path(d)


def _host_process(top: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "TMPDIR": str(top)}
    proc = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    with proc.stdout:
        return proc, Path(proc.stdout.readline().strip())


def test_the_socket_of_a_host_killed_is_removed(top: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host process killed (SIGKILL, as Ray ends it): its socket stays behind it; removed by pid."""
    monkeypatch.setattr(tempfile, "tempdir", str(top))
    proc, path = _host_process(top)
    try:
        assert path.exists() and path.parent == top / f"residency-{os.getuid()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert path.exists()  # nothing in the host ran at its end
        assert remove_host_sockets([proc.pid]) == [str(path)]
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_socket_still_listened_on_or_of_another_pid_is_kept(
    top: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live host's socket is kept though its pid is named (it has not ended); a dead host's socket
    whose pid is not named is not this stop's to remove."""
    monkeypatch.setattr(tempfile, "tempdir", str(top))
    live = ChannelServer(object(), "review19-live")
    proc, dead = _host_process(top)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        ticks = iter(range(100))
        removed = remove_host_sockets(
            [os.getpid(), proc.pid + 100000],
            wait_s=3.0,
            clock=lambda: float(next(ticks)),
            sleep=lambda s: None,
        )
        assert removed == []
        assert Path(live.path).exists() and dead.exists()
    finally:
        live.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not Path(live.path).exists()  # (its own close removes it, as before)


def test_no_channel_directory_is_nothing_to_remove(top: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(top / "none"))
    assert remove_host_sockets([os.getpid()]) == []
    assert not (top / "none").exists()
