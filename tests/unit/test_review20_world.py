"""Review 20, the world-session path (a read-through found each; real WorldPager sessions on the "micro"
stand-in, the manager over the in-process pool):

- A session whose disk filled (WorldPager goes host-only: steps acknowledged, their segments held in
  host RAM alone) and whose device host then died was reopened at the first segment the log lacked,
  silently: its client, which had segments 0-5, got segment 3 again, for the pose meant for segment 6,
  with nothing saying so. The output now says which segments are generated again (`unusable`), and the
  server log says why.
- A step whose model code raised ended the stream UNAVAILABLE (a client retries that), where an
  inference that raised is INTERNAL: now INTERNAL for both, and for an open the host failed.
- An unknown `start.codec` was refused by the device host only after the manager had admitted the
  session and loaded the world model (maybe evicting others for it): now refused before admission.
- A resume refused on a full disk told the client the server's session folder: now without it."""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_helpers import POSES, run, world_config
from test_review17_world_stream import Aborted, HeldAfter, _inputs, _pose

import worldpager.session as wps
import worldpager.session_store as st
from manager.api.errors import details_of, status_of
from manager.api.world import WorldSessionServicer, _output
from manager.config import load_config
from manager.errors import InvalidRequest, ModelFailed
from manager.live import LiveManager
from residency_proto.v1 import residency_pb2 as pb
from workers import protocol as P
from workers.host import DeviceHost
from workers.world import WorldSessions
from worldpager.codecs import CODECS
from worldpager.model import TinyCausalWan


def _run(
    tmp_path: Path, body: Callable[[LiveManager], Awaitable[Any]], patch: tuple[str, str] | None = None
) -> Any:
    config = world_config(tmp_path)
    if patch is not None:  # the config file's text changed: `patch` (old, new)
        text = (tmp_path / "c.yaml").read_text()
        assert patch[0] in text
        (tmp_path / "c.yaml").write_text(text.replace(*patch))
        config = load_config(tmp_path / "c.yaml")
    return run(config, body)


def _segment_bytes() -> int:
    cfg = wps.SESSION_PRESETS["micro"].on_the_fly()
    with tempfile.TemporaryDirectory() as d:
        s = wps.Session(TinyCausalWan(cfg), host_budget_bytes=1 << 22, log_dir=Path(d) / "s")
        try:
            return int(s.segment_bytes)
        finally:
            s.close()


def test_segments_lost_with_a_full_disk_and_a_host_death_are_said_to_be_generated_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    full_after = 3 * (_segment_bytes() + 4096)  # the disk fills after 3 segments

    class FillingDisk(wps.Session):
        def __init__(self, model: Any, **kw: Any) -> None:
            if not kw.get("resume"):
                kw["log_max_bytes"] = full_after
            super().__init__(model, **kw)

    monkeypatch.setattr(wps, "Session", FillingDisk)

    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        durable = [bool((await lm.step_session(sid, p))["durable"]) for p in POSES[:6]]
        assert durable == [True, True, True, False, False, False]
        old = lm.pool.hosts["cpu0"]
        lm.pool.hosts["cpu0"] = DeviceHost(old.name, old.kind, index=old.index)  # as Ray restarts it
        data = await lm.step_session(sid, POSES[6])
        assert data["resumed"] and data["step"] == 3
        assert data["replaced_segments"] == [3, 5]
        out = _output(sid, data)
        assert out.segment == 3 and out.resumed
        assert out.unusable[0] == (
            "segments 3-5: sent, but their saved copies are gone (never saved on a full disk, and lost "
            "with the device host) or unusable (corrupt): the session continues at segment 3, generating "
            "them again"
        )
        # and it goes on from there, as any session does
        assert (await lm.step_session(sid, POSES[7]))["step"] == 4
        await lm.close_session(sid)

    _run(tmp_path, body)
    assert any("segments 3-5 were sent to its client, but their saved" in r.message for r in caplog.records)


