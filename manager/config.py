"""The configuration (▶ Contract: configuration): YAML loading, error reporting, tuned copies.

The models live in `manager.config_schema` and are re-exported here. `load_config` reports every
problem as `file:line: field.path: what was expected` through `ConfigError`.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import io
import itertools
import os
import re
import stat
from pathlib import Path
from typing import Any, get_args

import annotated_types
from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, TaggedScalar
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.reader import ReaderError
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.scalarbool import ScalarBoolean
from ruamel.yaml.tokens import CommentToken

from manager.adapter_specs import known_adapters, model_json_schema_rules
from manager.config_schema import (
    CHECK_ADAPTERS,
    ByteSize,
    ClassConfig,
    Config,
    DeviceConfig,
    Duration,
    ElasticConfig,
    HostConfig,
    KeepAlive,
    LoadSeconds,
    Loc,
    ModelConfig,
    PolicyConfig,
    RayConfig,
    ServerConfig,
    StoreConfig,
    _FieldErrors,
    _fmt_loc,
)
from manager.units import DURATION_PATTERN, SIZE_PATTERN, ZERO_DURATION_PATTERN, ZERO_SIZE_PATTERN, shown

__all__ = [
    "ByteSize",
    "ClassConfig",
    "Config",
    "ConfigError",
    "DeviceConfig",
    "Duration",
    "ElasticConfig",
    "HostConfig",
    "KeepAlive",
    "LoadSeconds",
    "ModelConfig",
    "PolicyConfig",
    "RayConfig",
    "ServerConfig",
    "StoreConfig",
    "config_json_schema",
    "load_config",
    "write_config_with_updates",
]


class ConfigError(Exception):
    """Problems in a config file: `errors` holds (field path, message); `lines` the line of each."""

    def __init__(self, file: str, errors: list[tuple[str, str]], lines: list[int | None] | None = None):
        self.file = file
        self.errors = errors
        self.lines: list[int | None] = [*(lines or []), *[None] * len(errors)][: len(errors)]
        super().__init__(file, errors)

    def __str__(self) -> str:
        out = []
        for (path, msg), line in zip(self.errors, self.lines, strict=True):
            where = f"{self.file}:{line}" if line else self.file
            out.append(f"{where}: {path}: {msg}" if path else f"{where}: {msg}")
        return "\n".join(out)


class _Representer(RoundTripRepresenter):
    """Round-trip representer that writes None as `null` (not an empty value)."""


_Representer.add_representer(
    type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
)


class _Constructor(RoundTripConstructor):
    """Round-trip constructor whose `!!bool maybe`, `!!int abc` and `!!float x` are YAML errors at
    their line: ruamel let a KeyError (a traceback from `config check`) or a ValueError out."""

    def _scalar(self, node: Any, tag: str, kind: str) -> Any:
        try:
            return RoundTripConstructor.yaml_constructors[f"tag:yaml.org,2002:{tag}"](self, node)
        except (KeyError, ValueError) as exc:
            if "Exceeds the limit" in str(exc):  # an integer of 5000 digits: said by _parse_yaml
                raise
            problem = f"{shown(node.value)} is not {kind}, as its tag !!{tag} says"
            raise ConstructorError(None, None, problem, node.start_mark) from None

    def construct_checked_bool(self, node: Any) -> Any:
        return self._scalar(node, "bool", "true or false")

    def construct_checked_int(self, node: Any) -> Any:
        return self._scalar(node, "int", "a whole number")

    def construct_checked_float(self, node: Any) -> Any:
        return self._scalar(node, "float", "a number")


_BOOL_TAG, _INT_TAG, _FLOAT_TAG = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_Constructor.add_constructor(_BOOL_TAG, _Constructor.construct_checked_bool)
_Constructor.add_constructor(_INT_TAG, _Constructor.construct_checked_int)
_Constructor.add_constructor(_FLOAT_TAG, _Constructor.construct_checked_float)


def _yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.Representer = _Representer
    yaml.Constructor = _Constructor
    yaml.preserve_quotes = True
    yaml.width = 4096
    return yaml


MAX_NODES = 100_000
"""The most values a config may expand to. YAML aliases can repeat a list inside a list (a 1 kB
"billion laughs" file is 10^9 values): counting them as they are copied stops that early."""


class _TooManyNodes(Exception):
    pass


_STR_TAG = "tag:yaml.org,2002:str"
"""YAML's own tag for a string (`name: !!str 2026`), which the round-trip loader keeps as a tagged
scalar rather than making it a str."""


def _plain(node: Any, budget: list[int] | None = None) -> Any:
    """ruamel's round-trip nodes as plain Python values (dict, list, str, int, float, bool, None).

    Raises _TooManyNodes past MAX_NODES values (aliases counted once per use)."""
    if budget is None:
        budget = [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooManyNodes
    if isinstance(node, dict):
        return {_plain(k, budget): _plain(v, budget) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v, budget) for v in node]
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, ScalarBoolean):  # an anchored `&b true`: an int subclass, not a bool (was 1)
        return bool(node)
    if isinstance(node, TaggedScalar) and node.tag.value == _STR_TAG:  # `!!str 2026`: a string
        return str(node.value)
    for kind in (str, int, float):
        if isinstance(node, kind):
            return kind(node)
    return node


def _fields_at(loc: Loc) -> list[str]:
    """Field names (aliases) accepted by the model at `loc` under Config, or [] if unknown."""
    cls: type[BaseModel] | None = Config
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        cls = _submodel(field.annotation) if field else None
    return [f.alias or n for n, f in cls.model_fields.items()] if cls else []


def _submodel(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return next((m for m in map(_submodel, get_args(tp)) if m), None)


_FIXED_MESSAGES = {
    "missing": "required field is missing",
    "model_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
    "too_short": "expected at least one entry",
    "string_too_short": "expected a non-empty string",
    "string_pattern_mismatch": "expected letters, digits, '_', '.' or '-', starting with a letter or digit",
}


def _message(err: Any, loc: Loc) -> str:
    kind, value = err["type"], err.get("input")
    msg = str(err["msg"]).replace("Input should be ", "expected ", 1)
    scalar = isinstance(value, str | int | float | bool | datetime.date | datetime.time) or value is None
    kind_of = (
        "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list | tuple) else "a value"
    )
    got = f", got {shown(value)}" if scalar else f", got {kind_of}"
    if kind == "extra_forbidden" and loc:
        known = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known fields: {', '.join(known)})"
        return f"unknown field {loc[-1]!r}" + (hint if known else "")
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind == "invalid_key":  # reported at the mapping that holds the key
        return f"keys must be names (strings), got {shown(value)}"
    if kind in ("missing", "too_short"):
        return _FIXED_MESSAGES[kind]
    if kind in _FIXED_MESSAGES:
        return _FIXED_MESSAGES[kind] + got
    if msg.startswith(("expected greater", "expected less")):
        msg = msg.replace("expected ", "expected a value ", 1)
    return msg + got


def _user_loc(data: Any, raw: tuple[str | int, ...]) -> Loc:
    """`raw` (a pydantic error location) without the type tags pydantic adds inside unions and
    validators ("function-before[...]"). A part that is a key of the user's mapping at that point
    is the user's, whatever its characters (a key may well be "(" or "a[1]")."""
    node: Any = data
    out: list[str | int] = []
    for part in raw:
        in_dict = isinstance(node, dict) and part in node
        if in_dict or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            node = node[part]
        elif isinstance(part, str) and ("[" in part or "(" in part):
            continue
        else:
            node = None
        out.append(part)
    return tuple(out)


