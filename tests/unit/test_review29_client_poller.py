"""Found by the 29th session's CI run: an admin command whose call failed looks at the channel's
connectivity (`_connected`, as `watch_events` does), unsubscribes and closes the channel; gRPC's
connectivity-polling thread, still inside its 0.2 s watch, then died with "ValueError: Cannot monitor
channel state: Channel closed!" (a thread traceback on stderr). The unsubscribe now waits for the
poller to stop before the channel is closed. A real gRPC channel to a port nobody listens on."""

from __future__ import annotations

import socket
import threading
from typing import Any

import grpc

from manager.api.client import _connected, _unsubscribe


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_poller_has_stopped_when_the_unsubscribe_returns() -> None:
    ch = grpc.insecure_channel(f"127.0.0.1:{_closed_port()}")
    try:
        told = threading.Event()

        def note(state: Any) -> None:
            told.set()

        ch.subscribe(note, try_to_connect=True)
        assert told.wait(10)
        _unsubscribe(ch, note)
        assert ch._connectivity_state.polling is False  # type: ignore[attr-defined]
    finally:
        ch.close()


def test_a_failed_calls_connectivity_look_leaves_no_poller_behind() -> None:
    ch = grpc.insecure_channel(f"127.0.0.1:{_closed_port()}")
    try:
        assert _connected(ch) is False
        assert ch._connectivity_state.polling is False  # type: ignore[attr-defined]
    finally:
        ch.close()
