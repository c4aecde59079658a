"""worldpager fixes from review: no segment dropped when host cannot take it while the log is usable
(write-through), any whole-number seed, bounded sizes and counts on the command line, bench-stall
sizes checked against memory, finite bench-stall numbers, the GPU lease in force in the summary, and
the resume read-back counted. Real sessions on the "micro" stand-in (random weights, seeded).

Second review (section 8 on): an upload of a released step whose segment left host, the transfer
threads stopped by a close after a transfer failure, the log closed when a session cannot be built,
an unreadable session.json refused on resume, an index.json holding Infinity rebuilt, a miss without
host room leaving its slot to the next wanted segment, and a corrupt newest segment under a trusted
index regenerated."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from worldpager import cli, stall
from worldpager.cli import MAX_SIZE, main, parse_size
from worldpager.layout import SegmentLayout
from worldpager.model import TinyCausalWan
from worldpager.page_types import Backpressure, DiskFull, Read, SegState, Upload
from worldpager.pages import PageManager
from worldpager.retrieval import Pose, SegmentInfo
from worldpager.segment_log import HEADER_SIZE, INDEX_NAME, LOG_NAME, SegmentLog, slot_size_for
from worldpager.session import SESSION_FILE, SESSION_PRESETS, CorruptSlot, MissingSegment, Session
from worldpager.trajectory import block_inputs, generator_seed, yaw_sweep, yaw_sweep_trajectory
from worldpager.transfer import Dropped, TransferHandler, WrittenThrough

CFG = SESSION_PRESETS["micro"].on_the_fly()
SEG = SegmentLayout.from_config(CFG, "bf16").payload_nbytes
HUGE = "9" * 400


def _log_ids(log_dir: Path) -> list[int]:
    with SegmentLog.open(log_dir) as log:
        return sorted(log.header(slot).segment_id for slot in log.slots())


# ---- 1: a segment host cannot take goes straight to the log -------------------------------------


@pytest.mark.parametrize("host_segments", [1, 2])
def test_no_segment_is_lost_when_the_host_budget_is_below_k_plus_one(
    tmp_path: Path, host_segments: int
) -> None:
    """Found in review: with room for fewer than k+1 segments, the next step's protected retrieval set
    left no room for the new segment, no spill could help, and the segment was dropped although the
    log was usable: a resume then reported it missing. Now it is written through to the log."""
    n, log_dir = 40, tmp_path / "log"
    with Session(TinyCausalWan(CFG), host_budget_bytes=host_segments * SEG, log_dir=log_dir) as s:
        for pose in yaw_sweep_trajectory(n):
            rec = s.step(pose)
            assert s.wait_written(rec.step), f"segment {rec.step} is not in the log"
            assert s.pm.host_used_bytes <= host_segments * SEG
        s.handler.drain()
        s.pm.check()
        counts = s.event_counts()
        through = [e.seg_id for e in s.events if isinstance(e, WrittenThrough)]
    assert "Dropped" not in counts
    # with room for one segment the new one is always written through; with room for two, since
    # review 17 (host room for a step's reads goes to the rule's best first) this walk leaves room
    assert counts.get("WrittenThrough", 0) > 0 or host_segments > 1
    for sid in through:  # NVMe-only, and retrievable: read back when wanted
        loc = s.pm.lookup(sid)
        assert loc is not None and loc.state in (SegState.NVME, SegState.HOST_CLEAN)
    assert _log_ids(log_dir) == list(range(n))  # every segment, once
    r = Session.resume(log_dir, TinyCausalWan(CFG), host_budget_bytes=host_segments * SEG)
    with r:
        assert r.step_index == n
        assert not [e for e in r.events if isinstance(e, MissingSegment)]
        assert [i.segment_id for i in r._infos] == list(range(n))


def test_the_page_manager_registers_a_written_through_segment_nvme_only() -> None:
    pm = PageManager(2 * SEG, SEG, 2, segment_bytes=SEG)
    for sid in (0, 1):
        for job in pm.add_segment(sid, SEG):  # type: ignore[union-attr]
            pm.complete(job.job_id, True)
    plan = pm.prepare_step(5, [0, 1])  # both protected: no room for a third
    bp = pm.add_segment(2, SEG)
    assert isinstance(bp, Backpressure) and bp.spills == ()
    pm.add_on_nvme(2, SEG)
    loc = pm.lookup(2)
    assert loc is not None and loc.state is SegState.NVME and not loc.gpu
    assert pm.host_used_bytes == 2 * SEG
    pm.check()
    with pytest.raises(ValueError, match="duplicate"):
        pm.add_on_nvme(2, SEG)
    with pytest.raises(ValueError, match="smaller than one segment"):
        pm.add_on_nvme(3, 3 * SEG)
    for job in plan.jobs:
        pm.complete(job.job_id, True)
    pm.release_step(5)
    read = pm.prepare_step(6, [2])  # read back like a spilled segment
    assert [type(j) for j in read.jobs] == [Read]
    assert [type(j) for j in pm.complete(read.jobs[0].job_id, True)] == [Upload]
    pm.check()


def test_a_full_log_during_a_write_through_goes_host_only_and_loses_nothing_it_kept(tmp_path: Path) -> None:
    from worldpager.segment_log import slot_size_for

    n, log_dir = 16, tmp_path / "log"
    with Session(
        TinyCausalWan(CFG), host_budget_bytes=SEG, log_dir=log_dir, log_max_bytes=4 * slot_size_for(SEG)
    ) as s:
        s.run(yaw_sweep_trajectory(n))
        s.handler.drain()
        s.pm.check()
        events = s.events
    assert not s.pm.nvme_enabled and any(isinstance(e, DiskFull) for e in events)
    dropped = {e.seg_id for e in events if isinstance(e, Dropped)}
    in_log = set(_log_ids(log_dir))
    assert len(in_log) == 4 and dropped  # the log filled, then host-only mode dropped what had no room
    for sid in range(n):
        loc = s.pm.lookup(sid)
        assert (loc is None) == (sid in dropped), sid  # dropped: never registered, so never retrieved
        if loc is not None and loc.state is SegState.NVME:
            assert sid in in_log, f"segment {sid} is NVMe-only but not in the log"


def test_cli_refuses_a_host_tier_that_cannot_hold_the_next_retrieval_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["session", "--preset", "micro", "--segments", "2", "--json"]
    assert main([*base, "--host-segments", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: --host-segments 2:") and "--retrieval-k 2 needs at least 3" in err
    assert main([*base, "--host-memory", "80KiB"]) == 2
    assert "--host-memory 80KiB" in capsys.readouterr().err
    assert main([*base, "--host-segments", "2", "--retrieval-k", "1"]) == 0  # k+1 = 2 fits
    assert json.loads(capsys.readouterr().out)["host_segments"] == 2
    assert main([*base, "--retrieval-k", "-1"]) == 2
    assert "--retrieval-k -1" in capsys.readouterr().err


# ---- 2: any whole-number seed --------------------------------------------------------------------


def test_block_inputs_take_any_seed_and_keep_the_old_ones() -> None:
    for seed in (
        0,
        7,
        -1,
        9 * 10**12,
        -9 * 10**12,
    ):  # what torch took before seeds the same (torch wraps mod 2**64)
        g = torch.Generator().manual_seed(seed * 1_000_003 + 4)
        want = torch.randn((CFG.frames_per_block, CFG.tokens_per_frame, CFG.dim), generator=g)
        assert torch.equal(block_inputs(CFG, 4, seed)[0], want)
    for seed in (20_000_000_000_000, -(10**30), 10**400):
        latent, actions = block_inputs(CFG, 3, seed)
        assert torch.equal(latent, block_inputs(CFG, 3, seed)[0]) and actions.shape[0] == CFG.frames_per_block
    assert generator_seed(-1) == 2**64 - 1 and generator_seed(2**64 + 5) == 5
    assert list(zip(range(30), yaw_sweep(seed=3), strict=False)) == list(
        enumerate(yaw_sweep_trajectory(30, seed=3))
    )


@pytest.mark.parametrize("seed", ["20000000000000", "-5", HUGE])
def test_cli_session_runs_and_resumes_with_a_large_or_negative_seed(
    tmp_path: Path, seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["session", "--preset", "micro", "--log-dir", str(tmp_path / "s"), "--json"]
    assert main([*base, "--segments", "2", "--seed", seed]) == 0
    capsys.readouterr()
    assert main([*base, "--resume", "--segments", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_segment"] == 2 and out["total_segments"] == 4 and out["resumed"]


# ---- 3, 4, 5: bounded sizes and counts, finite numbers ------------------------------------------


def test_parse_size_is_bounded() -> None:
    assert parse_size("1048576TiB") == MAX_SIZE == 2**60
    for bad in ("1048577TiB", str(MAX_SIZE + 1), HUGE, HUGE + "TiB"):
        with pytest.raises(ValueError, match="at most"):
            parse_size(bad)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["sizing", "--host-memory", HUGE, "--codec", "int8"], "--host-memory"),
        (["sizing", "--host-memory", "32GiB", "--codec", "int8", "--fps", HUGE], "--fps"),
        (["session", "--host-memory", HUGE, "--preset", "micro", "--segments", "2"], "--host-memory"),
        (["session", "--read-bandwidth", HUGE, "--preset", "micro", "--segments", "2"], "--read-bandwidth"),
        (["session", "--segments", HUGE, "--preset", "micro"], "--segments"),
        (["session", "--host-segments", HUGE, "--preset", "micro", "--segments", "2"], "--host-segments"),
        (["session", "--retrieval-k", HUGE, "--preset", "micro", "--segments", "2"], "--retrieval-k"),
        (["bench-stall", "--quick", "--segment-size", HUGE], "--segment-size"),
        (["bench-stall", "--quick", "--segment-size", "100TiB"], "--segment-size"),
        (["bench-stall", "--quick", "--k", HUGE], "--k"),
        (["bench-stall", "--quick", "--steps", HUGE], "--steps"),
        (["bench-stall", "--quick", "--segments", HUGE], "--segments"),
        (["bench-stall", "--quick", "--compute-s", "inf"], "--compute-s"),
        (["bench-stall", "--quick", "--compute-s", "1e9"], "--compute-s"),
        (["bench-stall", "--quick", "--compute-s", "1e-320"], "--compute-s"),
        (["bench-stall", "--quick", "--multipliers", "1,inf"], "--multipliers"),
        (["bench-stall", "--quick", "--multipliers", "1e308"], "--multipliers"),
        (["bench-stall", "--quick", "--k", "3", "--segments", "8"], "--segments"),
    ],
)
def test_cli_names_the_flag_of_an_out_of_range_value(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"worldpager: {named}") and "Traceback" not in err
    assert len(err) < 400  # a 400-digit value is cut short
    assert "bytes_per_s" not in err


def test_bench_stall_checks_the_segments_against_the_memory_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    memory, disk = stall.bench_needs(128 << 10, "bf16", 8, 2)
    assert memory >= 8 * (128 << 10) and disk >= 8 * (128 << 10)

    class _Mem:
        available = memory - 1

    monkeypatch.setattr("psutil.virtual_memory", lambda: _Mem())
    assert main(["bench-stall", "--quick", "--segment-size", "128KiB"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("worldpager: --segment-size 128KiB: the benchmark needs about") and "available" in err
    )


def test_bench_stall_turns_an_allocation_failure_into_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(**_: Any) -> dict[str, Any]:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(stall, "run_bench", fail)
    assert main(["bench-stall", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldpager: --segment-size") and "out of memory" in err

    def bug(**_: Any) -> dict[str, Any]:
        raise RuntimeError("something else")

    monkeypatch.setattr(stall, "run_bench", bug)
    with pytest.raises(RuntimeError, match="something else"):  # not every RuntimeError is the user's
        main(["bench-stall", "--quick"])


def test_run_bench_refuses_non_finite_settings_before_building_anything() -> None:
    for kw in ({"compute_s": float("inf")}, {"multipliers": [float("inf")]}, {"multipliers": [1e308]}):
        with pytest.raises(ValueError):
            stall.run_bench(**{**stall.QUICK, **kw})
    assert cli._positive("--x", "3", int) == 3
    with pytest.raises(cli.UsageError, match="--x 'nan'"):
        cli._positive("--x", "nan", float)


# ---- 6: the GPU lease in force ------------------------------------------------------------------


def test_summary_reports_the_gpu_lease_in_force(tmp_path: Path) -> None:
    with Session(TinyCausalWan(CFG), host_budget_bytes=10 * SEG, log_dir=tmp_path / "l") as s:
        slot = s.layout.decoded_nbytes
        assert s.summary()["gpu_budget_bytes"] == 2 * 2 * slot
        s.resize_lease(gpu_budget_bytes=2 * slot)  # one slot per buffer
        assert s.pm.slots_per_buffer == 1 and s.summary()["gpu_budget_bytes"] == 2 * slot
        with pytest.raises(ValueError):
            s.resize_lease(gpu_budget_bytes=slot)  # below one slot per buffer: refused, lease kept
        assert s.summary()["gpu_budget_bytes"] == 2 * slot
        s.resize_lease(host_budget_bytes=8 * SEG)  # a host-only resize leaves the GPU lease
        s.run(yaw_sweep_trajectory(4))
    assert s.summary()["gpu_budget_bytes"] == 2 * slot


# ---- 7: the resume read-back is counted ---------------------------------------------------------


def test_resume_read_back_is_counted_and_the_cli_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from worldpager.segment_log import HEADER_SIZE

    with Session(TinyCausalWan(CFG), host_budget_bytes=64 << 20, log_dir=tmp_path / "l") as s:
        s.run(yaw_sweep_trajectory(6))
    assert s.summary()["resume_bytes_read"] == 0
    r = Session.resume(tmp_path / "l", TinyCausalWan(CFG), host_budget_bytes=64 << 20)
    with r:
        assert r.resume_bytes_read == 6 * (HEADER_SIZE + SEG)  # every segment read back into host
        assert r.handler.host_bytes == 6 * SEG
    assert r.summary()["resume_bytes_read"] == 6 * (HEADER_SIZE + SEG)

    base = ["session", "--preset", "micro", "--log-dir", str(tmp_path / "c"), "--json"]
    assert main([*base, "--segments", "6"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["resume_bytes_read"] == 0 and first["read_back"].startswith("none: the host budget holds")
    assert main([*base, "--resume", "--segments", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nvme_bytes_read"] == 0 and out["resume_bytes_read"] == 6 * (HEADER_SIZE + SEG)
    assert out["read_back"].startswith(f"on resume only: {6 * (HEADER_SIZE + SEG)} B")


# ---- 8: an upload of a released step whose segment has left host ---------------------------------


def test_an_upload_of_a_released_step_is_skipped_when_its_segment_left_host(tmp_path: Path) -> None:
    """Found in review: the upload thread looked the host copy up before it checked that the step was
    still prepared; a step released with its upload queued (allowed), then the segment evicted, killed
    the thread with a KeyError and every later call failed. Since review 17 the segment cannot leave
    host while that upload reads it (`PageManager.release_step` keeps it protected until the upload
    ends): the upload thread survives the released step either way, and its buffer is usable again."""
    layout = SegmentLayout.from_config(CFG, "bf16")
    kv = [(torch.randn(layout.kv_shape), torch.randn(layout.kv_shape)) for _ in range(layout.layers)]
    payload = layout.encode(kv)
    pm = PageManager(2 * SEG, layout.decoded_nbytes, 2, segment_bytes=SEG)
    with SegmentLog.create(tmp_path, slot_size_for(SEG)) as log:
        h = TransferHandler(pm, log, layout)
        try:
            for sid in (0, 1):
                assert h.add_segment(SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0)), payload)
            h.drain()
            with h._cond:  # the upload thread cannot take its job meanwhile
                h.prepare(0, [0], 6)
                h.release(0)
                for sid in (2, 3):  # 1 is evicted; 0 stays while its upload is queued (review 17)
                    h.add_segment(SegmentInfo(sid, 3 * sid, 3 * sid + 3, Pose(0, 0, 0, 0, 0)), payload)
                assert 0 in h._host and 1 not in h._host
            deadline = time.monotonic() + 10
            while any(pm._in_flight) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert h.error is None and pm._in_flight == [0, 0]
            h.prepare(2, [3], 12)  # the buffer is usable again
            h.wait_ready(2)
            assert h.memory(2)[1] == (3,)
            h.release(2)
            pm.check()
        finally:
            h.close()


# ---- 9: close() after a transfer thread failed ---------------------------------------------------


def test_close_after_a_transfer_failure_stops_the_threads_and_closes_the_log(tmp_path: Path) -> None:
    """Found in review: close() waited for the prefetched step first; after a transfer thread failed
    that raised and the handler was never closed, so its other thread stayed alive (one per session)."""
    s = Session(TinyCausalWan(CFG), host_budget_bytes=8 * SEG, log_dir=tmp_path)

    def eio(**_: object) -> int:
        raise OSError(errno.EIO, "I/O error")

    s.log.append = eio  # type: ignore[method-assign]  # the disk fails (not full): the I/O thread dies
    s.step(yaw_sweep_trajectory(1)[0])  # prefetch: step 1 is prepared, segment 0 written behind
    with pytest.raises(RuntimeError, match="transfer thread failed"):
        s.handler.drain()
    with pytest.raises(RuntimeError, match="transfer thread failed"):
        s.close()
    assert not any(t.is_alive() for t in s.handler._threads)
    assert s.log._fd == -1


# ---- 10: a session that cannot be built closes its log -------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open file descriptors on Linux")
def test_a_session_that_cannot_be_built_leaks_no_file_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the transfer handler (and the attributes after it) were built outside the
    try that closes the log, so a failure there (e.g. a bad device name) leaked the log's fd."""
    before = _open_fds()
    for i in range(3):
        with pytest.raises(RuntimeError):
            Session(TinyCausalWan(CFG), host_budget_bytes=4 * SEG, log_dir=tmp_path / f"d{i}", device="nope")
    assert not (tmp_path / "d0" / LOG_NAME).exists()  # refused before the log was created

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("no transfer handler")

    monkeypatch.setattr("worldpager.session.TransferHandler", broken)
    for i in range(3):
        with pytest.raises(RuntimeError, match="no transfer handler"):
            Session(TinyCausalWan(CFG), host_budget_bytes=4 * SEG, log_dir=tmp_path / f"e{i}")
    assert _open_fds() == before


