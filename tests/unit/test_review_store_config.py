"""Review of the config, units and SQLite store: each test is a bug found and fixed (see its docstring)."""

from __future__ import annotations

import math
import re
import sqlite3
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from ruamel.yaml import YAML

from manager.config import ConfigError, config_json_schema, load_config
from manager.store import open_store
from manager.store import sqlite as sqlite_store
from manager.units import DURATION_PATTERN, SIZE_PATTERN, format_duration, parse_duration, parse_size

REPO = Path(__file__).resolve().parents[2]
T0 = 1_764_547_200.0

BASE = """\
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 24GiB, reserve: 1GiB}
host: {memory: 64GiB, reserve: 4GiB}
classes:
  - {name: interactive}
models:
  - {name: llm, class: interactive, adapter: silero-vad, device: gpu0, memory: 20GiB,
     load_seconds: {disk: 9, host: 2}}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def config_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return e.value


# ---- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["٣GiB", "５GiB", "٣", "１２８MiB"])
def test_sizes_take_ascii_digits_only(text: str) -> None:
    """`\\d` took Arabic-Indic and full-width digits: '٣GiB' was 3 GiB in load_config while the
    config's JSON Schema ([0-9]) refused it."""
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)
    assert parse_size("3GiB") == 3 * 2**30


@pytest.mark.parametrize("text", ["٣m", "５", "1h٣m"])
def test_durations_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(text)
    assert parse_duration("3m") == 180.0


def test_negative_zero_is_zero_and_formats_as_a_duration_that_reads_back() -> None:
    """`-0.0` (YAML `-0.0`) parsed to -0.0 seconds, and format_duration(-0.0) gave '-0s', which
    parse_duration refuses (format_duration promises a spelling it reads back)."""
    assert math.copysign(1.0, parse_duration(-0.0)) == 1.0
    assert format_duration(-0.0) == "0s"
    assert parse_duration(format_duration(-0.0)) == 0.0
    assert parse_size(-0.0) == 0


# ---- the JSON Schema against load_config ---------------------------------------------------------

SIZES = [
    "1.5GiB",
    "0",
    " 1 gib ",
    "10GB",
    "123B",
    ".5kB",
    "1.",
    "5XB",
    "1.2.3GiB",
    "10k",
    "1e3MiB",
    "30M",
    "",
]
DURATIONS = ["30m", "30M", "1h30m", "1h 30m", "5MS", "90", "1.5h", "1m30", "x", "1h-1m", "inf", "1e3", ""]
DURATIONS += ["1m1m", "30m1h", "5ms5m", "5m5ms", "1w2d3h4m5s6ms", " 1h  30m ", "1s1S", " ", "."]


@pytest.mark.parametrize("text", SIZES)
def test_the_schemas_size_pattern_is_what_parse_size_reads(text: str) -> None:
    """The schema's size pattern was `[0-9.]+ [A-Za-z]*`: '5XB', '1.2.3GiB', '10k' passed it."""
    try:
        parse_size(text)
        parsed = True
    except ValueError:
        parsed = False
    assert bool(re.match(SIZE_PATTERN, text)) == parsed


@pytest.mark.parametrize("text", DURATIONS)
def test_the_schemas_duration_pattern_is_what_parse_duration_reads(text: str) -> None:
    """Durations were any string in the schema ('soon' passed)."""
    try:
        parse_duration(text)
        parsed = True
    except ValueError:
        parsed = False
    assert bool(re.match(DURATION_PATTERN, text)) == parsed


def _plain_yaml(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("devices", "memory", "24XB"),
        ("devices", "memory", "1.2.3GiB"),
        ("devices", "memory", 2**61),  # past 1024PiB
        ("models", "memory", "20 gigs"),
        ("models", "keep_alive", "soon"),
        ("models", "keep_alive", 10**12),  # past ten years
        ("policy", "thrash_window", "10 minutes"),
    ],
)
def test_the_schema_refuses_values_load_config_refuses(
    tmp_path: Path, section: str, field: str, value: Any
) -> None:
    validator = jsonschema.Draft202012Validator(config_json_schema())
    data = _plain_yaml(write(tmp_path, BASE))
    assert list(validator.iter_errors(data)) == []
    if section == "policy":
        data["policy"] = {field: value}
    else:
        data[section][0][field] = value
    config_error(write(tmp_path, _dump(data)))  # load_config refuses it ...
    assert list(validator.iter_errors(data)) != []  # ... and now so does the schema


