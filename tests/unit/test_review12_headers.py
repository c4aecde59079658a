"""Found in the review of 2026-12-04: the header lines `residency measure --write-config` and
`residency tune` put atop a config they write."""

from __future__ import annotations

from pathlib import Path

from manager.config import write_config_with_updates

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"
MEASURED = "load_seconds and memory measured by `residency measure --config {}`"


def test_a_config_measured_again_gets_one_measure_line_and_keeps_its_tuning_line(tmp_path: Path) -> None:
    """A config measured again stacked one more "measured by" line each time; and measuring a tuned
    config took its "Tuned by" line away (only tuning lines were recognised, and any header replaced
    them)."""
    tuned, m1, m2, t2 = (tmp_path / f"{n}.yaml" for n in ("tuned", "m1", "m2", "t2"))
    write_config_with_updates(
        HOME, tuned, {"image": {"keep_alive": "45m"}}, None, "Tuned by `residency tune` A"
    )
    write_config_with_updates(tuned, m1, {"llm": {"memory": "9GiB"}}, None, MEASURED.format(tuned))
    write_config_with_updates(m1, m2, {"llm": {"memory": "9GiB"}}, None, MEASURED.format(m1))
    head = m2.read_text(encoding="utf-8").splitlines()[:3]
    assert head == [
        f"# {MEASURED.format(m1)}",
        "# Tuned by `residency tune` A",
        HOME.read_text().splitlines()[0],
    ]
    write_config_with_updates(m2, t2, {"image": {"keep_alive": "1h"}}, None, "Tuned by `residency tune` B")
    head = t2.read_text(encoding="utf-8").splitlines()[:3]
    assert head == [
        "# Tuned by `residency tune` B",
        f"# {MEASURED.format(m1)}",
        HOME.read_text().splitlines()[0],
    ]
