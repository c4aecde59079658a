"""The configuration schema (▶ Contract: configuration): pydantic models and their cross-checks.

Sizes are `int` bytes (`24GiB`, `512MiB` or integers); durations are `float` seconds (`30m`, `2h`,
`45s` or numbers). Unknown fields are errors. Loading YAML and reporting errors with file and line
is `manager.config`'s job; import everything from there.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from manager.adapter_specs import BUILTIN, WORLD_ADAPTERS, adapter_problem, check_source
from manager.policy.stats import home_hours, zone_names
from manager.store.redis_url import redact, redis_url_problem
from manager.units import (
    DURATION_PATTERN,
    MAX_DURATION_S,
    MAX_SIZE,
    SIZE_PATTERN,
    format_duration,
    format_size,
    parse_duration,
    parse_keep_alive,
    parse_size,
    shown,
)

BUILTIN_NAMES = frozenset(a.name for a in BUILTIN)

Loc = tuple[str | int, ...]


def _fmt_loc(loc: Loc) -> str:
    """('models', 2, 'memory') -> 'models[2].memory'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class _FieldErrors(ValueError):
    """Raised by model validators: one (field path relative to the model, message) per problem."""

    def __init__(self, errors: list[tuple[Loc, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{_fmt_loc(loc)}: {msg}" for loc, msg in errors))


# What the JSON Schema says of sizes and durations: the spellings parse_size / parse_duration read
# (not any letters after any digits and dots), up to the largest value load_config takes.
HOST_DEVICE = "host"
"""Host RAM's name where a device's would be (an action's `device`, an event's): no device may have it."""

_SIZE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": SIZE_PATTERN},
        {"type": "number", "minimum": 0, "maximum": MAX_SIZE},  # a fraction of a byte is rounded up
    ],
    "examples": ["24GiB", "512MiB", 1073741824],
}
_DURATION_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": DURATION_PATTERN},
        {"type": "number", "minimum": 0, "maximum": MAX_DURATION_S},
    ],
    "examples": ["30m", "2h", "45s", "1h30m", 90],
}
DEFAULT_REQUEST_LOG_RETENTION_S = 8 * 7 * 86400
"""`store.request_log_retention`'s default (8w): eight times the tuning's default window
(`tuning.since`, 7d, and `residency tune --from-store`'s default `--since`)."""
MAX_LOAD_S = 86400
"""The longest load time a config takes (a day): a load is seconds to minutes."""


def _parse_config_duration(v: Any) -> float:
    seconds = parse_duration(v)
    if seconds > MAX_DURATION_S:
        raise ValueError(f"expected a duration of at most 3650d (ten years), got {shown(v)}")
    return seconds


ByteSize = Annotated[int, BeforeValidator(parse_size), WithJsonSchema(_SIZE_SCHEMA)]
"""Bytes; accepts `24GiB`, `512MiB`, `10GB` or an integer."""
Duration = Annotated[float, BeforeValidator(_parse_config_duration), WithJsonSchema(_DURATION_SCHEMA)]
"""Seconds; accepts `30m`, `2h`, `45s`, `1h30m` or a number; at most ten years (MAX_DURATION_S)."""


def _parse_keep_alive(v: Any) -> float | None:
    if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
        return None
    if isinstance(v, str) and v.strip().lower() == "forever":
        return math.inf
    if isinstance(v, float) and math.isinf(v) and v > 0:
        return math.inf
    if (isinstance(v, int | float) and not isinstance(v, bool) and v < 0) or (
        isinstance(v, str) and v.strip().startswith("-")
    ):  # Ollama's `-1` or `-1m`: forever, as a request's own keep-alive reads it (`-0s` is 0)
        try:
            return parse_keep_alive(v)
        except ValueError:
            raise ValueError(
                f"expected 'auto', 'forever', a duration like '30m', '2h', '45s' or seconds (a negative "
                f"one: forever), got {shown(v)}"
            ) from None
    try:
        seconds = parse_duration(v)
    except ValueError:
        raise ValueError(
            f"expected 'auto', 'forever', a duration like '30m', '2h', '45s' or seconds, got {shown(v)}"
        ) from None
    if seconds > MAX_DURATION_S:
        raise ValueError(
            f"expected a duration of at most 3650d (ten years), or 'forever' for no expiry, got {shown(v)}"
        )
    return seconds


def _dump_keep_alive(v: float | None) -> float | str | None:
    return "forever" if v is not None and math.isinf(v) else v


