"""Found in the review of 2026-12-04: the YAML writer behind `residency measure --write-config` and
`residency tune` (write-back) took the braces off one-key mappings in flow lists, and measure left a
comment written for the old value beside the measured one."""

from __future__ import annotations

from pathlib import Path

from manager.config import load_config
from manager.measure import ModelMeasure, write_measured_config
from manager.tuning_job import TuningOutcome, write_back

CONFIG = """\
devices: [{name: gpu0, kind: cpu, memory: 8GiB, reserve: 1GiB}]
host: {memory: 16GiB, reserve: 1GiB}
classes: [{name: realtime}, {name: background, may_evict: false}]
models:
  - name: voice
    class: realtime
    adapter: safetensors-module
    device: gpu0
    memory: 1GiB  # from the model card
    load_seconds: {disk: 3.0, cached: 1.2, host: 0.4}   # guessed
    keep_alive: 30m  # my choice
    source: {factory: "models.voice:build", path: voice.pt,
             kwargs: {layers: [{width: 4}], heads: [{n: 2}, {n: 3}]}}
  - name: embed
    class: background
    adapter: torchscript
    device: gpu0
    memory: 2GiB      # a guess too
    load_seconds:
      disk: 5.0       # disk guess
      cached: 2.0
      host: 0.5       # exact
    source: {path: embed.pt}
  - name: photos
    class: background
    adapter: torchscript
    device: gpu0
    memory: 1GiB      # not measured: stays
    load_seconds: {disk: 4.0, host: 0.5}  # not measured: stays
    source: {path: photos.pt}
"""


def _measured(name: str, disk: float, cached: float, host: float, footprint: int) -> ModelMeasure:
    mm = ModelMeasure(name, "torchscript", "gpu0", "gpu0", footprint_bytes=footprint)
    mm.transitions = {
        "disk->gpu(cold)": {"total_s": disk},
        "disk->gpu(cached)": {"total_s": cached},
        "host->gpu": {"total_s": host},
    }
    return mm


def _line(text: str, start: str) -> str:
    """The one line of `text` that begins (after its indent) with `start`."""
    (line,) = [x for x in text.splitlines() if x.lstrip().startswith(start)]
    return line


def test_one_key_mappings_in_flow_lists_keep_their_braces(tmp_path: Path) -> None:
    """`classes: [{name: realtime}, ...]` came back as `[name: realtime, ...]`, and a factory's
    `kwargs: {layers: [{width: 4}]}` as `[width: 4]`: the same data, not what the person wrote."""
    src, measured, tuned = tmp_path / "c.yaml", tmp_path / "m.yaml", tmp_path / "t.yaml"
    src.write_text(CONFIG, encoding="utf-8")
    write_measured_config(src, measured, [_measured("photos", 4.0, 2.0, 0.5, 2**30)])
    text = measured.read_text(encoding="utf-8")
    assert "classes: [{name: realtime}, {name: background, may_evict: false}]\n" in text
    assert "kwargs: {layers: [{width: 4}], heads: [{n: 2}, {n: 3}]}}\n" in text
    # tuning's write-back goes through the same writer
    tuned.write_text(CONFIG, encoding="utf-8")
    (tmp_path / "run").mkdir()
    outcome = TuningOutcome(
        tmp_path / "run" / "proposed.yaml", None, 0, model_updates={"embed": {"keep_alive": "1h"}}
    )
    assert write_back(tuned, outcome) == ""
    text = tuned.read_text(encoding="utf-8")
    assert "classes: [{name: realtime}, {name: background, may_evict: false}]\n" in text
    assert "kwargs: {layers: [{width: 4}], heads: [{n: 2}, {n: 3}]}}\n" in text
    assert load_config(tuned).model("embed").keep_alive == 3600


