"""A config written again (tune, measure) keeps each comment on the line it was written on when a
value is an alias of an anchored scalar (`keep_alive: *ka  # words`). ruamel reads the alias with the
anchor line's comment and moves the alias line's own comment below it: tune wrote one model's comment
on another model's line, and the right one on a line of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager.config import load_config, write_config_with_updates

CONFIG = """\
devices:
  - {name: cpu0, kind: cpu, memory: 4GiB, reserve: 512MiB}
host: {memory: 16GiB, reserve: 4GiB}
classes:
  - {name: realtime, reserve: 256MiB}
  - {name: interactive}
  - {name: background, may_evict: false}
models:
  - name: voice
    class: realtime
    adapter: silero-vad
    device: cpu0
    memory: 2MiB
    keep_alive: &ka 30m   # half an hour for voice
  - name: embed
    class: background
    adapter: sentence-transformers
    device: cpu0
    memory: 90MiB
    keep_alive: *ka       # same as voice

  # the second embedder
  - name: embed2
    class: background
    adapter: sentence-transformers
    device: cpu0
    memory: 90MiB
    keep_alive: *ka  # also
policy: {name: residency}
"""


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.parametrize(
    ("updates", "changed"),
    [
        # an update elsewhere: every line as it was
        ({"voice": {"memory": "3MiB"}}, {12: "    memory: 3MiB  # residency tune: voice.memory was 2MiB"}),
        # the alias tuned: its own comment stays on its line, the anchor's on the anchor's
        (
            {"embed": {"keep_alive": "10m"}},
            {19: "    keep_alive: 10m       # same as voice  # residency tune: embed.keep_alive was 30m"},
        ),
        # the anchor tuned: the next use of the old value holds the anchor now, with its own comment
        (
            {"voice": {"keep_alive": "10m"}},
            {
                13: "    keep_alive: 10m       # half an hour for voice"
                "  # residency tune: voice.keep_alive was 30m",
                19: "    keep_alive: &ka 30m   # same as voice",
            },
        ),
    ],
)
def test_comments_stay_on_their_lines_beside_aliases(
    tmp_path: Path, updates: dict[str, dict[str, str]], changed: dict[int, str]
) -> None:
    src, dst = tmp_path / "home.yaml", tmp_path / "tuned.yaml"
    src.write_text(CONFIG)
    write_config_with_updates(src, dst, updates, note_changes=True)
    want = CONFIG.splitlines()
    for i, line in changed.items():
        want[i] = line
    assert lines_of(dst) == want
    cfg = load_config(dst)
    assert {m.name: m.keep_alive for m in cfg.models}["embed2"] == 1800.0  # still the anchor's value


def test_a_class_named_like_markup_is_printed_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay`'s table printed a class's name as rich markup: `[/rt]` raised MarkupError (a
    traceback), `[bold]rt` lost its brackets. Both are valid class names."""
    from manager.cli import main

    root = Path(__file__).resolve().parents[2]
    trace = root / "bench" / "traces" / "home-week-seed1.jsonl"
    day = tmp_path / "day.jsonl"
    day.write_text("".join(trace.read_text().splitlines(keepends=True)[:300]))
    for name in ("[/rt]", "[bold]rt"):
        text = (root / "configs" / "home.yaml").read_text().replace("realtime", f'"{name}"')
        cfg = tmp_path / "weird.yaml"
        cfg.write_text(text)
        assert main(["replay", "--config", str(cfg), "--trace", str(day), "--policy", "residency"]) == 0
        assert f"p99 {name} s" in capsys.readouterr().out


def test_a_host_preload_of_a_model_on_the_gpu_says_it_stayed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`preload --tier host` of a model on the GPU said "preloaded to host (now gpu ...)": nothing
    moved (a preload never moves a model down)."""
    import types

    import manager.cli as cli

    answer = types.SimpleNamespace(name="embed", tier="gpu", device="cpu0", last_error="")
    monkeypatch.setattr(cli, "_admin", lambda *a, **k: answer)
    args = types.SimpleNamespace(name="embed", tier="host", json=False, timeout=None)
    monkeypatch.setattr(cli, "_model_arg", lambda a: a.name)
    assert cli.cmd_preload(args) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().out.strip() == "embed: already on the gpu, kept there (now gpu on cpu0)"
    answer.tier = "host"
    assert cli.cmd_preload(args) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().out.strip() == "embed: preloaded to host (now host on cpu0)"
