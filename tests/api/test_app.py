"""The app in-process: one source of settings, settings from the environment."""

from __future__ import annotations

import warnings
from typing import Annotated

import pytest
from fastapi import Depends

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx2
    from fastapi.testclient import TestClient

from remat.api import Settings, create_app, get_settings
from remat.ir import synthetic


def test_settings_from_env() -> None:
    s = Settings.from_env(
        {
            "REMAT_DB": "memory://",
            "REMAT_API_KEYS": "a, b,,",
            "REMAT_WORKERS": "3",
            "REMAT_MAX_NODES": "10",
            "REMAT_PLUGINS": "x.y",
        },
        workers=5,
        max_queue=None,
    )
    assert (s.db_url, s.api_keys, s.workers, s.max_nodes, s.plugins) == (
        "memory://",
        ("a", "b"),
        5,
        10,
        ("x.y",),
    )
    assert s.max_queue == Settings().max_queue
    with pytest.raises(ValueError, match="workers"):
        Settings.from_env({"REMAT_WORKERS": "0"})
    # The bodies held at once default to four of the largest, and never fewer than one.
    assert Settings(max_body_bytes=1000).held_body_limit_bytes == 4000
    assert Settings(max_body_bytes=1000, max_held_body_bytes=1500).held_body_limit_bytes == 1500
    with pytest.raises(ValueError, match="max_held_body_bytes=999 is below max_body_bytes=1000"):
        Settings.from_env({"REMAT_MAX_BODY_BYTES": "1000", "REMAT_MAX_HELD_BODY_BYTES": "999"})


def test_bad_db_url_and_plugin_are_named() -> None:
    with pytest.raises(ValueError, match="db_url"):
        create_app(Settings(db_url="oracle://x"))
    with pytest.raises(ValueError, match="plugins"):
        create_app(Settings(db_url="memory://", plugins=("no_such_module_xyz",)))


def test_settings_have_one_source() -> None:
    # The limits the routes apply, the service's own settings and get_settings are one object.
    settings = Settings(db_url="memory://", workers=1, max_nodes=5)
    app = create_app(settings)
    body = synthetic.chain(2).model_dump(mode="json")
    with TestClient(app) as c:
        assert app.state.service.settings is settings
        r = c.post("/v1/graphs", json=body)
        assert r.status_code == 422 and "max_nodes=5" in r.text
        assert c.get("/openapi.json").json()["info"]["title"] == "remat"
    seen: list[Settings] = []
    app2 = create_app(Settings(db_url="memory://", workers=1))

    @app2.get("/probe")
    def probe(s: Annotated[Settings, Depends(get_settings)]) -> dict[str, int]:
        seen.append(s)
        return {}

    with TestClient(app2) as c:
        assert c.get("/probe").status_code == 200
    assert seen == [app2.state.service.settings] and seen[0] is app2.state.service.settings


def test_service_client_and_cli_import_without_torch() -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # `import torch` now raises ImportError
        import remat.api.app, remat.api.tasks, remat.api.worker, remat.client, remat.cli
        from remat.api import Settings, create_app
        create_app(Settings(db_url="memory://", workers=1)).openapi()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_caching_is_decided_from_the_result_status(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat import solve
    from remat.api import tasks

    graph = synthetic.chain(3)
    good = solve(graph, "90%", solver="checkpoint-all")
    task = {
        "kind": "solve",
        "graph": graph.to_json(),
        "budget": "90%",
        "solver": "checkpoint-all",
        "time_limit_s": 5.0,
        "options": {},
    }
    assert tasks.run_task(task)["cacheable"] is True
    # A solver that ran out of time is not cached, whatever the JSON text looks like.
    timed_out = good.model_copy(update={"status": "timeout", "message": "x" * 300})
    monkeypatch.setattr(tasks, "_solve", lambda *a, **k: timed_out)
    assert tasks.run_task(task)["cacheable"] is False


def test_a_solver_plan_the_simulator_rejects_is_a_crash_not_a_422(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The solve path raises SolverBugError (a RematError): the service must answer it as the
    # solver's failure (500), never as a 422 'solver_error' blaming a valid request.
    import dataclasses

    from remat.api import tasks
    from remat.ir import Plan, eager_plan
    from remat.solver import base

    def broken(problem: base.Problem, **_: object) -> base.SolveResult:
        bad = Plan(steps=eager_plan(problem.graph).steps[1:])
        return problem.result(bad, solver="chen-greedy", started=0.0)

    si = base.info("chen-greedy")
    monkeypatch.setitem(base._REGISTRY, "chen-greedy", dataclasses.replace(si, fn=broken))
    graph = synthetic.chain(3)
    task = {
        "kind": "solve",
        "graph": graph.to_json(),
        "budget": "90%",
        "solver": "chen-greedy",
        "time_limit_s": 5.0,
        "options": {},
    }
    out = tasks.run_task(task)
    assert "crash" in out and "'chen-greedy'" in out["crash"] and "simulator" in out["crash"]
