"""Review 19: after a clean stop of `residency serve` with the local Ray it started, its device host's
data-channel socket was left in the channel's directory (`residency-<uid>` in the temporary
directory) until the next start. Now the stop removes it. The real `serve`, a real local Ray; the
temporary directory is one of the test's own (TMPDIR), so that no other test's host is counted."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY = Path(sys.executable).parent / "residency"
CONFIG = ROOT / "configs" / "local-cpu.yaml"


def test_a_clean_stop_leaves_no_host_socket(tmp_path: Path) -> None:
    top = Path(tempfile.mkdtemp(prefix="r19", dir="/tmp"))  # short: Ray's sockets go under it too
    config = tmp_path / "c.yaml"
    store = f'store: {{url: "sqlite:///{tmp_path / "state.db"}"}}\n'
    config.write_text(CONFIG.read_text().replace("devices:", f"{store}devices:", 1))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["TMPDIR"] = str(top)
    sockets = top / f"residency-{os.getuid()}"
    log = tmp_path / "serve.log"
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(RESIDENCY), "serve", "--config", str(config), "--listen", "127.0.0.1:0"],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True, env=env,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while not re.search(r"serving on \S+:\d+ ", log.read_text(errors="replace")):
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
            while not list(sockets.glob("*.sock")):  # the host's channel (it may come just after)
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, log.read_text(errors="replace")[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        text = log.read_text(errors="replace")
        assert text.strip().splitlines()[-1] == "residency: stopped", text[-3000:]
        assert sorted(p.name for p in sockets.iterdir()) == [], text[-3000:]
    finally:
        shutil.rmtree(top, ignore_errors=True)
