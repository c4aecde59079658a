"""World-model sessions on a device host: WorldPager's tiered KV runtime around the resident MG2 stand-in.

Order of use: `open(model_name, module, session_id, kv_bytes, log_dir, codec)` once the model is in
the gpu tier; `step(session_id, pose)` per segment (returns the segment's latents and its stall and tier
figures as plain data); `resize(session_id, kv_bytes)` whenever the manager changes the model's elastic
lease; `close(session_id)`. On the CPU stand-in the lease is the session's host KV budget (its "device"
memory is RAM); on CUDA it is the GPU retrieval budget. A lease below what the runtime needs to keep
working (three segments) is raised to that floor, and the result says so. One lock per session: a
resize may arrive from the manager while a step runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MIN_SEGMENTS = 3


@dataclass
class _Open:
    session: Any
    model: str
    segment_bytes: int
    kind: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    lease: int = 0


class WorldSessions:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.open_sessions: dict[str, _Open] = {}

    def _floor(self, o: _Open, kv_bytes: int) -> int:
        return max(int(kv_bytes), MIN_SEGMENTS * o.segment_bytes)

    def open(
        self, model: str, module: Any, session_id: str, kv_bytes: int, log_dir: Path, codec: str = "bf16"
    ) -> dict[str, Any]:
        from worldpager.layout import SegmentLayout
        from worldpager.session import Session

        if session_id in self.open_sessions:
            raise ValueError(f"session {session_id!r} is already open")
        seg = SegmentLayout.from_config(module.cfg, codec, module.head.weight.dtype).payload_nbytes
        kind = self.device.type
        host = max(int(kv_bytes), MIN_SEGMENTS * seg) if kind == "cpu" else 64 * seg
        session = Session(
            module,
            codec=codec,
            host_budget_bytes=host,
            log_dir=log_dir,
            device=self.device,
            keep_outputs=True,
        )
        o = _Open(session, model, seg, kind, lease=host)
        if kind != "cpu":
            session.resize_lease(gpu_budget_bytes=self._floor(o, kv_bytes))
            o.lease = self._floor(o, kv_bytes)
        self.open_sessions[session_id] = o
        return {"session_id": session_id, "segment_bytes": seg, "lease_bytes": o.lease, "codec": codec}

    def get(self, session_id: str) -> _Open:
        if session_id not in self.open_sessions:
            raise KeyError(f"no open world session {session_id!r}")
        return self.open_sessions[session_id]

    def step(self, session_id: str, pose: tuple[float, float, float, float, float]) -> dict[str, Any]:
        from worldpager.retrieval import Pose

        o = self.get(session_id)
        with o.lock:
            rec = o.session.step(Pose(*pose))
            outs = o.session.outputs
            latents = outs.pop() if outs else torch.empty(0)
            outs.clear()
        lat = latents.detach().float().cpu().contiguous()
        return {
            "step": rec.step, "stall_s": rec.stall_s, "compute_s": rec.compute_s, "hits": rec.hits,
            "misses": rec.misses, "bytes_read": rec.bytes_read, "bytes_written": rec.bytes_written,
            "host_bytes": rec.host_bytes, "max_position": rec.max_position, "lease_bytes": o.lease,
            "latents": lat.numpy().tobytes(), "shape": tuple(lat.shape),
        }  # fmt: skip

    def resize(self, session_id: str, kv_bytes: int) -> int:
        """Apply a new lease; returns the lease in force (the floor when asked for less)."""
        o = self.get(session_id)
        lease = self._floor(o, kv_bytes)
        with o.lock:
            if o.kind == "cpu":
                o.session.resize_lease(host_budget_bytes=lease)
            else:
                o.session.resize_lease(gpu_budget_bytes=lease)
            o.lease = lease
        return lease

    def close(self, session_id: str) -> dict[str, Any]:
        o = self.open_sessions.pop(session_id, None)
        if o is None:
            return {"session_id": session_id, "closed": False}
        with o.lock:
            o.session.close()
            return {"session_id": session_id, "closed": True, "segments": o.session.step_index}

    def close_model(self, model: str) -> list[str]:
        """Close every session of `model` (before its weights leave the gpu tier)."""
        ids = [sid for sid, o in self.open_sessions.items() if o.model == model]
        for sid in ids:
            self.close(sid)
        return ids
