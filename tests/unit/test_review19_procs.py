"""Review 19: one helper lists this process's descendants (`workers.procs.descendants`), used both by
`serve` (the processes of the local Ray it started, which a second stop signal ends) and by the Ray
pool (what a failed or interrupted Ray start leaves behind). They were two copies of one psutil call;
the module imports no Ray (`serve` lists them before the Ray pool is imported)."""

from __future__ import annotations

import subprocess
import sys
import time

from manager.api import server
from workers import procs, ray_pool


def test_serve_and_the_ray_pool_use_the_one_helper() -> None:
    assert server._descendants is procs.descendants
    assert ray_pool._children is procs.descendants


def test_it_lists_children_and_grandchildren() -> None:
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while True:
            found = procs.descendants()
            grandchildren = found - {child.pid}
            if child.pid in found and grandchildren:
                break
            assert time.monotonic() < deadline, f"no grandchild seen: {found}"
            time.sleep(0.05)
        assert all(isinstance(p, int) for p in found)
    finally:
        import psutil

        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()


def test_the_module_imports_no_ray() -> None:
    code = "import sys, workers.procs; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
