"""WorldPager sizing: the paper's numbers follow from MG2's real dimensions (WORLDPAGER_REFERENCE.md §2),
and `worldpager sizing` reports them."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worldpager.cli import main, parse_size
from worldpager.mg2 import (
    CODEC_BITS,
    MG2,
    MICRO,
    PRESETS,
    TINY,
    ModelDims,
    memory_seconds,
    positional_horizon_s,
    segment_bytes,
    segments_in_host,
    sizing,
)

GiB = 1 << 30
MiB = 1 << 20
HOST = 32 * GiB
CONTRACT_KEYS = {"segment_bytes", "segments_in_host", "memory_seconds", "positional_horizon_s", "fps"}
ALL_KEYS = CONTRACT_KEYS | {
    "codec",
    "bits_per_value",
    "host_budget_bytes",
    "usable",
    "action_positional_horizon_s",
    "segment_seconds",
}
MG2_KV_VALUES = 243_302_400  # 30 layers × (K+V) × 2640 tokens × 1536


# ---- MG2's dimensions -----------------------------------------------------------------------------


def test_mg2_segment_shape() -> None:
    assert MG2.tokens_per_segment == 880 * 3 == 2640
    assert MG2.kv_values_per_segment == 30 * 2 * 2640 * 1536 == MG2_KV_VALUES
    assert MG2.video_frames_per_segment == 12
    assert MG2.segment_seconds == 0.75
    assert MG2.heads * MG2.head_dim == MG2.dim
    assert PRESETS == {"mg2": MG2, "tiny": TINY, "micro": MICRO}


def test_tiny_has_mg2s_block_structure() -> None:
    m = MICRO
    assert (m.frames_per_block, m.window_frames, m.vae_time_ratio) == (3, 6, 4)
    assert (m.layers, m.dim, m.heads, m.head_dim, m.tokens_per_frame) == (2, 64, 4, 16, 24)
    assert (m.rope_table_frames, m.action_rope_table_frames) == (16, 40)
    assert m.kv_values_per_segment == 2 * 2 * 72 * 64


def test_bf16_segment_is_486_6_mb() -> None:
    b = segment_bytes(MG2, "bf16")
    assert b == 486_604_800
    assert round(b / 1e6, 1) == 486.6
    assert round(b / MiB, 1) == 464.1


def test_quantized_segment_bytes_include_group_metadata() -> None:
    assert CODEC_BITS == {"bf16": 16.0, "int8": 8.25, "int4": 4.25}
    assert segment_bytes(MG2, "int4") == math.ceil(MG2_KV_VALUES * 4.25 / 8) == 129_254_400
    assert segment_bytes(MG2, "int8") == math.ceil(MG2_KV_VALUES * 8.25 / 8) == 250_905_600


def test_segment_bytes_round_up() -> None:
    dims = dataclasses.replace(MICRO, layers=1, tokens_per_frame=1, frames_per_block=1, dim=4, head_dim=1)
    assert dims.kv_values_per_segment == 8
    assert segment_bytes(dims, "int4") == math.ceil(8 * 4.25 / 8) == 5


# ---- the paper's capacity figures -----------------------------------------------------------------


def test_32gib_bf16_holds_60_segments_45_seconds() -> None:
    n = segments_in_host(MG2, HOST, "bf16")
    assert n == 60
    assert memory_seconds(MG2, n) == 45.0


def test_32gib_int4_holds_about_226_segments_2_8_minutes() -> None:
    n = segments_in_host(MG2, HOST, "int4", usable=0.85)
    assert n in (225, 226)
    s = memory_seconds(MG2, n)
    assert 168.0 <= s <= 170.0
    assert 2.8 <= s / 60 <= 2.85


def test_int8_lies_between() -> None:
    bf16, int8, int4 = (segments_in_host(MG2, HOST, c) for c in ("bf16", "int8", "int4"))
    assert bf16 < int8 < int4
    assert int8 == 116
    assert memory_seconds(MG2, bf16) < memory_seconds(MG2, int8) < memory_seconds(MG2, int4)


def test_raw_pool_without_the_85_percent_gives_53_seconds() -> None:
    n = segments_in_host(MG2, HOST, "bf16", usable=1.0)
    assert n == 70  # 70.6 segments
    assert memory_seconds(MG2, n) == 52.5


def test_positional_horizons() -> None:
    assert round(positional_horizon_s(MG2), 1) == 255.8
    assert positional_horizon_s(MG2) == 4093 / 16
    assert positional_horizon_s(MG2, MG2.rope_table_frames) == positional_horizon_s(MG2)
    action = positional_horizon_s(MG2, MG2.action_rope_table_frames)
    assert action == (1 + 4 * 7499) / 16
    assert round(action / 60, 1) == 31.2
    assert positional_horizon_s(MG2, 1) == 1 / 16


def test_3000_segments_are_37_5_minutes() -> None:
    assert memory_seconds(MG2, 3000) / 60 == 37.5


def test_12_fps_scales_seconds_by_16_over_12() -> None:
    at12 = dataclasses.replace(MG2, fps=12.0)
    assert at12.segment_seconds == 1.0
    a, b = sizing(MG2, HOST, "int4"), sizing(at12, HOST, "int4")
    assert b["segments_in_host"] == a["segments_in_host"]
    assert b["segment_bytes"] == a["segment_bytes"]
    for key in ("memory_seconds", "positional_horizon_s", "action_positional_horizon_s", "segment_seconds"):
        assert b[key] == pytest.approx(a[key] * 16 / 12)
    assert memory_seconds(at12, 3000) / 60 == 50.0


def test_sizing_dict() -> None:
    r = sizing(MG2, HOST, "int4")
    assert set(r) == ALL_KEYS
    assert r["segment_bytes"] == segment_bytes(MG2, "int4")
    assert r["segments_in_host"] == segments_in_host(MG2, HOST, "int4")
    assert r["memory_seconds"] == memory_seconds(MG2, r["segments_in_host"])
    assert r["positional_horizon_s"] == positional_horizon_s(MG2)
    assert r["fps"] == 16.0
    assert (r["codec"], r["bits_per_value"], r["usable"]) == ("int4", 4.25, 0.85)
    assert r["host_budget_bytes"] == math.floor(HOST * 17 / 20) == 29_205_777_612
    assert r["segment_seconds"] == 0.75
    assert json.loads(json.dumps(r)) == r


@given(
    host=st.integers(min_value=1, max_value=1 << 44),
    usable=st.floats(min_value=0.01, max_value=1.0),
    codec=st.sampled_from(sorted(CODEC_BITS)),
)
def test_segments_fit_the_budget(host: int, usable: float, codec: str) -> None:
    r = sizing(MG2, host, codec, usable)
    seg = r["segment_bytes"]
    assert r["host_budget_bytes"] <= host
    assert r["segments_in_host"] * seg <= r["host_budget_bytes"] < (r["segments_in_host"] + 1) * seg


# ---- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp8", "INT4", "", "int3"])
def test_unknown_codec(codec: str) -> None:
    with pytest.raises(ValueError, match=r"codec .*expected one of bf16, int8, int4"):
        segment_bytes(MG2, codec)
    with pytest.raises(ValueError, match="codec"):
        sizing(MG2, HOST, codec)


@pytest.mark.parametrize("usable", [0.0, -0.1, 1.01, 2.0, math.nan, math.inf])
def test_usable_outside_0_1(usable: float) -> None:
    with pytest.raises(ValueError, match=r"usable = .*expected .*\(0, 1\]"):
        segments_in_host(MG2, HOST, "bf16", usable)
    with pytest.raises(ValueError, match="usable"):
        sizing(MG2, HOST, "bf16", usable)


@pytest.mark.parametrize("host", [0, -1, -HOST])
def test_non_positive_host_bytes(host: int) -> None:
    with pytest.raises(ValueError, match=rf"host memory = {host} bytes: expected a positive"):
        segments_in_host(MG2, host, "bf16")
    with pytest.raises(ValueError, match="host memory"):
        sizing(MG2, host, "bf16")


def test_bad_dims_and_arguments() -> None:
    with pytest.raises(ValueError, match=r"fps = 0\.0"):
        dataclasses.replace(MG2, fps=0.0)
    with pytest.raises(ValueError, match="layers = 0"):
        dataclasses.replace(MG2, layers=0)
    with pytest.raises(ValueError, match="heads × head_dim"):
        ModelDims(2, 64, 3, 16, 24, 3, 6, 16, 40)
    with pytest.raises(ValueError, match="table_frames = 0"):
        positional_horizon_s(MG2, 0)
    with pytest.raises(ValueError, match="segments = -1"):
        memory_seconds(MG2, -1)


# ---- parse_size -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32GiB", 32 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("30GB", 30 * 10**9),
        ("4kB", 4000),
        ("2KiB", 2048),
        ("1TiB", 1 << 40),
        ("2TB", 2 * 10**12),
        ("7MB", 7 * 10**6),
        ("12345", 12345),
        ("12345B", 12345),
        (" 32 gib ", 32 * GiB),
        ("0.5kB", 500),
        ("1.0001KiB", 1024),  # rounded down to whole bytes
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "32XB", "32G", "-1GiB", "1e9", "0", "0.1B", "32 Gi B", "1,5GiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"bad size"):
        parse_size(text)


# ---- CLI ------------------------------------------------------------------------------------------


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sizing", "--model", "mg2", "--host-memory", "32GiB", "--codec", "int4", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == ""
    r = json.loads(out)
    assert set(r) >= CONTRACT_KEYS
    assert r == sizing(MG2, HOST, "int4")
    assert r["segments_in_host"] == 225


def test_cli_fps_and_usable(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sizing", "--host-memory", "32GiB", "--codec", "bf16", "--usable", "1", "--fps", "12", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["fps"], r["usable"], r["segments_in_host"], r["memory_seconds"]) == (12.0, 1.0, 70, 70.0)


def test_cli_text_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizing", "--model", "mg2", "--host-memory", "32GiB", "--codec", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "486,604,800 B" in out
    assert "464.1 MiB" in out
    assert "segments in host    60" in out
    assert "45.00 s" in out
    assert "255.81 s" in out
    assert "{" not in out


def test_cli_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizing", "--model", "tiny", "--host-memory", "1MiB", "--codec", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == sizing(TINY, MiB, "int8")


@pytest.mark.parametrize("name", ["tiny", "micro"])
def test_sizing_presets_are_the_session_presets(name: str) -> None:
    """Found in review: `sizing --model tiny` described the 2-layer unit-test stand-in while
    `session --preset tiny` ran a 32-layer one, so its segment count was 96x off. Each stand-in
    `worldpager session` runs has a `sizing` preset with its dimensions, and their bf16 segment is
    the session's segment payload, byte for byte."""
    from worldpager.layout import SegmentLayout
    from worldpager.session import SESSION_PRESETS

    cfg, dims = SESSION_PRESETS[name], PRESETS[name]
    got = (dims.layers, dims.dim, dims.heads, dims.head_dim, dims.tokens_per_frame)
    assert got == (cfg.layers, cfg.dim, cfg.heads, cfg.head_dim, cfg.tokens_per_frame)
    assert (dims.frames_per_block, dims.window_frames) == (cfg.frames_per_block, cfg.window_frames)
    assert (dims.rope_table_frames, dims.action_rope_table_frames) == (
        cfg.rope_table_frames,
        cfg.action_rope_table_frames,
    )
    assert segment_bytes(dims, "bf16") == SegmentLayout.from_config(cfg, "bf16").payload_nbytes
    assert set(SESSION_PRESETS) <= set(PRESETS)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--host-memory", "32XB", "--codec", "int4"], "32XB"),
        (["--host-memory", "lots", "--codec", "int4"], "lots"),
        (["--host-memory", "32GiB", "--codec", "int4", "--usable", "1.5"], "1.5"),
        (["--host-memory", "32GiB", "--codec", "int4", "--usable", "most"], "most"),
        (["--host-memory", "32GiB", "--codec", "int4", "--fps", "0"], "fps"),
        (["--host-memory", "32GiB", "--codec", "int3"], "int3"),
        (["--host-memory", "32GiB", "--codec", "int4", "--model", "mg3"], "mg3"),
        (["--codec", "int4"], "--host-memory"),
    ],
)
def test_cli_errors(capsys: pytest.CaptureFixture[str], args: list[str], named: str) -> None:
    rc = main(["sizing", *args, "--json"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.startswith("worldpager: ")
    assert named in err
    assert "Traceback" not in err


def test_cli_without_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("worldpager: ")


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizing", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--host-memory" in out
    assert "--codec" in out


def _console_script() -> str:
    found = shutil.which("worldpager")
    if found is not None:
        return found
    return str(Path(sys.executable).parent / "worldpager")


def test_installed_console_script() -> None:
    script = _console_script()
    if not Path(script).exists():
        pytest.skip("the worldpager console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "sizing", "--model", "mg2", "--host-memory", "32GiB", "--codec", "bf16", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert set(r) >= CONTRACT_KEYS
    assert (r["segment_bytes"], r["segments_in_host"], r["memory_seconds"]) == (486_604_800, 60, 45.0)


def test_installed_console_script_error() -> None:
    script = _console_script()
    if not Path(script).exists():
        pytest.skip("the worldpager console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "sizing", "--host-memory", "big", "--codec", "bf16"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("worldpager: ") and "'big'" in proc.stderr
    assert "Traceback" not in proc.stderr