def _readable_errors(exc: ValidationError, data: Any) -> list[tuple[Loc, str]]:
    """pydantic's errors as (location, message); cross-check errors expand into their own paths."""
    out: list[tuple[Loc, str]] = []
    for err in exc.errors(include_url=False):
        if err["type"] == "default_factory_not_called":  # a default made from a field that is refused
            continue  # (a model's `load_seconds` from its `memory`): said at that field, not twice
        loc = _user_loc(data, err["loc"])
        if err["type"] == "invalid_key":
            loc = loc[:-1]
        elif err["loc"][-1:] == ("[key]",):  # a key of a free mapping (`source: {1: x}`) that is no name:
            loc = loc[:-1]  # said at the mapping, as invalid_key is, not as `source[1]` (a list index)
            err = {**err, "type": "invalid_key"}
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, _FieldErrors):
            out.extend(((*loc, *sub), msg) for sub, msg in inner.errors)
        else:
            out.append((loc, _message(err, loc)))
    return out


def _line_of(data: Any, loc: Loc) -> int | None:
    """1-based line of the deepest node along `loc` that exists in the round-trip YAML tree."""
    node, line = data, None
    for part in loc:
        if isinstance(node, dict) and part in node and hasattr(node, "lc"):
            line = _key_line(node, part)
            if line is None:
                break
        elif (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node) and hasattr(node, "lc")
        ):
            line = node.lc.item(part)[0]
        else:
            break
        node = node[part]
    return None if line is None else line + 1


def _key_line(node: Any, key: Any) -> int | None:
    """0-based line of `key` in the round-trip mapping `node`. A key the mapping takes from a YAML
    merge (`<<: *defaults`) is on the line where the merged mapping has it; None if none has it."""
    try:
        return int(node.lc.key(key)[0])
    except KeyError:
        pass
    for merged in getattr(node, "merge", None) or ():
        merged = merged[1] if isinstance(merged, tuple) else merged  # ruamel < 0.18.7: (index, map)
        if isinstance(merged, dict) and key in merged and hasattr(merged, "lc"):
            return _key_line(merged, key)
    return None


_LONG_NUMBER = re.compile(r"[0-9][0-9_]{4299,}")


def _line_of_long_number(text: str) -> int | None:
    """1-based line of the first run of more than 4300 digits in `text` (None if there is none)."""
    for m in _LONG_NUMBER.finditer(text):
        if len(m.group().replace("_", "")) > 4300:
            return text.count("\n", 0, m.start()) + 1
    return None


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return _yaml().load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        problem = problem if len(problem) <= 200 else problem[:200] + "..."
        raise ConfigError(
            file, [("", f"YAML syntax error: {problem}")], [mark.line + 1 if mark else None]
        ) from None
    except ReaderError as exc:  # a character YAML does not allow: its line, not "<unicode string>"
        row = text.count("\n", 0, max(exc.position, 0)) + 1
        char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
        msg = f"a character that YAML does not allow in a file (U+{char:04X}, not text); remove it"
        raise ConfigError(file, [("", msg)], [row]) from None
    except YAMLError as exc:
        raise ConfigError(file, [("", f"YAML error: {exc}")]) from None
    except RecursionError:
        raise ConfigError(file, [("", "YAML nested too deeply")]) from None
    except ValueError as exc:  # a value YAML cannot turn into Python, e.g. an integer of 5000 digits
        line = _line_of_long_number(text)
        if line is not None:
            msg = "a number of more than 4300 digits; no setting takes one that large"
        else:
            msg = f"YAML value that cannot be read: {shown(str(exc), 200)}"
        raise ConfigError(file, [("", msg)], [line]) from None


def _shares_a_node(data: Any) -> bool:
    """Whether a mapping or list occurs more than once in `data` (a YAML alias or merge of it)."""
    seen: set[int] = set()
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict | list):
            if id(node) in seen:
                return True
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    return False


