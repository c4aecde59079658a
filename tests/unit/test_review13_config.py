"""Review 13 of the configuration as a user writes it (YAML, sizes, the JSON Schema, `config check`):
each test is a bug found and fixed (see its docstring)."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from ruamel.yaml import YAML

from manager import config as config_module
from manager.cli import main
from manager.config import ConfigError, config_json_schema, load_config

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"

BASE: dict[str, Any] = {
    "devices": [{"name": "gpu0", "kind": "cuda", "memory": "24GiB", "reserve": "1GiB"}],
    "host": {"memory": "32GiB"},
    "classes": [{"name": "rt"}],
    "models": [
        {
            "name": "a",
            "class": "rt",
            "adapter": "worldpager-mg2",
            "device": "gpu0",
            "memory": "1GiB",
            "load_seconds": {"disk": 3, "host": 1},
            "elastic": {"min": "1GiB", "max": "2GiB"},
        }
    ],
}


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def config_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return e.value


# ---- YAML merge keys -----------------------------------------------------------------------------

MERGED = """\
devices:
  - {name: gpu0, kind: cuda, memory: 24GiB}
host: {memory: 32GiB}
classes: [{name: rt}]
models:
  - &llm
    name: a
    class: rt
    adapter: worldpager-mg2
    device: gpu0
    memory: 24XB
    load_seconds: {disk: 3, host: 1}
  - <<: *llm
    name: b
"""


def test_an_error_in_a_merged_field_is_reported_at_the_line_it_is_written_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value that an entry takes through a YAML merge key (`<<: *llm`, the usual way to share a
    model's settings) ended `load_config` and `config check` in a KeyError traceback: the error's line
    was looked up among the entry's own keys, where a merged key is not."""
    f = write(tmp_path, MERGED)
    err = config_error(f)
    expected = "expected a size like '24GiB', '512MiB' or a number of bytes, got '24XB'"
    assert err.errors == [("models[0].memory", expected), ("models[1].memory", expected)]
    assert err.lines == [11, 11]  # where `memory: 24XB` is written, for both
    assert main(["config", "check", str(f)]) == 2
    out = capsys.readouterr().err
    assert f"{f}:11: models[1].memory: {expected}" in out and "Traceback" not in out
    # a key of the entry's own, beside the merge, keeps its own line
    err = config_error(write(tmp_path, MERGED.replace("    name: b\n", "    name: b\n    memory: -1\n")))
    assert err.errors[1][0] == "models[1].memory" and err.lines == [11, 15]


# ---- `config check` and the bearer token ---------------------------------------------------------


def _home_with(tmp_path: Path, server_lines: str) -> Path:
    text = HOME.read_text(encoding="utf-8").replace("auth_token_env: null", "auth_token_env: R13_TOKEN")
    return write(tmp_path, text.replace("server:\n", "server:\n" + server_lines, 1))


def test_config_check_says_serve_would_refuse_metrics_without_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With metrics on the LAN, a token variable named and not set got the warning "admin calls would
    need no token": `serve` refuses to start there (metrics beyond loopback need the token)."""
    f = _home_with(tmp_path, '  metrics_listen: "0.0.0.0:9100"\n')
    monkeypatch.delenv("R13_TOKEN", raising=False)
    assert main(["config", "check", str(f)]) == 0  # the variable may be set where it serves
    out = capsys.readouterr().err
    assert (
        "$R13_TOKEN, which is not set here (and `serve` would refuse to serve metrics beyond loopback)" in out
    )
    assert "admin calls would need no token" not in out
    loopback = _home_with(tmp_path, "")
    assert main(["config", "check", str(loopback)]) == 0
    assert "not set here (and admin calls would need no token)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("token", "says"),
    [(" s3cret", "starts or ends with a space"), ("s3cret\r", "a character a gRPC header cannot carry")],
)
def test_config_check_warns_of_a_token_serve_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, token: str, says: str
) -> None:
    """A token `serve` refuses to start with (a space at an end, the carriage return of a token file
    written on Windows) passed `config check` without a word: "ok"."""
    f = _home_with(tmp_path, "")
    monkeypatch.setenv("R13_TOKEN", token)
    assert main(["config", "check", str(f)]) == 0
    out = capsys.readouterr().err
    assert f"{f}: warning: `residency serve` would refuse to start here: " in out and says in out
    monkeypatch.setenv("R13_TOKEN", "s3cret")
    assert main(["config", "check", str(f)]) == 0
    assert "warning" not in capsys.readouterr().err


# ---- the JSON Schema agrees with load_config -----------------------------------------------------


