"""A lock file held by one process, with its process id in it (for a refused one to name): what the
request journal and a served SQLite store each hold, so that a second service on them is refused.
Advisory (`flock`): the OS lets it go with the process, however it ends. A lock file is a regular
file of its own: one that is a symbolic link (a stale one, or one planted in a shared folder) or not a
regular file is refused, never opened through, for its pid is written over what the file held."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat


class Held(Exception):
    """Another process holds the lock file; `pid` as it wrote it (None when it wrote none)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"held by pid {pid}" if pid else "held")
        self.pid = pid


def hold(path: str | os.PathLike[str]) -> tuple[int, OSError | None]:
    """The lock file at `path` (made if missing), held: its descriptor (not inherited by children;
    closing it lets go), and None, or the error that says this file system cannot lock (some network
    ones: the caller goes on unguarded, and says so). Held when another process holds it; OSError
    naming the file when it cannot be opened, or is a symbolic link or not a regular file."""
    name = os.fspath(path)
    try:  # (O_NONBLOCK: opening a FIFO or a device must not wait; it is refused just below)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(
                errno.ELOOP,
                f"{name} is a symbolic link; a lock file must be a file of its own: remove it",
            ) from None
        raise OSError(e.errno, f"{name}: {e.strerror or e}") from None  # (the lock, not what it guards)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file; a lock file must be one: remove it")
    except BaseException:
        os.close(fd)
        raise
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
