"""The choice of store from a database URL.

Kept apart from :mod:`remat.api.store` (the interface, records and :class:`MemoryStore`) so that
the interface never imports the stores that implement it: the concrete stores import
``store.py``, and only this module imports them.
"""

from __future__ import annotations

from remat.api.store import MemoryStore, Store
from remat.api.store_sqlite import SQLiteStore


def open_store(url: str, timeout_s: float = 5.0) -> Store:
    """The store a database URL names.

    Parameters
    ----------
    url
        ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``,
        a bare file path (SQLite), ``memory://``, or ``postgresql://user@host:port/dbname``
        (also ``postgres://``; needs the ``postgres`` extra: psycopg 3).
    timeout_s
        How long an operation waits for a lock or a connection before
        :class:`~remat.api.store.StoreUnavailable`.

    Returns
    -------
    Store
        The open store; the caller closes it.

    Raises
    ------
    ValueError
        Naming ``db_url`` when the scheme is not one of those.
    StoreUnavailable
        When a PostgreSQL server cannot be reached.
    """
    if url == "memory://":
        return MemoryStore()
    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"db_url: expected sqlite:///PATH, got {url!r}")
        return SQLiteStore(path[1:] if path != "/:memory:" else ":memory:", timeout_s)
    if is_postgres(url):
        # Lazily: psycopg is an optional extra, and SQLite servers never need it.
        from remat.api.store_pg import PostgresStore

        return PostgresStore(url, timeout_s=timeout_s)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"db_url: no store for scheme {scheme!r} (supported: sqlite:///PATH, memory://, "
            "postgresql://...)"
        )
    return SQLiteStore(url, timeout_s)


def is_postgres(url: str) -> bool:
    """True when ``url`` names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return url.startswith(("postgresql://", "postgres://"))