def _set(data: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    node: Any = data
    for part in path[:-1]:
        if isinstance(part, str) and part not in node:
            node[part] = {}
        node = node[part]
    node[path[-1]] = value
    return data


def _both(tmp_path: Path, data: dict[str, Any]) -> tuple[bool, bool]:
    """(load_config takes it, the JSON Schema takes it), the schema seeing what an editor sees."""
    out = io.StringIO()
    YAML(typ="safe").dump(data, out)
    f = write(tmp_path, out.getvalue())
    try:
        load_config(f)
        loads = True
    except ConfigError:
        loads = False
    validator = jsonschema.Draft202012Validator(config_json_schema())
    return loads, not list(validator.iter_errors(YAML(typ="safe").load(out.getvalue())))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("models", 0, "pin"), "yes"),
        (("models", 0, "pin"), "No"),
        (("models", 0, "prewarm"), "off"),
        (("models", 0, "prewarm"), 0),
        (("classes", 0, "may_evict"), "false"),
        (("classes", 0, "may_evict"), 1),
        (("models", 0, "memory"), 1000.5),
        (("host", "reserve"), 1.5),
    ],
)
def test_the_schema_takes_what_load_config_takes(
    tmp_path: Path, path: tuple[str | int, ...], value: Any
) -> None:
    """An editor validating with `residency config schema` flagged `pin: yes` (pydantic reads it as
    true, as YAML 1.1 did) and a size of 1000.5 bytes (rounded to the byte) as errors in a file
    `load_config` takes."""
    assert _both(tmp_path, _set(BASE, path, value)) == (True, True)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("models", 0, "memory"), 0),
        (("models", 0, "memory"), "0GiB"),
        (("devices", 0, "memory"), "0"),
        (("host", "memory"), 0.0),
        (("models", 0, "elastic", "max"), " 0.0 MiB "),
        (("server", "max_request_bytes"), 2**31),
        (("server", "max_request_bytes"), 0),
        (("server", "keepalive"), 0),
        (("server", "keepalive"), "0m0s"),
        (("server", "keepalive"), 86401),
        (("server", "listen"), "50051"),
        (("server", "listen"), "127.0.0.1:65536"),
        (("server", "metrics_listen"), "0.0.0.0"),
        (("store", "url"), "postgres://h/db"),
        (("ray", "address"), "head-node"),
        (("models", 0, "pin"), "maybe"),
        (("models", 0, "pin"), 2),
    ],
)
def test_the_schema_refuses_what_load_config_refuses(
    tmp_path: Path, path: tuple[str | int, ...], value: Any
) -> None:
    """The schema had `minimum: 0` for every size and duration (a model of 0 bytes, a keepalive of 0s,
    a 4 GiB gRPC limit passed the editor) and took any string as server.listen, store.url or
    ray.address; `load_config` refuses them all."""
    assert _both(tmp_path, _set(BASE, path, value)) == (False, False)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("models", 0, "memory"), "0.5GiB"),
        (("server", "max_request_bytes"), 2**31 - 1),
        (("server", "keepalive"), "0m1s"),
        (("server", "keepalive"), 86400),
        (("server", "listen"), "[::1]:00080"),
        (("server", "listen"), "0.0.0.0:65535"),
        (("store", "url"), "redis://127.0.0.1:6379/0"),
        (("ray", "address"), "ray://head:10001"),
        (("ray", "address"), "auto"),
        (("ray", "address"), "10.0.0.5:6379"),
        (("models", 0, "pin"), True),
    ],
)
def test_the_schema_and_load_config_still_take_the_edges(
    tmp_path: Path, path: tuple[str | int, ...], value: Any
) -> None:
    assert _both(tmp_path, _set(BASE, path, value)) == (True, True)


# ---- messages ------------------------------------------------------------------------------------


def test_too_many_values_without_aliases_is_not_called_an_alias_bomb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file too large to be one (a few MB of keys, no alias in it) was refused as "an alias
    bomb?": the message blamed YAML aliases the file did not have."""
    monkeypatch.setattr(config_module, "MAX_NODES", 40)
    big = HOME.read_text(encoding="utf-8")
    err = config_error(write(tmp_path, big))
    assert err.errors == [("", "more than 40 values; a config file is not that large")]
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n"
    err = config_error(write(tmp_path, bomb))
    assert err.errors == [("", "more than 40 values once YAML aliases are expanded (an alias bomb?)")]


def test_a_file_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    """A config saved as Latin-1 (`name: gpu-é`) was refused with Python's codec message and a byte
    offset ("can't decode byte 0xe9 in position 83"), not the line to fix."""
    f = tmp_path / "latin1.yaml"
    f.write_bytes(HOME.read_bytes().replace(b"name: gpu0", b"name: gpu\xe9", 1))
    line = HOME.read_bytes().split(b"name: gpu0")[0].count(b"\n") + 1
    err = config_error(f)
    assert err.lines == [line]
    assert err.errors == [("", "not UTF-8 text (byte 0xe9); save the file as UTF-8")]


def test_a_file_far_larger_than_any_config_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3 MB file of 200k keys took 18 s and 465 MB of memory before it was refused."""
    from manager.config import MAX_CONFIG_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("".join(f"k{i}: {i}\n" for i in range(MAX_CONFIG_BYTES // 8)))
    assert big.stat().st_size > MAX_CONFIG_BYTES

    def parsed(*args: Any) -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(config_module, "_parse_yaml", parsed)
    with pytest.raises(ConfigError, match=r"more than 1 MiB; a config is not that large"):
        load_config(big)


def test_a_redis_password_with_url_characters_is_a_valid_store_url(tmp_path: Path) -> None:
    """The store took such a password (everything up to the last "@" is the user info), but the
    config's own check of store.url split it at its "/" or "#" and refused the file ("the port must
    be a number")."""
    text = (HOME.parent / "local-cpu.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text('store: {url: "redis://me:AbC/dEf+#q?x@y==@127.0.0.1:6379/3"}\n' + text)
    assert load_config(path).store.url.endswith("@127.0.0.1:6379/3")
    path.write_text('store: {url: "redis://me:AbC/dEf@127.0.0.1:port/3"}\n' + text)
    with pytest.raises(ConfigError, match="the port must be a number") as e:
        load_config(path)
    assert "dEf" not in str(e.value)
