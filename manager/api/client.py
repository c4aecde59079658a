"""Small client helpers for the CLI (`residency ps`, and the admin commands: pin, unpin, preload, evict,
stats, reload, events)."""

from __future__ import annotations

import re
import ssl
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import grpc

from residency_proto.v1 import residency_pb2, residency_pb2_grpc


class ClientError(Exception):
    """A call the server refused or that did not reach it; `code`: the gRPC status code's name;
    `answered`: the service itself answered (a refusal: an unknown model, a pinned one), not a
    connection that could not be made (no server there, TLS on one side only) or a call this side
    would not send (a bad token or certificate)."""

    def __init__(self, message: str, code: str = "", *, answered: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.answered = answered


ADMIN_TIMEOUT_S = 30.0
"""How long an admin call waits for its answer (the service answers these at once)."""
PRELOAD_TIMEOUT_S = 150.0
"""How long `residency preload` waits for the model's confirmed load unless `--timeout` says (the
service waits as long as the call's deadline lets it; past it, the load goes on)."""
CONNECTED_WAIT_S = 1.0
"""How long a failed call waits to learn whether its channel was connected (gRPC says at once)."""


def list_models(
    target: str, token: str | None, timeout_s: float = 10.0, *, root_cert: bytes | None = None
) -> Any:
    """The server's List answer. `root_cert` (PEM): talk TLS, trusting that certificate (a server
    with `server.tls_cert` serves nothing else); None: plaintext."""
    return admin_call(target, token, "List", residency_pb2.ListRequest(), timeout_s, root_cert=root_cert)


def admin_call(
    target: str,
    token: str | None,
    method: str,
    request: Any,
    timeout_s: float = ADMIN_TIMEOUT_S,
    *,
    root_cert: bytes | None = None,
) -> Any:
    """The answer of the unary `residency.v1.Residency` call `method` (Pin, Evict, Stats...) to
    `request`. ClientError (with `answered` when the service refused it) otherwise."""
    meta = _metadata(token, root_cert)
    with _channel(target, root_cert) as ch:
        try:
            return getattr(residency_pb2_grpc.ResidencyStub(ch), method)(
                request, timeout=timeout_s, metadata=meta
            )
        except grpc.RpcError as e:
            raise _error(e, ch, target, root_cert is not None) from None


def watch_events(
    target: str, token: str | None, *, root_cert: bytes | None = None
) -> Generator[Any, None, None]:
    """The service's residency events (`Event` messages) as they happen, until the caller stops
    (close the generator: the call is cancelled and the channel closed) or the stream ends
    (ClientError, as `admin_call`'s)."""
    meta = _metadata(token, root_cert)
    with _channel(target, root_cert) as ch:
        ready: list[bool] = []  # the connection was made (then lost: not a TLS mismatch)

        def note(state: Any) -> None:
            if state == grpc.ChannelConnectivity.READY:
                ready.append(True)

        ch.subscribe(note)
        stream = residency_pb2_grpc.ResidencyStub(ch).Events(residency_pb2.EventsRequest(), metadata=meta)
        try:
            for event in stream:
                ready.append(True)
                yield event
        except grpc.RpcError as e:
            raise _error(e, ch, target, root_cert is not None, lost=bool(ready)) from None
        finally:
            stream.cancel()
            _unsubscribe(ch, note)


def _metadata(token: str | None, root_cert: bytes | None) -> list[tuple[str, str]] | None:
    """The call's metadata (the bearer token), once the token and the certificate are checked."""
    if root_cert is not None:
        check_root_cert(root_cert)
    if token and not all(" " <= c <= "~" for c in token):
        # gRPC's C core refused it with lines of its own log and "INTERNAL: Invalid metadata"
        raise ClientError(
            "the bearer token has a character a gRPC header cannot carry (a carriage return or a newline "
            "from the file it was read from, a tab, another control character or a non-ASCII one): a "
            "token is printable ASCII only",
            "INVALID_ARGUMENT",
        )
    return [("authorization", f"Bearer {token}")] if token else None


def _channel(target: str, root_cert: bytes | None) -> Any:
    """A channel to `target`: TLS trusting `root_cert` (PEM) when given, else plaintext."""
    if root_cert is not None:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_cert))
    return grpc.insecure_channel(target)


STOPPING_WORDS = re.compile(r"\bthe (?:service|server) is stopping\b")
"""The service's own answer while it stops: its channel may be closed by the time the answer is
read, so the words, not the channel's state, say that the service answered (gRPC's own UNAVAILABLE
says "failed to connect", "Socket closed" and the like)."""


CONNECTION_LOST = re.compile(r"Socket closed|Connection reset by peer|Broken pipe|recvmsg|sendmsg")
"""gRPC's words for a connection that went away under a call: "Socket closed" where its server's
kernel closed it (FIN), a reset (RST) where the server died with data unread (SIGKILL while a
keepalive ping or a window update was in flight)."""


