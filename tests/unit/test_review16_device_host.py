"""Review 16: a device may not be named `host`. Host RAM is `host` where a device's name goes (an
action's device, an event's, the replay's), and the live manager tells a host-tier drop from a GPU
eviction by it: with a device named `host`, its evictions were never counted in `/metrics`
(`residency_evictions_total` had no series though the engine evicted twice). The loader and the JSON
Schema both refuse the name now; any other name still loads."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from manager.config import ConfigError, config_json_schema, load_config

CONFIG = """\
devices: [{{name: {name}, kind: cpu, memory: 4GiB}}]
host: {{memory: 8GiB}}
classes: [{{name: interactive}}]
models:
  - {{name: a, class: interactive, adapter: silero-vad, device: {name}, memory: 1MiB,
     load_seconds: {{disk: 1.0, host: 0.1}}}}
"""


def test_a_device_named_host_is_refused_by_the_loader_and_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(name="host"), encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "devices[0].name: expected a device name other than 'host'" in str(exc.value)
    validator = jsonschema.Draft202012Validator(config_json_schema())
    assert not validator.is_valid(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("name", ["cpu0", "hosts", "Host", "my-host"])
def test_other_names_load_and_pass_the_schema(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(name=name), encoding="utf-8")
    assert load_config(path).devices[0].name == name
    assert jsonschema.Draft202012Validator(config_json_schema()).is_valid(yaml.safe_load(path.read_text()))


def test_an_empty_config_path_is_named_as_one(capsys: pytest.CaptureFixture[str]) -> None:
    """`residency config check ""` said ": cannot read config file: [Errno 21] Is a directory: '.'"
    (Path("") is the current folder), naming no file."""
    from manager.cli import main

    with pytest.raises(ConfigError, match=r"\(no path\): expected a config file's path, got an empty one"):
        load_config("")
    assert main(["config", "check", ""]) == 2
    err = capsys.readouterr().err
    assert "expected a config file's path, got an empty one" in err and "Errno" not in err
