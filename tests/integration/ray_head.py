"""A private Ray head (`ray start --head`) for tests whose device hosts must outlive the process that
uses them (a manager joining with `ray.address`, or killed and restarted).

Ray 2.60 turns token authentication on by default; the head and the processes that join it run with
RAY_AUTH_MODE=disabled (PRIVATE_RAY), so they do not touch the session's token file."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
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


@pytest.fixture
def head_node() -> Iterator[str]:
    port = free_port()
    # a short temp dir: Ray's unix sockets live under it, and socket paths are limited to 107 bytes
    temp = Path(tempfile.mkdtemp(prefix="rayh-", dir="/tmp"))
    env = {**os.environ, **PRIVATE_RAY}
    proc = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
         "--num-gpus=1", "--include-dashboard=false", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # actor workers run in process groups of their own: end those of this head, by pid
        deadline = time.monotonic() + 10
        while (left := _pids_under(temp)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        shutil.rmtree(temp, ignore_errors=True)
