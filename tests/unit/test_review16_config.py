"""Review 16 of the config file, its units and its JSON Schema: each test is a bug found and fixed
(see its docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

from manager.cli import main
from manager.config import ConfigError, config_json_schema, load_config
from manager.units import parse_duration, parse_size

BASE = """\
devices:
  - {name: gpu0, kind: cuda, memory: 24GiB, reserve: 1GiB}
host: {memory: 32GiB}
classes:
  - {name: realtime, reserve: 3GiB}
  - {name: interactive}
models:
  - name: voice
    class: realtime
    adapter: silero-vad
    device: gpu0
    memory: 1GiB
    load_seconds: {disk: 3.0, host: 0.4}
"""


def _write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "c.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _errors(path: Path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    return str(exc.value)


def _schema_valid(data: Any) -> bool:
    return bool(jsonschema.Draft202012Validator(config_json_schema()).is_valid(data))


@pytest.mark.parametrize("value", ["5ſ", "90ſ", "1h30mſ"])
def test_a_duration_with_a_unicode_look_alike_unit_says_what_was_expected(tmp_path: Path, value: str) -> None:
    """`re.IGNORECASE` made 's' match 'ſ' (U+017F, long s), which no unit table has: `max_wait: 5ſ`
    failed with Python's own `tuple.index(x): x not in tuple` instead of the expected spellings."""
    with pytest.raises(ValueError, match="expected a duration like '30m'") as exc:
        parse_duration(value)
    assert "tuple" not in str(exc.value)
    path = _write(tmp_path, BASE.replace("{name: interactive}", f"{{name: interactive, max_wait: {value}}}"))
    msg = _errors(path)
    assert f"{path}:6: classes[1].max_wait: expected a duration like '30m'" in msg
    assert parse_duration("1H30M") == 5400.0 and parse_duration("500MS") == 0.5  # any case still


def test_class_underscore_is_refused_as_the_schema_refuses_it(tmp_path: Path) -> None:
    """A model's class is `class` in the file (the JSON Schema is by alias); `class_`, pydantic's name
    for it, was taken too by load_config while the schema refused it."""
    text = BASE.replace("class: realtime", "class_: realtime")
    msg = _errors(_write(tmp_path, text))
    assert "models[0].class_: unknown field 'class_' (did you mean 'class'?)" in msg
    assert "models[0].class: required field is missing" in msg


@pytest.mark.parametrize("value", ["0", "0.0", "'0s'", "'0m0s'"])
def test_a_zero_world_idle_timeout_is_refused_by_the_schema_too(tmp_path: Path, value: str) -> None:
    """`server.world_idle_timeout: 0` is refused by load_config (no session could take a step); the
    JSON Schema took it (its bounds never reached an optional size or duration)."""
    msg = _errors(_write(tmp_path, f"server: {{world_idle_timeout: {value}}}\n" + BASE))
    assert "server.world_idle_timeout: expected a duration above 0, like '10m'" in msg
    plain: Any = 0 if value.startswith("0") else value.strip("'")
    data = {
        "server": {"world_idle_timeout": plain},
        "devices": [{"name": "g", "kind": "cuda", "memory": "24GiB"}],
        "host": {"memory": "32GiB"},
        "classes": [{"name": "c"}],
        "models": [],
    }
    assert not _schema_valid(data)
    for ok in ("10m", 600, None):  # what load_config takes, the schema takes
        assert _schema_valid({**data, "server": {"world_idle_timeout": ok}})
    assert "gt" not in str(config_json_schema()["$defs"]["ServerConfig"]["properties"]["world_idle_timeout"])


@pytest.mark.parametrize(
    ("value", "loaded"), [(0.4, 1), ("0.4", 1), ("0.0000001KiB", 1), (2.5, 3), ("1.5GiB", 1610612736)]
)
def test_a_fraction_of_a_byte_counts_as_a_byte(tmp_path: Path, value: int | float | str, loaded: int) -> None:
    """A size is rounded up to a whole byte. It was rounded to the nearest (even) byte: `memory: 0.4`
    passed the JSON Schema (above 0) and load_config refused it as "greater than 0, got 0"."""
    assert parse_size(value) == loaded
    config = load_config(_write(tmp_path, BASE.replace("memory: 1GiB", f"memory: {value}")))
    assert config.models[0].memory == loaded


