"""Review 27: `residency preload` waited 150 s for the confirmed load whatever the model, while the
README said it waited as long as the load takes: a big model's cold load from disk ended
DEADLINE_EXCEEDED (exit 1; the load went on). `--timeout DURATION` now says how long it waits."""

from __future__ import annotations

from typing import Any

import pytest

import manager.cli as cli
from manager.api.client import PRELOAD_TIMEOUT_S
from residency_proto.v1 import residency_pb2 as pb


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    seen: list[float | None] = []

    def admin(a: Any, method: str, request: Any, timeout_s: float | None = None) -> Any:
        assert method == "Preload" and request.name == "llm"
        seen.append(timeout_s)
        return pb.ModelStatus(name="llm", tier="gpu", device="gpu0")

    monkeypatch.setattr(cli, "_admin", admin)
    return seen


@pytest.mark.parametrize(("flag", "seconds"), [([], PRELOAD_TIMEOUT_S), (["--timeout", "10m"], 600.0)])
def test_preload_waits_as_long_as_it_is_told(
    waits: list[float | None], capsys: pytest.CaptureFixture[str], flag: list[str], seconds: float
) -> None:
    assert cli.main(["preload", "llm", *flag]) == 0
    assert waits == [seconds]
    assert capsys.readouterr().out == "llm: preloaded to gpu (now gpu on gpu0)\n"


@pytest.mark.parametrize("bad", ["0", "-5", "abc", "2d", "inf"])
def test_a_wait_that_is_no_duration_or_over_a_day_is_refused_before_the_call(
    waits: list[float | None], capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert cli.main(["preload", "llm", "--timeout", bad]) == 2
    assert waits == [] and f"--timeout {bad!r}" in capsys.readouterr().err
