"""The ready-made CI configurations: examples/ci/github-actions.yml and the GitLab job in
docs/ci.md. Their structure is checked always; their commands run locally (installs left out:
this checkout is installed already) in the slow suite, twice, so the second run checks against
the first run's baseline."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "ci" / "github-actions.yml"
OUTPUTS = ("remat-check.xml", "pytest-junit.xml", "remat-check.json", "remat-report.html")


def github() -> dict[str, Any]:
    return dict(yaml.safe_load(WORKFLOW.read_text()))


def gitlab() -> dict[str, Any]:
    m = re.search(
        r"<!-- gitlab-ci -->\n```yaml\n(.*?)```", (ROOT / "docs" / "ci.md").read_text(), re.S
    )
    assert m, "docs/ci.md has no GitLab CI block after <!-- gitlab-ci -->"
    return dict(yaml.safe_load(m.group(1)))


def test_github_workflow_shape() -> None:
    wf = github()
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"  # a CPU runner
    uses = {s["uses"].split("@")[0]: s for s in job["steps"] if "uses" in s}
    assert uses["actions/setup-python"]["with"]["cache"] == "pip"
    uploaded = uses["actions/upload-artifact"]["with"]["path"].split()
    assert set(uploaded) == set(OUTPUTS)
    assert uses["actions/upload-artifact"]["if"] == "always()"  # the reports of a failed run too
    runs = " ".join(s.get("run", "") for s in job["steps"])
    assert "--junit remat-check.xml" in runs and "--junitxml=pytest-junit.xml" in runs
    assert "--baseline" in runs and "--html remat-report.html" in runs


def test_gitlab_job_shape() -> None:
    job = gitlab()["remat"]
    assert set(job["artifacts"]["reports"]["junit"]) == {"remat-check.xml", "pytest-junit.xml"}
    assert "remat-report.html" in job["artifacts"]["paths"]
    assert any(".cache/pip" in c["paths"] for c in job["cache"])
    assert job["artifacts"]["when"] == "always"


def local_env(variables: dict[str, Any], home: Path) -> dict[str, str]:
    env = {**os.environ, **{k: str(v) for k, v in variables.items()}}
    env["REMAT_TIME_LIMIT"] = "10"  # the same commands, a shorter solve
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    eps = importlib.metadata.entry_points(group="pytest11")
    if not any(ep.value == "remat.pytest_plugin" for ep in eps):
        # This checkout is newer than its editable install: load the plugin by name.
        env["PYTEST_ADDOPTS"] = "-p remat.pytest_plugin"
    env["HOME"] = str(home)
    return env


def workdir(tmp_path: Path) -> Path:
    """A checkout as the runner sees it: the examples and constraints at the top."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (work / "constraints.txt").symlink_to(ROOT / "constraints.txt")
    return work


def run(script: str, cwd: Path, env: dict[str, str]) -> None:
    out = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (
        f"{script}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
    )


def assert_outputs(work: Path) -> None:
    for name in OUTPUTS:
        assert (work / name).is_file(), name
    for name in ("remat-check.xml", "pytest-junit.xml"):
        root = ET.parse(work / name).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        assert suite is not None and suite.get("failures") == "0", name
    assert json.loads((work / "remat-check.json").read_text())["passed"] is True
    assert '<figure class="plot" id="timeline"' in (work / "remat-report.html").read_text()


@pytest.mark.slow
def test_github_workflow_commands_run_locally(tmp_path: Path) -> None:
    wf = github()
    (job,) = wf["jobs"].values()
    work = workdir(tmp_path)
    env = local_env(wf["env"], tmp_path)
    steps = [s for s in job["steps"] if "run" in s and not s["name"].startswith("Install")]
    for step in steps:
        if "github.ref" in step.get("if", ""):
            continue  # the main-branch-only step, run below for the second run
        run(step["run"], work, env)
    assert_outputs(work)
    # The next run on main: yesterday's report is today's baseline.
    keep = next(s for s in steps if s["name"].startswith("Keep the baseline"))
    run(keep["run"], work, env)
    fits = next(s for s in steps if s["name"] == "Fits the budget")
    run(fits["run"], work, env)
    report = json.loads((work / "remat-check.json").read_text())
    assert report["comparison"]["against"] == "remat-baseline.json"
    assert report["comparison"]["failures"] == []


@pytest.mark.slow
def test_gitlab_job_commands_run_locally(tmp_path: Path) -> None:
    job = gitlab()["remat"]
    work = workdir(tmp_path)
    env = local_env(job["variables"], tmp_path)
    env.update(CI_COMMIT_BRANCH="main", CI_DEFAULT_BRANCH="main", CI_PROJECT_DIR=str(work))
    script = [line for line in job["script"] if not line.startswith("pip install")]
    run("\n".join(script), work, env)  # GitLab runs a job's script lines in one shell
    assert_outputs(work)
    assert (work / "baseline" / "remat-check.json").is_file()
    run("\n".join(script[:2]), work, env)  # the next run finds the baseline
    assert json.loads((work / "remat-check.json").read_text())["comparison"]["failures"] == []
