"""Found in review of the device host, its data channel and its world sessions; each failed before its fix.

Fakes here (a slow adapter, a memory probe that reads nothing, a lock that lets a close or a drop run
first) are unit-test stand-ins; the real adapters, probes and locks are in `workers`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from workers import protocol as P
from workers.adapters import Adapter, HostCopy, make_adapter
from workers.channel import MAX_FRAME, ChannelAddress, ChannelClient, ChannelError, ChannelServer, boot_id
from workers.host import DeviceHost
from workers.measure import Phases
from workers.st_io import write_safetensors
from workers.world import WorldSessions

WORLD = P.ModelSpec("world", "worldpager-mg2", {"preset": "tiny"})


class _Slow(Adapter):
    """Fake adapter (unit tests only): loads at once; `infer` waits for `gate` and logs when it ran."""

    name = "slow"

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.gate = threading.Event()
        self.gate.set()
        self.ran: list[float] = []
        self.entered = threading.Event()

    def inputs(self) -> list[P.TensorSpec]:
        return []

    def outputs(self) -> list[P.TensorSpec]:
        return []

    def read(self, ph: Phases) -> HostCopy:
        return HostCopy()

    def materialize(self, host: HostCopy, ph: Phases) -> Any:
        return {"weights": "on the device"}

    def to_host(self, runnable: Any, ph: Phases) -> HostCopy:
        return HostCopy()

    def runnable_bytes(self, runnable: Any) -> int:
        return 0

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.gate.wait(10)
        self.ran.append(time.monotonic())
        return {"y": np.zeros(1, np.float32)}


class _NoProbe:
    """Fake memory probe (unit tests only; real: CpuProbe/CudaProbe) that reads nothing."""

    def used(self) -> int:
        return 0

    def free_total(self) -> tuple[int | None, int | None]:
        return None, None

    def release(self) -> None:
        pass


class _OtherFirst:
    """Fake lock (unit tests only): wraps a real one; its first taker runs `first` in another thread,
    to its end, before it takes the lock: the interleaving of a call that looked a model (or session)
    up, then waited while a drop (or close) ran."""

    def __init__(self, lock: Any, first: Callable[[], object]) -> None:
        self.lock, self.first = lock, first

    def __enter__(self) -> _OtherFirst:
        first, self.first = self.first, None
        if first is not None:
            t = threading.Thread(target=first)
            t.start()
            t.join(30)
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _slow_host() -> tuple[DeviceHost, list[_Slow]]:
    made: list[_Slow] = []

    def factory(spec: P.ModelSpec, device: torch.device) -> Adapter:
        made.append(_Slow(spec, device))
        return made[-1]

    host = DeviceHost("cpu0", "cpu", node="t", probe=_NoProbe(), adapter_factory=factory)
    assert host.apply(P.Load(P.ModelSpec("m", "slow")), "load").ok
    return host, made


@pytest.mark.parametrize("cmd", [P.Drop("m"), P.Demote("m")])
def test_a_request_that_waited_behind_a_drop_or_demote_is_refused_not_run(cmd: P.Command) -> None:
    """It looked the model up, then waited for the model's lock while the drop ran: it then ran on the
    module the host had already reported gone (on CUDA, memory the manager gives to the next load)."""
    host, made = _slow_host()
    got: dict[str, P.CommandResult] = {}
    r = host.models["m"]
    r.lock = _OtherFirst(r.lock, lambda: got.setdefault("cmd", host.apply(cmd, "op")))  # type: ignore[assignment]
    res = host.infer("m", {})
    assert got["cmd"].ok
    assert not res.ok and res.error_code == P.BAD_TRANSITION and "left the gpu tier" in (res.error or "")
    assert made[0].ran == []  # the adapter never ran on it


@pytest.mark.parametrize("cmd", [P.Drop("m"), P.Demote("m")])
def test_a_drop_or_demote_waits_for_the_running_inference(cmd: P.Command) -> None:
    host, made = _slow_host()
    made[0].gate.clear()
    infer = threading.Thread(target=host.infer, args=("m", {}))
    infer.start()
    assert made[0].entered.wait(10)
    done: list[float] = []
    command = threading.Thread(target=lambda: done.append((host.apply(cmd, "op"), time.monotonic())[1]))
    command.start()
    command.join(0.3)
    assert command.is_alive()  # still waiting for the inference, which holds the weights
    made[0].gate.set()
    infer.join(10)
    command.join(10)
    assert len(made[0].ran) == 1 and done and done[0] >= made[0].ran[0]


def test_a_failed_reload_under_a_changed_spec_says_the_model_is_gone(tmp_path: Path) -> None:
    """The old weights are dropped before the new ones load; when that load failed, the result said
    gpu->gpu (the manager kept counting the model on the device) while the host held nothing."""
    ck = tmp_path / "one.safetensors"
    write_safetensors({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, ck)
    kw = {"in_features": 2, "out_features": 2}
    spec = P.ModelSpec(
        "m", "safetensors-module", {"factory": "torch.nn:Linear", "path": str(ck), "kwargs": kw}
    )
    host = DeviceHost("cpu0", "cpu", node="t")
    assert host.apply(P.Load(spec), "1").ok
    r = host.apply(P.Load(replace(spec, source={**spec.source, "path": str(tmp_path / "none")})), "2")
    assert not r.ok and r.error_code == P.MISSING_CHECKPOINT
    assert r.transition == "gpu->disk" and host.status().models == {}


def test_a_failed_command_that_kept_the_model_says_where_it_is() -> None:
    host, _ = _slow_host()
    r = host.apply(P.Promote("ghost"), "1")
    assert not r.ok and r.transition == "disk->disk"
    failing = _Slow(P.ModelSpec("m", "slow"), torch.device("cpu"))
    failing.to_host = lambda runnable, ph: (_ for _ in ()).throw(RuntimeError("copy failed"))  # type: ignore[method-assign]
    host.models["m"].adapter = failing
    r = host.apply(P.Demote("m"), "2")
    assert not r.ok and r.error_code == P.INTERNAL and r.transition == "gpu->gpu"
    assert host.status().models["m"].tier == "gpu" and host.infer("m", {}).ok


def test_a_frame_length_alone_allocates_nothing_like_it() -> None:
    """A 4-byte header announcing ~1 GiB made the host allocate (and zero) all of it at once, per
    connection, before one byte of the body came."""

    class NoHost:
        def infer_many(self, items: Any) -> list[P.InferResult]:
            return []

    server = ChannelServer(NoHost(), "review-hostile")
    tracemalloc.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(server.path)
            s.sendall(struct.pack(">I", MAX_FRAME) + b"x" * 1000)
            s.shutdown(socket.SHUT_WR)  # the body never comes
            assert s.recv(1) == b""  # the server closed it
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert peak < 64 * 2**20


def test_frames_of_several_pieces_still_round_trip() -> None:
    class Echo:
        def infer_many(self, items: Any) -> list[P.InferResult]:
            return [P.InferResult(m, True, outputs={"x": P.encode_output(x["x"])}) for m, x in items]

    server = ChannelServer(Echo(), "review-big")
    big = np.arange(3 * 2**20 + 7, dtype=np.float32)  # 12 MiB: several read pieces each way

    async def main() -> list[P.InferResult]:
        client = ChannelClient(server.address)
        try:
            return await client.infer_many([("m", {"x": big})])
        finally:
            client.close()

    try:
        (res,) = asyncio.run(main())
    finally:
        server.close()
    np.testing.assert_array_equal(P.output_array(res.outputs["x"]), big)


def test_a_reply_length_alone_allocates_nothing_like_it() -> None:
    path = os.path.join(tempfile.mkdtemp(), "h.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def bad_host() -> None:
        conn, _ = listener.accept()
        with conn:
            (n,) = struct.unpack(">I", conn.recv(4))
            while n > 0:
                n -= len(conn.recv(min(n, 1 << 16)))
            conn.sendall(struct.pack(">I", MAX_FRAME) + b"x" * 10)

    t = threading.Thread(target=bad_host)
    t.start()

    async def main() -> None:
        client = ChannelClient(ChannelAddress(path, boot_id(), 1))
        with pytest.raises(ChannelError):
            await client.infer_many([("m", {})])

    tracemalloc.start()
    try:
        asyncio.run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        t.join(10)
        listener.close()
    assert peak < 64 * 2**20


def _world_module() -> Any:
    a = make_adapter(WORLD, torch.device("cpu"))
    return a.materialize(a.read(Phases()), Phases())


def _wp_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("wp-")}


def test_a_small_lease_on_a_gpu_is_raised_to_the_floor_not_refused(tmp_path: Path) -> None:
    """Off the CPU the lease is the GPU buffers' budget, which needs one decoded segment per buffer;
    the floor was three stored segments, less than that (bf16 on the tiny preset, int8/int4 on MG2),
    so the open failed. A "meta" device takes the same non-CPU path as CUDA here."""
    from worldpager.layout import SegmentLayout

    module = _world_module()
    ws = WorldSessions(torch.device("meta"))
    got = ws.open("world", module, "s1", 1 << 20, tmp_path / "s1", "bf16")
    try:
        decoded = SegmentLayout.from_config(module.cfg, "bf16", module.head.weight.dtype).decoded_nbytes
        assert got["lease_bytes"] >= 2 * decoded
        assert ws.resize("s1", 1) == got["lease_bytes"]  # the same floor on a resize
    finally:
        ws.close("s1")


def test_a_session_whose_lease_fails_at_open_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session was built (transfer threads, an open log) before its GPU lease was set; when that
    failed, nothing closed it: two threads and a file descriptor per failed open."""
    import worldpager.session as wss

    def refuse(self: Any, **kw: Any) -> None:
        raise ValueError("lease refused")

    module = _world_module()
    before = _wp_threads()
    monkeypatch.setattr(wss.Session, "resize_lease", refuse)
    ws = WorldSessions(torch.device("meta"))
    with pytest.raises(ValueError, match="lease refused"):
        ws.open("world", module, "s1", 64 << 20, tmp_path / "s1", "bf16")
    deadline = time.monotonic() + 10
    while _wp_threads() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ws.open_sessions == {} and _wp_threads() - before == set()


@pytest.mark.parametrize("call", ["step", "resize"])
def test_a_call_that_waited_behind_a_close_says_no_session(tmp_path: Path, call: str) -> None:
    """It looked the session up, then waited for its lock while a close (or a drop of the model) ran:
    the step then ran on the closed session (an internal error and a logged traceback) and a resize
    said ok on it."""
    host = DeviceHost("cpu0", "cpu", node="t")
    assert host.apply(P.Load(WORLD), "1").ok
    assert host.session_open("world", "s1", 64 << 20, "bf16", str(tmp_path / "s1")).ok
    o = host.world.open_sessions["s1"]
    closed: dict[str, P.SessionReply] = {}
    o.lock = _OtherFirst(o.lock, lambda: closed.setdefault("r", host.session_close("s1")))  # type: ignore[assignment]
    reply = (
        host.session_step("s1", (0.0, 0.0, 0.0, 0.0, 0.0))
        if call == "step"
        else host.session_resize("s1", 128 << 20)
    )
    assert closed["r"].ok and closed["r"].data["closed"] is True
    assert not reply.ok and reply.error_code == P.NO_SESSION, reply.error
