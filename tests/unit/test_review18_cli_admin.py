"""Found in the 18th review's user walkthrough of the `residency` CLI; each test failed before its fix.

- The CLI had no admin commands (pin, unpin, preload, evict, stats, reload, events): a user had to
  read the proto and use grpcurl. The commands against a real running service are in
  tests/integration/test_review18_cli_admin.py; here: the parser, and what is said without a service.
- `ps` had no column for an elastic model's KV lease (the world model showed its 49.9 MiB of weights
  only, while it held a 1 GiB lease).
- `config check` printed its `ok` line on stderr, leaving stdout empty.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from manager.cli import build_parser, main
from residency_proto.v1 import residency_pb2

ADMIN_COMMANDS = ("pin", "unpin", "preload", "evict", "stats", "reload", "events")

CONFIG = """
server: {listen: "127.0.0.1:PORT", auth_token_env: REVIEW18_CLI_TOKEN}
devices: [{name: cpu0, kind: cpu, memory: 1GiB, reserve: 128MiB}]
host: {memory: 8GiB, reserve: 1GiB}
classes: [{name: interactive}]
models:
  - {name: tiny, class: interactive, adapter: torchscript, device: cpu0, memory: 1MiB,
     load_seconds: {disk: 0.1, host: 0.05}, source: {path: tiny.pt}}
"""


def _closed_port() -> int:
    """A port on loopback that nothing listens on (it was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# --- 1. the admin commands ----------------------------------------------------------------------


def test_help_lists_the_admin_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ADMIN_COMMANDS:
        assert f"    {cmd} " in out, (cmd, out)


@pytest.mark.parametrize("cmd", ADMIN_COMMANDS)
def test_each_admin_command_has_the_connection_options_of_ps_and_help_for_every_option(cmd: str) -> None:
    commands = _subcommands(build_parser())
    p = commands[cmd]
    assert p.description, f"{cmd}: no description in its --help"
    flags = {s for a in p._actions for s in a.option_strings}
    assert {"--config", "--target", "--token-env", "--tls-cert"} <= flags
    for action in p._actions:
        assert action.help, f"{cmd}: {action.option_strings or action.dest} has no help text"


@pytest.mark.parametrize(
    "argv",
    [
        ["preload", "tiny", "--tier", "disk"],  # a preload goes to gpu or host
        ["evict", "tiny", "--to", "gpu"],  # an evict goes to host or disk
        ["pin"],  # no model named
        ["stats", "tiny"],  # stats takes no model
    ],
)
def test_a_bad_command_line_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--target", "127.0.0.1:1"])
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["pin", "tiny"],
        ["unpin", "tiny"],
        ["preload", "tiny"],
        ["evict", "tiny"],
        ["stats"],
        ["reload"],
        ["events"],
    ],
)
def test_no_service_there_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{_closed_port()}"
    assert main([*argv, "--target", target]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"residency: {target}: UNAVAILABLE"), cap.err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["pin", "tiny", "--target", "nohost"], "--target: expected host:port"),
        (["pin", "", "--target", "127.0.0.1:1"], "MODEL is empty"),
        (
            ["stats", "--target", "127.0.0.1:1", "--token-env", "REVIEW18_NOT_SET"],
            "--token-env REVIEW18_NOT_SET",
        ),
        (["reload", "--target", "127.0.0.1:1", "--tls-cert", "/nonexistent/cert.pem"], "cannot read the TLS"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REVIEW18_NOT_SET", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_the_config_gives_the_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--config names the service's address (its server.listen), as for `ps`."""
    port = _closed_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("PORT", str(port)))
    assert main(["stats", "--config", str(cfg)]) == 2
    assert f"residency: 127.0.0.1:{port}: UNAVAILABLE" in capsys.readouterr().err


# --- 2. ps shows the lease ----------------------------------------------------------------------


def _ps_rows(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """The header's cells and each model's row's cells of `ps`'s table (rich's box lines)."""
    lines = [ln for ln in out.splitlines() if "│" in ln or "┃" in ln]
    cells = [[c.strip() for c in ln.replace("┃", "│").split("│")[1:-1]] for ln in lines]
    header, rows = cells[0], cells[1:]
    return header, {r[0]: r for r in rows}


def test_ps_shows_an_elastic_models_lease(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    resp = residency_pb2.ListResponse(
        models=[
            residency_pb2.ModelStatus(name="world", tier="gpu", bytes=52366336, lease_bytes=2**30),
            residency_pb2.ModelStatus(name="voice", tier="gpu", bytes=2181128),
        ]
    )

    def listed(*_: Any, **__: Any) -> Any:
        return resp

    monkeypatch.setattr("manager.api.client.list_models", listed)
    assert main(["ps", "--target", "127.0.0.1:50051"]) == 0
    header, rows = _ps_rows(capsys.readouterr().out)
    lease = header.index("lease MiB")
    assert rows["world"][header.index("MiB")] == "49.9"
    assert rows["world"][lease] == "1024.0"
    assert rows["voice"][lease] == ""  # not elastic: no lease


# --- 3. config check says ok on stdout ----------------------------------------------------------


def test_config_check_prints_ok_on_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REVIEW18_CLI_TOKEN", "a-token")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("PORT", "50051"))
    assert main(["config", "check", str(cfg)]) == 0
    cap = capsys.readouterr()
    assert cap.out == f"{cfg}: ok (1 device, 1 class, 1 model)\n"
    assert cap.err == ""


def test_config_check_errors_stay_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("PORT", "50051").replace("memory: 1MiB", "memory: lots"))
    assert main(["config", "check", str(cfg)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "memory" in cap.err


def test_stats_json_of_no_service_prints_no_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--json", "--target", f"127.0.0.1:{_closed_port()}"]) == 2
    out = capsys.readouterr().out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
