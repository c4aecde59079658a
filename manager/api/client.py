"""Small client helpers for the CLI (`residency ps`)."""

from __future__ import annotations

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
            raise ClientError(f"{target}: {e.code().name}: {e.details()}", e.code().name) from None


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
