"""Config tooling beyond loading: error rendering, the JSON Schema, and comment-keeping rewrites
(what `residency tune` writes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from manager.config import ConfigError, config_json_schema, load_config, write_config_with_updates

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"


def test_config_error_rendering() -> None:
    err = ConfigError("x.yaml", [("models[0].memory", "bad"), ("", "worse")], [7])
    assert str(err) == "x.yaml:7: models[0].memory: bad\nx.yaml: worse"
    assert err.lines == [7, None]


def test_json_schema() -> None:
    schema = config_json_schema()
    assert isinstance(schema, dict) and "$schema" in schema and schema["title"] == "Residency config"
    assert {"models", "devices", "classes", "host", "policy"} <= set(schema["properties"])
    model = schema["$defs"]["ModelConfig"]["properties"]
    assert "class" in model and "class_" not in model
    assert {"type": "string"} in [{"type": s.get("type")} for s in model["memory"]["anyOf"]]
    assert model["memory"]["description"].startswith("Estimated weights footprint")
    assert schema["$defs"]["ModelConfig"]["additionalProperties"] is False


# --- rewriting ----------------------------------------------------------------------------------------


def test_write_config_with_updates_keeps_comments_and_validates(tmp_path: Path) -> None:
    dst = tmp_path / "tuned.yaml"
    cfg = write_config_with_updates(
        HOME,
        dst,
        {"llm": {"keep_alive": "45m", "prewarm": False}, "image": {"load_seconds.disk": 6.0}},
        {"background": {"max_wait": "2h"}},
        header_comment="tuned by residency tune\non trace week-1",
    )
    text = dst.read_text(encoding="utf-8")
    assert text.startswith("# tuned by residency tune\n# on trace week-1\n# Residency: a home AI server")
    assert re.search(r"keep_alive: 45m +# conversations pause for minutes", text)
    assert "address: null" in text
    assert cfg.model("llm").keep_alive == 2700.0 and cfg.model("llm").prewarm is False
    assert cfg.model("image").load_seconds.disk == 6.0
    assert cfg.classes[2].max_wait == 7200.0
    assert load_config(dst) == cfg
    assert cfg.model("tts") == load_config(HOME).model("tts")


def test_write_config_without_updates_round_trips_exactly(tmp_path: Path) -> None:
    dst = tmp_path / "same.yaml"
    write_config_with_updates(HOME, dst, {})
    assert dst.read_text(encoding="utf-8") == HOME.read_text(encoding="utf-8")


def test_write_config_refuses_invalid_results(tmp_path: Path) -> None:
    dst = tmp_path / "bad.yaml"
    with pytest.raises(ConfigError) as info:
        write_config_with_updates(HOME, dst, {"llm": {"keep_alive": "sometimes"}})
    assert info.value.file == str(dst) and info.value.errors[0][0] == "models[2].keep_alive"
    assert not dst.exists()
    with pytest.raises(ValueError, match="no entry named 'nope' in models"):
        write_config_with_updates(HOME, dst, {"nope": {"pin": True}})


ANCHORED = """\
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 24GiB, reserve: 1536MiB}
host: {memory: 32GiB, reserve: 4GiB}
classes:
  - {name: interactive}
models:
  - &base
    name: llm
    class: interactive
    adapter: silero-vad
    device: gpu0
    memory: 9GiB
    load_seconds: &ls {disk: 7.0, host: 1.0}
    keep_alive: 10m
  - <<: *base
    name: image
    memory: 7GiB
  - name: tts
    class: interactive
    adapter: silero-vad
    device: gpu0
    memory: 1GiB
    load_seconds: *ls
"""


@pytest.mark.parametrize(
    ("updates", "changed"),
    [
        ({"llm": {"keep_alive": "2h"}}, {"llm": ("keep_alive", 7200.0)}),
        ({"image": {"keep_alive": "1h"}}, {"image": ("keep_alive", 3600.0)}),
        ({"llm": {"load_seconds.disk": 3.0}}, {"llm": ("load_seconds", 3.0)}),
        ({"image": {"load_seconds.disk": 2.0}}, {"image": ("load_seconds", 2.0)}),
        ({"tts": {"load_seconds.disk": 1.0}}, {"tts": ("load_seconds", 1.0)}),
    ],
)
def test_an_update_of_an_anchored_model_changes_no_other_model(
    tmp_path: Path, updates: dict[str, dict[str, object]], changed: dict[str, tuple[str, float]]
) -> None:
    src, dst = tmp_path / "anchored.yaml", tmp_path / "tuned.yaml"
    src.write_text(ANCHORED, encoding="utf-8")
    before = load_config(src)
    cfg = write_config_with_updates(src, dst, updates)  # type: ignore[arg-type]
    assert load_config(dst) == cfg
    for m in cfg.models:
        if m.name not in changed:
            assert m == before.model(m.name), m.name
            continue
        field, value = changed[m.name]
        got = m.keep_alive if field == "keep_alive" else m.load_seconds.disk
        assert got == value
        # everything else of the updated model is as before
        rest = {"keep_alive", "load_seconds"}
        assert m.model_dump(exclude=rest) == before.model(m.name).model_dump(exclude=rest)
