"""Review 20, a walkthrough of the admin commands against the real service (its gRPC server in this
process on a free port, in-process device hosts, configs/local-cpu.yaml), each failing before its fix:

- An admin command given `--config` read and validated the whole file to learn the service's address,
  so one mistake anywhere in it (a typo in a model's keep_alive) made `reload --config home.yaml`, the
  command meant to apply the file, exit 2 with the file's error without asking the service, and `ps`
  and the rest fail too while the service ran on. Only the `server` section is read now: the service
  refuses the reload itself (INVALID_ARGUMENT, exit 1), and `ps` works.
- A refusal the service sends while it stops ("the service is stopping ...") exited 2, "cannot be
  reached", as gRPC's own UNAVAILABLE does, because the channel was closed by the time it was read.
  Its words now say it is the service's answer: exit 1."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from manager.api.client import ClientError, _error
from manager.live import LiveManager

from .test_review18_cli_admin import cli, with_service


def test_admin_commands_reach_the_service_though_the_file_has_a_mistake_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def body(target: str, manager: LiveManager, path: Path) -> None:
        text = path.read_text()
        assert "keep_alive: forever" in text
        path.write_text(text.replace("keep_alive: forever", "keep_alive: 1m1m", 1))
        assert await cli("reload", "--config", str(path), "--target", target) == 1
        err = capsys.readouterr().err
        assert "INVALID_ARGUMENT" in err and "config not reloaded" in err and "1m1m" in err, err
        assert await cli("ps", "--config", str(path), "--target", target) == 0
        assert await cli("stats", "--config", str(path), "--target", target) == 0
        capsys.readouterr()
        # a mistake in `server` itself is still said at once, naming the field (exit 2)
        path.write_text(text.replace('listen: "127.0.0.1:', 'listen: "127.0.0.1:x', 1))
        assert await cli("ps", "--config", str(path), "--target", target) == 2
        assert "server.listen" in capsys.readouterr().err

    with_service(tmp_path, body)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Closed:
    """A channel that no longer connects (the service closed it as it stopped)."""

    def subscribe(self, note: object, try_to_connect: bool = False) -> None:
        note(grpc.ChannelConnectivity.SHUTDOWN)  # type: ignore[operator]

    def unsubscribe(self, note: object) -> None:
        pass


@pytest.mark.parametrize(
    "details",
    [
        "the service is stopping; reconnect to follow its events",
        "model 'image': the service is stopping and its load did not finish in time; retry when it is back",
        "the server is stopping: world session 0123456789ab is saved",
    ],
)
def test_the_services_answer_while_it_stops_is_its_refusal(details: str) -> None:
    e = _error(_Failed(grpc.StatusCode.UNAVAILABLE, details), _Closed(), "127.0.0.1:1", False)
    assert isinstance(e, ClientError) and e.answered, e


def test_grpcs_own_unavailable_on_a_closed_channel_is_not_an_answer() -> None:
    e = _error(_Failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"), _Closed(), "127.0.0.1:1", False)
    assert not e.answered


# Review 27: a stream whose server went away was told "the connection to the service was lost" only
# when gRPC said "Socket closed" (the server's kernel closed it with a FIN). A server killed while data
# it had not read was in flight (a keepalive ping, a window update) resets the connection instead
# ("recvmsg:Connection reset by peer"), and that same loss read as gRPC's bare words. A call that
# never had a connection (`lost` False) gets no such hint, and the service's own UNAVAILABLE none.
LOST = "(the connection to the service was lost)"


@pytest.mark.parametrize(
    "details",
    [
        "Socket closed",
        "recvmsg:Connection reset by peer",
        "sendmsg: Broken pipe (32)",
        "Connection reset by peer",
    ],
)
def test_a_stream_whose_server_went_away_says_its_connection_was_lost(details: str) -> None:
    e = _error(_Failed(grpc.StatusCode.UNAVAILABLE, details), _Closed(), "127.0.0.1:1", False, lost=True)
    assert LOST in str(e) and "tls" not in str(e).lower(), e
    assert not e.answered


def test_a_call_that_never_connected_gets_the_tls_hint_not_the_lost_one() -> None:
    e = _error(_Failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"), _Closed(), "127.0.0.1:1", False)
    assert LOST not in str(e) and "--tls-cert" in str(e), e


def test_the_services_own_unavailable_on_a_stream_is_not_a_lost_connection() -> None:
    said = "the service is stopping; reconnect to follow its events"
    e = _error(_Failed(grpc.StatusCode.UNAVAILABLE, said), _Closed(), "127.0.0.1:1", False, lost=True)
    assert LOST not in str(e) and e.answered, e
