"""The offline tools, found by the 28th session's review (manager/config.py, manager/cli.py,
manager/replay/sim.py, manager/replay/report.py):

- A tuned config lost the user's comment lines: ruamel drops, at its load already, a comment line
  between two entries of a list of flow mappings when the first has no comment at its end and the
  second has one. The shipped home.yaml lost its interactive class's comment at the second tune (the
  first adds a note at the end of that entry's line), then at every write, even with no change.
  The lines are put back, before the line that followed them.
- `tune --holdout FILE` searched on the holdout's own days when they were in --trace too (a holdout
  cut from the same week): its before/after figures judged days the search had seen. The search
  now leaves out the requests within the holdout's span, and says so.
- `replay`'s per-model `requests` counted served requests only, though the top level's counts them
  at arrival: a model whose requests were all rejected said 0. It counts them at arrival now, and
  `rejected` says how many were rejected.
- A device named with `$` (matplotlib's math) failed `tune --report` with a traceback, after the
  whole search.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manager.cli import main
from manager.config import load_config, write_config_with_updates

ROOT = Path(__file__).resolve().parents[2]

FLOW = """\
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 8GiB}
host: {memory: 4GiB}

classes:                           # highest first
  # Voice must always answer.
  - {name: realtime, reserve: 1GiB}
  # Chat gets room of its own, so the batches never crowd it out.
  - {name: interactive, reserve: 4GiB}   # chat
  # Batches: tagging and indexing.
  - {name: background}   # batches

models:
  # the voice model
  - {name: voice, class: realtime, adapter: silero-vad, device: gpu0, memory: 1GiB, pin: true}
  # chat, kept warm
  - {name: chat, class: interactive, adapter: silero-vad, device: gpu0, memory: 2GiB}   # the LLM
policy: {name: residency, timezone: UTC}
"""


def _comments(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("#")]


class TestATunedConfigKeepsTheUsersCommentLines:
    def test_with_no_change(self, tmp_path: Path) -> None:
        src, dst = tmp_path / "c.yaml", tmp_path / "t.yaml"
        src.write_text(FLOW)
        write_config_with_updates(src, dst, {})
        assert _comments(dst.read_text()) == _comments(FLOW)
        # in their places: each before the entry it speaks of
        out = dst.read_text().splitlines()
        i = out.index("  # Chat gets room of its own, so the batches never crowd it out.")
        assert out[i + 1].startswith("  - {name: interactive")
        i = out.index("  # chat, kept warm")
        assert out[i + 1].startswith("  - {name: chat")

    def test_with_changes_noted(self, tmp_path: Path) -> None:
        src, dst = tmp_path / "c.yaml", tmp_path / "t.yaml"
        src.write_text(FLOW)
        write_config_with_updates(
            src, dst, {"chat": {"keep_alive": "10m"}}, {"interactive": {"reserve": "3GiB"}}, note_changes=True
        )
        text = dst.read_text()
        assert set(_comments(FLOW)) <= set(_comments(text)), text
        out = text.splitlines()
        i = out.index("  # Chat gets room of its own, so the batches never crowd it out.")
        assert out[i + 1].startswith("  - {name: interactive") and "3GiB" in out[i + 1]
        cfg = load_config(dst)
        assert next(c for c in cfg.classes if c.name == "interactive").reserve == 3 * 2**30

    def test_the_shipped_home_config_tuned_twice(self, tmp_path: Path) -> None:
        home = (ROOT / "configs" / "home.yaml").read_text()
        line = "# Chat, the world model and images: may evict each other and anything background."
        assert line in _comments(home)
        (tmp_path / "home.yaml").write_text(home)
        once, twice = tmp_path / "once.yaml", tmp_path / "twice.yaml"
        write_config_with_updates(
            tmp_path / "home.yaml", once, {}, {"interactive": {"reserve": "1GiB"}}, note_changes=True
        )
        write_config_with_updates(once, twice, {}, note_changes=True)
        assert line in _comments(once.read_text())
        assert line in _comments(twice.read_text())
        assert set(_comments(home)) <= set(_comments(twice.read_text()))


HEAD = """\
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 8GiB}
host: {memory: 4GiB}
classes:
  - {name: realtime, reserve: 1GiB}
  - {name: interactive, reserve: 4GiB}   # chat
