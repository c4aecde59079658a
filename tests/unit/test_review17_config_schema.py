"""Review 17: the JSON Schema (`residency config schema`, what editors and check-jsonschema validate a
config with) takes exactly what `load_config` takes. The shipped home config is edited one field at a
time (every field of every section, whether home.yaml sets it or not) to edge values: whole and
fractional floats where integers go, infinities, -0.0, negatives, huge numbers, bools, nulls, empty
strings, unit spellings, a trailing newline, wrong types, unknown and non-string keys at every level.
Each edit must be taken by both or refused by both, but for what JSON Schema cannot say (below)."""

from __future__ import annotations

import copy
import io
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from ruamel.yaml import YAML

from manager import config as config_module
from manager.config import Config, ConfigError, config_json_schema, load_config
from manager.units import DURATION_PATTERN, MAX_SIZE, SIZE_PATTERN

HOME = Path(__file__).resolve().parents[2] / "configs" / "home.yaml"
BASE: dict[str, Any] = YAML(typ="safe").load(HOME.read_text(encoding="utf-8"))

# What load_config refuses that the schema cannot say, kept out of the parity check:
#  - cross-field checks (model validators): unique names; a model's device and class exist; one device
#    per GPU; class reserves and pinned models fit each device, every model fits below higher
#    reserves; reserve < memory (devices, host); elastic.min <= max; load_seconds host <= cached <=
#    disk; store.request_log_retention >= tuning.since; server.tls_cert and tls_key go together;
#  - a size or duration written as a string above its field's maximum (`3651d`, `4GiB` for
#    server.max_request_bytes): a pattern says the spelling, not the value it adds up to;
#  - NaN (YAML `.nan`): not a JSON value, so JSON Schema has no word for it (Python's jsonschema
#    compares it with `minimum` and `maximum` and lets it through);
#  - store.url past its scheme: the sqlite path and the redis url's host, port, db and parameters
#    (the store's rules, manager/store/redis_url.py).
CROSS_CHECKS = re.compile(
    "|".join(
        (
            r"duplicate name",
            r"unknown (device|class) ",
            r"is already device",
            r"class reserves and pinned models need",
            r"can never fit on",
            r"must be less than memory",
            r"must not be larger than max",
            r"must not be slower than disk",
            r"must be between host",
            r"is shorter than tuning\.since",
            r"tls_cert and tls_key go together",
        )
    )
)
UPPER_BOUND = re.compile(r"of at most|less than or equal to")

EDGES: list[Any] = [
    *(0, 1, 2, 3, -1, 16, 17, 255, 256, 4096, 4097, 86400, 86401, 315360000, 315360001),
    *(2**31 - 1, 2**31, MAX_SIZE, MAX_SIZE + 1, 2**63, 2**64, 10**30, 10**400),
    *(0.0, -0.0, 1.0, 2.0, 0.5, 1.5, 1e-300, 5e-324, 1e3, 1e20, 1e308, math.inf, -math.inf, math.nan),
    *(True, False, None, [], {}, [1], {"a": 1}),
    *("", " ", "0", "1", "2.0", "-1", "1e3", "0x10", "1_000", "１", "inf", ".inf", "nan", "abc", "a b"),
    *("30m", "0s", "1h30m", "10d", "3651d", "86401", "0.5s", "24GiB", "24 GiB", "1GiB", "0GiB", "2GiB"),
    *("auto", " auto ", "forever", "Forever", "yes", "YES", "off", "daily", "auto", "propose", "cuda"),
    *("gpu0", "host", "realtime", "rt", "127.0.0.1:1", "h:1", "ray://h:1", "sqlite:///x.db"),
    *("a\n", "gpu0\n", "auto\n", "yes\n", "30m\n", "24GiB\n", "h:1\n", "ray://h:1\n", "forever\n"),
]
BAD_KEYS: list[Any] = [1, True, None, "", "bogus", "class_"]

# Each kind of section once (home.yaml's models[3] has `elastic`, models[6] a `source` with a list).
SECTIONS: list[tuple[str | int, ...]] = [
    ("server",),
    ("store",),
    ("ray",),
    ("devices", 0),
    ("host",),
    ("classes", 0),
    ("models", 0),
    ("models", 3),
    ("models", 0, "load_seconds"),
    ("models", 3, "elastic"),
    ("models", 6, "source"),
    ("policy",),
    ("tuning",),
]


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model of the section at `loc` (None for a free mapping: `source`)."""
    cls: type[BaseModel] | None = Config
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = next(f for n, f in cls.model_fields.items() if part in (n, f.alias))
        cls = config_module._submodel(field.annotation)
    return cls


def _section(data: Any, loc: tuple[str | int, ...]) -> Any:
    for part in loc:
        if isinstance(part, str) and part not in data:
            data[part] = {}
        data = data[part]
    return data


def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(config_json_schema())


def _loader_errors(data: Any) -> list[tuple[str, str]]:
    """load_config's errors for the plain data (the YAML file it would read), [] if it takes it."""
    try:
        config_module._validate(copy.deepcopy(data), "c.yaml")
    except ConfigError as exc:
        return exc.errors
    return []


