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


# ---- the worldpager CLI ---------------------------------------------------------------------------


def test_an_interrupt_while_torch_is_still_imported_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C or SIGTERM in a run's first seconds (torch half imported) failed importing the session
    module again inside the interrupt's handler: a traceback and exit 1. Here torch cannot be
    imported at all, as a half-imported one could not."""
    import sys

    from worldpager import cli

    class Interrupted:
        def parse_args(self, argv: Any) -> Any:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", lambda: Interrupted())
    for name in ("worldpager.session", "worldpager.session_store"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # (an import of it raises)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "worldpager: interrupted (SIGINT)\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["session", "--preset", "micro", "--segments", "1", "--log-dir", "/tmp/" + "a" * 300],
        ["bench-stall", "--plot", "/tmp/" + "a" * 300 + ".png"],
        ["bench-stall", "--plot", ""],
    ],
    ids=["log-dir-too-long", "plot-too-long", "plot-empty"],
)
def test_a_path_the_file_system_refuses_or_an_empty_plot_is_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A name over 255 bytes was a traceback (Path.exists raised); `--plot ''` was no plot, exit 0."""
    from worldpager.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"worldpager: {argv[-2]} ") and err.count("\n") == 1
    assert "name too long" in err or "is empty" in err
