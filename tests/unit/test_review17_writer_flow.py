"""Review 17: a field `residency tune` set in a flow-style model entry (`- {name: llm, ...}`), then
tuned back to its default where the person had never set it, stayed as `keep_alive: auto  # residency
tune: llm.keep_alive was unset`, though the README says such a field goes (a block-style entry lost
its line already). The field is now cut from the flow mapping, and the file is the person's again."""

from __future__ import annotations

from pathlib import Path

from manager.config import load_config, write_config_with_updates

_ENTRY = "  - {{name: {}, class: {}, adapter: silero-vad, device: cpu0, memory: 1GiB, {}}}\n"
CONFIG = (
    "devices: [{name: cpu0, kind: cpu, memory: 8GiB, reserve: 512MiB}]\n"
    "host: {memory: 8GiB, reserve: 1GiB}\n"
    "classes: [{name: realtime}, {name: interactive}]\n"
    "models:\n"
    + _ENTRY.format("voice", "realtime", "load_seconds: {disk: 1.0, host: 0.2}")
    + _ENTRY.format("llm", "interactive", "load_seconds: {disk: 2.0, host: 0.4}")
)


def test_a_flow_style_field_tuned_back_to_its_default_goes(tmp_path: Path) -> None:
    src = tmp_path / "c.yaml"
    src.write_text(CONFIG)
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"llm": {"keep_alive": "4h"}}, note_changes=True)
    text = once.read_text()
    assert "keep_alive: 4h" in text and "llm.keep_alive was unset" in text
    cfg = write_config_with_updates(once, twice, {"llm": {"keep_alive": "auto"}}, note_changes=True)
    assert twice.read_text() == CONFIG  # the person's file again
    assert cfg.model("llm").keep_alive == load_config(src).model("llm").keep_alive


def test_a_flow_style_field_tuned_to_another_value_keeps_its_note(tmp_path: Path) -> None:
    src = tmp_path / "c.yaml"
    src.write_text(CONFIG)
    once, twice = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_config_with_updates(src, once, {"llm": {"keep_alive": "4h"}}, note_changes=True)
    write_config_with_updates(once, twice, {"llm": {"keep_alive": "2h"}}, note_changes=True)
    text = twice.read_text()
    assert "keep_alive: 2h" in text and text.count("llm.keep_alive was unset") == 1
    assert load_config(twice).model("llm").keep_alive == 7200
