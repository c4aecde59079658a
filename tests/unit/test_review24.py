"""Found in the 24th review (a read of the README's service section against the code); each test
failed before its fix."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from manager.api.runtime import LOAD_WAIT_S
from manager.api.world import WorldSessionServicer
from manager.errors import InvalidRequest
from residency_proto.v1 import residency_pb2 as pb


class Context:
    """A world stream's servicer context with a deadline `left` seconds away (None: none)."""

    def __init__(self, left: float | None) -> None:
        self.left = left
        self.aborted: list[tuple[Any, str]] = []

    def time_remaining(self) -> float | None:
        return self.left

    async def abort(self, code: Any, details: str) -> None:
        self.aborted.append((code, details))


async def _start() -> AsyncIterator[pb.WorldInput]:
    yield pb.WorldInput(start=pb.WorldStart(model="world"))


@pytest.mark.parametrize(("left", "waits"), [(None, LOAD_WAIT_S), (600.0, 599.0), (5.0, 4.5)])
def test_a_world_sessions_open_waits_as_long_as_the_calls_deadline_lets_it(
    left: float | None, waits: float
) -> None:
    """Its admission and cold load waited 60 s at most, whatever deadline the client set (none: a
    world model that waited for room, or loaded slowly, was DEADLINE_EXCEEDED to a client that set
    no deadline), as ModelInfer's did before its fix."""
    asked: list[float] = []

    async def open_session(model: str, **kw: Any) -> Any:
        asked.append(kw["timeout_s"])
        raise InvalidRequest("(enough: the open was asked)")

    async def main() -> Context:
        manager = SimpleNamespace(open_session=open_session, sessions={})
        context = Context(left)
        await WorldSessionServicer(manager)._run(_start(), context)  # type: ignore[arg-type]
        return context

    context = asyncio.run(main())
    assert asked == [pytest.approx(waits)]
    assert "(enough" in context.aborted[0][1]