def _cannot_say(value: Any, errors: list[tuple[str, str]]) -> bool:
    """Whether every error is one the schema cannot say (the list above)."""
    if isinstance(value, float) and math.isnan(value):
        return True
    bounded = isinstance(value, str) and bool(
        re.match(SIZE_PATTERN, value) or re.match(DURATION_PATTERN, value)
    )
    return all(
        CROSS_CHECKS.search(msg) or path == "store.url" or (bounded and UPPER_BOUND.search(msg))
        for path, msg in errors
    )


def _disagreement(validator: jsonschema.Draft202012Validator, data: Any, value: Any, what: str) -> str | None:
    errors = _loader_errors(data)
    schema_takes = validator.is_valid(data)
    if schema_takes == (not errors):
        return None
    if schema_takes and _cannot_say(value, errors):
        return None
    said = "; ".join(f"{p}: {m}" for p, m in errors) or "taken"
    return f"{what}: load_config {said!r}, the schema {'takes' if schema_takes else 'refuses'} it"


def _edits() -> list[tuple[Any, Any, str]]:
    """(edited data, the value put in, what was done) for every single-field edit."""
    out: list[tuple[Any, Any, str]] = []
    for loc in SECTIONS:
        model = _model_at(loc)
        fields = [f.alias or n for n, f in model.model_fields.items()] if model else []
        for key in BAD_KEYS:
            data = copy.deepcopy(BASE)
            _section(data, loc)[key] = 1
            out.append((data, None, f"{loc} key {key!r}"))
        for value in [*EDGES, {1: "x"}]:
            data = copy.deepcopy(BASE)
            _section(data, loc[:-1])[loc[-1]] = copy.deepcopy(value)
            out.append((data, value, f"{loc} = {value!r}"))
        for field in fields:
            if field in _section(copy.deepcopy(BASE), loc):
                data = copy.deepcopy(BASE)
                del _section(data, loc)[field]
                out.append((data, None, f"{loc} without {field!r}"))
            for value in EDGES:
                data = copy.deepcopy(BASE)
                _section(data, loc)[field] = copy.deepcopy(value)
                out.append((data, value, f"{(*loc, field)} = {value!r}"))
    return out


def test_the_schema_takes_exactly_what_load_config_takes() -> None:
    """`max_batch: 2.0` (and `index`, `frontends`, `max_queue`) passed the schema (JSON Schema's
    integer is any number without a fraction) and load_config refused it; `keep_alive: .inf` (read as
    forever) was refused by the schema; `name: "a\\n"`, `listen: "h:1\\n"`, `pin: "yes\\n"` passed
    Python's JSON Schema validators (`$` also matches before a final newline in Python's re) and
    `source: {1: x}` passed the schema; load_config refused them."""
    validator = _validator()
    assert validator.is_valid(BASE) and not _loader_errors(BASE)
    found = [d for data, value, what in _edits() if (d := _disagreement(validator, data, value, what))]
    assert found == [], f"{len(found)} disagreements:\n" + "\n".join(found[:40])


# ---- random edits (hypothesis) -------------------------------------------------------------------

