"""The store interface, run over each implementation; and the database URL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from remat.api.store import JobRecord, MemoryStore, Store, StoreUnavailable, open_store
from remat.api.store_sqlite import SQLiteStore


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "sqlite":
        return SQLiteStore(str(tmp_path / "sub" / "remat.db"))
    return MemoryStore()


def _job(job_id: str, owner: str = "a", status: str = "queued", at: float = 0.0) -> JobRecord:
    return JobRecord(
        id=job_id,
        owner=owner,
        kind="solve",
        status=status,  # type: ignore[arg-type]
        graph_id="g" * 64,
        request="{}",
        request_key="k",
        created_at=at,
        updated_at=at,
    )


def test_graphs_belong_to_their_owner(store: Store) -> None:
    assert store.put_graph("a", "g1", "{json}", "{summary}") is True
    assert store.put_graph("a", "g1", "{other}", "{other}") is False  # first one stays
    assert store.graph_json("a", "g1") == "{json}"
    assert store.graph_summary("a", "g1") == "{summary}"
    assert store.graph_json("b", "g1") is None and store.graph_summary("b", "g1") is None
    assert store.put_graph("b", "g1", "{json}", "{summary}") is True


def test_cache(store: Store) -> None:
    assert store.cached("k") is None
    store.put_cached("k", '{"r":1}')
    assert store.cached("k") == '{"r":1}'


def test_jobs_lifecycle(store: Store) -> None:
    store.create_job(_job("j1", at=1.0))
    store.create_job(_job("j2", at=2.0, status="running"))
    store.create_job(_job("j3", owner="b", at=3.0))
    assert [j.id for j in store.jobs("a")] == ["j2", "j1"]  # newest first, own only
    assert store.job("j3", "a") is None and store.job("j3", "b") is not None
    assert store.job("j3") is not None
    assert [j.id for j in store.unfinished_jobs()] == ["j1", "j2", "j3"]
    assert store.update_job("j1", status="running", attempts=1, only_if=("queued",))
    assert not store.update_job("j1", status="running", only_if=("queued",))  # no longer queued
    assert store.update_job("j1", status="done", result='{"x":1}', progress='{"p":1}')
    j1 = store.job("j1")
    assert j1 is not None and (j1.status, j1.attempts, j1.result) == ("done", 1, '{"x":1}')
    assert j1.updated_at >= j1.created_at
    assert [j.id for j in store.unfinished_jobs()] == ["j2", "j3"]
    with pytest.raises(ValueError, match="owner"):
        store.update_job("j1", owner="b")
    assert not store.update_job("nope", status="done")


def test_sqlite_persists_across_connections(tmp_path: Path) -> None:
    path = str(tmp_path / "x.db")
    s = SQLiteStore(path)
    s.create_job(_job("j", at=time.time()))
    s.put_graph("", "g", "{}", "{}")
    s.close()
    s2 = open_store(f"sqlite:///{path}")
    assert s2.job("j") is not None and s2.graph_json("", "g") == "{}"
    s2.close()


def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    assert isinstance(open_store("sqlite:///:memory:"), SQLiteStore)
    monkeypatch.chdir(tmp_path)
    rel = open_store("sqlite:///rel/r.db")
    assert isinstance(rel, SQLiteStore) and (tmp_path / "rel" / "r.db").exists()
    assert isinstance(open_store(str(tmp_path / "plain.db")), SQLiteStore)
    with pytest.raises(StoreUnavailable, match=r"db_url.*postgresql://u@127.0.0.1:9/db"):
        open_store("postgresql://u:secret@127.0.0.1:9/db", timeout_s=1)  # no password echoed
    with pytest.raises(ValueError, match="db_url"):
        open_store("sqlite://relative.db")