# ---- 11: an unreadable session.json ---------------------------------------------------------------


def test_resume_refuses_a_partly_written_session_json(tmp_path: Path) -> None:
    """Found in review: an unreadable session.json made resume go on with the default seed and codec
    and without the roll-backs: a continuation unlike the saved session, silently."""
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG}
    with Session(TinyCausalWan(CFG), log_dir=tmp_path, seed=7, **opts) as s:
        s.run(yaw_sweep_trajectory(4))
    path = tmp_path / SESSION_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{SESSION_FILE}: missing or unreadable"):
        Session.resume(tmp_path, TinyCausalWan(CFG), **opts)
    path.unlink()
    with pytest.raises(ValueError, match=f"{SESSION_FILE}: missing or unreadable"):
        Session.resume(tmp_path, TinyCausalWan(CFG), **opts)
    path.write_bytes(data)  # the log was left usable
    with Session.resume(tmp_path, TinyCausalWan(CFG), **opts) as r:
        assert r.seed == 7 and r.step_index == 4
    with pytest.raises(FileNotFoundError):  # no log at all: as before
        Session.resume(tmp_path / "none", TinyCausalWan(CFG), **opts)


# ---- 12: index.json holding Infinity ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["n_slots", "file_size", "entry"])
def test_an_index_json_with_infinity_is_rebuilt(tmp_path: Path, where: str) -> None:
    """Found in review: json.loads takes Infinity, int() of it raised OverflowError out of open()."""
    with SegmentLog.create(tmp_path, slot_size_for(100)) as log:
        for i in range(3):
            log.append(
                segment_id=i, frame_start=3 * i, frame_end=3 * i + 3, pose=(0, 0, 0, 0, 0), codec="bf16",
                position_state="post-rope", position=3 * i, payload=bytes([i]) * 100,
            )  # fmt: skip
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    if where == "entry":
        idx["entries"][1]["segment_id"] = float("inf")
    else:
        idx[where] = float("inf")
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))  # writes Infinity
    with SegmentLog.open(tmp_path) as log:
        assert log.index_state == "rebuilt" and log.slots() == [0, 1, 2]
        assert log.read(1)[1] == bytes([1]) * 100


