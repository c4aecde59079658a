"""The memory soak killed (SIGTERM) midway stops its manager and removes its temporary folders, as
Ctrl-C does; before, a kill left the soak's temporary folder (and a session's logs) in TMPDIR."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_killed_soak_leaves_no_temporary_folder(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    err = tmp_path / "stderr.txt"
    with err.open("wb") as f:
        p = subprocess.Popen(
            [sys.executable, "bench/soak.py", "--minutes", "2", "--cycle-seconds", "10"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while b"[soak] t=" not in err.read_bytes():  # the schedule runs: a world session is open
                assert p.poll() is None, err.read_text()
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.2)
            assert list(tmp_path.glob("soak-*")), "the soak's temporary folder is where the test looks"
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    text = err.read_text()
    assert rc == 128 + signal.SIGTERM, text
    assert "[soak] terminated: no result" in text, text
    assert "Traceback" not in text, text
    # torch's compile cache (torchinductor_USER) is torch's own, kept between runs on purpose
    left = [
        q.name
        for q in tmp_path.iterdir()
        if q.name != "stderr.txt" and not q.name.startswith("torchinductor")
    ]
    assert left == [], left
