"""Review 17 on a private, real redis-server: an unreadable document is moved aside
(`Store.set_aside_doc`, ``<key>.corrupt-<UTC time>``) as stored, not overwritten by the next save."""

from __future__ import annotations

from typing import Any

import pytest

from manager.store import CorruptDocument


def test_a_corrupt_document_is_moved_aside_as_stored(rstore: Any, client: Any) -> None:
    assert rstore.set_aside_doc("stats") is None  # none there: nothing moved
    client.hset("residency:docs", "stats", '{"voice": {"hist": ')
    with pytest.raises(CorruptDocument):
        rstore.get_doc("stats")
    aside = rstore.set_aside_doc("stats")
    assert aside is not None and aside.startswith("stats.corrupt-")
    assert client.hget("residency:docs", aside) == b'{"voice": {"hist": '
    assert rstore.get_doc("stats") is None
    rstore.put_doc("stats", {"voice": {}})  # the next save goes beside it
    assert rstore.get_doc("stats") == {"voice": {}}
    assert client.hget("residency:docs", aside) == b'{"voice": {"hist": '
