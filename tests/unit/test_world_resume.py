"""World sessions survive their device host: durable steps, the reopen from the saved index (after a
crash, without close()), a roll-back to the last segment the client got, and missing slots reported.
Real WorldPager sessions on the "micro" stand-in (random weights, seeded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.world import INDEX_EVERY, WorldSessions
from worldpager.model import TinyCausalWan
from worldpager.retrieval import Pose
from worldpager.segment_log import SegmentLog
from worldpager.session import SESSION_PRESETS, CorruptSlot, MissingSegment, Session
from worldpager.trajectory import yaw_sweep_trajectory

CFG = SESSION_PRESETS["micro"].on_the_fly()
POSES = yaw_sweep_trajectory(14)  # a sweep that comes back: later segments retrieve early ones


def _pose(p: Pose) -> tuple[float, float, float, float, float]:
    return (p.x, p.y, p.z, p.pitch, p.yaw)


def _seg(dtype: torch.dtype = torch.float32) -> int:
    from worldpager.layout import SegmentLayout

    return SegmentLayout.from_config(CFG, "bf16", dtype).payload_nbytes


def test_a_crashed_world_session_reopens_from_its_saved_index_and_continues(tmp_path: Path) -> None:
    n = INDEX_EVERY + 1  # the index is saved after segment 7; segment 8 is in the log past it
    ref_ws, ws = WorldSessions(torch.device("cpu")), WorldSessions(torch.device("cpu"))
    ref_ws.open("world", TinyCausalWan(CFG), "ref", 3 * _seg(), tmp_path / "ref")
    ref = [ref_ws.step("ref", _pose(p)) for p in POSES]
    ref_ws.close("ref")
    assert any(r["misses"] for r in ref[n:]), "the trajectory should read old segments back from NVMe"

    ws.open("world", TinyCausalWan(CFG), "s", 3 * _seg(), tmp_path / "s")
    before = [ws.step("s", _pose(p)) for p in POSES[:n]]
    assert all(r["durable"] for r in before)  # every returned segment is in the log
    crashed = ws.get("s").session  # the host dies here: no close(), no window.bin, no session.json update
    try:
        again = WorldSessions(torch.device("cpu"))  # the restarted host, its model built again
        opened = again.open("world", TinyCausalWan(CFG), "s", 3 * _seg(), tmp_path / "s", resume=True)
        assert opened["resumed"] and opened["next_segment"] == n
        assert opened["corrupt_slots"] == {} and opened["missing_segments"] == []
        s = again.get("s").session
        assert s.log.index_state == "extended"  # the saved index, plus the one slot appended after it
        assert s.window_source == "log"  # rebuilt from the last segments in the log
        after = [again.step("s", _pose(p)) for p in POSES[n:]]
        again.close("s")
    finally:
        crashed.handler.close()
        crashed.log.close()
    assert [r["step"] for r in after] == list(range(n, len(POSES)))  # no segment lost, none repeated
    assert [r["retrieved"] for r in after] == [r["retrieved"] for r in ref[n:]]
    assert any(i < n for r in after if r["misses"] for i in r["retrieved"])  # old segments, from disk
    for got, want in zip(after, ref[n:], strict=True):  # the window at codec precision: close, not exact
        a = torch.frombuffer(bytearray(got["latents"]), dtype=torch.float32)
        b = torch.frombuffer(bytearray(want["latents"]), dtype=torch.float32)
        assert got["shape"] == want["shape"]
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-2
    with SegmentLog.open(tmp_path / "s") as log:
        assert sorted(log.header(slot).segment_id for slot in log.slots()) == list(range(len(POSES)))


def test_resume_at_generates_again_a_segment_the_client_never_got(tmp_path: Path) -> None:
    """A host that died after writing segment k but before its reply reached the manager: the session
    reopens at k (the log's copy of k is ignored), k is generated again and its new copy supersedes."""
    model = TinyCausalWan(CFG, dtype=torch.bfloat16)  # bf16 model + bf16 codec: the log is exact
    opts: dict[str, object] = {"host_budget_bytes": 8 * _seg(torch.bfloat16), "keep_outputs": True}
    with Session(model, log_dir=tmp_path / "ref", **opts) as ref:  # type: ignore[arg-type]
        ref.run(POSES[:9])
    with Session(model, log_dir=tmp_path / "a", **opts) as a:  # type: ignore[arg-type]
        a.run(POSES[:7])
    with Session.resume(tmp_path / "a", model, resume_at=5, **opts) as b:  # type: ignore[arg-type]
        assert b.step_index == 5 and b.window_source == "log"  # window.bin is of step 7: not used
        assert not [e for e in b.events if isinstance(e, MissingSegment | CorruptSlot)]
        recs = b.run(POSES[5:9])
    assert [r.step for r in recs] == [5, 6, 7, 8]
    assert [r.retrieved for r in recs] == [r.retrieved for r in ref.records[5:9]]
    assert b.outputs is not None and ref.outputs is not None
    for out, want in zip(b.outputs, ref.outputs[5:9], strict=True):
        assert torch.equal(out, want)
    with SegmentLog.open(tmp_path / "a") as log:
        assert log.find(5) == 7 and log.find(6) == 8  # the new copies, after the old ones (slots 5, 6)
    with pytest.raises(ValueError, match="resume_at"):
        Session(model, log_dir=tmp_path / "c", resume_at=1, **opts)  # type: ignore[arg-type]


def test_segments_missing_from_a_cut_log_are_reported_and_never_attended_to(tmp_path: Path) -> None:
    n, seg = 10, _seg()
    with Session(TinyCausalWan(CFG), log_dir=tmp_path / "a", host_budget_bytes=3 * seg) as a:
        a.run(POSES[:n])
        # Wait out each segment's write-behind: read before it lands, the last one has no slot yet.
        slots = {sid: a.handler.wait_written(sid) for sid in range(n)}
        slot_size = a.log.slot_size
    cut = sorted(sid for sid in range(n) if (slots[sid] or 0) >= 6)
    assert cut, "some segments should sit in the last slots"
    os.truncate(tmp_path / "a" / "segments.wplog", 6 * slot_size)  # the saved index names 10 slots
    with Session.resume(tmp_path / "a", TinyCausalWan(CFG), host_budget_bytes=3 * seg) as b:
        assert b.step_index == n  # window.bin (saved by close) still matches: the session goes on at 10
        corrupt = [e for e in b.events if isinstance(e, CorruptSlot)]
        missing = [e.segment_id for e in b.events if isinstance(e, MissingSegment)]
        assert sorted(e.slot for e in corrupt) == list(range(6, n))
        assert all(e.reason.startswith("missing") for e in corrupt)
        assert missing == cut
        recs = b.run(POSES[n:])
    assert not {i for r in recs for i in r.retrieved} & set(cut)
    assert any(r.retrieved for r in recs)


def test_the_manager_reopens_a_session_on_a_restarted_host_or_says_how_to_resume_it(tmp_path: Path) -> None:
    """In-process hosts; the host is replaced by an empty one, as Ray restarts a dead actor."""
    from live_helpers import world_config

    from manager.errors import ModelNotFound, WorkerUnavailable
    from manager.live import LiveManager
    from manager.workers_bridge import create_pool
    from workers.host import DeviceHost

    config = world_config(tmp_path)
    pool = create_pool(config, in_process=True)

    def restart() -> None:
        old = pool.hosts["cpu0"]
        pool.hosts["cpu0"] = DeviceHost(old.name, old.kind, index=old.index)

    async def main() -> None:
        manager = LiveManager(config, pool)
        events = manager.subscribe()
        await manager.start()
        try:
            sid, opened = await manager.open_session("world")
            assert opened["next_segment"] == 0 and not opened["resumed"]
            assert (tmp_path / "sessions" / sid / "index.json").exists()
            first = [await manager.step_session(sid, _pose(p)) for p in POSES[:4]]
            assert [d["step"] for d in first] == [0, 1, 2, 3] and not any(d["resumed"] for d in first)

            restart()  # the session and the model are gone from the device host
            d = await manager.step_session(sid, _pose(POSES[4]))
            assert (
                d["step"] == 4 and d["resumed"] and d["corrupt_slots"] == {} and d["missing_segments"] == []
            )
            assert manager.live["world"].ready.is_set()  # the model was loaded again
            d = await manager.step_session(sid, _pose(POSES[5]))
            assert d["step"] == 5 and not d["resumed"]
            kinds = []
            while not events.empty():
                kinds.append(events.get_nowait()["kind"])
            assert "session_lost" in kinds and "session_resumed" in kinds

            restart()  # no time to reopen it: UNAVAILABLE, naming the id to resume with
            with pytest.raises(WorkerUnavailable, match=f"resume_session_id='{sid}'.*segment 6"):
                await manager.step_session(sid, _pose(POSES[6]), recover_s=0.0)
            await manager.close_session(sid)  # the stream ends; the saved state stays
            sid2, again = await manager.open_session("world", resume_id=sid, codec="")
            assert sid2 == sid and again["resumed"] and again["next_segment"] == 6
            d = await manager.step_session(sid, _pose(POSES[6]))
            assert d["step"] == 6 and not d["resumed"]
            await manager.close_session(sid)
            with pytest.raises(ModelNotFound, match="no saved world session"):
                await manager.open_session("world", resume_id="0123456789ab")
        finally:
            await manager.stop()
            pool.close()

    import asyncio

    asyncio.run(main())


def test_a_world_model_runs_one_session_at_a_time(tmp_path: Path) -> None:
    # The rolling KV window is the model's (MG2's kv_cache lives on the module): a second session
    # opened on the same model reset it under the first, whose next step then failed ("not
    # contiguous with the cached window") or, had the window lined up, attended to the other's frames.
    ws, model = WorldSessions(torch.device("cpu")), TinyCausalWan(CFG)
    ws.open("world", model, "a", 3 * _seg(), tmp_path / "a")
    first = [ws.step("a", _pose(p)) for p in POSES[:3]]
    with pytest.raises(ValueError, match=r"model 'world' runs world session 'a'.*one session at a time"):
        ws.open("world", model, "b", 3 * _seg(), tmp_path / "b")
    assert not (tmp_path / "b").exists() and list(ws.open_sessions) == ["a"]
    assert ws.step("a", _pose(POSES[3]))["step"] == first[-1]["step"] + 1  # a goes on undisturbed
    ws.close("a")
    assert ws.open("world", model, "b", 3 * _seg(), tmp_path / "b")["next_segment"] == 0  # then b may
    ws.close("b")
