"""A local append-only journal of served requests, so a killed service loses none of its request log.

Each served request is appended as one JSON line (flushed to the OS at once: a process that is killed
keeps it; a power cut may lose the last moment). When a batch reaches the store, the journal is
rewritten with what is still waiting. At start, the journal's records go to the store first. A crash
between the store write and the rewrite can log a batch twice (at most one second of requests).
A line that cannot be read (a torn write at a crash) is skipped and counted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class RequestJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        self.skipped = 0

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, rec: dict[str, Any]) -> None:
        # one write(2) of the whole line on an O_APPEND descriptor: in the OS at once, no buffer
        data = (_ENCODE(rec) + "\n").encode()
        while data:  # a regular file takes it whole; a short write (disk filling up) goes on
            data = data[os.write(self._fd, data) :]

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return out
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
                    continue
            except (ValueError, RecursionError):  # not JSON, or nested too deeply
                pass
            self.skipped += 1
            logger.warning("%s:%d: unreadable journal line skipped", self.path, n)
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

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
