"""The command line with user text that looks like markup, times and spans it cannot use, flags out of
range, and `ps` against a TLS server whose config names a token variable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.cli import main
from manager.replay.synth import synth
from manager.replay.trace import write_trace
from residency_proto.v1 import residency_pb2, residency_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs" / "home.yaml"


def lines(path: Path, *objs: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


@pytest.mark.parametrize("model", ["[/x]", "[red]", "[bold]x[/bold]"])
def test_trace_values_that_look_like_markup_are_printed_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    trace = lines(tmp_path / "t.jsonl", {"t": 1, "model": model, "busy_s": 1})
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json"]) == 2  # no valid line
    err = capsys.readouterr().err
    assert f"unknown model {model!r}" in err


def test_tune_holdout_without_valid_requests_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "week.jsonl"
    write_trace(trace, synth("home", 2, 1))
    ms = lines(tmp_path / "ms.jsonl", {"t": 1793577600000, "model": "voice", "busy_s": 1})  # milliseconds
    args = ["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(tmp_path / "t.yaml")]
    assert main([*args, "--holdout", str(ms)]) == 2
    assert f"{ms}: no valid request line" in capsys.readouterr().err


def test_tune_out_into_a_missing_folder_makes_it(tmp_path: Path) -> None:
    trace = tmp_path / "week.jsonl"
    write_trace(trace, synth("home", 1, 1))
    out = tmp_path / "new" / "folder" / "tuned.yaml"
    assert main(["tune", "--config", str(HOME), "--trace", str(trace), "--out", str(out), "--json"]) == 0
    assert out.exists()


@pytest.mark.parametrize("days", ["0", "-1", "3661", "100000000000000000000"])
def test_trace_synth_days_out_of_range_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], days: str
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "synth", "--days", days, "--out", str(out)]) == 2
    assert "--days must be between 1 and 3660" in capsys.readouterr().err
    assert not out.exists()


def test_replay_of_a_time_in_milliseconds_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = lines(tmp_path / "t.jsonl", {"t": 1e19, "model": "voice", "busy_s": 1})
    assert main(["replay", "--config", str(HOME), "--trace", str(trace), "--json", "--strict"]) == 2
    assert "(milliseconds?)" in capsys.readouterr().err


# --- ps against a TLS server ---------------------------------------------------------------------


class FakeResidency(residency_pb2_grpc.ResidencyServicer):
    """A fake residency server: List answers one model, to a caller with the right bearer token."""

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        if ("authorization", "Bearer s3cret") not in context.invocation_metadata():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        return residency_pb2.ListResponse(models=[residency_pb2.ModelStatus(name="voice", tier="gpu")])


@pytest.fixture
def tls_server(tls_pair: tuple[Path, Path]) -> Iterator[tuple[int, Path]]:
    """The fake on 127.0.0.1 over TLS with a fresh self-signed certificate: (port, cert file)."""
    cert, key = tls_pair
    with futures.ThreadPoolExecutor(2) as pool:
        server = grpc.server(pool)
        residency_pb2_grpc.add_ResidencyServicer_to_server(FakeResidency(), server)
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        try:
            yield port, cert
        finally:
            server.stop(None)


def test_ps_with_a_config_speaks_tls_and_reads_its_token_variable(
    tmp_path: Path,
    tls_server: tuple[int, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, cert = tls_server
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f'server: {{listen: "127.0.0.1:{port}", tls_cert: {cert}, tls_key: {cert}, auth_token_env: PS_TOK}}\n'
        "devices: [{name: cpu0, kind: cpu, memory: 4GiB}]\n"
        "host: {memory: 16GiB, reserve: 4GiB}\n"
        "classes: [{name: interactive}]\n"
        "models: [{name: m, class: interactive, adapter: silero-vad, device: cpu0, memory: 1MiB,"
        " load_seconds: {disk: 1, host: 0.1}}]\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("PS_TOK", "s3cret")
    assert main(["ps", "--config", str(cfg), "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)["models"]] == ["voice"]
    monkeypatch.delenv("PS_TOK")
    assert main(["ps", "--config", str(cfg), "--json"]) == 2  # no token: the server refuses, named
    assert "UNAUTHENTICATED" in capsys.readouterr().err
