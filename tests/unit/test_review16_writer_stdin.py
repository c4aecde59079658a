"""Review 16: the tuned-config writer and `--trace -`.

1. `write_config_with_updates` read a config saved with CRLF line endings and wrote it back with LF
   throughout (a whole-file diff for a Windows user), and gave a file without a final newline one.
2. A field `residency tune` had set (`prewarm: false  # residency tune: world.prewarm was unset`)
   and a later tuning set back to its default was left as `prewarm: true  # ... was unset`: a line
   the person never wrote. It is now removed, and the file reads as the person wrote it.
3. `read_trace("-")` opened a file named "-" instead of reading standard input, though `trace synth
   --out -` writes to standard output.

Real components throughout: the writer, the loader, the trace reader; standard input is a real
byte stream (io.BytesIO under a TextIOWrapper, as the interpreter's own stdin is).
"""

from __future__ import annotations

import errno
import io
import sys
from pathlib import Path
from typing import Any

import pytest

from manager.config import load_config, write_config_with_updates
from manager.replay.trace import STDIN_NAME, TraceError, read_trace

CONFIG = """# my box
devices: [{name: gpu0, kind: cuda, index: 0, memory: 24GiB}]
host: {memory: 32GiB}
classes: [{name: realtime}, {name: interactive}]
models:
  - name: world    # the world model
    class: interactive
    adapter: silero-vad
    device: gpu0
    memory: 4GiB
    load_seconds: {disk: 4.0, host: 0.5}
    keep_alive: auto
  # the voice model, always ready
  - name: voice
    class: realtime
    adapter: silero-vad
    device: gpu0
    memory: 1GiB
    load_seconds: {disk: 1.0, host: 0.2}
"""


def _write(path: Path, text: str, newline: str = "\n") -> Path:
    path.write_bytes(text.replace("\n", newline).encode())
    return path


# 1. line endings


def test_crlf_config_stays_crlf(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.yaml", CONFIG, "\r\n")
    dst = tmp_path / "out.yaml"
    update = {"world": {"prewarm": False}}
    write_config_with_updates(src, dst, update, header_comment="Tuned", note_changes=True)
    raw = dst.read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n") == CONFIG.count("\n") + 2  # header + prewarm line
    assert b"    prewarm: false  # residency tune: world.prewarm was unset\r\n" in raw
    assert raw.startswith(b"# Tuned\r\n# my box\r\n")
    assert load_config(dst).models[0].prewarm is False


def test_lf_config_stays_lf_and_no_final_newline_is_kept(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.yaml", CONFIG.rstrip("\n"))
    dst = tmp_path / "out.yaml"
    write_config_with_updates(src, dst, {"voice": {"keep_alive": "10m"}}, note_changes=True)
    raw = dst.read_bytes()
    assert b"\r" not in raw
    assert raw.endswith(b"keep_alive: 10m  # residency tune: voice.keep_alive was unset")
    crlf = _write(tmp_path / "w.yaml", CONFIG.rstrip("\n"), "\r\n")
    write_config_with_updates(crlf, dst, {"voice": {"keep_alive": "10m"}}, note_changes=True)
    raw = dst.read_bytes()
    assert raw.endswith(b"was unset") and raw.count(b"\r\n") == raw.count(b"\n") > 10


# 2. a field tuned back to its default


def test_field_tuned_back_to_default_loses_its_line(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.yaml", CONFIG)
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"world": {"prewarm": False}}, note_changes=True)
    assert "    prewarm: false  # residency tune: world.prewarm was unset\n" in once.read_text()
    cfg = write_config_with_updates(once, twice, {"world": {"prewarm": True}}, note_changes=True)
    assert twice.read_text() == CONFIG  # the person's file again: no `prewarm: true  # ... was unset`
    assert cfg.models[0].prewarm is True


def test_field_tuned_back_keeps_the_comments_after_it(tmp_path: Path) -> None:
    """The removed line is the last of its entry: the comment line and blank line after it stay."""
    text = CONFIG.replace("    keep_alive: auto\n", "    keep_alive: auto\n\n")
    src = _write(tmp_path / "c.yaml", text, "\r\n")
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"world": {"prewarm": False}}, note_changes=True)
    write_config_with_updates(once, twice, {"world": {"prewarm": True}}, note_changes=True)
    assert twice.read_bytes() == text.replace("\n", "\r\n").encode()


def test_field_tuned_to_default_that_a_person_had_set_keeps_its_note(tmp_path: Path) -> None:
    """A value the person wrote (`prewarm: false`) tuned to the default is a change: noted, kept."""
    src = _write(tmp_path / "c.yaml", CONFIG.replace("    keep_alive: auto\n", "    prewarm: false\n"))
    dst = tmp_path / "out.yaml"
    write_config_with_updates(src, dst, {"world": {"prewarm": True}}, note_changes=True)
    assert "    prewarm: true  # residency tune: world.prewarm was false\n" in dst.read_text()


