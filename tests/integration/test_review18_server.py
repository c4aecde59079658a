"""Review 18: a second stop signal to `residency serve` on a real local Ray (its default mode).

Before: with Ray's device hosts (and uvloop, the default event loop), `kill -INT $P; sleep 0.3; kill
-INT $P` ended the process 2.2-2.7 s after the first signal, exit status 0, without the line the
README promises. `serve`'s own stop was over within milliseconds (Ray's pool only lets its actors go)
and had put the event loop's handlers back; the process then spent seconds in Ray's atexit hook
(`ray.shutdown()`: the local Ray's processes stopped), where uvloop's handler, its loop closed, only
noted the second signal, and asyncio's, removed at the loop's close, left Python's default (a
KeyboardInterrupt inside that hook: "Exception ignored in atexit callback", status 0; a SIGTERM killed
the process with no word). Now `serve` shuts down the local Ray it started as the last step of its
stop, while a second signal still ends the process at once (one line, 128 + the signal's number),
with the processes of that Ray; and says when the stop begins and when it is done.

The subprocess runs the real `residency serve` (`cli.main()`), its `ray.shutdown` wrapped to say
when it begins and, in mode "hold", to wait first (a shutdown that takes long), so that the second
signal comes while it is under way.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from manager.api.server import SAME_STOP_S

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "local-cpu.yaml"

SCRIPT = """
import sys, threading
from pathlib import Path
import ray
import manager.cli as cli

work, mode = Path(sys.argv[1]), sys.argv[2]
real = ray.shutdown


def shutdown(*args, **kwargs):
    (work / "ray-shutdown").write_text("1")
    if mode == "hold":
        threading.Event().wait(300)
    return real(*args, **kwargs)


ray.shutdown = shutdown
sys.argv = ["residency", "serve", "--config", str(work / "c.yaml"), "--listen", "127.0.0.1:0"]
sys.exit(cli.main())
"""


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


class Served:
    """The script's `serve` on a local Ray, in a session of its own, on the event loop `loop`."""

    def __init__(self, work: Path, mode: str, loop: str) -> None:
        store = f'store: {{url: "sqlite:///{work / "state.db"}"}}\n'
        (work / "c.yaml").write_text(CONFIG.read_text().replace("devices:", f"{store}devices:", 1))
        (work / "serve.py").write_text(SCRIPT)
        self.work, self.log = work, work / "serve.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RESIDENCY_EVENT_LOOP=loop, GRPC_ENABLE_FORK_SUPPORT="false")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(work / "serve.py"), str(work), mode],
                stdout=subprocess.DEVNULL, stderr=out, cwd=work, start_new_session=True, env=env,
            )  # fmt: skip
        self.until(lambda: re.search(r"serving on \S+:\d+ ", self.text()) is not None, "serve to start")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def until(self, cond: Any, what: str) -> None:
        deadline = time.monotonic() + 180
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve ended ({self.proc.returncode}) before {what}: {self.text()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"waited too long for {what}: {self.text()[-3000:]}"
            time.sleep(0.02)

    def wait(self) -> int:
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve did not end: " + self.text()[-3000:]) from None

    def left(self) -> list[str]:
        """The processes of its session still running 30 s on at most (Ray's, when not ended)."""
        deadline = time.monotonic() + 30
        while _in_session(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return _in_session(self.proc.pid)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for left in _in_session(self.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(int(left.split()[0]), signal.SIGKILL)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Any]:
    made: list[Served] = []

    def start(mode: str, loop: str) -> Served:
        made.append(Served(tmp_path, mode, loop))
        return made[-1]

    yield start
    for s in made:
        s.end()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_second_sigint_while_ray_shuts_down_exits_at_once(served: Any, loop: str) -> None:
    """Before: the stop was over before Ray's shutdown (in Ray's atexit hook), the second signal was
    lost there, and the process ended with status 0 (here: before `serve` shut Ray down)."""
    s = served("hold", loop)
    s.proc.send_signal(signal.SIGINT)
    s.until(lambda: (s.work / "ray-shutdown").exists(), "the stop to shut Ray down")
    # a second one, not the same stop: timed from what the child wrote after it took the first (it
    # may have taken it late), not from when it was sent
    time.sleep(SAME_STOP_S + 0.3)
    s.proc.send_signal(signal.SIGINT)
    rc = s.wait()
    text = s.text()
    assert rc == 128 + signal.SIGINT, text[-3000:]
    assert "residency: stopping (SIGINT); a second SIGINT exits at once" in text
    assert text.strip().splitlines()[-1] == (
        "residency: second SIGINT: exiting now, without waiting for the stop to finish"
    )
    assert s.left() == []  # the local Ray's processes ended with it


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_stop_shuts_the_local_ray_down_and_says_so(served: Any, loop: str) -> None:
    s = served("plain", loop)
    s.proc.send_signal(signal.SIGTERM)
    rc = s.wait()
    text = s.text()
    assert rc == 0, text[-3000:]
    assert (s.work / "ray-shutdown").exists()  # within the stop, not at the process's exit
    said = [x for x in text.splitlines() if x.startswith("residency: ")]
    assert said[-2:] == [
        "residency: stopping (SIGTERM); a second SIGTERM exits at once",
        "residency: stopped",
    ]
    assert "Traceback" not in text
    assert s.left() == []
