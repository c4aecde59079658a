"""A lock file held by one process, with its process id in it (for a refused one to name): what the
request journal and a served SQLite store each hold, so that a second service on them is refused.
Advisory (`flock`): the OS lets it go with the process, however it ends."""

from __future__ import annotations

import contextlib
import fcntl
import os


class Held(Exception):
    """Another process holds the lock file; `pid` as it wrote it (None when it wrote none)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"held by pid {pid}" if pid else "held")
        self.pid = pid


def hold(path: str | os.PathLike[str]) -> tuple[int, OSError | None]:
    """The lock file at `path` (made if missing), held: its descriptor (not inherited by children;
    closing it lets go), and None, or the error that says this file system cannot lock (some network
    ones: the caller goes on unguarded, and says so). Held when another process holds it; OSError
    when the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        os.close(fd)
        raise Held(int(text) if text.isdigit() else None) from None
    except OSError as e:
        return fd, e
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # (the pid only helps the message of a refused one)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, None