def _validate(data: Any, file: str) -> Config:
    if not isinstance(data, dict):
        got = "an empty file" if data is None else "a list" if isinstance(data, list) else shown(data)
        raise ConfigError(
            file, [("", f"expected a mapping at the top level (devices, host, ...), got {got}")]
        )
    try:
        plain = _plain(data)
    except _TooManyNodes:
        if _shares_a_node(data):
            msg = f"more than {MAX_NODES} values once YAML aliases are expanded (an alias bomb?)"
        else:  # that many values written out: not a config file (a data file given by mistake?)
            msg = f"more than {MAX_NODES} values; a config file is not that large"
        raise ConfigError(file, [("", msg)]) from None
    except RecursionError:
        raise ConfigError(file, [("", "YAML nested too deeply")]) from None
    try:
        # by_name=False: a model's class is `class` in the file, as the JSON Schema says; `class_` (the
        # Python name, which code may use) was taken from a file too
        return Config.model_validate(plain, by_name=False, context={CHECK_ADAPTERS: True})
    except RecursionError:
        raise ConfigError(file, [("", "YAML nested too deeply")]) from None
    except ValidationError as exc:
        errors = _readable_errors(exc, plain)
        raise ConfigError(
            file, [(_fmt_loc(loc), msg) for loc, msg in errors], [_line_of(data, loc) for loc, _ in errors]
        ) from None


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (a home's is a few KiB: `configs/home.yaml` is 5 KiB)."""


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config; every problem is reported through ConfigError."""
    file = str(path)
    return _validate(_parse_yaml(_read_config_text(path), file), file)


class _ServerSection(BaseModel):
    """A config's `server` section alone (`load_server_settings`), under its key as in Config."""

    server: ServerConfig


def load_server_settings(path: str | Path) -> ServerConfig:
    """The `server` section of the config file at `path` alone, validated as `load_config` does:
    what the admin commands need to reach the service (its listen address, token variable, TLS
    certificate). A mistake elsewhere in the file is the service's to refuse (`reload` says it, exit
    1), not the reason a command cannot reach the service; one in `server` is a ConfigError."""
    file = str(path)
    text = _read_config_text(path)
    try:
        data = _parse_yaml(text, file)
    except ConfigError:  # (a YAML slip elsewhere in the file: its `server` block read alone)
        block = _server_block(text)
        if block is None:
            raise
        data = _parse_yaml(block, file)
    if not isinstance(data, dict):
        _validate(data, file)  # (raises: the top level is not a mapping)
    server = data.get("server")
    if server is None:
        return ServerConfig()
    try:
        plain = {"server": _plain(server)}  # (under its key: messages see it where Config has it)
        return _ServerSection.model_validate(plain, by_name=False).server
    except (_TooManyNodes, RecursionError):
        _validate(data, file)  # (raises, naming what is too large or deep)
        raise
    except ValidationError as exc:
        errors = _readable_errors(exc, plain)
        raise ConfigError(
            file, [(_fmt_loc(loc), msg) for loc, msg in errors], [_line_of(data, loc) for loc, _ in errors]
        ) from None


def _server_block(text: str) -> str | None:
    """The top-level `server:` block of a config's text alone (its lines from `server:` to the next
    top-level key), the other lines blanked so that line numbers stay the file's; None when there is
    none (or it is written inline in a flow mapping)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"server\s*:", line)), None)
    if start is None:
        return None
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "\t", "#")),
        len(lines),
    )
    return "\n" * start + "\n".join(lines[start:end]) + "\n"


def _read_config_text(path: str | Path) -> str:
    """The text of the config file at `path` (at most MAX_CONFIG_BYTES, UTF-8); ConfigError naming
    the file (and the line of a byte that is not UTF-8) when it cannot be had."""
    file = str(path)
    if not file.strip():  # (Path("") is the current folder: "Is a directory: '.'", naming no file)
        raise ConfigError("(no path)", [("", "expected a config file's path, got an empty one")])
    try:
        # O_NONBLOCK: a FIFO (or a device) at the path must not hold the open, and with it a hot
        # reload's thread and every later reload, until something writes into it; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            kind = _not_regular(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        if kind:
            os.close(fd)
            raise ConfigError(file, [("", f"not a regular file ({kind}); a config is a file")])
        with os.fdopen(fd, "rb") as f:  # a cap first: a 3 MB file took 18 s and 465 MB to refuse
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            msg = f"more than {MAX_CONFIG_BYTES // 2**20} MiB; a config is not that large (a wrong file?)"
            raise ConfigError(file, [("", msg)])
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(file, [("", "config file not found")]) from None
    except UnicodeDecodeError as exc:  # the line to fix, not Python's codec message and byte offset
        line = exc.object[: exc.start].count(b"\n") + 1
        msg = f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save the file as UTF-8"
        raise ConfigError(file, [("", msg)], [line]) from None
    except OSError as exc:
        raise ConfigError(file, [("", f"cannot read config file: {exc}")]) from None


def _not_regular(mode: int) -> str:
    """What a file of `mode` is when it is not a regular file ("" when it is)."""
    if stat.S_ISREG(mode):
        return ""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip
    return next((what for test, what in kinds if test(mode)), "not a file")


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of the config file (by alias: `class`, not `class_`)."""
    schema = Config.model_json_schema(by_alias=True)
    _bound_units(Config, schema["properties"], schema.get("$defs", {}), set())
    _adapters(schema["$defs"][ModelConfig.__name__])
    _end_at_the_end(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "Residency config"}


def _adapters(model: dict[str, Any]) -> None:
    """A model's schema (in place) as the loader checks it: `adapter` one of the catalogue's
    (`manager.adapter_specs`), and per adapter (`if` adapter is X `then` ...) the keys its `source`
    takes, their types, and those it needs."""
    adapter = model["properties"]["adapter"]
    adapter.pop("minLength", None)
    adapter.pop("type", None)
    adapter["enum"] = known_adapters()
    model.setdefault("allOf", []).extend(model_json_schema_rules())


_END = r"(?![\s\S])"
"""The end of the text, as every regex dialect says it: a pattern's final `$` in Python's re (which
Python's JSON Schema validators use: jsonschema, check-jsonschema) also matches before a final
newline, so a model named "voice\\n" passed the schema; ECMA's and pydantic's `$` do not."""


def _end_at_the_end(schema: Any) -> None:
    """Each `pattern` in `schema` that ends in `$` ends in `_END` instead (in place)."""
    if isinstance(schema, list):
        for item in schema:
            _end_at_the_end(item)
    elif isinstance(schema, dict):
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and re.search(r"(?<!\\)(?:\\\\)*\$$", pattern):
            schema["pattern"] = pattern[:-1] + _END
        for key, value in schema.items():
            if key not in ("examples", "default", "const", "enum"):
                _end_at_the_end(value)


_NUMBER_BOUNDS: dict[type, tuple[str, str]] = {
    annotated_types.Gt: ("gt", "exclusiveMinimum"),
    annotated_types.Ge: ("ge", "minimum"),
    annotated_types.Lt: ("lt", "exclusiveMaximum"),
    annotated_types.Le: ("le", "maximum"),
}
_ZERO_PATTERNS = {SIZE_PATTERN: ZERO_SIZE_PATTERN, DURATION_PATTERN: ZERO_DURATION_PATTERN}


def _bound_units(model: type[BaseModel], props: dict[str, Any], defs: dict[str, Any], seen: set[str]) -> None:
    """Each size and duration field's own bounds (`Field(gt=0, le=...)`) put into its schema, which
    is otherwise the same for every size (`minimum: 0`): a number branch gets the bounds, and a string
    branch of a field that must be positive refuses the spellings of zero (`0GiB`, `0s`). An upper
    bound stays unsaid for strings (`4GiB` passes the schema where max_request_bytes is 2GiB at most)."""
    seen.add(model.__name__)
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None and sub.__name__ in defs and sub.__name__ not in seen:
            _bound_units(sub, defs[sub.__name__].get("properties", {}), defs, seen)
        branches = _branches(props.get(field.alias or name, {}))
        bounds = [
            (key, getattr(m, attr))
            for m in field.metadata
            for t, (attr, key) in _NUMBER_BOUNDS.items()
            if isinstance(m, t)
        ]
        positive = any(
            (key == "exclusiveMinimum" and value >= 0) or (key == "minimum" and value > 0)
            for key, value in bounds
        )
        for branch in branches if bounds else ():
            if branch.get("type") in ("integer", "number"):
                for key, value in bounds:
                    old = branch.get(key)
                    tighter = min if key in ("maximum", "exclusiveMaximum") else max
                    branch[key] = value if old is None else tighter(old, value)
            elif positive and branch.get("pattern") in _ZERO_PATTERNS:
                branch["not"] = {"pattern": _ZERO_PATTERNS[branch["pattern"]]}


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of a field's schema, those of an optional one's value included (`Duration |
    None` is `anyOf: [{anyOf: [string, number]}, null]`: its bounds go on the inner ones). The
    `gt: 0` pydantic leaves beside an inner `anyOf` (no JSON Schema word) is dropped."""
    out: list[dict[str, Any]] = []
    for branch in schema.get("anyOf", []):
        if "anyOf" in branch:
            for attr, _ in _NUMBER_BOUNDS.values():
                branch.pop(attr, None)
            out.extend(_branches(branch))
        else:
            out.append(branch)
    return out


def _set_path(entry: Any, key: str, value: Any, where: str) -> None:
    """`entry[key] = value`; a dotted key (`load_seconds.disk`) walks into nested mappings."""
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(entry.get(part), dict):
            raise ValueError(f"{where}.{part} is not a mapping; cannot set {key!r}")
        entry = entry[part]
    _assign(entry, last, value)


def _assign(mapping: Any, key: Any, value: Any) -> None:
    """`mapping[key] = value`. A mapping value given to a mapping that `mapping` writes itself (not
    merged from another entry, not anchored for others to share) is set key by key, so that it keeps
    its style (`{disk: 3.0, ...}` stays on its line) and the comments on its lines."""
    old = mapping.get(key)
    if (
        isinstance(value, dict)
        and isinstance(old, CommentedMap)
        and old.anchor.value is None
        and not old.merge
        and not getattr(mapping, "merge", None)
    ):
        for k in [k for k in old if k not in value]:
            del old[k]
        for i, (k, v) in enumerate(value.items()):
            if k in old:
                _assign(old, k, v)
            else:  # a new key goes where `value` has it (`cached` between `disk` and `host`)
                old.insert(min(i, len(old)), k, v)
        return
    if key not in mapping:
        _append(mapping, key, value)
        return
    mapping[key] = value


def _append(mapping: Any, key: Any, value: Any) -> None:
    """`mapping[key] = value` for a key `mapping` lacks. In a block mapping the new line goes right
    after the last key's line, not after the comment lines that follow that line (which YAML keeps
    with the last key): a comment that heads the next model would otherwise end up above the new
    line, as if it spoke of it."""
    last = next(reversed(list(mapping)), None) if isinstance(mapping, CommentedMap) else None
    slots = mapping.ca.items.get(last) if last is not None else None
    tok = slots[2] if slots and len(slots) > 2 else None
    mapping[key] = value
    if (
        not isinstance(tok, CommentToken)
        or isinstance(value, dict | list)  # (a collection's comments are kept in it, not here)
        or mapping.fa.flow_style()
        or getattr(mapping, "merge", None)  # (its last key may be a merged one)
    ):
        return
    eol, newline, rest = tok.value.partition("\n")
    if newline and rest:
        tok.value = eol + newline
        mapping.ca.items[key] = [None, None, CommentToken(newline + rest, tok.start_mark), None]


def _apply(data: Any, section: str, updates: dict[str, dict[str, Any]], file: str) -> None:
    items = data.get(section) if isinstance(data, dict) else None
    for name, changes in updates.items():
        index = next(
            (i for i, e in enumerate(items or []) if isinstance(e, dict) and e.get("name") == name), None
        )
        if items is None or index is None:
            raise ValueError(f"{file}: no entry named {name!r} in {section}")
        for key, value in changes.items():
            _set_path(items[index], key, value, f"{section}[{index}]")


Indent = tuple[int, int, int]
"""Block indentation as ruamel's `YAML.indent(mapping, sequence, offset)` takes it."""

