"""Review 18 (a user's walk-through) of the config and the admin API's comments:

1. A model added without `load_seconds` was refused ("models[6].load_seconds: required field is
   missing"), though the config says those figures are first estimates that Residency replaces with
   measured ones: it is now estimated from the model's `memory` (disk ~1 GB/s, host RAM ~10 GB/s,
   floors for tiny models), for the loader and the JSON Schema alike, and whatever reads it (the
   engine's cost table, the replay, the tuning and its config writer) works from the estimate
   without writing it into the file.
3. residency.proto's comment on the Events stream listed kinds that are never sent (loaded,
   promoted, thrash, lease_changed, ...) and none of those that are.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

from manager.cli import main
from manager.config import Config, ConfigError, config_json_schema, load_config, write_config_with_updates
from manager.config_schema import (
    ESTIMATE_DISK_BYTES_PER_S,
    ESTIMATE_HOST_BYTES_PER_S,
    ESTIMATE_MIN_DISK_S,
    ESTIMATE_MIN_HOST_S,
    MAX_LOAD_S,
    estimated_load_seconds,
)
from manager.policy.factory import create_policy
from manager.policy.types import ActionKind, Request
from manager.replay.sim import replay
from manager.replay.trace import write_trace
from manager.replay.tune import with_settings

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"
PROTO = ROOT / "protos" / "residency_proto" / "v1" / "residency.proto"
GiB, MiB = 1 << 30, 1 << 20
LLM_LS = "    load_seconds: {disk: 7.0, cached: 2.8, host: 1.0}\n"
EMBED_LS = "    load_seconds: {disk: 1.0, cached: 0.4, host: 0.1}\n"


def _home_without(tmp_path: Path, *lines: str, replace: tuple[tuple[str, str], ...] = ()) -> Path:
    """configs/home.yaml with `lines` (each once in it) taken out, and the (old, new) `replace` made."""
    text = HOME.read_text(encoding="utf-8")
    for line in lines:
        assert text.count(line) == 1, line
        text = text.replace(line, "")
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "home.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# ---- 1. load_seconds is optional: estimated from memory --------------------------------------------


def test_a_model_without_load_seconds_loads_with_times_estimated_from_its_memory(tmp_path: Path) -> None:
    cfg = load_config(_home_without(tmp_path, LLM_LS))
    llm = cfg.model("llm")  # 9 GiB of weights
    disk, host = 9 * GiB / 1e9, 9 * GiB / 1e10  # 1 GB/s from disk, 10 GB/s from host RAM
    assert llm.load_seconds.disk == pytest.approx(disk)
    assert llm.load_seconds.host == pytest.approx(host)
    assert llm.load_seconds.cached is None and llm.load_seconds.cached_s == pytest.approx((disk + host) / 2)
    # (the shipped estimate for this model was 7 / 1 s: the rates are of the same order)
    assert 5 < llm.load_seconds.disk < 15 and 0.5 < llm.load_seconds.host < 2
    assert "load_seconds" not in llm.model_fields_set  # estimated, not written
    # the models that give their times keep them
    assert cfg.model("tts").load_seconds.disk == 2.2 and "load_seconds" in cfg.model("tts").model_fields_set


def test_the_estimate_has_floors_for_tiny_models_and_a_ceiling_for_huge_ones(tmp_path: Path) -> None:
    tiny = estimated_load_seconds(1 * MiB)
    assert (tiny.disk, tiny.host) == (ESTIMATE_MIN_DISK_S, ESTIMATE_MIN_HOST_S)
    assert tiny.host <= tiny.cached_s <= tiny.disk
    assert ESTIMATE_DISK_BYTES_PER_S == 1e9 and ESTIMATE_HOST_BYTES_PER_S == 1e10
    # a model of 512 PiB (a device may say 1024 PiB): at most a day, host never slower than disk
    huge = (("memory: 24GiB, reserve: 1536MiB", "memory: 1024PiB, reserve: 1536MiB"), ("9GiB", "512PiB"))
    path = _home_without(tmp_path, LLM_LS, replace=huge)
    llm = load_config(path).model("llm")
    assert llm.load_seconds.disk == MAX_LOAD_S and llm.load_seconds.host <= llm.load_seconds.disk


def test_a_bad_memory_without_load_seconds_is_said_once_naming_the_memory(tmp_path: Path) -> None:
    path = _home_without(tmp_path, LLM_LS, replace=(("memory: 9GiB", "memory: lots"),))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    said = str(info.value)
    assert "models[2].memory: expected a size" in said
    assert "load_seconds" not in said and len(info.value.errors) == 1


def test_load_seconds_given_in_part_is_still_refused(tmp_path: Path) -> None:
    path = _home_without(tmp_path, replace=((LLM_LS, "    load_seconds: {disk: 7.0}\n"),))
    with pytest.raises(ConfigError, match=r"models\[2\]\.load_seconds\.host: required field is missing"):
        load_config(path)


def test_the_json_schema_takes_a_model_without_load_seconds_too(tmp_path: Path) -> None:
    schema = config_json_schema()
    model = schema["$defs"]["ModelConfig"]
    assert "load_seconds" not in model["required"]
    assert "estimate" in model["properties"]["load_seconds"]["description"]
    assert "measured" in model["properties"]["load_seconds"]["description"]
    path = _home_without(tmp_path, LLM_LS, EMBED_LS)
    data = YAML(typ="safe").load(io.StringIO(path.read_text(encoding="utf-8")))
    jsonschema.Draft202012Validator(schema).validate(data)
    load_config(path)
    # and both still refuse a load_seconds that is not a mapping of times
    bad = _home_without(tmp_path, replace=((LLM_LS, "    load_seconds: 7\n"),))
    data = YAML(typ="safe").load(io.StringIO(bad.read_text(encoding="utf-8")))
    assert not jsonschema.Draft202012Validator(schema).is_valid(data)
    with pytest.raises(ConfigError, match=r"models\[2\]\.load_seconds"):
        load_config(bad)


def test_config_check_passes_a_model_without_load_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", str(_home_without(tmp_path, LLM_LS))]) == 0
    assert "load_seconds" not in capsys.readouterr().err


def test_the_engine_and_the_replay_cost_a_load_at_the_estimate(tmp_path: Path) -> None:
    from manager.policy.engine import Engine

    cfg = load_config(_home_without(tmp_path, LLM_LS))
    est = cfg.model("llm").load_seconds
    cost = Engine(cfg, create_policy("residency", [])).state.models["llm"].cost
    assert [cost.get(s) for s in ("disk", "cached", "host")] == [est.disk, est.cached_s, est.host]
    t0 = 1_764_547_200.0
    result = replay(cfg, [Request(t=t0, model="llm", busy_s=1.0)], "lru-keepalive")
    assert result.served == 1 and result.cold_starts == 1
    assert result.load_wait_s == pytest.approx(est.disk)  # a cold file, at the estimate


def test_tuning_leaves_an_estimated_load_seconds_out_of_the_written_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _home_without(tmp_path, LLM_LS, EMBED_LS)
    cfg = load_config(src)
    # the tuning's in-memory copies (model_dump, then validated again) keep the same estimate
    assert with_settings(cfg, {"llm": {"keep_alive": 900.0}}, {}).model("llm").load_seconds == (
        cfg.model("llm").load_seconds
    )
    # the writer the tuning (and the service's auto-apply) uses
    out = tmp_path / "written.yaml"
    written = write_config_with_updates(src, out, {"llm": {"keep_alive": "15m"}}, note_changes=True)
    assert written.model("llm").keep_alive == 900.0
    assert out.read_text(encoding="utf-8").count("load_seconds:") == 5  # the five models that had one
    # `residency tune` end to end
    t0 = 1_764_547_200.0
    reqs = [Request(t=t0 + 600.0 * i, model=("llm", "embed", "voice")[i % 3], busy_s=2.0) for i in range(60)]
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, reqs)
    tuned = tmp_path / "tuned.yaml"
    args = ["tune", "--config", str(src), "--trace", str(trace), "--out", str(tuned), "--json"]
    assert main(args) == 0, capsys.readouterr().err
    text = tuned.read_text(encoding="utf-8")
    assert text.count("load_seconds:") == 5
    block = text[text.index("  - name: llm") : text.index("  - name: world")]
    assert "load_seconds" not in block
    assert load_config(tuned).model("llm").load_seconds == cfg.model("llm").load_seconds


def test_a_reload_that_changes_nothing_says_so_for_an_estimated_model(tmp_path: Path) -> None:
    from manager.reload import plan_reload

    a = load_config(_home_without(tmp_path, LLM_LS))
    b = load_config(_home_without(tmp_path, LLM_LS))
    assert plan_reload(a, b) == []
    # memory changed: the estimate with it, which the service takes at its next start (as memory)
    c = load_config(_home_without(tmp_path, LLM_LS, replace=(("memory: 9GiB", "memory: 10GiB"),)))
    changes = plan_reload(a, c)
    assert "models.llm.memory (at the next restart, unless measured)" in changes
    assert "models.llm.load_seconds (at the next restart, unless measured)" in changes


def test_every_shipped_config_still_loads() -> None:
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        assert isinstance(load_config(path), Config), path


# ---- 3. the Events comment lists the kinds that are sent -------------------------------------------


def _events_comment() -> str:
    lines = PROTO.read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("rpc Events("))
    block: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("//"):
            break
        block.insert(0, line.strip()[2:])
    return "\n".join(block)


def _published_kinds() -> set[str]:
    """Every kind manager/ publishes: the literal first argument of each `_publish(` call (both sides
    of a conditional), the kinds assigned to a `kind` variable that is published, the policy's
    actions (published by their value) and the gap note a slow watcher gets."""
    kinds = {k.value for k in ActionKind} | {"events_dropped"}
    for path in (ROOT / "manager").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"_publish\(\s*([^,]+),", text):
            kinds |= set(re.findall(r'"([a-z_]+)"', m.group(1)))
        if re.search(r"_publish\(\s*kind,", text):
            for m in re.finditer(r"^\s*kind = (.+)$", text, flags=re.M):
                kinds |= set(re.findall(r'"([a-z_]+)"', m.group(1)))
    return kinds


def test_the_events_comment_lists_every_kind_sent_and_no_other() -> None:
    comment = _events_comment()
    words = set(re.findall(r"[a-z]+(?:_[a-z]+)*", comment))
    published = _published_kinds()
    assert {"load", "promote", "confirmed", "session_opened", "config_reloaded", "tuning"} <= published
    missing = sorted(published - words)
    assert missing == [], f"kinds sent but not listed in the Events comment: {missing}"
    never = {"loaded", "promoted", "demoted", "evicted", "thrash", "lease_changed", "rejected"}
    assert not never & words, f"kinds listed that are never sent: {sorted(never & words)}"
    # each kind-like word (with an underscore) the comment names is one that is sent
    listed = {w for w in words if "_" in w}
    assert listed <= published, sorted(listed - published)
