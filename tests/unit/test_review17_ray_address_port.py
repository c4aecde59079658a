"""Review 17, the probe of the Ray cluster to join (workers.ray_pool.unreachable) with a port that is
not one.

The config refuses a `ray.address` whose port is not 0-65535, but RAY_ADDRESS (which Ray joins in
place of a null `ray.address`) and a "ray://" address are not checked there. The probe handed such a
port to the resolver, which takes it modulo 65536 (70000 is 4464) or refuses it as a service name: it
then probed another port than the one Ray would use (and called the address reachable when that one
answered, so Ray's minutes of retries came back), or blamed the host name for the port. Now the
address is said to be unusable, naming the port and where it comes from."""

from __future__ import annotations

import socket

import pytest

from workers import ray_pool


def test_a_port_past_65535_is_said_not_probed_modulo(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1] + 65536  # what the resolver would wrap to the listener's
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        assert ray_pool.unreachable(None) == (
            f"cannot connect to 127.0.0.1:{port} (RAY_ADDRESS '127.0.0.1:{port}', from the environment, "
            f"which Ray joins in its place): port {port} is not a TCP port (1-65535)"
        )
        monkeypatch.delenv("RAY_ADDRESS")
        assert ray_pool.unreachable(f"ray://127.0.0.1:{port}") == (
            f"cannot connect to 127.0.0.1:{port}: port {port} is not a TCP port (1-65535)"
        )


def test_a_negative_port_is_said_as_the_port_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:-1")
    why = ray_pool.unreachable("auto")
    assert why is not None and why.endswith(": port -1 is not a TCP port (1-65535)")
    assert "not resolved" not in why
