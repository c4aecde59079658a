"""Found in the 29th review (the documents against the code): `tuning.since: 0` passed `config check`
(every scheduled tuning would have tuned on nothing), unlike its sibling durations; and `worldpager
bench-stall --plot NAME` wrote `NAME.png` but said so only in `--json`, where the README says it is
said. Each test failed before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_review16_config import BASE, _errors, _schema_valid, _write

from worldpager.cli import main as worldpager_main


@pytest.mark.parametrize("value", ["0", "'0s'", "'0d'"])
def test_a_zero_tuning_window_is_refused_in_words_and_by_the_schema(tmp_path: Path, value: str) -> None:
    msg = _errors(_write(tmp_path, f"tuning: {{schedule: weekly, since: {value}}}\n" + BASE))
    assert "tuning.since: expected a duration above 0, like '7d'" in msg, msg
    data: dict[str, Any] = {
        "tuning": {"since": 0},
        "devices": [{"name": "g", "kind": "cuda", "memory": "24GiB"}],
        "host": {"memory": "32GiB"},
        "classes": [{"name": "c"}],
        "models": [],
    }
    assert not _schema_valid(data)
    for ok in ("7d", 86400):
        assert _schema_valid({**data, "tuning": {"since": ok}})


def test_a_plot_is_said_after_the_text_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert worldpager_main(["bench-stall", "--quick", "--plot", str(tmp_path / "stalls")]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == f"plot: {tmp_path / 'stalls.png'}"
    assert (tmp_path / "stalls.png").read_bytes().startswith(b"\x89PNG")
