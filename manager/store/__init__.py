"""The service's store (`store.url` in the config): request log, JSON documents, tier intents.

  open_store(url, create=True) -> Store
    sqlite:///PATH                              embedded default; a relative PATH is from the cwd
                                                (sqlite:////ABS/PATH, four slashes, for an absolute
                                                one; `store_location` prints a relative one with the
                                                file it opens); parent folders are created
                                                (sqlite.py); with create=False (read-only commands)
                                                a missing file is a StoreError, nothing created
    redis://[:PASSWORD@]HOST:PORT/DB[?prefix=P]  Redis Streams + hashes under prefix P, default
                                                "residency"; rediss:// for TLS (redis.py)
  Store, StoreError - the protocol and its error (base.py); export.py turns a time range of the
  request log back into a ▶ trace file.

The Redis client library is imported only when a redis url is opened, so the embedded default
needs nothing beyond the standard library.
"""

from __future__ import annotations

from manager.store.base import CorruptDocument, Store, StoreError, redact, store_location

__all__ = ["CorruptDocument", "Store", "StoreError", "open_store", "store_location"]

_EXPECTED = "expected sqlite:///PATH or redis://HOST:PORT/DB"


def open_store(url: str, *, create: bool = True, hold: bool = False) -> Store:
    """Open the store at `url`; `create` False (for read-only commands): a missing SQLite file is
    a StoreError ("no store at PATH") and nothing is created. `hold` (a service): an SQLite store is
    held for as long as it is open (a lock file beside it), so a second service on it is refused,
    naming the first; a Redis store is shared by design.

    Raises:
        StoreError: unknown scheme or malformed url (the message names the url, password hidden,
            and what is wrong), or an SQLite file that cannot be opened. A Redis server is
            contacted lazily: see `Store.ping`.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StoreError(redact(url) if isinstance(url, str) else repr(url), f"not a store url; {_EXPECTED}")
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        from manager.store.sqlite import open_sqlite

        return open_sqlite(url, create=create, hold=hold)
    if scheme in ("redis", "rediss"):
        from manager.store.redis import open_redis

        return open_redis(url)
    raise StoreError(redact(url), f"unknown scheme {scheme!r}; {_EXPECTED}")
