"""The store interface, run over each implementation; and the database URL."""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remat.api.store import JobRecord, MemoryStore, Store, StoreUnavailable
from remat.api.store_factory import open_store
from remat.api.store_sqlite import SQLiteStore


@pytest.fixture(params=["sqlite", "memory", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s: Store = SQLiteStore(str(tmp_path / "sub" / "remat.db"))
    elif request.param == "postgres":
        from remat.api.store_pg import PostgresStore

        s = PostgresStore(request.getfixturevalue("pg_url"))
    else:
        s = MemoryStore()
    yield s
    s.close()


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


def test_an_empty_only_if_changes_nothing(store: Store) -> None:
    store.create_job(_job("j", at=1.0))
    assert not store.update_job("j", status="cancelled", only_if=())
    j = store.job("j")
    assert j is not None and (j.status, j.updated_at) == ("queued", 1.0)


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


def test_a_job_is_taken_once_and_finished_only_by_its_holder(store: Store) -> None:
    store.create_job(_job("j1", at=1.0))
    store.create_job(_job("j2", at=2.0))
    assert store.count_queued() == 2
    a = store.claim_job("A", lease_s=60, max_attempts=2)
    b = store.claim_job("B", lease_s=60, max_attempts=2)
    assert a is not None and b is not None and (a.id, b.id) == ("j1", "j2")  # oldest first
    assert (a.status, a.holder, a.attempts) == ("running", "A", 1)
    assert store.claim_job("C", lease_s=60, max_attempts=2) is None  # nothing waits
    assert store.take_job("j1", "C", lease_s=60, max_attempts=2) is None  # A's lease holds
    assert store.count_queued() == 0
    assert store.renew_lease("j1", "A", 60) and not store.renew_lease("j1", "B", 60)
    assert not store.finish_job("j1", "B", status="done", result="{}")  # not B's
    assert store.finish_job("j1", "A", status="done", result='{"r":1}')
    j1 = store.job("j1")
    assert j1 is not None and (j1.status, j1.result, j1.holder) == ("done", '{"r":1}', None)
    assert not store.renew_lease("j1", "A", 60)  # finished: the runner stops
    # A cancel (by any server) ends B's lease: its next renewal says stop.
    assert store.update_job("j2", status="cancelled", only_if=("queued", "running"))
    assert not store.renew_lease("j2", "B", 60)
    assert not store.finish_job("j2", "B", status="done", result="{}")
    j2 = store.job("j2")
    assert j2 is not None and j2.status == "cancelled"


def test_a_lost_runner_s_job_is_taken_again_until_attempts_run_out(store: Store) -> None:
    store.create_job(_job("j", at=1.0))
    first = store.claim_job("A", lease_s=0.2, max_attempts=2)
    assert first is not None and first.attempts == 1
    time.sleep(0.3)  # A died: no renewal, the lease runs out
    assert store.count_queued() == 1
    second = store.claim_job("B", lease_s=0.2, max_attempts=2)
    assert second is not None and (second.holder, second.attempts) == ("B", 2)
    assert "re-queued" in second.message
    assert not store.finish_job("j", "A", status="done", result="{}")  # A came back: too late
    assert not store.renew_lease("j", "A", 1)
    time.sleep(0.3)  # B died too, on the last attempt allowed
    assert store.claim_job("C", lease_s=1, max_attempts=2) is None
    j = store.job("j")
    assert j is not None and j.status == "failed" and "job_max_attempts=2" in (j.error or "")


def test_release_and_expire(store: Store) -> None:
    store.create_job(_job("j", at=1.0))
    assert store.claim_job("A", lease_s=60, max_attempts=1) is not None
    assert store.release_job("j", "A", "shut down")  # an orderly stop: no attempt used
    j = store.job("j")
    assert j is not None and (j.status, j.attempts, j.message) == ("queued", 0, "shut down")
    assert store.take_job("j", "B", lease_s=60, max_attempts=1) is not None
    assert not store.expire_lease("j", "A") and store.expire_lease("j", "B")  # B known dead
    c = store.take_job("j", "C", lease_s=60, max_attempts=2)
    assert c is not None and c.holder == "C" and c.attempts == 2


def test_ping(store: Store) -> None:
    store.ping()


def _store_imports(path: Path) -> set[str]:
    """The ``remat.api.store*`` modules a file imports, lazy imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat.api.store"):
            found.add(str(node.module).rsplit(".", 1)[1])
    return found


def test_no_import_circle_among_the_store_modules() -> None:
    # store.py is the interface the concrete stores import; it must not import them back, and
    # only store_factory.py chooses among them.
    api = Path(__file__).resolve().parents[2] / "remat" / "api"
    graph = {p.stem: _store_imports(p) - {p.stem} for p in api.glob("store*.py")}
    assert graph["store"] == set(), graph

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n}))
            for n in graph.get(start, set())
        )

    assert [m for m in graph if reaches(m, m)] == [], graph
    assert not any("store_factory" in deps for deps in graph.values()), graph


def test_a_job_id_is_written_once(store: Store) -> None:
    # A request sent again with its Idempotency-Key derives the same job id: the second
    # write changes nothing and says so.
    assert store.create_job(_job("j", at=1.0)) is True
    assert store.create_job(_job("j", at=2.0, status="running")) is False
    j = store.job("j")
    assert j is not None and j.status == "queued" and j.created_at == 1.0
