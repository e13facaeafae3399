"""The app in-process: settings as an overridable dependency, settings from the environment."""

from __future__ import annotations

import warnings

import pytest

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


def test_bad_db_url_and_plugin_are_named() -> None:
    with pytest.raises(ValueError, match="db_url"):
        create_app(Settings(db_url="oracle://x"))
    with pytest.raises(ValueError, match="plugins"):
        create_app(Settings(db_url="memory://", plugins=("no_such_module_xyz",)))


def test_limits_come_from_the_settings_dependency() -> None:
    app = create_app(Settings(db_url="memory://", workers=1))
    app.dependency_overrides[get_settings] = lambda: Settings(db_url="memory://", max_nodes=5)
    body = synthetic.chain(2).model_dump(mode="json")
    with TestClient(app) as c:
        r = c.post("/v1/graphs", json=body)
        assert r.status_code == 422 and "max_nodes=5" in r.text
        app.dependency_overrides.clear()
        r = c.post("/v1/graphs", json=body)
        assert r.status_code == 201
        assert c.get("/openapi.json").json()["info"]["title"] == "remat"


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
