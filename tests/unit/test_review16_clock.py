"""Review 16: the live service's clock (`manager.clock.SteadyWallClock`, the LiveManager's default).
It was `time.time`: a step back of the system clock (NTP correcting a clock that ran ahead) made the
service's times go back, so a request's deadline was put off by the step and reuse intervals came
out negative. The wall and monotonic clocks here are lists the tests move (stand-ins for the system's
clocks); one test drives a real LiveManager's request deadline through such a step."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from live_helpers import TEXT, lru_config

from manager.clock import SteadyWallClock
from manager.errors import DeadlineExceeded
from manager.live import LiveManager
from manager.workers_bridge import create_pool
from workers import protocol as P

T0 = 1_800_000_000.0


def _clocks() -> tuple[list[float], list[float], SteadyWallClock]:
    wall, mono = [T0], [50.0]
    return wall, mono, SteadyWallClock(lambda: wall[0], lambda: mono[0])


def _advance(wall: list[float], mono: list[float], s: float) -> None:
    wall[0] += s
    mono[0] += s


def test_it_is_wall_time_and_does_not_follow_a_step_back(caplog: pytest.LogCaptureFixture) -> None:
    wall, mono, clock = _clocks()
    assert clock() == T0
    _advance(wall, mono, 10.0)
    assert clock() == T0 + 10.0
    with caplog.at_level(logging.WARNING, logger="manager.clock"):
        wall[0] -= 3600.0  # NTP steps the system clock back an hour
        assert clock() == T0 + 10.0
        _advance(wall, mono, 5.0)
        assert clock() == T0 + 15.0  # it runs on from where it was
        assert clock() == T0 + 15.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "stepped back by 3600.0 s" in said[0], said  # once, with its size
    assert clock.behind_s == pytest.approx(3600.0)


def test_a_step_forward_is_followed() -> None:
    """A home server without a real-time clock boots with a wrong time that NTP then corrects: the
    statistics by hour of week need the right time."""
    wall, mono, clock = _clocks()
    wall[0] += 86400.0
    assert clock() == T0 + 86400.0
    _advance(wall, mono, 1.0)
    assert clock() == T0 + 86401.0


def test_small_differences_are_not_steps() -> None:
    wall, _, clock = _clocks()
    wall[0] += 0.5
    assert clock() == T0
    wall[0] -= 1.0
    assert clock() == T0 and clock.behind_s == 0.0


def test_a_request_deadline_is_not_put_off_by_a_step_back(tmp_path: Path) -> None:
    """A request whose model's load does not end: its 1 s deadline expires about 1 s after it came,
    though the system clock steps back an hour while it waits. Before (a `time.time` clock), the
    deadline moved with the clock: the request would have waited the hour (here: the test's limit)."""
    config = lru_config(tmp_path)
    step = [0.0]
    clock = SteadyWallClock(lambda: time.time() - step[0], time.monotonic)
    gate, loading = threading.Event(), threading.Event()

    async def main() -> tuple[float, BaseException | None]:
        pool = create_pool(config, in_process=True)
        for host in pool.hosts.values():  # the embedding model's load holds until the gate opens

            def apply(cmd: P.Command, op_id: str, real: Any = host.apply) -> P.CommandResult:
                if isinstance(cmd, P.Load) and cmd.model.name == "embed":
                    loading.set()
                    gate.wait(60.0)
                result: P.CommandResult = real(cmd, op_id)
                return result

            host.apply = apply
        lm = LiveManager(config, pool, clock=clock)
        await lm.start()
        try:
            asked = time.monotonic()
            call = asyncio.ensure_future(lm.infer("embed", TEXT, timeout_s=1.0))
            while not loading.is_set():
                await asyncio.sleep(0.01)
            step[0] = 3600.0  # the system clock steps back while the request waits
            try:
                await asyncio.wait_for(call, 20.0)
                error: BaseException | None = None
            except (DeadlineExceeded, TimeoutError) as e:
                error = e
            return time.monotonic() - asked, error
        finally:
            gate.set()
            await lm.stop()
            pool.close()

    took, error = asyncio.run(main())
    assert isinstance(error, DeadlineExceeded), error  # not the test's own 20 s limit
    assert took < 5.0, took
