"""Review 17: `residency ps` with a bearer token a gRPC header cannot carry says so.

A token read with a carriage return (a token file written on Windows, `$(cat token.txt)` keeps its
`\\r`), a newline or a non-ASCII character was sent as it was: gRPC's C core printed "Metadata value
for key authorization is invalid: INTERNAL: Illegal header value" with its source location, and the
command failed "INTERNAL: Invalid metadata", naming neither the token nor what is wrong with it (the
server refuses such a token at its start, naming it). The client refuses it before any call now.
"""

from __future__ import annotations

import pytest

from manager.api.client import ClientError, list_models


@pytest.mark.parametrize("token", ["s3cret\r", "s3cret\n", "s3\tcret", "sécret"])
def test_a_token_a_header_cannot_carry_is_named(token: str) -> None:
    with pytest.raises(ClientError) as e:
        list_models("127.0.0.1:1", token, timeout_s=5.0)
    msg = str(e.value)
    assert "bearer token" in msg and "printable ASCII" in msg
    assert "Invalid metadata" not in msg and token not in msg  # (the token itself is not echoed)
    assert e.value.code == "INVALID_ARGUMENT"


def test_a_plain_token_is_sent() -> None:
    with pytest.raises(ClientError) as e:  # nothing listens there: the call itself was made
        list_models("127.0.0.1:1", "s3cret-token_1.2", timeout_s=5.0)
    assert e.value.code == "UNAVAILABLE"