def _error(e: grpc.RpcError, ch: Any, target: str, tls: bool, *, lost: bool = False) -> ClientError:
    """The failed call `e` as a ClientError naming `target`, the code and the server's words; it was
    answered by the service when its channel is connected: gRPC's own UNAVAILABLE (nothing listens,
    the connection was closed) and DEADLINE_EXCEEDED (still connecting) leave it unconnected, while
    the service's UNAVAILABLE (a load that failed) comes over a connected one. `lost`: the call's
    connection had been made (a stream that ended when the server went away): no TLS hint then."""
    code = e.code()
    details = str(e.details())
    answered = (
        code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        or STOPPING_WORDS.search(details) is not None  # (its channel closing meanwhile: its words)
        or _connected(ch)
    )
    hint = " (the connection to the service was lost)" if lost and CONNECTION_LOST.search(details) else ""
    return ClientError(
        f"{target}: {code.name}: {details}{hint or _tls_hint(details, tls)}", code.name, answered=answered
    )


def _connected(ch: Any) -> bool:
    """Whether the channel `ch` is connected (READY) now, as gRPC tells its subscribers."""
    seen: list[Any] = []
    told = threading.Event()

    def note(state: Any) -> None:
        seen.append(state)
        told.set()

    ch.subscribe(note, try_to_connect=False)
    try:
        told.wait(CONNECTED_WAIT_S)
    finally:
        _unsubscribe(ch, note)
    return bool(seen) and seen[0] == grpc.ChannelConnectivity.READY


POLL_END_WAIT_S = 1.0
"""How long an unsubscribe waits for gRPC's connectivity poller to stop (it looks every 0.2 s)."""


def _unsubscribe(ch: Any, note: Callable[[Any], None]) -> None:
    """`ch.unsubscribe(note)`, then a moment for gRPC's connectivity-polling thread to see that nobody
    subscribes and stop, before the caller closes the channel: a poller still watching a closed
    channel died with "ValueError: Cannot monitor channel state: Channel closed!", a traceback on
    the admin command's stderr. (Reads gRPC's own `polling` flag; without it, no wait.)"""
    ch.unsubscribe(note)
    state = getattr(ch, "_connectivity_state", None)
    deadline = time.monotonic() + POLL_END_WAIT_S
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.01)


def check_root_cert(root_cert: bytes) -> None:
    """ClientError unless `root_cert` holds a PEM certificate: gRPC took any file, printed lines of
    its C core's log ("Could not load any root certificate") and then failed the call with "Failed
    to create security handshaker", naming neither the file nor what is wrong with it."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=root_cert.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as e:
        why = "not text" if isinstance(e, UnicodeDecodeError) else e.reason or str(e)
        raise ClientError(
            "the TLS certificate to trust (--tls-cert, or the config's server.tls_cert) holds no PEM "
            f"certificate ({why}): give the server's certificate (-----BEGIN CERTIFICATE-----), not its key"
        ) from None


def _tls_hint(details: str, tls: bool) -> str:
    """Why a connection failed, when gRPC's words leave it to guess: a plaintext call to a server
    that speaks TLS only sees the connection closed (it reads as a server that is down), a TLS call
    to a plaintext server a "wrong version number"."""
    if not tls and "Socket closed" in details:
        return (
            " (the server closed the connection at once: if it serves TLS, give its certificate with "
            "--tls-cert, or --config with its server.tls_cert)"
        )
    if tls and "WRONG_VERSION_NUMBER" in details:
        return " (the server does not speak TLS there: leave out --tls-cert, or check server.tls_cert)"
    return ""


def as_dict(msg: Any) -> dict[str, Any]:
    """`msg` as plain JSON values, like the other `--json` outputs: the proto's snake_case field
    names, every field present (defaults included: `pinned: false`, `last_error: ""`), 64-bit
    integers as numbers (not the strings of protobuf's JSON mapping), enums by name."""
    return {f.name: _field(f, getattr(msg, f.name)) for f in msg.DESCRIPTOR.fields}


def _field(f: Any, v: Any) -> Any:
    if f.type == f.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
        vf = f.message_type.fields_by_name["value"]
        return {str(k): _scalar(vf, x) for k, x in v.items()}
    if f.is_repeated:
        return [_scalar(f, x) for x in v]
    return _scalar(f, v)


def _scalar(f: Any, v: Any) -> Any:
    if f.type == f.TYPE_MESSAGE:
        return as_dict(v)
    if f.type == f.TYPE_ENUM:
        value = f.enum_type.values_by_number.get(v)
        return value.name if value is not None else v
    if f.type == f.TYPE_BYTES:
        return v.hex()
    return v
