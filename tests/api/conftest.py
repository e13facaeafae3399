"""Fixtures for the service tests: real ``remat serve`` processes (see service_harness)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres import PostgresServer, find_bin
from service_harness import Server

from remat.ir import Graph, synthetic


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A default server (2 workers, no keys) shared by the tests of one pytest process."""
    s = Server(tmp_path_factory.mktemp("server")).start()
    yield s
    s.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    """A server of the test's own, not started (set ``env`` first)."""
    s = Server(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_graph() -> Graph:
    return synthetic.chain(8)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this pytest process (skipped only where none is installed)."""
    bindir, why = find_bin()
    if bindir is None:
        pytest.skip(why)
    s = PostgresServer(bindir).start()
    yield s
    s.stop()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """The URL of a fresh, empty database."""
    return postgres.new_database()
