"""Small client helpers for the CLI (`residency ps`)."""

from __future__ import annotations

import ssl
from typing import Any

import grpc

from residency_proto.v1 import residency_pb2, residency_pb2_grpc


class ClientError(Exception):
    """A call the server refused or that did not reach it; `code`: the gRPC status code's name."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def list_models(
    target: str, token: str | None, timeout_s: float = 10.0, *, root_cert: bytes | None = None
) -> Any:
    """The server's List answer. `root_cert` (PEM): talk TLS, trusting that certificate (a server
    with `server.tls_cert` serves nothing else); None: plaintext."""
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
    meta = [("authorization", f"Bearer {token}")] if token else None
    ch = (
        grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_cert))
        if root_cert is not None
        else grpc.insecure_channel(target)
    )
    with ch:
        try:
            return residency_pb2_grpc.ResidencyStub(ch).List(
                residency_pb2.ListRequest(), timeout=timeout_s, metadata=meta
            )
        except grpc.RpcError as e:
            details = str(e.details())
            raise ClientError(
                f"{target}: {e.code().name}: {details}{_tls_hint(details, root_cert is not None)}",
                e.code().name,
            ) from None


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