Flag = Annotated[
    bool,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "boolean"},
                {  # the words pydantic reads as a bool, in any case (YAML 1.1's yes/no/on/off among them)
                    "type": "string",
                    "pattern": r"^(?:[yY](?:[eE][sS])?|[oO](?:[nN]|[fF][fF])|[tT](?:[rR][uU][eE])?|[nN][oO]?"
                    r"|[fF](?:[aA][lL][sS][eE])?|[01])$",
                },
                {"enum": [0, 1]},
            ]
        }
    ),
]
"""true or false; also `yes`/`no`, `on`/`off`, `y`/`n`, `t`/`f` (any case), 1 and 0, as pydantic
reads them (what the JSON Schema says, so that an editor takes what load_config takes)."""


def _whole_number(v: Any) -> Any:
    """A float without a fraction (`64.0`, `1e3`) as the int it is, as JSON Schema's `integer` takes
    it (so an editor does); a fraction, infinity or NaN refused here in words; anything else (a bool,
    a string) left to the strict int, which refuses it."""
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"expected a whole number, got {shown(v)}")
        return int(v)
    return v


WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
"""An integer field (with `strict=True` on its Field: no bools, no strings): `64` or `64.0`."""


_PORT = r"(?:[0-9]{1,4}|[0-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
HOST_PORT_PATTERN = rf"^[\s\S]+:{_PORT}$"
"""What check_host_port takes, as a regular expression JSON Schema can use."""


NEGATIVE_DURATION_PATTERN = r"^\s*-" + DURATION_PATTERN[1:]
"""A duration with a minus before it (`-1`, `-1m`): a keep-alive of forever, as Ollama reads it."""


KeepAlive = Annotated[
    float | None,
    BeforeValidator(_parse_keep_alive),
    PlainSerializer(_dump_keep_alive, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*(?:[aA][uU][tT][oO]|[fF][oO][rR][eE][vV][eE][rR])\s*$"},
                {"type": "string", "pattern": DURATION_PATTERN},
                {"type": "string", "pattern": NEGATIVE_DURATION_PATTERN},  # (forever, as Ollama's `-1m`)
                {"type": "number", "minimum": 0, "maximum": MAX_DURATION_S},
                {"type": "number", "exclusiveMaximum": 0},  # (forever, as Ollama's `-1`)
                # YAML's `.inf` (read as forever): the one number above the largest float that
                # is no integer (a 400-digit integer is too large a duration, not forever)
                {"type": "number", "exclusiveMinimum": sys.float_info.max, "not": {"type": "integer"}},
                {"type": "null"},
            ],
            "examples": ["auto", "forever", "30m", 600],
        }
    ),
]
"""Seconds; None ("auto") lets the policy decide from reuse intervals; inf is "forever"."""


MAX_GRPC_MESSAGE = 2**31 - 1
"""gRPC's largest message length: its channel options are C ints."""
MAX_KEEPALIVE_S = 86400
"""The longest `server.keepalive`: a day is far below gRPC's C-int milliseconds (24.8 days)."""


def check_host_port(v: str) -> str:
    """`v` if it is host:port with an ASCII decimal port 0-65535; ValueError saying what was expected.
    (`server.listen`, `server.metrics_listen`, and the `--listen` / `--target` flags.)"""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not _ascii_port(port):
        raise ValueError(f"expected host:port with a port 0-65535, like '127.0.0.1:50051', got {shown(v)}")
    return v


def _ascii_port(port: str) -> bool:
    """0-65535 in ASCII digits (str.isdigit also takes '５' and '²', which no socket API does)."""
    return 0 < len(port) <= 5 and port.isascii() and port.isdigit() and int(port) <= 65535


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def _not_zero(v: Any, like: str) -> Any:
    """A duration field's value, zero refused in its own words (`like`: an example and what null
    means) before `gt=0`, which puts the bound in the JSON Schema, would say it less helpfully;
    anything else is left to the duration's own parsing."""
    try:
        zero = v is not None and _parse_config_duration(v) == 0
    except ValueError:
        zero = False
    if zero:
        raise ValueError(f"expected a duration above 0, {like}, got {shown(v)}")
    return v


