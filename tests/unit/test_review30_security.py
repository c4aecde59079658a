"""Found in the thirtieth session's security review, from a home whose LAN has other, possibly
compromised, devices (each test names what was wrong):

- a local Ray start (`residency serve` with `ray.address: null`) turns Ray's token authentication on
  and writes the cluster token to ~/.ray/auth_token with the umask's mode (0644) in a 0755 folder:
  any user of the machine could read it, and run code as the service's user through Ray's ports,
  which listen on every interface. The folder is now 0700 and the token 0600;
- `serve` listening beyond loopback without TLS said nothing, though the admin bearer token (which a
  metrics scraper sends too) then crosses the network in plain text: it is now warned of at start.

Real files and modes on disk; Ray's own start is replaced by a stand-in that writes its token as Ray
2.60 does (the real start is driven by the integration tests)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

import workers.ray_pool as rp
from manager.api.server import plaintext_warnings
from manager.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_the_token_folder_and_file_are_made_private(tmp_path: Path) -> None:
    folder = tmp_path / ".ray"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    token = folder / "auth_token"
    token.write_text("secret")
    token.chmod(0o644)
    rp.keep_ray_token_private(tmp_path)
    assert (_mode(folder), _mode(token)) == (0o700, 0o600)


def test_a_missing_folder_is_made_private_before_ray_writes_into_it(tmp_path: Path) -> None:
    rp.keep_ray_token_private(tmp_path)
    assert _mode(tmp_path / ".ray") == 0o700
    assert not (tmp_path / ".ray" / "auth_token").exists()


def test_a_symlinked_folder_is_left_as_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o755)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".ray").symlink_to(elsewhere)
    rp.keep_ray_token_private(tmp_path / "home")
    assert _mode(elsewhere) == 0o755
    assert "symbolic link" in caplog.text


def test_a_local_start_keeps_the_token_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    seen: list[int] = []

    def ray_init(**kw: Any) -> None:  # as Ray 2.60's local start writes its token (umask 022)
        folder = tmp_path / ".ray"
        seen.append(_mode(folder))
        token = folder / "auth_token"
        token.write_text("secret")
        token.chmod(0o644)

    monkeypatch.setattr(rp.ray, "init", ray_init)
    rp.start_local_ray(address="local")
    assert seen == [0o700]  # private before Ray wrote into it
    assert _mode(tmp_path / ".ray" / "auth_token") == 0o600


def _server(tmp_path: Path, **server: Any) -> Any:
    config = load_config(ROOT / "configs" / "home.yaml")
    return config.model_copy(update={"server": config.server.model_copy(update=server)})


def test_plain_text_beyond_loopback_is_warned_of(tmp_path: Path) -> None:
    got = plaintext_warnings(_server(tmp_path, listen="0.0.0.0:50051", metrics_listen="192.168.1.5:9100"))
    assert len(got) == 2
    assert "server.listen '0.0.0.0:50051' is beyond loopback without TLS" in got[0]
    assert "server.metrics_listen '192.168.1.5:9100'" in got[1] and "server.tls_cert" in got[1]


def test_loopback_or_tls_is_not_warned_of(tmp_path: Path) -> None:
    assert plaintext_warnings(_server(tmp_path, listen="127.0.0.1:50051", metrics_listen=None)) == []
    tls = _server(tmp_path, listen="0.0.0.0:50051", tls_cert="c.pem", tls_key="k.pem")
    assert plaintext_warnings(tls) == []


def _texts_declared(n: int) -> Any:
    import struct

    from residency_proto.inference import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name="embed")
    req.inputs.add(name="text", datatype="BYTES", shape=[n])
    req.raw_input_contents.append((struct.pack("<I", 2) + b"ab") * n)
    return req


def test_too_many_items_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of a few MiB declaring millions of 2-byte texts (the embedding model takes 256) was
    decoded whole, at ten times its size in memory and seconds of CPU, before its count refused it;
    ten such calls at once took 2.6 GiB. Its count is now refused before any decoding."""
    import manager.api.oip as oip
    from manager.errors import InvalidRequest
    from workers import protocol as P

    spec = P.TensorSpec("text", "BYTES", (-1,), items=(1, 256), utf8=True, unit="texts")
    decoded: list[str] = []
    real = oip.decode_input

    def spy(name: str, *a: Any) -> Any:
        decoded.append(name)
        return real(name, *a)

    monkeypatch.setattr(oip, "decode_input", spy)
    srv = oip.InferenceServicer.__new__(oip.InferenceServicer)
    with pytest.raises(InvalidRequest, match=r"input 'text' has 300000 texts; expected 1\.\.256"):
        srv._inputs(_texts_declared(300_000), [spec])
    assert decoded == []
    assert srv._inputs(_texts_declared(3), [spec])["text"].shape == (3,)  # within the limit: decoded
    assert decoded == ["text"]