policy: {name: residency, timezone: UTC}
models:
"""


class TestTheCommentsPutBackAreInTheirPlaces:
    """Found by the review of the fix above: comments put back by their text alone."""

    def test_two_comment_lines_of_the_same_text(self, tmp_path: Path) -> None:
        # the first was lost, the second kept: the second was taken for the first, and put back twice
        models = (
            "  - {name: voice, class: realtime, adapter: silero-vad, device: gpu0, memory: 1GiB}\n"
            "  # keep warm all day\n"
            "  - {name: chat, class: interactive, adapter: silero-vad, device: gpu0, memory: 2GiB}"
            "   # the LLM\n"
            "  # keep warm all day\n"
            "  - {name: tag, class: interactive, adapter: silero-vad, device: gpu0, memory: 2GiB}\n"
        )
        (tmp_path / "c.yaml").write_text(HEAD + models)
        write_config_with_updates(tmp_path / "c.yaml", tmp_path / "t.yaml", {})
        assert (tmp_path / "t.yaml").read_text().endswith(models)

    def test_a_line_joined_by_the_dump_moves_no_comment_into_another_entry(self, tmp_path: Path) -> None:
        # its second line gone, a later `device:` line was taken for it: the comment went there
        (tmp_path / "c.yaml").write_text(
            HEAD + "  - {name: voice, class: realtime, adapter: silero-vad,\n"
            "     device: gpu0, memory: 1GiB}\n"
            "  # about chat\n"
            "  - {name: chat, class: interactive, adapter: silero-vad, device: gpu0, memory: 2GiB}"
            "   # the LLM\n"
            "  - name: tag\n    class: interactive\n    adapter: silero-vad\n    # about tag's device\n"
            "    device: gpu0\n    memory: 2GiB\n"
        )
        write_config_with_updates(tmp_path / "c.yaml", tmp_path / "t.yaml", {})
        out = (tmp_path / "t.yaml").read_text().splitlines()
        assert out.count("  # about chat") == 1
        assert out[out.index("  # about chat") + 1].startswith("  - {name: chat")
        assert out[out.index("    # about tag's device") + 1] == "    device: gpu0"


def _trace(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


class TestAHoldoutWithinTheTraceIsNotSearched:
    def test_the_search_leaves_the_holdouts_days_out(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        cfg = ROOT / "configs" / "home.yaml"
        assert (
            main(
                [
                    "trace",
                    "synth",
                    "--profile",
                    "home",
                    "--days",
                    "7",
                    "--seed",
                    "3",
                    "--out",
                    str(tmp_path / "w.jsonl"),
                ]
            )
            == 0
        )
        lines = [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()]
        cut = lines[0]["t"] + 5 * 86400
        hold = _trace(tmp_path / "hold.jsonl", [x for x in lines if x["t"] >= cut])
        capsys.readouterr()
        code = main([
            "tune", "--config", str(cfg), "--trace", str(tmp_path / "w.jsonl"), "--holdout", str(hold),
            "--out", str(tmp_path / "t.yaml"), "--json",
        ])  # fmt: skip
        assert code == 0
        got = capsys.readouterr()
        fig = json.loads(got.out)
        before = sum(1 for x in lines if x["t"] < cut)
        assert fig["search"]["before"]["requests"] == before < len(lines)
        assert fig["holdout"]["before"]["requests"] == len(lines) - before
        assert f"and {len(lines) - before} of the {len(lines)} requests of --trace fall in it" in " ".join(
            got.err.split()
        )
        assert f"({before} requests)" in (tmp_path / "t.yaml").read_text().splitlines()[0]

    def test_a_holdout_that_holds_the_whole_trace_is_refused(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        t = _trace(
            tmp_path / "t.jsonl", [{"t": 1.8e9 + i * 60, "model": "embed", "busy_s": 1} for i in range(30)]
        )
        code = main([
            "tune", "--config", str(ROOT / "configs" / "home.yaml"), "--trace", str(t), "--holdout", str(t),
            "--out", str(tmp_path / "o.yaml"),
        ])  # fmt: skip
        assert code == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "which holds every request of --trace" in err and "nothing is left to search" in err
        assert not (tmp_path / "o.yaml").exists()


SMALL = """\
devices:
  - {name: gpu0, kind: cuda, index: 0, memory: 8GiB, reserve: 0}
host: {memory: 8GiB, reserve: 1GiB}
classes:
  - {name: realtime}
  - {name: interactive, max_wait: 5, max_queue: 1}
models:
  - {name: a, class: interactive, adapter: silero-vad, device: gpu0, memory: 5GiB,
     load_seconds: {disk: 10, host: 2}}
  - {name: b, class: interactive, adapter: silero-vad, device: gpu0, memory: 5GiB,
     load_seconds: {disk: 10, host: 2}}
policy: {name: residency}
"""


def test_replays_per_model_requests_count_the_rejected_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "c.yaml").write_text(SMALL)
    t = _trace(
        tmp_path / "t.jsonl",
        [
            {"t": 1000000, "model": "a", "busy_s": 30},
            {"t": 1000001, "model": "b", "busy_s": 30},
            {"t": 1000002, "model": "a", "busy_s": 1},
            {"t": 1000003, "model": "b", "busy_s": 1},
        ],
    )
    assert (
        main(
            [
                "replay",
                "--config",
                str(tmp_path / "c.yaml"),
                "--trace",
                str(t),
                "--policy",
                "residency",
                "--json",
            ]
        )
        == 0
    )
    fig = json.loads(capsys.readouterr().out)
    assert (fig["requests"], fig["served"], fig["rejected"]) == (4, 2, 2)
    models = fig["models"]
    assert (models["b"]["requests"], models["b"]["rejected"]) == (2, 2)  # it said 0: never asked for
    assert sum(m["requests"] for m in models.values()) == fig["requests"]
    assert sum(m["rejected"] for m in models.values()) == fig["rejected"]


def test_a_device_named_with_dollars_gets_its_report(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(SMALL.replace("gpu0", "gpu$_$0").replace("max_wait: 5, max_queue: 1", "max_wait: 600"))
    t = _trace(
        tmp_path / "t.jsonl", [{"t": 1.8e9 + i * 600, "model": "ab"[i % 2], "busy_s": 1} for i in range(40)]
    )
    code = main([
        "tune", "--config", str(cfg), "--trace", str(t), "--out", str(tmp_path / "o.yaml"),
        "--report", str(tmp_path / "rep"),
    ])  # fmt: skip
    assert code == 0
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"index.html", "memory.png", "timeline.png"}
    assert (tmp_path / "o.yaml").is_file()