class ServerConfig(_Model):
    listen: str = Field(default="127.0.0.1:50051", json_schema_extra={"pattern": HOST_PORT_PATTERN})
    """Address the gRPC service listens on, as host:port."""
    auth_token_env: str | None = None
    """Name of the environment variable holding the bearer token (optional on loopback)."""
    max_request_bytes: ByteSize = Field(default=64 * 2**20, gt=0, le=MAX_GRPC_MESSAGE)
    """Largest gRPC message accepted (and sent); larger requests get RESOURCE_EXHAUSTED. At most
    2147483647 bytes (2GiB less one byte): gRPC keeps the limit in a C int."""
    metrics_listen: str | None = Field(default=None, json_schema_extra={"pattern": HOST_PORT_PATTERN})
    """host:port for Prometheus metrics over HTTP (/metrics); null: no metrics endpoint."""
    tls_cert: str | None = None
    """PEM certificate chain for TLS (with tls_key); null serves plaintext."""
    tls_key: str | None = None
    """PEM private key for TLS (with tls_cert)."""
    keepalive: Duration = Field(default=30, gt=0, le=MAX_KEEPALIVE_S)
    """How often the server pings each client connection (gRPC keepalive). A client that does not
    answer within this long (20 s at most) is dropped and its calls are cancelled, so the world session
    of a client that vanished (a laptop asleep, a dropped Wi-Fi link) is closed and frees its model.
    At most 1d (gRPC keeps it in milliseconds in a C int). A change takes effect at the next start."""
    world_idle_timeout: Duration | None = Field(default=600, gt=0)
    """How long an open world session waits for its client: for its next action, and for it to take
    each output (a client that stops reading fills its HTTP/2 window and the server's send waits). A
    client that keeps its `residency.v1.WorldSession` stream open and sends nothing for this long, or
    reads nothing for this long (a frozen app), has its session closed, its state saved (as when the
    client ends its stream), and the stream ends DEADLINE_EXCEEDED with a message saying how long it
    was idle or did not read its outputs and the session id to resume it with; its world model is free
    for the next session. Null: wait for ever (the session holds its model until its client ends it or
    vanishes: `keepalive`); 0 is refused (no session could take a step). A change (a reload) reaches
    the sessions waiting for an action within a second, and each output's send from the next one."""
    frontends: WholeNumber = Field(default=0, ge=0, le=16, strict=True)
    """Extra gRPC front-end processes on `listen` (they share the address with SO_REUSEPORT; Linux
    spreads connections over them): each does gRPC's per-call work on its own core, sends ModelInfer
    calls to the manager's process in batches over a Unix socket and relays every other call to it.
    0: the manager's process serves every connection itself. A change takes effect at the next start."""

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise _FieldErrors([(("tls_cert",), "tls_cert and tls_key go together: give both or neither")])
        return self

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        return v if v is None else check_host_port(v)

    @field_validator("world_idle_timeout", mode="before")
    @classmethod
    def _some_wait(cls, v: Any) -> Any:
        return _not_zero(v, "like '10m' (null: no idle timeout)")


class StoreConfig(_Model):
    url: str = Field(
        default="sqlite:///.residency/state.db", json_schema_extra={"pattern": "^(?:sqlite:///|rediss?://)"}
    )
    """Where state (statistics, intents, pins, tuning records) and the request log are kept:
    sqlite:///PATH or redis(s)://HOST:PORT/DB.
    sqlite:///PATH (three slashes) is relative to the working folder the service is started from
    (sqlite:///tmp/x.db is ./tmp/x.db); an absolute path takes four slashes: sqlite:////tmp/x.db.
    rediss:// (TLS) takes `?ssl_ca_certs=CA.pem&ssl_certfile=CLIENT.pem&ssl_keyfile=CLIENT.key` (files
    as paths; `&ssl_cert_reqs=none|optional|required`), beside `prefix=NAME`."""
    journal: str | None = ".residency/requests.journal"
    """Local append-only file holding request-log records until the store has them (a killed service
    loses none; they are written to the store at the next start). Null: no journal."""
    sessions: str = ".residency/sessions"
    """Where world sessions keep their saved state, one directory per session (the NVMe segment log,
    its index, the rolling window): a session reopens from it when its device host restarts, and a new
    stream can resume it by id. Device hosts on other machines need it on a path they share."""
    sessions_keep: ByteSize = Field(default=20 * 2**30, ge=0)
    """Disk kept for saved world sessions: when a session opens, the least recently used sessions
    that are not open are deleted, oldest first, until the rest fit in this (0: keep none)."""
    request_log_retention: Duration | None = Field(default=DEFAULT_REQUEST_LOG_RETENTION_S, gt=0)
    """How long the request log (the requests' times, models and durations, which the tuning
    reads) is kept: the running service deletes the records older than this from the store about once
    an hour, so its SQLite file or Redis stream stops growing. Default 8w (56 days). At least
    `tuning.since` (the tuning's window; a shorter one is refused), and at least the `--since` you give
    `residency tune --from-store` or `residency trace export` (they find only what is kept). Null: keep
    every record for ever. A change applies from the next trim on (a reload)."""

    @field_validator("request_log_retention", mode="before")
    @classmethod
    def _some_retention(cls, v: Any) -> Any:  # (zero would delete the whole log)
        return _not_zero(v, "like '8w' (null: keep every request record)")

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("sqlite:///", "redis://", "rediss://")):
            raise ValueError(
                f"expected a URL starting with sqlite:///, redis:// or rediss://, like "
                f"'sqlite:///.residency/state.db', got {shown(redact(v))}"
            )
        if v.startswith("sqlite:"):
            problem = _sqlite_url_problem(v)
            if problem:
                raise ValueError(f"{problem}, got {shown(v)}")
        else:
            problem = _redis_url_problem(v)
            if problem:
                raise ValueError(problem)
        return v


