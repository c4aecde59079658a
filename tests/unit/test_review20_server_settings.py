"""Review 20: `load_server_settings`, what the admin commands read of a config file to reach the
service: its `server` section alone, checked as `load_config` checks it (see
tests/integration/test_review20_cli_admin.py for the commands against a real service)."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager.config import ConfigError, load_config, load_server_settings

BROKEN_ELSEWHERE = """
server: {listen: "127.0.0.1:50999", auth_token_env: MY_TOKEN}
devices: [{name: cpu0, kind: cpu, memory: 1GiB}]
models:
  - {name: m, class: nope, adapter: torchscript, device: gpu9, memory: 1MiB, keep_alive: 1m1m}
"""


def test_a_file_broken_elsewhere_gives_its_server_section(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(BROKEN_ELSEWHERE)
    with pytest.raises(ConfigError):
        load_config(f)
    server = load_server_settings(f)
    assert server.listen == "127.0.0.1:50999" and server.auth_token_env == "MY_TOKEN"


def test_no_server_section_is_the_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("devices: []\n")
    assert load_server_settings(f).listen == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('devices: []\nserver:\n  listen: "nowhere"\n', ":3: server.listen"),
        ("- a list\n", "expected a mapping at the top level"),
        ("server: {listen: [\n", "YAML syntax error"),
        ("server: {lisen: x}\n", "server.lisen"),
    ],
)
def test_a_mistake_in_the_server_section_or_the_file_is_said(tmp_path: Path, text: str, said: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_server_settings(f)
    assert said in str(e.value), str(e.value)


def test_a_missing_file_is_said(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_server_settings(tmp_path / "none.yaml")


def test_a_yaml_slip_elsewhere_in_the_file_still_gives_its_server_section(tmp_path: Path) -> None:
    """(Read-through: the whole file was parsed first, so a YAML syntax error anywhere still made the
    admin commands exit 2 without asking the service.)"""
    f = tmp_path / "c.yaml"
    f.write_text(
        "# my home\nserver:\n  listen: 127.0.0.1:50998   # mine\n\n  auth_token_env: T\n"
        "policy: {default_keep_alive: [5m}\n"
    )
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_config(f)
    server = load_server_settings(f)
    assert (server.listen, server.auth_token_env) == ("127.0.0.1:50998", "T")
    # a mistake in the server block itself is still said, at its line in the file
    f.write_text("devices: [\nserver:\n  listen: nowhere\n")
    with pytest.raises(ConfigError) as e:
        load_server_settings(f)
    assert ":3: server.listen" in str(e.value), str(e.value)
