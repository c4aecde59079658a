"""Review 17: `server.listen: "Localhost:50051"` was taken for an address beyond loopback (host names
are case-insensitive), so the service refused to start without an admin token there."""

from __future__ import annotations

import pytest

from manager.api.server import is_loopback


@pytest.mark.parametrize(
    "listen",
    ["localhost:50051", "Localhost:50051", "LOCALHOST:1", "localhost.:50051", "127.0.0.1:1", "[::1]:1"],
)
def test_loopback_addresses(listen: str) -> None:
    assert is_loopback(listen)


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:50051", "[::]:1", "myhost:50051", "localhost.example:1", "10.0.0.2:1"]
)
def test_other_addresses(listen: str) -> None:
    assert not is_loopback(listen)