def _redis_url_problem(url: str) -> str | None:
    """What `open_store` refuses in a redis(s):// url, or None: the store's own rules
    (store/redis_url.py, which imports no redis). The message never quotes the user info."""
    return redis_url_problem(url)


def _sqlite_url_problem(url: str) -> str | None:
    """What `open_store` refuses in a sqlite:/// url (the rules of store/sqlite.py), or None."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        return "a sqlite url takes no ?query or #fragment"
    path = parts.path[1:]
    if not path or path.endswith("/"):
        return "no database file in the url; expected sqlite:///PATH/TO/FILE.db"
    return None


class RayConfig(_Model):
    address: str | None = Field(
        default=None, json_schema_extra={"pattern": rf"^(?:auto|ray://[\s\S]+|[\s\S]+:{_PORT})$"}
    )
    """Null starts a local Ray; "auto", "ray://HOST:PORT" or "HOST:PORT" joins a cluster."""

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v == "auto" or (v.startswith("ray://") and len(v) > 6):
            return v
        host, sep, port = v.rpartition(":")
        if sep and host and _ascii_port(port):
            return v
        raise ValueError(
            f"expected null, 'auto', 'ray://HOST:PORT' or 'HOST:PORT' (a port 0-65535), got {shown(v)}"
        )


def _check_reserve(memory: int, reserve: int) -> None:
    if reserve >= memory:
        msg = f"reserve ({format_size(reserve)}) must be less than memory ({format_size(memory)})"
        raise _FieldErrors([(("reserve",), msg)])


class DeviceConfig(_Model):
    name: str = Field(min_length=1, json_schema_extra={"not": {"const": HOST_DEVICE}})
    """Name models refer to, e.g. gpu0. Not `host`: that is host RAM's name in the decisions, events
    and replay outputs (an action on device `host` is a host-tier move)."""
    kind: Literal["cuda", "cpu"]
    """cuda (a GPU) or cpu (models run on the host's CPU)."""
    index: WholeNumber = Field(default=0, ge=0, le=255, strict=True)
    """Device index (CUDA ordinal) on its node."""
    memory: ByteSize = Field(gt=0)
    """Total memory of the device."""
    reserve: ByteSize = 0
    """Emergency reserve no model is ever given (driver, CUDA context, fragmentation)."""
    node: str | None = None
    """Ray node the device is on; null for the local node."""

    @field_validator("name")
    @classmethod
    def _not_host(cls, v: str) -> str:
        if v == HOST_DEVICE:
            raise ValueError(
                f"expected a device name other than {HOST_DEVICE!r} (host RAM's name in the decisions "
                "and events), like 'gpu0'"
            )
        return v

    @model_validator(mode="after")
    def _reserve_below_memory(self) -> DeviceConfig:
        _check_reserve(self.memory, self.reserve)
        return self

    @property
    def usable(self) -> int:
        """Bytes models may use: memory - reserve."""
        return self.memory - self.reserve


class HostConfig(_Model):
    memory: ByteSize = Field(gt=0)
    """Host RAM."""
    reserve: ByteSize = 0
    """RAM kept for the OS and other programs; never used for parked models."""

    @model_validator(mode="after")
    def _reserve_below_memory(self) -> HostConfig:
        _check_reserve(self.memory, self.reserve)
        return self

    @property
    def usable(self) -> int:
        """Bytes of host RAM for models parked off the GPU: memory - reserve."""
        return self.memory - self.reserve


class ClassConfig(_Model):
    name: str = Field(min_length=1)
    """Class name models and requests refer to."""
    reserve: ByteSize = 0
    """Bytes on each GPU (cuda) device that lower classes may not use."""
    may_evict: Flag = True
    """False: requests of this class take only free room and the room of models whose keep-alive has
    expired; they never evict a model within its keep-alive (they wait, or run where room exists)."""
    max_wait: Duration | None = None
    """A request of this class that waits longer than this for room is rejected; null: wait."""
    # (the bound before the validator: outside the union it would be left in the schema as `ge`)
    max_queue: Annotated[int, Field(ge=1, strict=True), BeforeValidator(_whole_number)] | None = None
    """At most this many requests of this class may wait for their model at once (for room, or for
    its load to end); one more that would wait is refused (RESOURCE_EXHAUSTED, "queue full"), one
    whose model is loaded and ready is served. `residency replay` and `tune` count the same. Null: no
    limit."""


class LoadSeconds(_Model):
    disk: float = Field(gt=0, le=MAX_LOAD_S, allow_inf_nan=False, strict=True)
    """Seconds to load from disk into the GPU (cold file); at most a day."""
    cached: float | None = Field(default=None, gt=0, le=MAX_LOAD_S, allow_inf_nan=False, strict=True)
    """Seconds to load from the OS page cache into the GPU; null: halfway between host and disk."""
    host: float = Field(gt=0, le=MAX_LOAD_S, allow_inf_nan=False, strict=True)
    """Seconds to move from host RAM to the GPU."""

    @model_validator(mode="after")
    def _ordered(self) -> LoadSeconds:
        if self.host > self.disk:
            msg = f"host ({self.host}s) must not be slower than disk ({self.disk}s): RAM beats disk"
            raise _FieldErrors([(("host",), msg)])
        if self.cached is not None and not self.host <= self.cached <= self.disk:
            msg = f"cached ({self.cached}s) must be between host ({self.host}s) and disk ({self.disk}s)"
            raise _FieldErrors([(("cached",), msg)])
        return self

    @property
    def cached_s(self) -> float:
        """Seconds from the page cache: `cached`, or halfway between host and disk."""
        return self.cached if self.cached is not None else (self.disk + self.host) / 2


# A model's `load_seconds` when its config gives none: first estimates from its `memory`, which the
# running service replaces with the times it measures (as it does the ones a config gives), and which
# `residency measure --write-config` writes down. The rates are those of a home server's usual parts.
ESTIMATE_DISK_BYTES_PER_S = 1e9
"""Disk -> GPU: about 1 GB/s, an NVMe read of a cold checkpoint plus its deserialising and the copy to
the device (home.yaml's 9 GiB LLM: 7 s); a SATA SSD or a hard disk is slower, and measured so."""
ESTIMATE_HOST_BYTES_PER_S = 10e9
"""Host RAM -> GPU: about 10 GB/s, a copy from pinned memory over PCIe 4.0 x16 (half its peak)."""
ESTIMATE_MIN_DISK_S = 0.2
"""The least estimated disk load: a tiny model still opens a file and builds its module."""
ESTIMATE_MIN_HOST_S = 0.05
"""The least estimated host -> GPU move: a tiny model's copy is a few calls (local-cpu.yaml measures
0.03-0.06 s)."""


def estimated_load_seconds(memory: int) -> LoadSeconds:
    """The load times a model of `memory` bytes is given when its config has no `load_seconds`:
    `memory` at ESTIMATE_DISK_BYTES_PER_S from disk and ESTIMATE_HOST_BYTES_PER_S from host RAM, with
    their floors, at most MAX_LOAD_S; `cached` unset (halfway between, as for a config without it)."""
    disk = min(max(memory / ESTIMATE_DISK_BYTES_PER_S, ESTIMATE_MIN_DISK_S), MAX_LOAD_S)
    host = min(max(memory / ESTIMATE_HOST_BYTES_PER_S, ESTIMATE_MIN_HOST_S), disk)
    return LoadSeconds(disk=disk, host=host)


def _load_seconds_from_memory(data: dict[str, Any]) -> LoadSeconds:
    """`load_seconds`' default: estimated from the model's validated `memory` (a memory that is not
    valid is said at `memory`; the model is refused then, whatever this returns)."""
    memory = data.get("memory")
    return estimated_load_seconds(memory if isinstance(memory, int) else 0)


class ElasticConfig(_Model):
    min: ByteSize
    """Smallest lease of the elastic tenant's working set (always granted while resident)."""
    max: ByteSize = Field(gt=0)
    """Largest lease it may grow to when memory is free."""

    @model_validator(mode="after")
    def _ordered(self) -> ElasticConfig:
        if self.min > self.max:
            msg = f"min ({format_size(self.min)}) must not be larger than max ({format_size(self.max)})"
            raise _FieldErrors([(("min",), msg)])
        return self


CHECK_ADAPTERS = "check_adapters"
"""Validation context key (`Config.model_validate(data, context={CHECK_ADAPTERS: True})`, as
`manager.config` loads a file): each model's `adapter` must be one of the catalogue
(`manager.adapter_specs`) and its `source` hold the keys that adapter reads. Configs built in code
(the policy's and replay's tests) name stand-in adapters and are not checked."""


def _checks_adapters(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and bool(info.context.get(CHECK_ADAPTERS))


class ModelConfig(_Model):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Model name used by requests: letters, digits, '_', '.', '-'."""
    class_: str = Field(alias="class")
    """Priority class of its requests (one of `classes`)."""
    adapter: str = Field(min_length=1)
    """Worker adapter that loads it (one of `manager.adapter_specs`); adapter-specific keys go in `source`."""
    device: str
    """Device it runs on (one of `devices`)."""
    memory: ByteSize = Field(gt=0)
    """Estimated weights footprint; replaced by the measured footprint after a load."""
    load_seconds: LoadSeconds = Field(default_factory=_load_seconds_from_memory)
    """Seconds to load it from disk, the page cache and host RAM: first estimates, which the service
    replaces with measured times after its loads (`residency measure --write-config` writes measured
    ones here). Optional: left out, it is estimated from `memory` (about 1 GB/s from disk, 10 GB/s from
    host RAM, `cached` halfway between; at least 0.2 s and 0.05 s); the tuning leaves it out of the
    configs it writes."""
    pin: Flag = False
    """Always resident on its device; never evicted."""
    keep_alive: KeepAlive = None
    """Idle time before it may be evicted: 'auto' (policy decides), 'forever', or a duration (a
    negative one, Ollama's `-1`, is forever)."""
    prewarm: Flag = True
    """The policy may load it before a predicted request."""
    elastic: ElasticConfig | None = None
    """KV lease range of an elastic tenant (e.g. a world model), on top of `memory`."""
    source: dict[str, Any] = Field(
        default_factory=dict, validate_default=True, json_schema_extra={"propertyNames": {"type": "string"}}
    )
    """Adapter-specific keys (paths, factories, package names): those `manager.adapter_specs` lists for
    the model's adapter."""
    max_batch: WholeNumber = Field(1, ge=1, le=4096, strict=True)
    """Dynamic batching: concurrent requests for this model with the same input dtypes and shapes
    (but the first dimension) run as one call of up to this many rows, stacked along the first
    dimension and split again. For models whose rows are independent (an MLP, an embedder); 1 (the
    default) runs one request per call, as a stateful model (silero-vad) needs."""

    @model_validator(mode="after")
    def _elastic_is_a_world_models(self, info: ValidationInfo) -> ModelConfig:
        """(When the loader asks, as for the adapter's name.) A world model's adapter without an
        `elastic` lease could run no session, and got plain requests it refused once loaded; a plain
        model's with one was taken for a world model and refused every request."""
        if not _checks_adapters(info):
            return self
        if self.adapter in WORLD_ADAPTERS and self.elastic is None:
            msg = (
                f"adapter {self.adapter!r} runs world sessions, whose KV memory is leased: give the model "
                "`elastic: {min: SIZE, max: SIZE}` (configs/home.yaml's world model has 1GiB to 8GiB)"
            )
            raise _FieldErrors([(("elastic",), msg)])
        if self.elastic is not None and self.adapter in BUILTIN_NAMES and self.adapter not in WORLD_ADAPTERS:
            msg = (
                f"only a world model ({', '.join(sorted(WORLD_ADAPTERS))}) has an elastic KV lease; adapter "
                f"{self.adapter!r} serves plain requests: remove `elastic`"
            )
            raise _FieldErrors([(("elastic",), msg)])
        return self

    @field_validator("adapter")
    @classmethod
    def _known_adapter(cls, v: str, info: ValidationInfo) -> str:
        """An adapter of the catalogue (when the loader asks: `CHECK_ADAPTERS` in the context)."""
        problem = adapter_problem(v) if _checks_adapters(info) else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("source")
    @classmethod
    def _source_keys(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The keys the model's adapter reads, each of its type (when the loader asks); shapes' whole
        floats as ints. Nothing is said of the source of an adapter that is not known (said there)."""
        adapter = info.data.get("adapter")
        if not _checks_adapters(info) or not isinstance(adapter, str):
            return v
        fixed, errors = check_source(adapter, v)
        if errors:
            raise _FieldErrors(errors)
        return fixed

    @property
    def footprint_min(self) -> int:
        """Least bytes it needs on its device while resident: memory + elastic.min."""
        return self.memory + (self.elastic.min if self.elastic else 0)


def _zones(schema: dict[str, Any]) -> None:
    """`policy.timezone`'s values in its JSON Schema (editors offer them): this machine's zones."""
    schema["enum"] = [None, *sorted(zone_names())]


class PolicyConfig(_Model):
    name: Literal["residency", "lru-keepalive", "histogram", "gdsf", "oracle"] = "residency"
    """The eviction/prewarm policy."""
    thrash_window: Duration = 600
    """A model reloaded within this time of its eviction counts as thrash."""
    min_residency: Duration = 60
    """Within this time of its load a model is not displaced by a prewarm, nor, until it has served the
    request it was loaded for, by a request of its own class (a lower class never evicts it at all).
    Once it has served, a request of its class may take its room (as `configs/home.yaml` says)."""
    default_keep_alive: Duration = 300
    """Keep-alive used by `lru-keepalive` and where nothing else decides."""
    timezone: str | None = Field(default=None, json_schema_extra=_zones)
    """The home's time zone, as an IANA name ("Europe/Berlin", "America/New_York", "UTC"): the
    statistics by hour of week (and the tuning report's hours) follow its wall clock, summer time
    included, so a habit at 07:00 stays at 07:00 when the clocks change. Null: this machine's own
    zone (the TZ environment variable's, else /etc/localtime's; UTC where neither names one). The
    synthetic weeks of `residency trace synth` are on UTC's wall clock."""

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v: str | None) -> str | None:
        if v is not None:
            home_hours(v)  # ValueError naming it when no zone has the name
        return v


class TuningConfig(_Model):
    schedule: Literal["off", "daily", "weekly"] = "off"
    """How often the running service re-tunes itself from its own request log."""
    apply: Literal["propose", "auto"] = "propose"
    """propose: write the tuned config and its report only; auto: also, when it beats the running
    config on the most recent days (held out from the search), write the tuned fields into the config
    file (comments kept; the replaced file is kept beside the proposal as previous.yaml) and hot-reload it."""
    since: Duration = Field(default=7 * 86400, gt=0)
    """How much of the request log to tune on (more than zero)."""
    out_dir: str = ".residency/tuning"
    """Where proposed configs and their HTML reports are written."""

    @field_validator("since", mode="before")
    @classmethod
    def _some_window(cls, v: Any) -> Any:  # (zero: every scheduled run would tune on nothing)
        return _not_zero(v, "like '7d'")


class Config(_Model):
    server: ServerConfig = ServerConfig()
    """The gRPC service."""
    store: StoreConfig = StoreConfig()
    """State store."""
    ray: RayConfig = RayConfig()
    """Ray cluster to run workers on."""
    devices: list[DeviceConfig] = Field(min_length=1)
    """Accelerators (and CPU devices) models run on."""
    host: HostConfig
    """Host RAM used to park models off the GPU."""
    classes: list[ClassConfig] = Field(min_length=1)
    """Priority classes, highest priority first."""
    models: list[ModelConfig]
    """The models Residency manages."""
    policy: PolicyConfig = PolicyConfig()
    """Policy and its knobs."""
    tuning: TuningConfig = TuningConfig()
    """The weekly loop, built in: tune from the store on a schedule."""

    def device(self, name: str) -> DeviceConfig:
        """The device called `name` (KeyError if none)."""
        return {d.name: d for d in self.devices}[name]

    def model(self, name: str) -> ModelConfig:
        """The model called `name` (KeyError if none)."""
        return {m.name: m for m in self.models}[name]

    def class_rank(self, name: str) -> int:
        """Rank of class `name`: 0 is the highest priority (KeyError if none)."""
        return {c.name: i for i, c in reversed(list(enumerate(self.classes)))}[name]

    def class_reserves(self, device: str) -> list[int]:
        """Each class's reservation on `device`, in class order: the classes' `reserve` on a GPU
        (cuda) device, none on a cpu one (see `ClassConfig.reserve`)."""
        cuda = self.device(device).kind == "cuda"
        return [c.reserve if cuda else 0 for c in self.classes]

    def model_names(self) -> list[str]:
        """Model names in config order."""
        return [m.name for m in self.models]

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        errors = (_names_and_refs(self) or _budgets(self)) + _retention(self)
        if errors:
            raise _FieldErrors(errors)
        return self


def _names_and_refs(cfg: Config) -> list[tuple[Loc, str]]:
    """Names are unique; every model names a known device and class."""
    errors: list[tuple[Loc, str]] = []
    devices, classes = [d.name for d in cfg.devices], [c.name for c in cfg.classes]
    for field, names in (("devices", devices), ("classes", classes), ("models", cfg.model_names())):
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            if name in first:
                errors.append(((field, i, "name"), f"duplicate name {name!r} (also {field}[{first[name]}])"))
            first.setdefault(name, i)
    gpus: dict[tuple[str | None, int], int] = {}
    for i, d in enumerate(cfg.devices):
        if d.kind != "cuda":
            continue
        if (d.node, d.index) in gpus:  # two budgets for one GPU: twice its memory would be handed out
            j = gpus[(d.node, d.index)]
            on = f"node {d.node!r}" if d.node is not None else "the local node"
            msg = f"cuda index {d.index} on {on} is already device {cfg.devices[j].name!r} (devices[{j}])"
            errors.append((("devices", i, "index"), msg))
        gpus.setdefault((d.node, d.index), i)
    for i, m in enumerate(cfg.models):
        if m.device not in devices:
            msg = f"unknown device {m.device!r}; known devices: {', '.join(devices)}"
            errors.append((("models", i, "device"), msg))
        if m.class_ not in classes:
            msg = f"unknown class {m.class_!r}; known classes: {', '.join(classes)}"
            errors.append((("models", i, "class"), msg))
    return errors


def _retention(cfg: Config) -> list[tuple[Loc, str]]:
    """The request log is kept at least as long as the tuning reads it (`tuning.since`)."""
    keep, since = cfg.store.request_log_retention, cfg.tuning.since
    if keep is None or keep >= since:
        return []
    msg = (  # (said at store.request_log_retention: the message names the other field)
        f"{format_duration(keep)} is shorter than tuning.since ({format_duration(since)}), the part of "
        f"the request log the tuning reads: it would find only the last {format_duration(keep)}; make "
        f"request_log_retention at least {format_duration(since)} (null: keep every record), or "
        "tuning.since shorter"
    )
    return [(("store", "request_log_retention"), msg)]


def _budgets(cfg: Config) -> list[tuple[Loc, str]]:
    """Class reserves plus pinned models fit each device; every model fits below higher reserves."""
    errors: list[tuple[Loc, str]] = []
    for di, d in enumerate(cfg.devices):
        parts: list[str] = []
        total = 0
        for c, reserve in zip(cfg.classes, cfg.class_reserves(d.name), strict=True):
            pinned = [m for m in cfg.models if m.pin and m.device == d.name and m.class_ == c.name]
            need = max(reserve, sum(m.footprint_min for m in pinned))
            total += need
            if need:
                pins = ", ".join(f"{m.name} {format_size(m.footprint_min)}" for m in pinned)
                parts.append(f"{c.name} {format_size(need)}" + (f" [pinned {pins}]" if pins else ""))
        if total > d.usable:
            errors.append(
                (
                    ("devices", di),
                    f"device {d.name!r}: class reserves and pinned models need {format_size(total)} "
                    f"({'; '.join(parts)}) but only {format_size(d.usable)} is usable "
                    f"(memory {format_size(d.memory)} - reserve {format_size(d.reserve)})",
                )
            )
    for i, m in enumerate(cfg.models):
        d = cfg.device(m.device)
        rank = cfg.class_rank(m.class_)
        reserves = cfg.class_reserves(d.name)
        higher = [(c, r) for c, r in zip(cfg.classes[:rank], reserves, strict=False) if r]
        room = d.usable - sum(r for _, r in higher)
        if m.footprint_min > room:
            el = (
                f" (= {format_size(m.memory)} + elastic.min {format_size(m.elastic.min)})"
                if m.elastic
                else ""
            )
            held = "".join(f" - {c.name} reserve {format_size(r)}" for c, r in higher)
            errors.append(
                (
                    ("models", i, "memory"),
                    f"model {m.name!r} needs at least {format_size(m.footprint_min)}{el} and can never "
                    f"fit on {d.name!r}: usable {format_size(d.usable)}{held} = {format_size(max(room, 0))}",
                )
            )
    return errors


# ---------------------------------------------------------------------------------------------------
# YAML loading and writing