DEFAULT_INDENT: Indent = (2, 4, 2)
"""configs/home.yaml's: `models:` then `  - name: voice` then `    class: realtime`."""

_KEY_LINE = re.compile(r"^( *)[^\s#\-][^#]*:[ \t]*(#.*)?$")
"""A block key whose value starts on the next line (`models:`, `server:  # words`)."""


def _indentation(text: str) -> Indent:
    """The block indentation `text` is written in, so that a config written again (tune, measure)
    differs only where its values changed: a file in `yaml.dump`'s style (`- name: voice` at the
    key's column) was re-indented whole. The first mapping nested under a key gives `mapping` (its
    keys' column past the key's); the first block sequence under a key gives `offset` (its dash's
    column past the key's) and `sequence` (its items' keys': `- name` two past the dash, PyYAML's
    `indent=4` `-   name` four). What the text does not show keeps DEFAULT_INDENT's."""
    mapping, sequence, offset = DEFAULT_INDENT
    seen_map = seen_seq = False
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for prev, line in itertools.pairwise(lines):
        key = _KEY_LINE.match(prev)
        if key is None:
            continue
        k, at = len(key.group(1)), len(line) - len(line.lstrip(" "))
        if line.lstrip().startswith("- ") and at >= k and not seen_seq:
            item = line.lstrip()[1:]  # its keys' column: past the dash and the spaces after it
            seen_seq, offset, sequence = True, at - k, at - k + 1 + len(item) - len(item.lstrip(" "))
        elif at > k and not line.lstrip().startswith("- ") and not seen_map:
            seen_map, mapping = True, at - k
        if seen_map and seen_seq:
            break
    return mapping, sequence, offset