# ---- 13: a miss without host room leaves its slot to the next wanted segment ---------------------


@pytest.mark.parametrize("place_by_id", [False, True])
def test_a_miss_without_host_room_leaves_its_slot_to_the_next_wanted(place_by_id: bool) -> None:
    """Found in review: a miss that found no host room still took one of the slots_per_buffer places,
    so a wanted segment already in host was dropped and the step attended to nothing (e.g. after a
    GPU lease shrink to one slot)."""
    pm = PageManager(2 * 10, 10, 1)
    for job in pm.add_segment(0, 10):  # type: ignore[union-attr]
        pm.complete(job.job_id, True)
    pm.add_segment(1, 10)  # 1 and 2 dirty (write-backs outstanding): no room for a read
    pm.add_segment(2, 10)  # evicts 0: NVMe only
    plan = pm.prepare_step(0, [0, 2], place_by_id=place_by_id)
    assert plan.slots == {2: 0} and plan.unavailable == (0,) and plan.dropped == ()
    assert [(type(j).__name__, j.seg_id) for j in plan.jobs] == [("Upload", 2)]
    pm.check()
    for job in plan.jobs:
        pm.complete(job.job_id, True)
    assert pm.buffer_ready(0)
    pm.release_step(0)
    pm.check()


def test_slots_freed_by_misses_without_room_keep_id_order_and_best_first() -> None:
    pm = PageManager(3 * 10, 10, 2)
    for sid in (0, 1):
        for job in pm.add_segment(sid, 10):  # type: ignore[union-attr]
            pm.complete(job.job_id, True)
    for sid in (2, 3, 4):  # dirty; 0 and 1 evicted to make room
        pm.add_segment(sid, 10)
    plan = pm.prepare_step(1, [1, 4, 0, 2, 3], place_by_id=True)
    assert plan.slots == {2: 0, 4: 1} and plan.unavailable == (1, 0) and plan.dropped == (3,)
    assert [j.seg_id for j in plan.jobs] == [2, 4]  # slot order
    pm.check()


