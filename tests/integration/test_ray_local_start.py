"""A real local Ray start.

- A SIGTERM while `residency serve` starts it: `ray.init` installs a SIGTERM handler of its own that
  exits at once (`sys.exit(signum)`), so the process ended with status 15 and no word, leaving Ray's
  processes to themselves. Now one line, status 128 + 15, and nothing left running. (The mechanism's
  unit tests, with a stand-in for `ray.init`, are `tests/unit/test_review13_ray.py`.)
- A stale `ray_current_cluster` file (a dead `ray start`): Ray joined it in place of a local start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def _config(tmp_path: Path) -> Path:
    """local-cpu.yaml with its store in `tmp_path`."""
    store = f'store: {{url: "sqlite:///{tmp_path / "state.db"}"}}\n'
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.read_text().replace("devices:", f"{store}devices:", 1))
    return path


def _in_session(sid: int) -> list[str]:
    """The processes of session `sid` still running."""
    out = []
    for proc in psutil.process_iter(["name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {proc.info['name']}")
        except OSError:
            continue
    return out


def test_sigterm_while_a_real_local_ray_starts(tmp_path: Path) -> None:
    """`residency serve` starting a real local Ray, given SIGTERM as soon as Ray's GCS process is
    there (its start goes on for seconds more): one line, status 143, and no Ray process left."""
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(RESIDENCY), "serve", "--config", str(_config(tmp_path)), "--listen", "127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        gcs = False
        while not gcs and proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):  # (a child that ended meanwhile)
                gcs = any("gcs_server" in c.name() for c in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.05)
        assert gcs, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while _in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _in_session(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for left in _in_session(proc.pid):
            os.kill(int(left.split()[0]), signal.SIGKILL)
    text = log.read_text()
    assert text.strip().splitlines()[-1] == "residency: stopped during start-up (SIGTERM)", text[-3000:]
    assert "Traceback" not in text, text[-3000:]


STALE = """
import sys, time
from pathlib import Path
import ray
from workers.ray_pool import ensure_ray
Path(sys.argv[1], "ray_current_cluster").write_text("127.0.0.1:1")  # a `ray start` long gone
t0 = time.monotonic()
ensure_ray(_temp_dir=sys.argv[1])
print("local", ray.get_runtime_context().gcs_address != "127.0.0.1:1", round(time.monotonic() - t0, 1))
ray.shutdown()
"""


def test_a_local_start_ignores_the_address_a_dead_ray_start_left(tmp_path: Path) -> None:
    """`ray.address: null` is a local Ray, but Ray's own None joins the cluster its
    `ray_current_cluster` file names (the last `ray start` on the machine): one that had died left
    `residency serve` in Ray's connection retries for minutes."""
    temp = Path(tempfile.mkdtemp(prefix="rayst-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", STALE, str(temp)], capture_output=True, text=True, timeout=150,
            cwd=ROOT, env=env,
        )  # fmt: skip
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[:2] == ["local", "True"], done.stdout
