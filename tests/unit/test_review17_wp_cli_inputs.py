"""`worldpager` CLI review round 17: flags named right, nonsense values refused, failures without a
traceback, hints that are true for the preset and codec that ran, sizes rounded down exactly."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from worldpager import session_store
from worldpager.cli import main, parse_size
from worldpager.layout import SegmentLayout
from worldpager.session import SESSION_PRESETS

# ---- bench-stall ----------------------------------------------------------------------------------


def test_a_k_too_large_for_the_default_segments_names_k_not_an_unused_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --quick logs 8 segments; --k 3 needs 12. The user never typed --segments.
    assert main(["bench-stall", "--quick", "--k", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("worldpager: --k 3: ")
    assert "needs at least 12 segments" in err and "8 by --quick" in err


def test_a_k_too_large_for_the_given_segments_still_names_segments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench-stall", "--quick", "--k", "3", "--segments", "8"]) == 2
    assert capsys.readouterr().err.startswith("worldpager: --segments 8: expected at least 4 x --k = 12")


@pytest.mark.parametrize("compute_s", ["1e-300", "1e-9", "0.0005"])
def test_a_compute_time_below_a_millisecond_is_refused(
    compute_s: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a sleep cannot calibrate it, and L becomes astronomically large: every "throttled" read runs
    # unthrottled and the table shows no stall at any multiple of L (it printed 300-digit MB/s)
    assert main(["bench-stall", "--quick", "--compute-s", compute_s]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith(
        f"worldpager: --compute-s '{compute_s}': expected a positive finite number >= 0.001"
    )


# ---- session --------------------------------------------------------------------------------------


def test_a_session_whose_final_save_fails_reports_it_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = session_store.save_state

    def full_disk(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("window") is not None:  # the save at close (window.bin written), not the first
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "s" / "session.json"))
        real(*args, **kwargs)

    monkeypatch.setattr(session_store, "save_state", full_disk)
    argv = ["session", "--preset", "micro", "--segments", "2", "--log-dir", str(tmp_path / "s"), "--json"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("worldpager: session: ")
    assert "No space left on device" in err and str(tmp_path / "s") in err


def _read_back(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    base = ["session", "--segments", "2", "--host-memory", "64MiB", "--json"]
    assert main([*base, *argv]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    text: str = out["read_back"]
    return text


def test_the_no_read_back_hint_gives_tinys_count_for_the_codec_that_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tiny = SESSION_PRESETS["tiny"].on_the_fly()
    per_64 = (64 << 20) // SegmentLayout.from_config(tiny, "int4").payload_nbytes
    assert per_64 == 71  # not the 18 of bf16
    hint = _read_back(capsys, "--preset", "micro", "--codec", "int4")
    assert f"--preset tiny: {per_64} segments per 64 MiB with --codec int4" in hint
    assert "18 segments" not in hint


def test_the_no_read_back_hint_does_not_suggest_the_preset_that_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hint = _read_back(capsys, "--preset", "tiny", "--segments", "2")
    assert "--preset tiny" not in hint and "smaller --host-memory" in hint


def test_host_segments_zero_spelled_with_leading_zeros_is_no_cap(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["session", "--preset", "micro", "--segments", "1", "--host-segments", "00", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["host_segments_cap"] == 0


# ---- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.99999999999999999999999999999B", 1),  # 30 digits: Decimal's 28-digit context rounded up
        ("4095.99999999999999999999999999KiB", 4095 * 1024 + 1023),
        ("0.5KiB", 512),
    ],
)
def test_a_fractional_size_is_rounded_down_exactly(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_a_size_just_under_one_byte_is_refused_not_rounded_up() -> None:
    with pytest.raises(ValueError, match="expected at least 1 byte"):
        parse_size("0.99999999999999999999999999999B")
