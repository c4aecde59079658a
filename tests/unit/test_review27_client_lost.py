"""Review 27: a stream whose server went away was told "the connection to the service was lost" only
when gRPC said "Socket closed" (the server's kernel closed it with a FIN). A server killed while data
it had not read was in flight (a keepalive ping, a window update) resets the connection instead
("recvmsg:Connection reset by peer"), and that same loss read as gRPC's bare words. A call that
never had a connection (`lost` False) gets no such hint, and the service's own UNAVAILABLE none."""

from __future__ import annotations

import grpc
import pytest

from manager.api.client import _error


class _Failed(grpc.RpcError):
    """A failed call as gRPC raises it (unit tests only), with its status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Closed:
    """A channel that no longer connects (unit tests only): the service is gone."""

    def subscribe(self, note: object, try_to_connect: bool = False) -> None:
        note(grpc.ChannelConnectivity.TRANSIENT_FAILURE)  # type: ignore[operator]

    def unsubscribe(self, note: object) -> None:
        pass


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
