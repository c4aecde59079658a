"""Review 20: a world session admitted (its model loaded, its wait over) whose open then failed on its
device host (the host refused it, or a resume found nothing saved under its id) was counted nowhere:
not in Stats' `errors`, not in `residency_requests_total`, while an inference that fails after
admission counts as an `error` in both. Such an open now counts as a request that failed (`errors`,
outcome `error`); a refusal before admission (one session at a time) still counts as neither.

The manager over the in-process pool (real device hosts), as in test_review19_metrics_sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_review19_metrics_sessions import POSE, _run, samples

from manager.api.admin import AdminServicer
from manager.errors import ModelFailed, ModelNotFound
from manager.live import LiveManager
from residency_proto.v1 import residency_pb2 as rpb
from workers import protocol as P

ERROR = (("cls", "interactive"), ("model", "world"), ("outcome", "error"))
OK = (("cls", "interactive"), ("model", "world"), ("outcome", "ok"))


def test_a_resume_of_nothing_saved_counts_as_a_failed_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(lm: LiveManager) -> None:
        with pytest.raises(ModelNotFound, match="no saved world session"):
            await lm.open_session("world", resume_id="0123456789ab", codec="")
        stats = await AdminServicer(lm).Stats(rpb.StatsRequest(), None)
        assert stats.errors == 1 and stats.requests == 0 and stats.rejected == 0
        assert samples(lm, "residency_requests_total") == {ERROR: 1.0}
        # the model is idle again: a new session opens, and counts as served once it ends
        sid, _ = await lm.open_session("world")
        await lm.step_session(sid, POSE)
        await lm.close_session(sid)
        assert samples(lm, "residency_requests_total") == {ERROR: 1.0, OK: 1.0}
        stats = await AdminServicer(lm).Stats(rpb.StatsRequest(), None)
        assert (stats.requests, stats.errors) == (1, 1)

    _run(tmp_path, monkeypatch, body)


def test_an_open_its_host_refuses_counts_as_a_failed_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(lm: LiveManager) -> None:
        real = lm.pool.session

        def refuses_opens(device: str, op: str, *args: Any) -> P.SessionReply:
            if op == "open":
                return P.SessionReply(False, error_code=P.INTERNAL, error="out of host memory")
            reply: P.SessionReply = real(device, op, *args)
            return reply

        monkeypatch.setattr(lm.pool, "session", refuses_opens)
        with pytest.raises(ModelFailed, match="could not open: out of host memory"):
            await lm.open_session("world")
        assert samples(lm, "residency_requests_total") == {ERROR: 1.0}
        assert lm.failed == 1 and lm.served == 0
        # (its wait was not counted as a served request's)
        assert samples(lm, "residency_request_wait_seconds_count") == {}

    _run(tmp_path, monkeypatch, body)
