"""Integration fixtures: one real local Ray for the session (logical GPUs, so CUDA-device actors
schedule on CPU-only CI), torn down at the end; named test actors are killed after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .ray_head import head_node  # noqa: F401  (fixture: a private Ray head)
from .redis_server import client, redis_clean, redis_url, rstore  # noqa: F401  (fixtures: a private redis-server)

TEST_NAMESPACE = "residency-test"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    from workers.ray_pool import start_local_ray

    start_local_ray(
        num_cpus=2,
        num_gpus=2,
        namespace=TEST_NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 2**20,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def ray_actors(ray_cluster: None) -> Iterator[list[object]]:
    """Pools made by a test register here; their device-host actors are killed after it."""
    pools: list[object] = []
    yield pools
    for pool in pools:
        pool.shutdown_actors()  # type: ignore[attr-defined]
