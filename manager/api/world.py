"""`residency.v1.WorldSession`: a bidirectional stream driving a WorldPager session on the world
model's device host. First message: `start`; then one `action` (camera pose) per segment; the session
closes when the client ends its stream (or the call is cancelled)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from manager.api.errors import status_of
from manager.errors import InvalidRequest, ResidencyError
from manager.live import LiveManager
from residency_proto.v1 import residency_pb2 as pb
from residency_proto.v1 import residency_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def _output(sid: str, d: dict[str, Any]) -> pb.WorldOutput:
    return pb.WorldOutput(
        session_id=sid, segment=int(d["step"]), latents=d["latents"], shape=list(d["shape"]),
        stall_s=float(d["stall_s"]), compute_s=float(d["compute_s"]), lease_bytes=int(d["lease_bytes"]),
        host_bytes=int(d["host_bytes"]), hits=int(d["hits"]), misses=int(d["misses"]),
        bytes_read=int(d["bytes_read"]), bytes_written=int(d["bytes_written"]),
        max_position=int(d["max_position"]),
    )  # fmt: skip


class WorldSessionServicer(pb_grpc.WorldSessionServicer):
    def __init__(self, manager: LiveManager) -> None:
        self.manager = manager

    async def Run(
        self, request_iterator: AsyncIterator[pb.WorldInput], context: Any
    ) -> AsyncIterator[pb.WorldOutput]:
        sid: str | None = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("msg") != "start":
                raise InvalidRequest("the first message of a world session must be `start` (with the model)")
            st = first.start
            sid, opened = await self.manager.open_session(
                st.model, cls=st.class_name or None, codec=st.codec or "bf16"
            )
            yield pb.WorldOutput(session_id=sid, segment=-1, lease_bytes=int(opened["lease_bytes"]))
            async for msg in request_iterator:
                if msg.WhichOneof("msg") != "action":
                    raise InvalidRequest("after `start`, a world session takes only `action` messages")
                a = msg.action
                data = await self.manager.step_session(sid, (a.x, a.y, a.z, a.pitch, a.yaw))
                yield _output(sid, data)
        except ResidencyError as e:
            await context.abort(status_of(e), str(e))
        except Exception:
            logger.exception("world session failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, "world session: internal error (see the server log)"
            )
        finally:
            if sid is not None and sid in self.manager.sessions:
                await self.manager.close_session(sid)