def _dump(data: Any, indent: Indent = DEFAULT_INDENT) -> str:
    out = io.StringIO()
    yaml = _yaml()
    yaml.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    yaml.brace_single_entry_mapping_in_flow_sequence = True  # `[{name: a}]`, not `[name: a]`
    yaml.dump(data, out)
    return out.getvalue()


def _dump_unshared(data: Any, expected: Any, file: str, indent: Indent = DEFAULT_INDENT) -> str:
    """`data` as YAML text that reads back as `expected` (the plain data with only the updates).

    A mapping that YAML shares (`&base` merged with `<<: *base` into another model, or a
    `load_seconds: *ls` alias) is written once: a field set in it reaches every entry that uses it.
    Each entry of models/classes whose field reads back different from `expected` gets its own copy
    of that field, so the sharing ends for that field only. An entry that then still reads back
    different (it merges an entry that was updated, and inherits a field that it should not have
    at all) is written out whole, without its merge (its own comments go with it). Raises ValueError
    if the text still reads back different (a share this cannot undo)."""
    for attempt in range(4):
        text = _dump(data, indent)
        got = _plain(_yaml().load(text))
        if got == expected:
            return text
        for section in ("models", "classes"):
            items = data.get(section) if isinstance(data, dict) else None
            now = got.get(section) if isinstance(got, dict) else None
            want = expected.get(section) if isinstance(expected, dict) else None
            for i, (entry, have, should) in enumerate(zip(items or [], now or [], want or [], strict=False)):
                if not (isinstance(entry, dict) and isinstance(have, dict) and isinstance(should, dict)):
                    continue
                if attempt == 2 and have != should:
                    data[section][i] = copy.deepcopy(should)
                    continue
                for key, value in should.items():
                    if have.get(key) != value:
                        entry[key] = copy.deepcopy(value)
    raise ValueError(
        f"{file}: the update would also change entries that share a YAML anchor with the updated "
        "one; give that entry its own copy of the field by hand"
    )


def _printable(line: str) -> str:
    """`line` with each character YAML does not take in a comment (a control character; a file name's
    byte that is not UTF-8, which Python hands over as a lone surrogate) written as its escape."""
    return "".join(
        ch if ch == "\t" or (ch.isprintable() and not 0xD800 <= ord(ch) <= 0xDFFF) else ascii(ch)[1:-1]
        for ch in line
    )


TUNING_HEADERS = ("# Tuned by `residency tune` ", "# Proposed by the service's tuning ")
"""How the lines `residency tune` and the service's tuning put atop a config they write begin."""
MEASURE_HEADERS = ("# load_seconds and memory measured by `residency measure ",)
"""How the line `residency measure --write-config` puts atop a config it writes begins."""
GENERATED_HEADERS = (TUNING_HEADERS, MEASURE_HEADERS)
"""The tools' header lines, by tool: a config written again by one gets its new line in place of
that tool's last one; the other tool's line stays."""

TUNED_NOTE = "# residency tune: "
"""How the note at the end of a line whose value tuning changed begins: `# residency tune:
tts.keep_alive was 30m` (several fields on one line: `..., tts.prewarm was true`). The comment a
person wrote for the value they chose stays; the note says that value was replaced, and by which."""
_NOTE_RE = re.compile(r"\s*# residency tune: (?P<items>\S+ was .*?)\s*$")
_NOTE_ITEM_RE = re.compile(r"(?P<field>\S+) was (?P<was>.*)")


def _note_value(v: Any, present: bool) -> str:
    """A field's value as the note shows it: YAML spelling (`true`, `null`), `unset` when absent."""
    if not present:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def _same_setting(key: str, a: str, b: str) -> bool:
    """Whether the note values `a` and `b` of the field `key` mean the same (`3GiB` and 3221225472)."""
    if a == b:
        return True
    from manager.config_schema import _parse_keep_alive
    from manager.units import parse_size

    parse = {"reserve": parse_size, "memory": parse_size, "keep_alive": _parse_keep_alive}.get(key)
    try:
        return parse is not None and parse(a) == parse(b)
    except (ValueError, TypeError):
        return False


def _get_path(entry: Any, key: str) -> tuple[bool, Any]:
    """(present, value) of the dotted `key` in the plain mapping `entry`."""
    for part in key.split("."):
        if not isinstance(entry, dict) or part not in entry:
            return False, None
        entry = entry[part]
    return True, entry


def _line_of_field(data: Any, section: str, name: str, key: str) -> int | None:
    """0-based line of `key` in the entry `name` of `section` in round-trip `data`, or None."""
    items = data.get(section) if isinstance(data, dict) else None
    entry = next((e for e in items or [] if isinstance(e, dict) and e.get("name") == name), None)
    *parents, last = key.split(".")
    for part in parents:
        entry = entry.get(part) if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not hasattr(entry, "lc"):
        return None
    try:
        return int(entry.lc.key(last)[0])
    except (KeyError, TypeError):  # the key only comes from a merged (`<<: *base`) mapping
        return None