def _dump(data: Any) -> str:
    import io

    out = io.StringIO()
    YAML(typ="safe").dump(data, out)
    return out.getvalue()


def test_the_schema_still_takes_the_shipped_configs() -> None:
    validator = jsonschema.Draft202012Validator(config_json_schema())
    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert files
    for f in files:
        load_config(f)
        assert [e.message for e in validator.iter_errors(_plain_yaml(f))] == [], f


# ---- cross-checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["10.0.0.5:99999", "10.0.0.5:٣", "10.0.0.5:65536"])
def test_a_ray_address_needs_a_real_port(tmp_path: Path, address: str) -> None:
    """`ray.address: 10.0.0.5:99999` was accepted (str.isdigit, no range; '٣' too): `serve` then
    spent minutes trying to join a cluster at a port no socket can have."""
    err = config_error(write(tmp_path, BASE + f"ray: {{address: '{address}'}}\n"))
    assert err.errors[0][0] == "ray.address" and "port 0-65535" in err.errors[0][1]
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:9: ray.address: expected null, 'auto'")
    assert load_config(write(tmp_path, BASE + "ray: {address: '10.0.0.5:6379'}\n")).ray.address


def test_one_gpu_cannot_be_two_devices(tmp_path: Path) -> None:
    """Two cuda devices with the same index on the same node were accepted: each got the GPU's whole
    budget, and a replay kept a 20 GiB model resident on each of them (40 GiB on one 24 GiB GPU)."""
    second = "  - {name: gpu0b, kind: cuda, index: 0, memory: 24GiB, reserve: 1GiB}\nhost:"
    err = config_error(write(tmp_path, BASE.replace("host:", second, 1)))
    assert str(err) == (
        f"{tmp_path / 'c.yaml'}:3: devices[1].index: cuda index 0 on the local node is already device "
        "'gpu0' (devices[0])"
    )
    # another index, another node, or cpu devices are different memory
    for other in (
        "  - {name: gpu1, kind: cuda, index: 1, memory: 24GiB}\nhost:",
        "  - {name: gpu0b, kind: cuda, index: 0, node: box2, memory: 24GiB}\nhost:",
    ):
        assert len(load_config(write(tmp_path, BASE.replace("host:", other, 1))).devices) == 2
    cpus = BASE.replace("kind: cuda", "kind: cpu").replace(
        "host:", "  - {name: cpu1, kind: cpu, memory: 8GiB}\nhost:", 1
    )
    assert len(load_config(write(tmp_path, cpus)).devices) == 2


# ---- SQLite store ------------------------------------------------------------------------------


def test_a_reader_that_may_not_write_can_read_a_store_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a store wrote its schema and `PRAGMA user_version` every time, even with create=False
    (`residency trace export`): a user with read access only (the service runs as another user) got
    "cannot open the database: attempt to write a readonly database"."""
    url = f"sqlite:///{tmp_path}/state.db"
    service = open_store(url)  # the service keeps it open (its -wal and -shm are there)
    service.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
    connect = sqlite3.connect

    def read_only(path: str, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        return connect(f"file:{path}?mode=ro", *args, uri=True, **kwargs)

    monkeypatch.setattr(sqlite_store.sqlite3, "connect", read_only)
    reader = open_store(url, create=False)
    try:
        assert list(reader.requests(0)) == [{"t": T0, "model": "voice", "busy_s": 0.4}]
        assert reader.count_requests() == 1
    finally:
        reader.close()
        service.close()


def test_a_store_from_before_user_version_still_gets_its_schema(tmp_path: Path) -> None:
    """The schema is written when the file's version is older than this program's (a new file)."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE docs (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.commit()
    conn.close()
    store = open_store(f"sqlite:///{path}")
    try:
        store.append_requests([{"t": T0, "model": "voice", "busy_s": 0.4}])
        store.set_intent("voice", "gpu")
        assert store.count_requests() == 1 and store.intents() == {"voice": "gpu"}
    finally:
        store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (sqlite_store.SCHEMA_VERSION,)
    conn.close()
