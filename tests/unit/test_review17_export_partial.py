"""Review 17, `residency trace export` to a regular file (`manager.store.export.export_trace`), which
writes a temporary file beside the target and renames it into place.

Bugs: the temporary file had one fixed name, `.<name>.partial`, opened through whatever was there:
- two exports to one file at once (a cron job and a person) wrote the same temporary file: the one
  that finished first had its trace overwritten in part by the other (lines of both, some twice), and
  the other then failed with "No such file or directory";
- a symbolic link left at that name (in a shared folder such as /tmp) had the file it points to
  overwritten with the trace, and the link renamed over the target.
Each export now writes a new file of its own (made, never opened through a link).
"""

from __future__ import annotations

import json
import os
from contextlib import closing
from pathlib import Path

from manager.store import open_store
from manager.store.export import export_trace

T0 = 1_790_000_000.0


def _times(path: Path) -> list[float]:
    return [json.loads(line)["t"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_two_exports_to_one_file_at_once_each_write_a_whole_trace(tmp_path: Path) -> None:
    with closing(open_store(f"sqlite:///{tmp_path}/state.db")) as store:
        store.append_requests([{"t": T0 + i, "model": "voice", "busy_s": 0.25} for i in range(10)])
        out = tmp_path / "trace.jsonl"
        now = T0 + 10
        inner: list[int] = []

        def other_export_meanwhile() -> bool:  # (asked as the first export starts reading)
            if not inner:
                inner.append(export_trace(store, 10, now, out))  # the whole ten
            return False

        n = export_trace(store, 3, now, out, stop=other_export_meanwhile)  # the last three
    assert (inner, n) == ([10], 3)
    assert _times(out) == [T0 + 7, T0 + 8, T0 + 9]  # the one that finished last, whole
    assert [p.name for p in tmp_path.iterdir() if "trace" in p.name] == ["trace.jsonl"]


def test_a_link_left_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n", encoding="utf-8")
    (tmp_path / ".trace.jsonl.partial").symlink_to(victim)
    out = tmp_path / "trace.jsonl"
    with closing(open_store(f"sqlite:///{tmp_path}/state.db")) as store:
        store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.25}])
        assert export_trace(store, 10, T0 + 1, out) == 1
    assert victim.read_text(encoding="utf-8") == "precious\n"
    assert not out.is_symlink() and _times(out) == [T0]


def test_a_new_file_gets_the_usual_mode_and_a_replaced_one_keeps_its_own(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    with closing(open_store(f"sqlite:///{tmp_path}/state.db")) as store:
        store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.25}])
        umask = os.umask(0o022)
        try:
            export_trace(store, 10, T0 + 1, out)
            assert out.stat().st_mode & 0o777 == 0o644
            out.chmod(0o600)
            export_trace(store, 10, T0 + 1, out)
            assert out.stat().st_mode & 0o777 == 0o600
        finally:
            os.umask(umask)