def _noted(
    text: str, before: Any, updates: dict[str, dict[str, dict[str, Any]]], expected: Any
) -> tuple[str, Any]:
    """`text` with a `# residency tune: NAME.FIELD was OLD` note at the end of each line whose value
    the updates changed, and the plain data it reads as. A line noted by an earlier tuning keeps the
    value a person had chosen (its first `was`); a field tuned back to that value loses its note,
    and one tuned back to its default where the person had not set it at all (`was unset`) loses its
    line too, as the person wrote the file (failing that, it keeps the line and its note). `text`
    and `expected` themselves when the notes would not read back as `expected` (a line that takes
    no comment)."""
    data = _yaml().load(text)
    # line: [(NAME.FIELD, old, new, (section, name, field))]
    per_line: dict[int, list[tuple[str, str, str, tuple[str, str, str]]]] = {}
    for section, by_name in updates.items():
        items = before.get(section) if isinstance(before, dict) else None
        for name, changes in by_name.items():
            entry = next((e for e in items or [] if isinstance(e, dict) and e.get("name") == name), {})
            for key, value in changes.items():
                line = _line_of_field(data, section, name, key)
                if line is None:
                    continue
                present, prior = _get_path(entry, key)
                old = _note_value(prior, present)
                where = (section, name, key)
                per_line.setdefault(line, []).append((f"{name}.{key}", old, _note_value(value, True), where))
    for drop in (True, False):
        lines = text.splitlines(keepends=True)
        unset = copy.deepcopy(expected) if drop else expected
        dropped = False
        for line, fields in per_line.items():
            if line >= len(lines):
                continue
            body = lines[line].rstrip("\r\n")
            m = _NOTE_RE.search(body)
            was: dict[str, str] = {}
            if m:
                body = body[: m.start()]
                for item in m.group("items").split(", "):
                    im = _NOTE_ITEM_RE.fullmatch(item)
                    if im:
                        was[im.group("field")] = im.group("was")
            back: tuple[str, str, str] | None = None  # the line's one field, tuned back to unset
            for field, old, new, where in fields:
                first = was.setdefault(field, old)  # an earlier note holds the value a person chose
                if _same_setting(field.rpartition(".")[2], first, new):
                    del was[field]
                elif drop and first == "unset" and len(fields) == 1 and _means_default(expected, *where):
                    back = where
            if back is not None and len(was) == 1 and _only_the_field(body, back[2]):
                _del_path(unset, *back)
                lines[line] = ""
                dropped = True
                continue
            cut = _without_flow_field(body, back[2]) if back is not None and len(was) == 1 else None
            if back is not None and cut is not None:  # (`- {name: llm, ..., keep_alive: auto}`)
                _del_path(unset, *back)
                lines[line] = cut + "\n"
                dropped = True
                continue
            note = ", ".join(f"{f} was {w}" for f, w in was.items())
            lines[line] = body + (f"  {TUNED_NOTE}{note}" if note else "") + "\n"
        if not dropped:  # (the same lines as the pass without dropping would give)
            return _if_same("".join(lines), expected, text), expected
        if _if_same("".join(lines), unset, text) != text:
            return "".join(lines), unset
    raise AssertionError("unreachable: the second pass drops nothing")  # pragma: no cover


def _means_default(expected: Any, section: str, name: str, key: str) -> bool:
    """Whether the entry `name` of `section` in the plain `expected` reads the same with its field
    `key` (dotted: nested) left out: its value is the field's default."""
    without = copy.deepcopy(expected)
    if not _del_path(without, section, name, key):
        return False
    try:
        return bool(_validate(expected, "") == _validate(without, ""))
    except (ConfigError, ValueError, TypeError):
        return False


def _del_path(plain: Any, section: str, name: str, key: str) -> bool:
    """Remove the dotted `key` from the entry `name` of `section` in the plain data; whether it was there."""
    items = plain.get(section) if isinstance(plain, dict) else None
    entry = next((e for e in items or [] if isinstance(e, dict) and e.get("name") == name), None)
    *parents, last = key.split(".")
    for part in parents:
        entry = entry.get(part) if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or last not in entry:
        return False
    del entry[last]
    return True


def _only_the_field(body: str, key: str) -> bool:
    """Whether the line `body` (its tuning note cut off) is the block-mapping line `KEY: value` of
    the last part of the dotted `key` and nothing else (no other key, no comment a person added)."""
    last = key.rpartition(".")[2]
    return re.fullmatch(rf"[ \t]+{re.escape(last)}[ \t]*:[ \t]+[^\s#{{\[|>&*!'\"][^#]*", body) is not None


def _without_flow_field(body: str, key: str) -> str | None:
    """The line `body` (its tuning note cut off) without the plain `KEY: value` of a flow mapping on
    it (`- {name: llm, keep_alive: auto}` -> `- {name: llm}`), or None when it has none such. What is
    cut is checked by the caller: the file must read back as it should (`_if_same`)."""
    if "." in key:
        return None
    k, value = re.escape(key), r"[^\s,{}\[\]#'\"][^,{}\[\]#]*?"
    for pattern in (
        rf",[ \t]*{k}[ \t]*:[ \t]+{value}[ \t]*(?=[,}}])",
        rf"(?<={{)[ \t]*{k}[ \t]*:[ \t]+{value}[ \t]*,[ \t]*",
    ):
        m = re.search(pattern, body)
        if m is not None:
            return body[: m.start()] + body[m.end() :]
    return None


def _if_same(out: str, expected: Any, text: str) -> str:
    """`out` (a file with notes written into its comments) when it still reads as `expected`, else
    `text` as it was: a note never changes what the file means."""
    try:
        same = _plain(_yaml().load(out)) == expected
    except (YAMLError, ValueError):
        same = False
    return out if same else text


MEASURED_NOTE = "# residency measure: "
"""How the comment on a line whose value `residency measure` changed begins: `# residency measure:
memory was 9GiB (from the model card)`. It takes the place of the comment that was there, which
spoke of the old value (its words are kept, in brackets); a line with no comment gets none (the
header line says what was measured), nor does a line whose value stayed."""
_MEASURED_RE = re.compile(r"# residency measure: (?P<items>\S+ was .*?)(?: \((?P<words>.*)\))?")
_ITEMS_RE = re.compile(r"(?P<field>\S+) was (?P<was>.*?)(?=, \S+ was |$)")


def _comment_columns(node: Any, out: dict[int, int], seen: set[int]) -> dict[int, int]:
    """{0-based line: column of the first comment that starts on it} over round-trip `node`."""
    if id(node) in seen:
        return out
    seen.add(id(node))
    ca = getattr(node, "ca", None)
    stack: list[Any] = [ca.comment, list(ca.items.values()), ca.end] if ca is not None else []
    while stack:
        x = stack.pop()
        if isinstance(x, CommentToken) and x.start_mark is not None and x.value.startswith("#"):
            line, col = x.start_mark.line, x.start_mark.column
            out[line] = min(col, out.get(line, col))
        elif isinstance(x, list):
            stack.extend(x)
    for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
        _comment_columns(child, out, seen)
    return out


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted key, value) of each scalar that setting `key` to `value` (a mapping: each of its keys) sets."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _leaves(f"{key}.{k}", v)]
    return [(key, value)]