def test_a_reopen_at_the_clients_next_segment_says_nothing_is_replaced(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        for p in POSES[:3]:
            await lm.step_session(sid, p)
        old = lm.pool.hosts["cpu0"]
        lm.pool.hosts["cpu0"] = DeviceHost(old.name, old.kind, index=old.index)
        data = await lm.step_session(sid, POSES[3])
        assert data["resumed"] and data["step"] == 3 and data["replaced_segments"] == []
        assert list(_output(sid, data).unusable) == []
        await lm.close_session(sid)

    _run(tmp_path, body)


def test_a_step_whose_model_raises_ends_the_stream_internal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = WorldSessions.step
    calls = [0]

    def step(self: WorldSessions, sid: str, pose: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, sid, pose)

    monkeypatch.setattr(WorldSessions, "step", step)

    async def body(lm: LiveManager) -> None:
        ctx = HeldAfter(ok=100)  # (every output goes out)
        start = pb.WorldInput(start=pb.WorldStart(model="world"))
        with pytest.raises(Aborted):
            await WorldSessionServicer(lm)._run(_inputs(start, _pose(0), _pose(1), _pose(2)), ctx)
        assert [o.segment for o in ctx.written] == [-1, 0]
        ((code, details),) = ctx.aborted
        assert code == grpc.StatusCode.INTERNAL, details  # was UNAVAILABLE
        assert "illegal memory access" in details and "resume it" in details

    _run(tmp_path, body)


def test_the_error_of_a_host_that_failed_an_open_is_internal(tmp_path: Path) -> None:
    async def body(lm: LiveManager) -> None:
        real = lm.pool.session

        def fails(device: str, op: str, *args: Any) -> Any:
            if op == "open":
                return P.SessionReply(False, error_code=P.INTERNAL, error="RuntimeError('boom')")
            return real(device, op, *args)

        lm.pool.session = fails  # type: ignore[method-assign]
        with pytest.raises(ModelFailed, match="could not open: RuntimeError"):
            await lm.open_session("world")

    _run(tmp_path, body)


def test_an_unknown_codec_is_refused_before_the_world_model_is_loaded(tmp_path: Path) -> None:
    assert P.SESSION_CODECS == CODECS  # the manager's list is WorldPager's

    async def body(lm: LiveManager) -> None:
        m = lm.engine.models["world"]
        tier = m.tier
        events = lm.subscribe()
        with pytest.raises(InvalidRequest, match="unknown codec 'int3': expected one of bf16, int8, int4"):
            await lm.open_session("world", codec="int3")
        assert m.tier == tier and lm.cold_starts == 0 and lm.failed == 0 and lm.rejected == 0
        kinds = []
        while not events.empty():
            kinds.append(events.get_nowait()["kind"])
        assert "load" not in kinds, kinds
        sid, opened = await lm.open_session("world", codec="int8")  # a known codec still opens
        assert opened["codec"] == "int8"
        await lm.close_session(sid)

    # the world model not prewarmed: a session's open would load it
    _run(tmp_path, body, patch=("source: {preset: micro}}", "source: {preset: micro}, prewarm: false}"))


def test_a_resume_refused_on_a_full_disk_does_not_name_the_servers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(lm: LiveManager) -> None:
        sid, _ = await lm.open_session("world")
        for p in POSES[:3]:
            await lm.step_session(sid, p)
        lm.unsent(sid, 2)  # segment 2 never reached its client: a resume rolls back to it
        await lm.close_session(sid)
        real = st.save_state

        def full(*a: Any, **k: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(a[0]) / "session.json.tmp"))

        monkeypatch.setattr(st, "save_state", full)
        with pytest.raises(Exception) as raised:
            await lm.open_session("world", resume_id=sid, codec="")
        monkeypatch.setattr(st, "save_state", real)
        said = details_of(raised.value)
        assert str(lm.session_dir) not in said and str(tmp_path) not in said, said
        assert "disk full: cannot save the roll-back to step 2" in said, said
        assert status_of(raised.value) == grpc.StatusCode.UNAVAILABLE

    _run(tmp_path, body)
