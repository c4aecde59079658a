"""Review 26 on a private, real redis-server: the store's own id (`Store.store_id`, what a request
journal names its store by) is made once and kept, whatever url reaches the server."""

from __future__ import annotations

from typing import Any

from manager.store import open_store


def test_the_id_is_made_once_and_is_the_same_by_another_url(rstore: Any, redis_clean: str) -> None:
    sid = rstore.store_id()
    assert sid and sid == rstore.store_id()
    port = redis_clean.rsplit(":", 1)[1].split("/", 1)[0]
    other = open_store(f"redis://localhost:{port}")  # (the same server and db 0, spelled otherwise)
    try:
        assert other.store_id() == sid
    finally:
        other.close()
