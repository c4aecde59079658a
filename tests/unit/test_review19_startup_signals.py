"""Review 19: a stop signal while `residency serve` starts (user walkthrough).

- A signal once Ray had started (the device hosts' pool being made, the gRPC server and the front
  ends starting) was said twice (`residency: stopping (SIGINT); a second SIGINT exits at once`, then
  `residency: stopped during start-up (SIGINT)`), and the start went on meanwhile: the front ends
  were started after the signal. Now the rest of the start is abandoned at the signal (what had
  started is undone), and one line says so, as the README says for a signal during start-up.
- A signal during the first steps (the imports of `serve`'s modules, before its handlers were in
  place): a SIGTERM killed the process without a word (status -15), a SIGINT printed
  `residency: interrupted`. Now the same line as any start-up stop, 128 + the signal's number; a
  SIGINT the process was started with ignored (a shell's background job) stays ignored then.
- A signal during torch's import (the device hosts' modules): the stop is followed by no library
  log lines (torch's FakeTensor cache statistics at exit, at INFO).

Each case runs the real `serve` (`cli.main()`, as the `residency` script calls it) in a process of
its own, with in-process device hosts; the signal is sent by that process to itself from inside the
step named, so that it lands there whatever the machine's speed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = """
import importlib.abc, os, signal, sys
from pathlib import Path
work, mode = Path(sys.argv[1]), sys.argv[2]
SIG = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}
where, _, sig = mode.partition(":")
if where == "ignored":  # as a shell starts a background job: SIGINT ignored, from the start
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    where = "import"

def send():
    (work / "sent").write_text(where)
    os.kill(os.getpid(), SIG[sig])

class At(importlib.abc.MetaPathFinder):
    # the signal when the module `name` is first looked for (its import then goes on as usual)
    def __init__(self, name):
        self.name, self.fired = name, False
    def find_spec(self, fullname, path, target=None):
        if fullname == self.name and not self.fired:
            self.fired = True
            send()
        return None

if where == "import":  # `serve`'s own modules, before its handlers
    sys.meta_path.insert(0, At("manager.api.server"))
elif where == "torch":  # within torch's import (the device hosts' modules)
    sys.meta_path.insert(0, At("torch._subclasses.fake_tensor"))
else:
    import manager.api.server as server
    import manager.workers_bridge as bridge
    if where == "pool":  # the device hosts' pool being made
        specs = bridge.device_specs
        def device_specs(*a, **kw):
            send()
            return specs(*a, **kw)
        bridge.device_specs = device_specs
    elif where == "build":  # the gRPC server being built (the front ends start after it)
        build = server.build_server
        async def build_server(*a, **kw):
            send()
            return await build(*a, **kw)
        server.build_server = build_server
sys.argv = ["residency", "serve", "--config", str(work / "c.yaml"), "--in-process", "--listen", "127.0.0.1:0"]
sys.exit(__import__("manager.cli", fromlist=["main"]).main())
"""

CONFIG = """\
store: {{url: "sqlite:///{work}/state.db", journal: "{work}/requests.jsonl"}}
server: {{listen: "127.0.0.1:0", frontends: 1}}
devices:
  - {{name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}}
host: {{memory: 16GiB, reserve: 4GiB}}
classes:
  - {{name: realtime}}
models:
  - name: voice
    class: realtime
    adapter: silero-vad
    device: cpu0
    memory: 2181128
    load_seconds: {{disk: 0.07, cached: 0.07, host: 0.06}}
"""


def _serve(work: Path, mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    (work / "c.yaml").write_text(CONFIG.format(work=work))
    (work / "serve.py").write_text(SCRIPT)
    log = work / "serve.log"
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}
    env.pop("RAY_ADDRESS", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(work / "serve.py"), str(work), mode],
            stdout=out, stderr=subprocess.STDOUT, cwd=work, start_new_session=True, env=env,
        )  # fmt: skip
    return proc, log


def _ended(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    try:
        rc = proc.wait(180)  # a hang guard only
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError("serve did not end: " + log.read_text(errors="replace")[-3000:]) from None
    return rc, log.read_text(errors="replace")


def _residency_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("residency:")]


STEPS = [("build", "TERM"), ("build", "INT"), ("pool", "INT"), ("pool", "TERM")]


@pytest.mark.parametrize(("where", "sig"), STEPS)
def test_a_signal_during_start_up_abandons_the_rest_of_the_start_in_one_line(
    tmp_path: Path, where: str, sig: str
) -> None:
    """The signal while the pool is made, or while the gRPC server is built: no front end is started
    after it, nothing is served, one line, and the signal's exit status."""
    proc, log = _serve(tmp_path, f"{where}:{sig}")
    rc, text = _ended(proc, log)
    signum = getattr(signal, f"SIG{sig}")
    assert (tmp_path / "sent").read_text() == where, text[-3000:]
    assert rc == 128 + signum, text[-3000:]
    assert _residency_lines(text) == [f"residency: stopped during start-up (SIG{sig})"], text[-3000:]
    assert "gRPC front ends on" not in text
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_a_signal_before_serves_handlers_stops_the_start_as_any_start_up_stop(
    tmp_path: Path, sig: str
) -> None:
    """The signal while `serve`'s own modules are imported (before its handlers were in place): the
    start stops there with the same line as any start-up stop, not killed without a word (SIGTERM)
    nor `residency: interrupted` (SIGINT)."""
    proc, log = _serve(tmp_path, f"import:{sig}")
    rc, text = _ended(proc, log)
    signum = getattr(signal, f"SIG{sig}")
    assert (tmp_path / "sent").read_text() == "import", text[-3000:]
    assert rc == 128 + signum, text[-3000:]
    assert _residency_lines(text) == [f"residency: stopped during start-up (SIG{sig})"], text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_signal_within_torchs_import_stops_without_library_log_lines(tmp_path: Path) -> None:
    """The signal within torch's import (the device hosts' modules): one line, the last one (no torch
    log lines at exit: its FakeTensor cache statistics)."""
    proc, log = _serve(tmp_path, "torch:INT")
    rc, text = _ended(proc, log)
    assert (tmp_path / "sent").read_text() == "torch", text[-3000:]
    assert rc == 128 + signal.SIGINT, text[-3000:]
    assert _residency_lines(text) == ["residency: stopped during start-up (SIGINT)"], text[-3000:]
    assert text.strip().splitlines()[-1] == "residency: stopped during start-up (SIGINT)", text[-3000:]
    assert "cache_hits" not in text and "FakeTensor" not in text, text[-3000:]


def test_a_sigint_the_process_was_started_with_ignored_stays_ignored_at_start(tmp_path: Path) -> None:
    """SIGINT ignored from the start (a shell's background job): one during the imports does not stop
    the start (the shell's choice is kept); the service serves, and a SIGTERM stops it."""
    proc, log = _serve(tmp_path, "ignored:INT")
    deadline = time.monotonic() + 180
    while not re.search(r"serving on \S+:\d+ ", log.read_text(errors="replace")):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, text = _ended(proc, log)
    assert (tmp_path / "sent").read_text() == "import", text[-3000:]
    assert rc == 0, text[-3000:]
    assert _residency_lines(text)[-1] == "residency: stopped", text[-3000:]
    assert "stopped during start-up" not in text