def test_the_journals_store_id_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    """`RequestJournal.claim` wrote `<journal>.store` through `<journal>.store.tmp` with a plain write:
    a link planted there (a journal folder another user may write in) was followed, and its target, a
    file of the service's user, overwritten with the store id."""
    from manager.journal import RequestJournal

    victim = tmp_path / "victim.txt"
    victim.write_text("IMPORTANT\n")
    (tmp_path / "requests.journal.store.tmp").symlink_to(victim)
    j = RequestJournal(tmp_path / "requests.journal")
    try:
        j.append({"t": 1.0e9, "model": "voice", "busy_s": 0.1})
        j.claim("store-id-0123")
    finally:
        j.close()
    assert victim.read_text() == "IMPORTANT\n"
    store = tmp_path / "requests.journal.store"
    assert not store.is_symlink() and store.read_text() == "store-id-0123\n"


def test_a_streams_error_answer_fits_the_send_limit() -> None:
    """A ModelStreamInfer error answer repeats the request's id and model name: a request just under
    `server.max_request_bytes` made an answer over gRPC's send limit, and gRPC ended the whole stream
    (RESOURCE_EXHAUSTED), losing the answers of the requests after it. The answer is now cut to fit."""
    from manager.api.oip import STREAM_WRAP_BYTES, _stream_error
    from residency_proto.inference import grpc_service_pb2 as pb

    limit = 2**20
    big = pb.ModelInferRequest(model_name="no-such-model", id="i" * (limit - 64))
    details = "model 'no-such-model' is not served here; its models: voice, embed"
    answer = _stream_error(big, details, limit)
    assert answer.ByteSize() + STREAM_WRAP_BYTES <= limit
    assert answer.infer_response.id.startswith("iiii") and answer.infer_response.id.endswith("…")
    assert answer.error_message == details and answer.infer_response.model_name == "no-such-model"
    small = pb.ModelInferRequest(model_name="no-such-model", id="small")
    whole = _stream_error(small, details, limit)  # one that fits is as it was
    assert (whole.error_message, whole.infer_response.id) == (details, "small")
    assert _stream_error(big, details).infer_response.id == big.id  # no limit: nothing cut


def test_a_new_store_and_journal_are_private(tmp_path: Path) -> None:
    """`.residency/` was made 0755 and `state.db` and `requests.journal` 0644: any user of the machine
    could read the home's timeline of use (which model, when), the reason the metrics endpoint asks
    for a token beyond loopback. A new store folder is now 0700, the database and journal 0600."""
    from contextlib import closing

    from manager.journal import RequestJournal
    from manager.store import open_store

    folder = tmp_path / ".residency"
    with closing(open_store(f"sqlite:///{folder / 'state.db'}")) as store:
        store.append_requests([{"t": 1.0e9, "model": "voice", "busy_s": 0.1}])
    assert _mode(folder) == 0o700 and _mode(folder / "state.db") == 0o600
    wal = folder / "state.db-wal"
    assert not wal.exists() or _mode(wal) == 0o600
    j = RequestJournal(tmp_path / "j" / "requests.journal")
    try:
        j.append({"t": 1.0e9, "model": "voice", "busy_s": 0.1})
        j.claim("store-id")
    finally:
        j.close()
    assert _mode(tmp_path / "j") == 0o700 and _mode(tmp_path / "j" / "requests.journal") == 0o600
    assert _mode(tmp_path / "j" / "requests.journal.store") == 0o600