def _same_measured(key: str, a: str, b: str) -> bool:
    """Whether the note values `a` and `b` of `key` mean the same (`9GiB` and 9663676416; 3 and 3.0)."""
    if _same_setting(key, a, b):
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def _measure_noted(text: str, before: Any, updates: dict[str, dict[str, Any]], expected: Any) -> str:
    """`text` where each line whose value a model update changed, and that has a comment, has that
    comment replaced by `MEASURED_NOTE`, `FIELD was OLD (the comment's words)`. A line noted by an
    earlier measurement keeps its first `was` and the words; measured back to that value, the line
    gets the person's comment back. A tuning note at the end of the line stays after the new note.
    `text` itself when the notes would not read back as `expected`."""
    data = _yaml().load(text)
    per_line: dict[int, list[tuple[str, str, str, str]]] = {}  # line: [(entry, key, old, new)]
    items = before.get("models") if isinstance(before, dict) else None
    for name, changes in updates.items():
        entry = next((e for e in items or [] if isinstance(e, dict) and e.get("name") == name), {})
        for key, value in changes.items():
            for leaf, new in _leaves(key, value):
                present, prior = _get_path(entry, leaf)
                old_s, new_s = _note_value(prior, present), _note_value(new, True)
                line = _line_of_field(data, "models", name, leaf)
                if line is not None and not _same_measured(leaf.rpartition(".")[2], old_s, new_s):
                    per_line.setdefault(line, []).append((name, leaf, old_s, new_s))
    columns = _comment_columns(data, {}, set())
    lines = text.splitlines(keepends=True)
    for line, fields in per_line.items():
        col = columns.get(line)
        if line >= len(lines) or col is None:
            continue
        body = lines[line].rstrip("\r\n")
        if body[col : col + 1] != "#" or not body[:col].strip():  # not a comment after a value
            continue
        pre, comment = body[:col], body[col:]
        tuned = _NOTE_RE.search(comment)
        tail = comment[tuned.start() :].strip() if tuned else ""
        comment = comment[: tuned.start()].rstrip() if tuned else comment.rstrip()
        m = _MEASURED_RE.fullmatch(comment)
        was = {i.group("field"): i.group("was") for i in _ITEMS_RE.finditer(m.group("items"))} if m else {}
        words = (m.group("words") or "") if m else comment[1:].strip()
        if not was and not words:  # only a tuning note: nothing said of the old value
            continue
        # a field is named by its key (`memory`, `disk`), or by entry and path where that is ambiguous
        keys = {k.rpartition(".")[2] for _, k, *_ in fields}
        short = len({n for n, *_ in fields}) == 1 and len(keys) == len(fields)
        for name, key, old, new in fields:
            label = key.rpartition(".")[2] if short else f"{name}.{key}"
            first = was.setdefault(label, old)  # an earlier note holds the value a person wrote
            if _same_measured(key.rpartition(".")[2], first, new):
                del was[label]
        if was:
            note = MEASURED_NOTE + ", ".join(f"{f} was {w}" for f, w in was.items())
            note += f" ({words})" if words else ""
        else:
            note = f"# {words}" if words else ""
        note = "  ".join(x for x in (note, tail) if x)
        pre = pre if pre.endswith("  ") or not note else pre.rstrip() + "  "
        lines[line] = (pre + note if note else pre.rstrip()) + "\n"
    return _if_same("".join(lines), expected, text)


AliasComment = tuple[tuple[Any, ...], str, int]
"""(the path of keys and indices to a field whose value is an alias, its line's own end-of-line
comment, that comment's column)."""


def _alias_comments(data: Any) -> list[AliasComment]:
    """Take out of round-trip `data` the end-of-line comments of lines whose value is an alias of a
    scalar (`keep_alive: *ka  # words`), and return them, for `_with_alias_comments`.

    ruamel reads such a line with the comment of the line its anchor is on (the node is shared, and
    so is its comment) and puts the line's own comment before the next item of an enclosing
    collection, or at its end; it writes a shared node's comment once, beside the anchor. Written
    back, the anchor's words would land on the alias's line (or the alias's on the anchor's) and the
    alias's words on a line of their own below. Here the alias loses the shared comment, and its own
    comment goes back on its line after the file is written."""
    tokens: dict[int, tuple[list[Any], CommentToken]] = {}  # line: (the list holding it, the token)
    aliases: list[tuple[tuple[Any, ...], Any, Any]] = []  # (path, mapping, key)
    seen: set[int] = set()
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen or not isinstance(node, dict | list):
            continue
        seen.add(id(node))
        ca = getattr(node, "ca", None)
        held: list[Any] = [ca.end, ca.comment, *ca.items.values()] if ca is not None else []
        while held:
            x = held.pop()
            if isinstance(x, list):
                held.extend(y for y in x if isinstance(y, list))
                for tok in x:
                    if isinstance(tok, CommentToken) and tok.start_mark is not None:
                        tokens.setdefault(tok.start_mark.line, (x, tok))
        for key, value in node.items() if isinstance(node, dict) else ():
            anchor = getattr(getattr(value, "anchor", None), "value", None)
            if anchor is not None and not isinstance(value, dict | list) and hasattr(node, "lc"):
                aliases.append(((*path, key), node, key))
        children = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend(((*path, k), v) for k, v in children)
    out: list[AliasComment] = []
    for path, mapping, key in aliases:
        try:
            key_line, value_line = int(mapping.lc.key(key)[0]), int(mapping.lc.value(key)[0])
        except (KeyError, TypeError, IndexError):
            continue
        if value_line >= key_line:  # the anchor itself (an alias comes after its anchor)
            continue
        slot = mapping.ca.items.get(key)
        shared = slot[2] if slot and len(slot) > 2 else None
        if (
            isinstance(shared, CommentToken)
            and shared.start_mark is not None
            and shared.start_mark.line == value_line  # the anchor line's comment
        ):
            del mapping.ca.items[key]
        own = tokens.pop(key_line, None)
        if own is None or not own[1].value.startswith("#"):
            continue
        held_in, tok = own
        first, _, rest = tok.value.partition("\n")
        if rest:  # blank lines and comment lines after it stay where they are
            tok.value = rest
        else:
            held_in.remove(tok)
        out.append((path, first.rstrip(), tok.start_mark.column))
    return out


def _with_alias_comments(text: str, comments: list[AliasComment], expected: Any) -> str:
    """`text` with each comment of `_alias_comments` back at the end of its field's line (where that
    line has no comment of its own now); `text` as it is if that would not read back as `expected`."""
    if not comments:
        return text
    data = _yaml().load(text)
    lines = text.splitlines(keepends=True)
    for path, comment, column in comments:
        node = data
        try:
            for part in path[:-1]:
                node = node[part]
            line = int(node.lc.key(path[-1])[0])
        except (KeyError, IndexError, TypeError, AttributeError):
            continue
        if line >= len(lines) or "#" in lines[line]:
            continue
        body = lines[line].rstrip("\r\n")
        lines[line] = body + " " * max(2, column - len(body)) + comment + "\n"
    return _if_same("".join(lines), expected, text)


