"""Small client helpers for the CLI (`residency ps`)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from residency_proto.v1 import residency_pb2, residency_pb2_grpc


class ClientError(Exception):
    pass


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
            raise ClientError(f"{target}: {e.code().name}: {e.details()}") from None


def as_dict(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = MessageToDict(msg)
    return out