# ---- 14: a corrupt newest segment under a trusted index ------------------------------------------


def test_a_corrupt_newest_segment_under_a_trusted_index_is_generated_again(tmp_path: Path) -> None:
    """Found in review: with a flushed (trusted) index the newest segment's damage was found only on
    read-back, after the step to continue at had been counted past it: the resume then failed to
    rebuild the rolling window, while the same damage under a scanned index resumed at that segment."""
    opts: dict[str, Any] = {"host_budget_bytes": 8 * SEG}
    s = Session(TinyCausalWan(CFG), log_dir=tmp_path, **opts)
    s.run(yaw_sweep_trajectory(6))
    s.handler.drain()
    s.flush_index()
    s.handler.close()  # the host dies: no close(), so no window.bin
    s.log.close()
    slot = s.log.find(5)
    assert slot is not None
    with open(tmp_path / LOG_NAME, "r+b") as f:  # a damaged byte in segment 5's payload
        f.seek(slot * s.log.slot_size + HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with Session.resume(tmp_path, TinyCausalWan(CFG), **opts) as r:
        assert r.step_index == 5 and r.window_source == "log"
        assert any(isinstance(e, CorruptSlot) and e.slot == slot for e in r.events)
        assert not [e for e in r.events if isinstance(e, MissingSegment)]
        r.step(yaw_sweep_trajectory(6)[5])
        assert r.step_index == 6


def test_cli_a_new_session_over_a_saved_one_says_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a README walk-through: `--log-dir` of a saved session without `--resume` printed a raw
    `[Errno 17] File exists`. The saved session is left as it was."""
    base = ["session", "--preset", "micro", "--log-dir", str(tmp_path / "s"), "--json", "--segments", "2"]
    assert main(base) == 0
    capsys.readouterr()
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "s").iterdir())
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "holds a saved session" in err and "--resume" in err and "Errno" not in err
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "s").iterdir()) == before