def test_max_request_bytes_a_fraction_above_its_bound_is_refused_as_the_schema_does(tmp_path: Path) -> None:
    """`server.max_request_bytes: 2147483647.4` was rounded down to the largest gRPC message and taken,
    where the JSON Schema (maximum 2147483647) refused it."""
    msg = _errors(_write(tmp_path, "server: {max_request_bytes: 2147483647.4}\n" + BASE))
    assert "server.max_request_bytes: expected a value less than or equal to 2147483647" in msg
    assert load_config(_write(tmp_path, "server: {max_request_bytes: 2147483647}\n" + BASE))


def test_yaml_str_tag_reads_as_a_string(tmp_path: Path) -> None:
    """`!!str` is YAML's way to make `2026` or `yes` a string; the round-trip loader keeps it as a
    tagged scalar, which was refused as "got TaggedScalar(value='30m', ...)"."""
    text = BASE.replace("name: voice", "name: !!str 2026") + "    keep_alive: !!str 30m\n"
    config = load_config(_write(tmp_path, text))
    assert config.models[0].name == "2026"
    assert config.models[0].keep_alive == 1800.0


@pytest.mark.parametrize(("char", "line"), [(b"\x07", 10), (b"\x01", 14), (b"\x7f", 14)])
def test_a_control_character_is_named_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], char: bytes, line: int
) -> None:
    """A control character in the file was reported as a two-line `YAML error: unacceptable
    character #x0007 ... in "<unicode string>", position 219`: no line, and a made-up file name."""
    raw = BASE.encode()
    raw = raw.replace(b"silero-vad", b"silero" + char + b"vad") if line == 10 else raw + b"# " + char + b"\n"
    path = _write(tmp_path, raw)
    msg = _errors(path)
    said = f"a character that YAML does not allow in a file (U+{char[0]:04X}, not text); remove it"
    assert msg == f"{path}:{line}: {said}"
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}:" in err and "Traceback" not in err


@pytest.mark.parametrize(("key", "said"), [("1", "got 1"), ("null", "got None"), ("2.5", "got 2.5")])
def test_a_source_key_that_is_not_a_name_is_said_at_source(tmp_path: Path, key: str, said: str) -> None:
    """`source: {1: x}` was reported as `models[0].source[1]: expected a valid string, got 1`, which
    reads as the second entry of a list; it is the key that must be a name."""
    msg = _errors(_write(tmp_path, BASE + f"    source: {{{key}: x}}\n"))
    assert msg.endswith(f":14: models[0].source: keys must be names (strings), {said}")


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("memory: 1GiB", "memory: &b true", "models[0].memory: expected a size like '24GiB'"),
        ("name: voice", "name: &n true", "models[0].name: expected a valid string, got True"),
        (
            "kind: cuda,",
            "kind: cuda, index: &i true,",
            "devices[0].index: expected a valid integer, got True",
        ),
    ],
)
def test_an_anchored_boolean_is_a_boolean(tmp_path: Path, old: str, new: str, said: str) -> None:
    """The round-trip loader gives an anchored `&b true` as an int subclass, which was read as 1:
    `memory: &b true` was a 1-byte model and `max_batch: &b true` a batch of 1, where `true` alone is
    refused."""
    assert said in _errors(_write(tmp_path, BASE.replace(old, new)))
    msg = _errors(_write(tmp_path, BASE + "    max_batch: &b true\n"))
    assert "models[0].max_batch: expected a valid integer, got True" in msg
    text = BASE.replace("{name: interactive}", "{name: interactive, may_evict: &f false}")
    config = load_config(_write(tmp_path, text + "    pin: *f\n"))
    assert config.classes[1].may_evict is False and config.models[0].pin is False


@pytest.mark.parametrize(
    ("old", "new", "line", "said"),
    [
        ("host: 0.4}", "host: 0.4}\n    pin: !!bool maybe", 14, "'maybe' is not true or false, as its tag"),
        ("memory: 1GiB", "memory: !!int abc", 12, "'abc' is not a whole number, as its tag !!int says"),
        ("disk: 3.0", "disk: !!float x", 13, "'x' is not a number, as its tag !!float says"),
    ],
)  # fmt: skip
def test_a_value_its_yaml_tag_does_not_fit_is_an_error_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, line: int, said: str
) -> None:
    """`pin: !!bool maybe` let ruamel's KeyError out of load_config (`residency config check` printed a
    traceback); `!!int abc` and `!!float x` were said with no line, in Python's words."""
    path = _write(tmp_path, BASE.replace(old, new))
    assert f"{path}:{line}: YAML syntax error: {said}" in _errors(path)
    assert main(["config", "check", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err
