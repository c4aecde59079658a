"""Bad config files (hypothesis): random edits of the shipped home config — a value swapped for one of
another type or an absurd size, a key deleted or misspelt — and random bytes as a file. Every one
either loads or raises ConfigError naming the file and, for a field, its path; never another
exception. Through the CLI (`residency config check`): exit 0 or 2, never a traceback."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from manager import cli
from manager.config import Config, ConfigError, load_config
from manager.units import MAX_SIZE

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["24GiB", "-1GiB", "1e40GiB", "0B", "30m", "-5s", "forever", "auto", "1ZiB", "nan"]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a plain YAML tree (mapping keys and list indexes)."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


BASE = _plain(YAML(typ="safe").load(HOME.read_text(encoding="utf-8")))
PATHS = _paths(BASE)


def _edit(tree: Any, path: tuple[Any, ...], how: str, value: Any) -> None:
    parent = tree
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "rename" and isinstance(parent, dict):
        parent[f"{key}_x"] = parent.pop(key)
    else:
        parent[key] = value


def _dump(tree: Any) -> str:
    buf = io.StringIO()
    y = YAML(typ="safe")
    y.default_flow_style = False
    y.dump(tree, buf)
    return buf.getvalue()


def _check(path: Path) -> None:
    try:
        cfg = load_config(path)
    except ConfigError as e:
        text = str(e)
        assert str(path) in text and text.strip() != str(path)
        assert "Traceback" not in text
        for where, message in e.errors:
            assert message, (where, text)
        return
    assert isinstance(cfg, Config)
    for dev in cfg.devices:  # whatever loads must be a coherent config
        assert 0 <= dev.reserve < dev.memory <= MAX_SIZE and dev.usable > 0
    for m in cfg.models:  # sizes fit int64 (store, protos); load times are finite seconds
        assert 0 < m.memory <= MAX_SIZE
        ls = m.load_seconds
        assert all(math.isfinite(x) and x > 0 for x in (ls.disk, ls.host, ls.cached_s))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=len(PATHS) - 1),
            st.sampled_from(["set", "set", "delete", "rename"]),
            values,
        ),
        min_size=1,
        max_size=3,
    )
)
def test_random_edits_load_or_get_a_clear_error(tmp_path: Path, edits: list[tuple[int, str, Any]]) -> None:
    tree = copy.deepcopy(BASE)
    for index, how, value in edits:
        path = PATHS[index]
        try:
            _edit(tree, path, how, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path's parent
    f = tmp_path / "edited.yaml"
    f.write_text(_dump(tree), encoding="utf-8")
    _check(f)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda s: s.encode("utf-8"))))
def test_random_bytes_as_a_config_file_get_a_clear_error(tmp_path: Path, data: bytes) -> None:
    f = tmp_path / "random.yaml"
    f.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert str(f) in str(err.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(min_value=0, max_value=len(PATHS) - 1), value=values)
def test_the_cli_check_exits_0_or_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: int, value: Any
) -> None:
    tree = copy.deepcopy(BASE)
    _edit(tree, PATHS[index], "set", value)
    f = tmp_path / "cli.yaml"
    f.write_text(_dump(tree), encoding="utf-8")
    rc = cli.main(["config", "check", str(f)])
    out = capsys.readouterr()
    assert rc in (0, 2)
    assert "Traceback" not in out.out + out.err
    if rc == 2:
        assert str(f) in out.err.replace("\n", "")


def test_the_fuzzed_base_is_the_shipped_config_and_loads() -> None:
    assert len(PATHS) > 50
    assert load_config(HOME).devices


@pytest.mark.parametrize(
    "text",
    [
        "[" * 20000,
        "models: " + "[" * 3000 + "]" * 3000,
        "models:\n" + "".join("  " * i + "a:\n" for i in range(1, 400)),
    ],
    ids=["flow", "flow-closed", "block"],
)
def test_yaml_nested_too_deeply_is_a_config_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(f)