_PATHS = [
    (*loc, f.alias or n) for loc in SECTIONS if (m := _model_at(loc)) for n, f in m.model_fields.items()
]

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=5000).map(lambda f: float(round(f))),  # whole floats
    st.text(max_size=12),
    st.from_regex(r"\A ?[0-9]{1,4}(\.[0-9]{0,2})? ?(ms|s|m|h|d|w|B|KiB|MiB|GiB|TiB|kB|MB|GB)? ?\n?\Z"),
    st.sampled_from(["auto", "forever", "yes", "no", "on", "off", "sqlite:///a.db", "redis://h:1/0"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@settings(max_examples=300)
@given(path=st.sampled_from(_PATHS), value=values)
def test_random_edits_agree(path: tuple[str | int, ...], value: Any) -> None:
    data = copy.deepcopy(BASE)
    _section(data, path[:-1])[path[-1]] = value
    assert _disagreement(_validator(), data, value, f"{path} = {value!r}") is None


# ---- through YAML, as a user writes them ---------------------------------------------------------


def _yaml_both(tmp_path: Path, old: str, new: str) -> tuple[Any, bool]:
    """(load_config's Config, or the ConfigError text; whether the schema takes the file's data)."""
    text = HOME.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    data = YAML(typ="safe").load(io.StringIO(path.read_text(encoding="utf-8")))
    try:
        loaded: Any = load_config(path)
    except ConfigError as exc:
        loaded = str(exc)
    return loaded, _validator().is_valid(data)


def test_keep_alive_inf_is_forever_for_both(tmp_path: Path) -> None:
    """YAML's `.inf` as a keep-alive is what `forever` is to load_config (no expiry); the schema
    refused it. `-.inf` was refused by both; since the thirtieth session a negative keep-alive is
    forever in the config too (Ollama's `-1`, as a request's own keep-alive reads it), so both take
    it, as forever."""
    cfg, schema_takes = _yaml_both(tmp_path, "keep_alive: forever", "keep_alive: .inf")
    assert isinstance(cfg, Config) and cfg.model("voice").keep_alive == math.inf and schema_takes
    cfg, schema_takes = _yaml_both(tmp_path, "keep_alive: forever", "keep_alive: -.inf")
    assert isinstance(cfg, Config) and cfg.model("voice").keep_alive == math.inf and schema_takes
    for negative in ("-1", "'-1m'", "-0.5"):
        cfg, schema_takes = _yaml_both(tmp_path, "keep_alive: forever", f"keep_alive: {negative}")
        assert isinstance(cfg, Config) and cfg.model("voice").keep_alive == math.inf and schema_takes, (
            negative
        )
    cfg, schema_takes = _yaml_both(tmp_path, "keep_alive: forever", "keep_alive: '-0s'")
    assert isinstance(cfg, Config) and cfg.model("voice").keep_alive == 0 and schema_takes  # (as Go reads it)
    said, schema_takes = _yaml_both(tmp_path, "keep_alive: forever", "keep_alive: '-x'")
    assert isinstance(said, str) and ":45: models[0].keep_alive: expected 'auto', 'forever'" in said
    assert not schema_takes


@pytest.mark.parametrize(
    ("old", "new", "field", "want"),
    [
        ("max_batch: 64 ", "max_batch: 64.0 ", ("embed", "max_batch"), 64),
        ("max_batch: 64 ", "max_batch: 1e3 ", ("embed", "max_batch"), 1000),
        ("index: 0,", "index: 0.0,", ("gpu0", "index"), 0),
        ("frontends: 1 ", "frontends: 1.0 ", ("server", "frontends"), 1),
    ],
)
def test_a_whole_float_where_an_integer_goes_is_taken_as_the_schema_takes_it(
    tmp_path: Path, old: str, new: str, field: tuple[str, str], want: int
) -> None:
    """JSON Schema's `integer` is any number without a fraction, so editors took `max_batch: 64.0`;
    load_config said "expected a valid integer, got 64.0". Now both take it, as the integer."""
    cfg, schema_takes = _yaml_both(tmp_path, old, new)
    assert isinstance(cfg, Config), cfg
    assert schema_takes
    owner, name = field
    section = cfg.server if owner == "server" else cfg.device(owner) if owner == "gpu0" else cfg.model(owner)
    value = getattr(section, name)
    assert value == want and type(value) is int


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("max_batch: 64 ", "max_batch: 2.5 ", "models[5].max_batch: expected a whole number, got 2.5"),
        ("max_batch: 64 ", "max_batch: true ", "models[5].max_batch: expected a valid integer, got True"),
        ("max_batch: 64 ", "max_batch: '64' ", "models[5].max_batch: expected a valid integer, got '64'"),
        ("max_batch: 64 ", "max_batch: .inf ", "models[5].max_batch: expected a whole number, got inf"),
        ("frontends: 1 ", "frontends: 16.5 ", "server.frontends: expected a whole number, got 16.5"),
    ],
)
def test_a_fraction_bool_or_string_where_an_integer_goes_is_still_refused_by_both(
    tmp_path: Path, old: str, new: str, said: str
) -> None:
    loaded, schema_takes = _yaml_both(tmp_path, old, new)
    assert isinstance(loaded, str) and said in loaded
    assert not schema_takes


def test_a_trailing_newline_is_refused_by_python_schema_validators_too(tmp_path: Path) -> None:
    """Python's `re` (jsonschema, check-jsonschema) let `$` match before a final newline, so a model
    named "voice\\n" or `listen: "h:1\\n"` passed the schema; load_config refuses them (as an editor's
    ECMA regex does)."""
    for old, new in [
        ("- name: voice ", '- name: "voice\\n" '),
        ('listen: "127.0.0.1:50051"', 'listen: "127.0.0.1:50051\\n"'),
        ("pin: true", 'pin: "yes\\n"'),
        ("address: null", 'address: "auto\\n"'),
    ]:
        loaded, schema_takes = _yaml_both(tmp_path, old, new)
        assert isinstance(loaded, str), new
        assert not schema_takes, new


def test_a_source_key_that_is_not_a_string_is_refused_by_the_schema_too(tmp_path: Path) -> None:
    loaded, schema_takes = _yaml_both(tmp_path, "source: {package: ", "source: {1: x, package: ")
    assert isinstance(loaded, str) and "models[5].source: keys must be names (strings), got 1" in loaded
    assert not schema_takes