def test_measure_replaces_the_comment_beside_a_value_it_changed_and_no_other(tmp_path: Path) -> None:
    """`memory: 1GiB  # from the model card` became `memory: 1500000000 # from the model card`: the
    card's figure was gone, its comment stayed, now speaking of the measured value."""
    src, dst = tmp_path / "c.yaml", tmp_path / "m.yaml"
    src.write_text(CONFIG, encoding="utf-8")
    config = write_measured_config(
        src, dst, [_measured("voice", 2.5, 1.0, 0.3, 1_500_000_000), _measured("embed", 4.0, 2.0, 0.5, 2**31)]
    )
    text = dst.read_text(encoding="utf-8")
    assert _line(text, "memory: 1500000000") == (
        "    memory: 1500000000  # residency measure: memory was 1GiB (from the model card)"
    )
    # the flow mapping stays on its line; the note names each value that changed
    assert _line(text, "load_seconds: {disk: 2.5") == (
        "    load_seconds: {disk: 2.5, cached: 1.0, host: 0.3}   "
        "# residency measure: disk was 3.0, cached was 1.2, host was 0.4 (guessed)"
    )
    # block style: each line with its own value; a value measured as it was keeps its comment, as
    # does a line whose value did not change (embed's memory is 2 GiB, written in bytes)
    assert _line(text, "disk: 4.0") == "      disk: 4.0       # residency measure: disk was 5.0 (disk guess)"
    assert _line(text, "host: 0.5") == "      host: 0.5       # exact"
    assert _line(text, "memory: 2147483648").endswith("# a guess too")
    for kept in ("keep_alive: 30m  # my choice", "memory: 1GiB      # not measured: stays"):
        assert _line(text, kept.split("#")[0].strip()).strip() == kept
    assert _line(text, "load_seconds: {disk: 4.0, host: 0.5}").endswith("  # not measured: stays")
    assert text.count("# residency measure:") == 3
    assert load_config(dst) == config
    assert config.model("voice").memory == 1_500_000_000
    assert (config.model("voice").load_seconds.disk, config.model("embed").load_seconds.disk) == (2.5, 4.0)


def test_measured_again_the_note_keeps_the_persons_value_and_gives_the_comment_back(tmp_path: Path) -> None:
    src, first, second = tmp_path / "c.yaml", tmp_path / "1.yaml", tmp_path / "2.yaml"
    src.write_text(CONFIG, encoding="utf-8")
    write_measured_config(src, first, [_measured("voice", 2.5, 1.0, 0.3, 1_500_000_000)])
    # measured again: the memory comes out as the card said, the load times differ once more
    write_measured_config(first, second, [_measured("voice", 2.0, 1.2, 0.4, 2**30)])
    text = second.read_text(encoding="utf-8")
    assert _line(text, "memory: 1073741824") == "    memory: 1073741824  # from the model card"
    assert _line(text, "load_seconds: {disk: 2.0").endswith(
        "  # residency measure: disk was 3.0 (guessed)"
    )  # (cached and host are back to the person's figures)
    assert load_config(second).model("voice").load_seconds.disk == 2.0


def test_the_note_goes_past_a_hash_in_a_quoted_value_and_before_a_tuning_note(tmp_path: Path) -> None:
    src, dst = tmp_path / "c.yaml", tmp_path / "m.yaml"
    src.write_text(
        "devices: [{name: gpu0, kind: cpu, memory: 8GiB}]\nhost: {memory: 16GiB}\nclasses: [{name: rt}]\n"
        "models:\n"
        "  - {name: a, class: rt, adapter: silero-vad, device: gpu0, memory: 1GiB,"
        " load_seconds: {disk: 2, host: 1},"
        ' source: {path: "a # b.pt"}}  # card # 2024\n'
        "  - {name: b, class: rt, adapter: silero-vad, device: gpu0, memory: 1GiB,"
        " load_seconds: {disk: 2, host: 1},"
        " keep_alive: auto}  # mine  # residency tune: b.keep_alive was 10m\n",
        encoding="utf-8",
    )
    config = write_measured_config(src, dst, [_measured(n, 2.0, 1.5, 1.0, 2**29) for n in ("a", "b")])
    text = dst.read_text(encoding="utf-8")
    assert _line(text, "- {name: a").endswith(
        'source: {path: "a # b.pt"}}  # residency measure: cached was unset, memory was 1GiB (card # 2024)'
    )
    assert _line(text, "- {name: b").endswith(
        "  # residency measure: cached was unset, memory was 1GiB (mine)"
        "  # residency tune: b.keep_alive was 10m"
    )
    assert config.model("a").source == {"path": "a # b.pt"}
    assert load_config(dst) == config
