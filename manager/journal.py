"""A local append-only journal of served requests, so a killed service loses none of its request log.

Each served request is appended as one JSON line (flushed to the OS at once: a process that is killed
keeps it; a power cut may lose the last moment). When a batch reaches the store, the journal is
rewritten with what is still waiting. At start, the journal's records go to the store first. A crash
between the store write and the rewrite can log a batch twice (at most one second of requests).
A line that cannot be read (a torn write at a crash, a damaged byte, a record the store would refuse)
is skipped, counted and logged with its line number: one bad line must not hold up the others.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from manager.store.base import normalize_record

logger = logging.getLogger(__name__)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class RequestJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        self.skipped = 0
        self.lines = 0
        """Records in the file (as far as this process knows: read, appended, rewritten)."""
        self._end_line()

    def _end_line(self) -> None:
        """End a torn last line (a kill mid-write) so the next record starts a line of its own
        instead of being glued to the torn one and lost with it."""
        with self.path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            os.write(self._fd, b"\n")

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, rec: dict[str, Any]) -> None:
        # one write(2) of the whole line on an O_APPEND descriptor: in the OS at once, no buffer
        data = (_ENCODE(rec) + "\n").encode()
        while data:  # a regular file takes it whole; a short write (disk filling up) goes on
            data = data[os.write(self._fd, data) :]
        self.lines += 1

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return out
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            self.lines += 1
            try:
                # the store's own check: a record it would refuse would block the whole log
                out.append(normalize_record(json.loads(raw.decode("utf-8"))))
                continue
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, too deep, not a record
                reason = str(e) or type(e).__name__
            self.skipped += 1
            logger.warning("%s:%d: unreadable journal line skipped (%s)", self.path, n, reason[:200])
        return out

    def rewrite(self, pending: list[dict[str, Any]]) -> None:
        """Replace the journal with `pending` (atomically: a temp file renamed over it)."""
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for rec in pending:
                f.write(_ENCODE(rec) + "\n")
        if self._fd >= 0:
            os.close(self._fd)
        os.replace(tmp, self.path)
        self._fd = self._open()
        self.lines = len(pending)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
