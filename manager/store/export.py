"""`residency trace export`: a time range of the store's request log back into a ▶ trace file.

Primitives, in the order the command uses them:
  parse_since  - "7d", "36h", "90m", "45s", "1h30m" or plain seconds -> seconds (ValueError naming
                 the text otherwise); `manager.units.parse_duration` does the parsing.
  export_trace - requests with now - since_s <= t < now -> a JSON Lines trace written with
               `manager.replay.trace.write_trace` (so only t, model, busy_s, class, kind, client,
               t and busy_s rounded to ms); the service extras (wait_s, outcome, source) are dropped.

The file is written to a temporary sibling and renamed into place, so a failed export (an
unreachable or corrupt store) never leaves a half-written trace behind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from manager.policy.types import Request
from manager.replay.trace import write_trace
from manager.store.base import Store
from manager.units import parse_duration

__all__ = ["export_trace", "parse_since"]

logger = logging.getLogger(__name__)


def parse_since(text: str) -> float:
    """Seconds in `text`: `7d`, `36h`, `90m`, `45s`, `1h30m`, `1w` or a plain number of seconds.

    Raises:
        ValueError: naming `text`, when it is not a duration.
    """
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(
            f"--since: expected a duration like '7d', '36h', '90m', '45s' or seconds, got {text!r}"
        ) from None


def _trace_requests(store: Store, since: float, until: float) -> Iterator[Request]:
    for rec in store.requests(since, until):
        yield Request(
            t=rec["t"],
            model=rec["model"],
            busy_s=rec["busy_s"],
            cls=rec.get("class"),
            kind=rec.get("kind", "infer"),
            client=rec.get("client"),
        )


def export_trace(store: Store, since_s: float, now: float, out: Path) -> int:
    """Write the requests of [now - since_s, now) to `out` as a trace; return how many.

    `out`'s parent folders are created; an existing `out` is replaced only when the export succeeds.

    Raises:
        StoreError: the store cannot be read (nothing is written).
        OSError: `out` cannot be written.
    """
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        n = write_trace(tmp, _trace_requests(store, now - since_s, now))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("exported %s requests from %s to %s", n, store.url, out)
    return n
