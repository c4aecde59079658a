"""This process's own processes, as psutil sees them. It imports no Ray: `serve` lists them before
the Ray pool (slow to import) is loaded, to tell which processes its local Ray started."""

from __future__ import annotations

import psutil


def descendants() -> set[int]:
    """The pids of this process's children, and theirs."""
    return {c.pid for c in psutil.Process().children(recursive=True)}
