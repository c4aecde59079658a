"""A private Ray head (`ray start --head`) for tests whose device hosts must outlive the process that
uses them (a manager joining with `ray.address`, or killed and restarted).

Ray 2.60 turns token authentication on by default; the head and the processes that join it run with
RAY_AUTH_MODE=disabled (PRIVATE_RAY), so they do not touch the session's token file."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .redis_server import free_port

VENV_BIN = Path(sys.executable).parent
PRIVATE_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _pids_under(temp: Path) -> list[int]:
    """Processes whose command line names this head's temp dir (its daemons and workers)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(temp) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


READY_S = 120.0
"""How long the head may take to listen on its port (a loaded 2-core machine starts Ray slowly)."""


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        return True
    return False


def _ready(said: Path, port: int, text: str | None = None) -> bool:
    """Whether the head started (its own words, in `said`) and its GCS listens on `port` (not only
    some other process that took the port)."""
    if text is None:
        try:
            text = said.read_text(errors="replace")
        except OSError:
            return False
    return "Ray runtime started" in text and _listening(port)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _end_all(temp: Path) -> None:
    """End what is left of a head whose temp dir is `temp`, and remove that dir: actor workers run in
    process groups of their own, so they are found by pid."""
    deadline = time.monotonic() + 10
    while (left := _pids_under(temp)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def head_node() -> Iterator[str]:
    env = {**os.environ, **PRIVATE_RAY, "PYTHONUNBUFFERED": "1"}  # (its words reach its log at once)
    for _ in range(3):  # a port taken between free_port() and the head's bind: another port
        # a short temp dir: Ray's unix sockets live under it, and socket paths are limited to 107 bytes
        temp = Path(tempfile.mkdtemp(prefix="rayh-", dir="/tmp"))
        said = temp.parent / f"{temp.name}.log"
        port = free_port()
        with said.open("wb") as log:
            proc = subprocess.Popen(
                [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                 "--num-gpus=1", "--include-dashboard=false", f"--temp-dir={temp}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        # ready once it says it started and its GCS listens (a process that joins it earlier may
        # give up on it); a port another process took meanwhile: it exits, and another is tried
        deadline = time.monotonic() + READY_S
        while proc.poll() is None and not _ready(said, port) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = said.read_text(errors="replace")
        said.unlink(missing_ok=True)
        if proc.poll() is None and _ready(said, port, text):
            break
        if proc.poll() is None:  # (neither ready nor ended in READY_S: not tried again)
            _stop(proc)
            _end_all(temp)
            pytest.fail(
                f"the private Ray head did not start on {port} within {READY_S:.0f} s:\n{text[-3000:]}"
            )
        _end_all(temp)
    else:
        pytest.fail(
            f"the private Ray head could not start (three ports tried); the last said:\n{text[-2000:]}"
        )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)
        _end_all(temp)