def write_config_with_updates(
    src: Path,
    dst: Path,
    model_updates: dict[str, dict[str, Any]],
    class_updates: dict[str, dict[str, Any]] | None = None,
    header_comment: str | None = None,
    *,
    note_changes: bool = False,
    note_measured: bool = False,
) -> Config:
    """Copy `src` to `dst` with some model/class fields changed, keeping comments and key order.

    `model_updates` is {model name: {field: value}} (values as YAML scalars: "45m", False, 600);
    `class_updates` the same for classes. `header_comment` (may span lines) is prepended as
    `# ...` lines. With `note_changes` (tuning), each line whose value changed ends in a note
    saying so and what the value was (`TUNED_NOTE`): the comment a person wrote beside or above the
    value they chose would otherwise speak of a value that is gone. With `note_measured` (measure),
    the comment beside a model value that changed is replaced by one saying what the value was
    (`MEASURED_NOTE`). The result is validated before `dst` is written (ConfigError naming `dst`);
    unknown model or class names raise ValueError.
    """
    with Path(src).open(encoding="utf-8", newline="") as f:  # its line endings, as written
        raw = f.read()
    newline = _newline_of(raw)
    data = _parse_yaml(raw.replace("\r\n", "\n").replace("\r", "\n"), str(src))
    alias_comments = _alias_comments(data)
    try:
        expected = _plain(data)  # every alias its own copy: what the updates alone should give
    except (_TooManyNodes, RecursionError):
        raise ConfigError(str(src), [("", "too many values once YAML aliases are expanded")]) from None
    before = copy.deepcopy(expected)
    _apply(expected, "models", model_updates, str(src))
    _apply(expected, "classes", class_updates or {}, str(src))
    _apply(data, "models", model_updates, str(src))
    _apply(data, "classes", class_updates or {}, str(src))
    indent = _indentation(raw.replace("\r\n", "\n").replace("\r", "\n"))  # (the file's own)
    text = _with_alias_comments(_dump_unshared(data, expected, str(src), indent), alias_comments, expected)
    if note_changes:
        text, expected = _noted(
            text, before, {"models": model_updates, "classes": class_updates or {}}, expected
        )
    if note_measured:
        text = _measure_noted(text, before, model_updates, expected)
    text = _lost_comments_restored(raw.replace("\r\n", "\n").replace("\r", "\n"), text, str(src))
    if header_comment:
        # a config tuned (or measured) again gets the new line in place of that tool's last one (not a
        # stack of one more line a week); the other tool's line and the user's own comments stay
        head = "".join(f"# {_printable(line)}".rstrip() + "\n" for line in header_comment.splitlines())
        own = next((g for g in GENERATED_HEADERS if head.startswith(g)), ())
        lines = text.splitlines(keepends=True)
        n = 0
        while n < len(lines) and lines[n].startswith(TUNING_HEADERS + MEASURE_HEADERS):
            n += 1
        kept = [line for line in lines[:n] if not (own and line.startswith(own))]
        text = head + "".join(kept + lines[n:])
    config = _validate(_parse_yaml(text, str(dst)), str(dst))
    if raw and not raw.endswith(("\n", "\r")):  # no newline at its end: none added
        text = text.removesuffix("\n")
    with Path(dst).open("w", encoding="utf-8", newline=newline) as f:  # `\n` written as `newline`
        f.write(text)
    return config


def _content(line: str) -> str:
    """A YAML line without its comment at the end (a ` #` outside quotes) and surrounding blanks."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].strip()
    return line.strip()


def _loose_key(content: str) -> str:
    """What a line is about, whatever value it holds: a flow entry's `- {name: X`, else its text up
    to its first `:` (a line a tool changed still has it)."""
    m = re.match(r"(-\s*\{\s*name:\s*[^,}]+)", content)
    if m:
        return m.group(1).strip()
    return content.split(":", 1)[0] if ":" in content else content


def _lost_comments_restored(src: str, text: str, file: str) -> str:
    """`text` (`src` dumped again) with the comment lines of `src` that ruamel's round trip lost put
    back, each run before the flow-list entry that followed it in `src`. ruamel drops a comment line
    between two entries of a list of flow mappings when the first has no comment at its end and the
    second has one (`- {name: a}` / `# about b` / `- {name: b}  # b`): at its load already, so a tuned
    config lost the user's own words at each write, even with no change. Only such runs are mended:
    those above a flow entry (`- {`) found in `text` (as it is, or by its `- {name: X`), missing from
    the comment lines just above it there. Left as it is when the lines put back would change what
    the file says (never seen: comment lines hold no data)."""
    out = text.split("\n")
    inserts: dict[int, list[str]] = {}  # output line index -> comment lines to put before it
    run: list[str] = []  # the comment lines since the last line of data
    j = 0
    for line in src.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            run.append(line)
            continue
        if not stripped:
            continue
        content, comments, run = _content(line), run, []
        flow = content.startswith("- {")
        k = next((i for i in range(j, len(out)) if _content(out[i]) == content), None)
        if k is None and flow:  # (a value a tool changed on it: found by its name)
            key = _loose_key(content)
            k = next(
                (
                    i
                    for i in range(j, len(out))
                    if _content(out[i]).startswith("- {") and _loose_key(_content(out[i])) == key
                ),
                None,
            )
        if k is None:
            continue  # (not in `text` as it was: joined to the line before, say)
        j = k + 1
        if not (flow and comments):
            continue
        above: list[str] = []  # the comment lines just above it in `text`
        i = k - 1
        while i >= 0 and (not out[i].strip() or out[i].strip().startswith("#")):
            above.append(out[i].strip())
            i -= 1
        missing = []
        for c in comments:
            if c.strip() in above:
                above.remove(c.strip())
            else:
                missing.append(c)
        if missing:
            inserts.setdefault(k, []).extend(missing)
    if not inserts:
        return text
    restored = "\n".join(line for i, kept in enumerate(out) for line in (*inserts.get(i, ()), kept))
    try:
        same = _plain(_parse_yaml(restored, file)) == _plain(_parse_yaml(text, file))
    except (ConfigError, _TooManyNodes, RecursionError):
        same = False
    return restored if same else text


def _newline_of(text: str) -> str:
    """The line ending `text` uses: that of its first line (`\\r\\n` in a file saved on Windows);
    `\\n` for a file of one line."""
    m = re.search(r"\r\n|\n|\r", text)
    return m.group() if m else "\n"
