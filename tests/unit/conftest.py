"""Unit tests never start Ray (STYLE practice 5): `ray.init` raises here."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def disallow_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit tests must not start Ray; put the test under tests/integration/")

    monkeypatch.setattr(ray, "init", refuse)