def test_field_tuned_to_another_non_default_keeps_was_unset(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.yaml", CONFIG)
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"voice": {"keep_alive": "10m"}}, note_changes=True)
    write_config_with_updates(once, twice, {"voice": {"keep_alive": "20m"}}, note_changes=True)
    assert "    keep_alive: 20m  # residency tune: voice.keep_alive was unset\n" in twice.read_text()
    # and then back to the default (`auto`, what an unset keep_alive means): the line goes
    write_config_with_updates(twice, once, {"voice": {"keep_alive": "auto"}}, note_changes=True)
    assert once.read_text() == CONFIG


# 3. `-` is standard input


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> io.TextIOWrapper:
    stream = io.TextIOWrapper(io.BytesIO(data), encoding="ascii")  # not UTF-8: the trace still is
    monkeypatch.setattr(sys, "stdin", stream)
    return stream


LINES = '{"t":1,"model":"voice","busy_s":0.5,"client":"café"}\r\n\n{"t":2,"model":"voice","busy_s":1}\n'


def test_dash_reads_stdin_as_utf8(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a file named "-" here is not what "-" reads
    (tmp_path / "-").write_text("not a trace\n")
    stream = _stdin(monkeypatch, ("\ufeff" + LINES + "x\n").encode())
    res = read_trace("-")
    assert [r.t for r in res.requests] == [1.0, 2.0]
    assert res.requests[0].client == "café"
    assert res.bad_lines == [(4, "not valid JSON (Expecting value at column 1)")]  # blank lines counted
    assert res.path == STDIN_NAME
    assert not stream.buffer.closed and not stream.closed  # the process's stdin is left open
    assert read_trace(Path("-")).bad_lines[0][0] == 1  # a Path "-" is the file ./-


def test_dash_strict_and_binary_errors_name_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    _stdin(monkeypatch, b'{"t":1,"model":"voice","busy_s":0.5}\n{"t":0}\n')
    with pytest.raises(TraceError) as e:
        read_trace("-", strict=True)
    assert (e.value.path, e.value.line) == (STDIN_NAME, 2)
    _stdin(monkeypatch, '{"t":1}\n'.encode("utf-16"))
    with pytest.raises(TraceError) as e:
        read_trace("-")
    assert e.value.line == 0 and "NUL bytes" in e.value.reason


def test_dash_refuses_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeTerminal(io.TextIOWrapper):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", FakeTerminal(io.BytesIO(b"")))
    with pytest.raises(TraceError, match="standard input is a terminal"):
        read_trace("-")


def test_dash_read_error_is_a_trace_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard input whose read fails (a folder given as `< somedir`, a disk's I/O error): said as
    a TraceError for the input as a whole, not a traceback."""

    class FakeFailingInput(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            raise IsADirectoryError(errno.EISDIR, "Is a directory")

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(FakeFailingInput())))
    with pytest.raises(TraceError, match="cannot be read: Is a directory") as e:
        read_trace("-")
    assert (e.value.path, e.value.line) == (STDIN_NAME, 0)


def test_field_tuned_back_with_a_persons_comment_keeps_line_and_note(tmp_path: Path) -> None:
    """A comment a person added to the tuned line since: the line stays (with its accurate note)."""
    src = _write(tmp_path / "c.yaml", CONFIG)
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"world": {"prewarm": False}}, note_changes=True)
    once.write_text(once.read_text().replace("prewarm: false  #", "prewarm: false  # cold is fine  #"))
    write_config_with_updates(once, twice, {"world": {"prewarm": True}}, note_changes=True)
    line = next(x for x in twice.read_text().splitlines() if "prewarm" in x)
    assert line.startswith("    prewarm: true ")  # (the comment stays in its column)
    assert line.endswith(" # cold is fine  # residency tune: world.prewarm was unset")


def test_new_field_goes_above_the_comment_that_heads_the_next_entry(tmp_path: Path) -> None:
    """`# the voice model` (and the blank line) follow world's last line: a field tuning adds to
    world goes before them, not below them as if it were voice's."""
    text = CONFIG.replace("  # the voice model", "\n  # the voice model")
    src = _write(tmp_path / "c.yaml", text)
    dst = tmp_path / "out.yaml"
    write_config_with_updates(src, dst, {"world": {"prewarm": False}}, note_changes=True)
    want = "    keep_alive: auto\n    prewarm: false  # residency tune: world.prewarm was unset\n\n  # the"
    assert want in dst.read_text()
    # the last entry of the file, and a last line with its own comment
    src = _write(tmp_path / "c.yaml", text + "    pin: false  # mine\n# the end\n")
    write_config_with_updates(src, dst, {"voice": {"keep_alive": "1h"}}, note_changes=True)
    assert dst.read_text().endswith(
        "    pin: false  # mine\n    keep_alive: 1h  # residency tune: voice.keep_alive was unset\n"
        "# the end\n"
    )
