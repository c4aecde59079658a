"""Review 14 of the configuration as a user writes it: each test is a bug found and fixed (see its
docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager.cli import main
from manager.config import ConfigError, load_config

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"


def _home_with(tmp_path: Path, old: str, new: str) -> Path:
    text = HOME.read_text()
    assert old in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    ("old", "new", "field", "said"),
    [
        ("name: image", "name: 2026-12-05", "models[4].name", "the date 2026-12-05"),
        (
            "keep_alive: auto             # bursts",
            "keep_alive: 2026-12-05 12:00:00  # bursts",
            "models[4].keep_alive",
            "the date-time 2026-12-05 12:00:00",
        ),
        ("memory: 7GiB", "memory: 2026-12-05", "models[4].memory", "the date 2026-12-05"),
    ],
)
def test_an_unquoted_date_is_named_as_one_with_the_fix(
    tmp_path: Path, old: str, new: str, field: str, said: str
) -> None:
    """YAML reads an unquoted `2026-12-05` as a date. A string field said 'expected a valid string,
    got a value', and a duration field quoted Python's `datetime.datetime(2026, 12, 5, 12, 0)`:
    neither says what the user wrote, nor that quotes fix it."""
    path = _home_with(tmp_path, old, new)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = str(e.value)
    assert f"{field}: " in text
    assert f"got {said} (YAML reads it unquoted as one: put it in quotes)" in text
    assert "datetime." not in text and "got a value" not in text


def test_config_check_prints_the_date_message_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _home_with(tmp_path, "name: image", "name: 2026-12-05")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models[4].name: expected a valid string, got the date 2026-12-05" in err
    assert "Traceback" not in err


def test_a_repeated_duration_unit_is_refused_in_a_config(tmp_path: Path) -> None:
    """`min_residency: 1m1m` was read as 2 minutes (a typo most likely); now refused, saying how."""
    path = _home_with(tmp_path, "min_residency: 1m ", "min_residency: 1m1m ")
    with pytest.raises(ConfigError, match=r"policy\.min_residency: .*each unit once, largest first"):
        load_config(path)
