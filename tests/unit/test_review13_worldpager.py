"""worldpager fixes from review 13: a corrupt slot is reported naming the log file and the slot (the
error's text, the session's runtime event, the `worldpager session` output), an fp16 page near fp16's
largest value decodes finite, and `worldpager session --log-dir` naming a file is refused as such.
Real files and real sessions on the "micro" stand-in (random weights, seeded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldpager import codecs
from worldpager.cli import main
from worldpager.page_types import Corrupt
from worldpager.segment_log import HEADER_SIZE, LOG_NAME, CorruptSlotError, SegmentLog

SLOT = 2 * 4096


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _log(tmp_path: Path, n: int) -> SegmentLog:
    log = SegmentLog.create(tmp_path, SLOT)
    for i in range(n):
        payload = bytes([i + 1]) * 1000
        log.append(
            segment_id=i, frame_start=3 * i, frame_end=3 * i + 3, pose=(0.0,) * 5, codec="bf16",
            position_state="post-rope", position=3 * i, payload=payload, page_offsets=(0, 500),
        )  # fmt: skip
    return log


# ---- 1: a corrupt slot is named with its file -----------------------------------------------------


def test_a_corrupt_slot_error_names_the_log_file_and_the_slot(tmp_path: Path) -> None:
    """Found in review: CorruptSlotError read "slot 1: payload checksum mismatch", without the file,
    so an operator with several session directories could not tell which log was damaged."""
    log = _log(tmp_path, 3)
    path = str(tmp_path / LOG_NAME)
    _flip(tmp_path / LOG_NAME, SLOT + HEADER_SIZE + 600)  # page 1 of slot 1
    _flip(tmp_path / LOG_NAME, 2 * SLOT + 40)  # the header of slot 2
    with log:
        with pytest.raises(CorruptSlotError) as err:
            log.read(1)
        assert str(err.value) == f"{path}: slot 1: payload checksum mismatch"
        assert (err.value.path, err.value.slot) == (path, 1)
        with pytest.raises(CorruptSlotError) as err:
            log.read_page(1, 1)
        assert str(err.value) == f"{path}: slot 1: page 1 checksum mismatch"
        with pytest.raises(CorruptSlotError) as err:
            log.read(2)
        assert str(err.value) == f"{path}: slot 2: header checksum mismatch"
        with pytest.raises(CorruptSlotError) as err:
            log.header(7)
        assert str(err.value) == f"{path}: slot 7: beyond end of log"
        assert log.read(0)[1] == bytes([1]) * 1000


# ---- 2: the session's runtime event and the CLI name every corrupt slot ---------------------------


def test_worldpager_session_names_each_corrupt_slot_it_met(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: a slot found corrupt when a step read it back was a `Corrupt` event with the
    segment only, and `worldpager session` printed just counts (``"events": {"Corrupt": 1}``): which
    file and slot, and why, was said nowhere. Now the event carries the slot and the reason, and the
    command prints one warning line per corrupt slot on stderr and lists them in its output."""
    d = tmp_path / "s"
    args = ["session", "--preset", "micro", "--host-memory", "200KiB", "--log-dir", str(d), "--json"]
    assert main([*args, "--segments", "30"]) == 0
    capsys.readouterr()
    slot_size = json.loads((d / "meta.json").read_text())["slot_size"]
    for slot in [*range(21), 27]:  # a trusted index: 27 is met on resume's read-back, 0..20 by steps
        _flip(d / LOG_NAME, slot * slot_size + HEADER_SIZE + 100)
    assert main([*args, "--segments", "30", "--resume"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    path = str(d / LOG_NAME)
    corrupt = result["corrupt_slots"]
    assert result["events"].get("Corrupt", 0) >= 1, "no step read a corrupt slot back"
    assert {"file": path, "slot": 27, "segment": None, "reason": "payload checksum mismatch"} in corrupt
    at_run = [c for c in corrupt if c["segment"] is not None]
    assert len(at_run) == result["events"]["Corrupt"]
    for c in at_run:
        assert c == {"file": path, "slot": c["segment"], "segment": c["segment"],
                     "reason": "payload checksum mismatch"}  # fmt: skip
        assert 0 <= c["slot"] <= 20
    lines = [line for line in err.splitlines() if line.startswith("worldpager: warning:")]
    assert f"worldpager: warning: {path}: slot 27: payload checksum mismatch (never used)" in lines
    assert len(lines) == len(corrupt)


def test_a_corrupt_event_from_the_bookkeeping_still_compares_by_segment() -> None:
    """The slot and reason the transfer side adds are optional: the PageManager's own event (segment
    and size only) is unchanged."""
    assert Corrupt(3, 10) == Corrupt(3, 10, None, None)
    assert Corrupt(3, 10, 5, "payload checksum mismatch").slot == 5


# ---- 3: fp16 pages near 65504 decode finite -------------------------------------------------------


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("values", [[-65504.0, 65504.0], [0.0, 65504.0], [-1000.0, 65504.0]])
def test_an_fp16_page_near_the_largest_fp16_decodes_finite(codec: str, values: list[float]) -> None:
    """Found in review: the decoded value q * scale + zero (fp32) of a group reaching fp16's largest
    value could land past it (scale rounded up), and the cast back to fp16 made it inf: a finite page
    came back with inf in its KV, which turns attention into NaN. Decoding now clamps to the page
    dtype's finite range, which never moves a value away from its original."""
    x = torch.tensor(values * 70, dtype=torch.float16)  # 140 values: one full group and a partial one
    p = codecs.encode(x, codec)
    y = codecs.decode(p)
    assert bool(torch.isfinite(y).all()), y
    scale = codecs.decode(codecs.from_bytes(codec, p.shape, p.dtype, codecs.to_bytes(p)))
    assert torch.equal(scale, y)
    n = p.payload.numel()
    groups = -(-x.numel() // codecs.GROUP)
    scales = p.payload[n - 4 * groups : n - 2 * groups].clone().view(torch.float16).float()
    bound = scales.repeat_interleave(codecs.GROUP)[: x.numel()] / 2
    assert bool(((y.float() - x.float()).abs() <= bound).all())


# ---- 4: --log-dir naming a file ---------------------------------------------------------------------


def test_session_log_dir_that_is_a_file_is_refused_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: ``--log-dir`` naming an existing file said it "holds a saved session" and
    suggested ``--resume``, which then failed for another reason."""
    f = tmp_path / "notes.txt"
    f.write_text("x")
    args = ["session", "--preset", "micro", "--segments", "1", "--host-memory", "1MiB"]
    assert main([*args, "--log-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"worldpager: --log-dir {f}: is a file, expected a folder"
    assert f.read_text() == "x"


@pytest.mark.parametrize("usable", ["0", "1.5", "nan", "-0.2"])
def test_sizing_usable_out_of_range_names_the_flag(usable: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found in review: ``--usable 0`` said "usable = 0.0: expected ...", naming no flag."""
    assert main(["sizing", "--host-memory", "32GiB", "--codec", "int4", "--usable", usable]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"worldpager: --usable {usable!r}: expected a fraction of the host budget in (0, 1]"
