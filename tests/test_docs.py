"""Every example in README.md and docs/ runs, so the manual cannot rot.

The fenced ```python and ```bash blocks of each page run in document order in one fresh
interpreter per page (python blocks share one namespace, as a reader pasting them would; bash
blocks run with ``bash -e`` in the same directory, so files one block writes the next reads).
The directory is a temporary one with the repository's examples/ linked in, and ``remat`` on
PATH is this checkout's command. A block that cannot run here is marked right before it with
``<!-- no-run: REASON -->``; the marked blocks are counted and each must give its reason. A
block that repeats another page's word for word (README's quick examples are getting-started's)
is marked ``<!-- runs-in: PAGE -->`` and runs there only: the test checks that PAGE runs a block
with the very same code, in CI, so the copy cannot drift from what is run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Pages whose examples take long (several traces and solves, pytest inside, torch.compile):
# run with `-m slow` (make test-all). README and getting-started always run.
SLOW_PAGES = {
    "docs/applying.md",
    "docs/ci.md",
    "docs/cli.md",
    "docs/cost-model.md",
    "docs/torch-compile.md",
}
PAGE_TIMEOUT_S = 120

FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->\s*$")
RUNS_IN = re.compile(r"<!--\s*runs-in:\s*(\S+)\s*-->\s*$")
RUNNABLE = ("python", "bash")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    no_run: str | None  # the reason given, None for a block that runs
    runs_in: str | None = None  # the page that runs this very code instead (runs-in mark)

    @property
    def runs_here(self) -> bool:
        return self.lang in RUNNABLE and self.no_run is None and self.runs_in is None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = NO_RUN.search(before)
        elsewhere = RUNS_IN.search(before)
        found.append(
            Block(
                m.group(1),
                m.group(2),
                text.count("\n", 0, m.start()) + 1,
                mark.group(1) if mark else None,
                elsewhere.group(1) if elsewhere else None,
            )
        )
    return found


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# The driver runs in the page's interpreter: python blocks exec'd in one namespace, bash blocks
# in a subprocess; it stops at the first failing block and says which.
DRIVER = r"""
import json, os, subprocess, sys, traceback
sys.path.insert(0, os.getcwd())
page, todo = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in todo:
    print(f"--- {page}:{b['line']} ({b['lang']})", flush=True)
    if b["lang"] == "python":
        try:
            exec(compile(b["code"], f"{page}:{b['line']}", "exec"), ns)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"FAILED: the python block at {page}:{b['line']}")
    else:
        rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b["code"]]).returncode
        if rc:
            sys.exit(f"FAILED: the bash block at {page}:{b['line']} (exit {rc})")
"""


def env_for(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "remat"  # this checkout's command, whatever the venv has installed
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m remat.cli "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def page_params() -> list[object]:
    return [
        pytest.param(p, id=rel(p), marks=[pytest.mark.slow] if rel(p) in SLOW_PAGES else [])
        for p in PAGES
        if any(b.runs_here for b in blocks(p))
    ]


@pytest.mark.parametrize("page", page_params())
def test_page_examples_run(page: Path, tmp_path: Path) -> None:
    todo = [b.__dict__ for b in blocks(page) if b.runs_here]
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([rel(page), todo]))
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(spec)],
        cwd=work,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    took = time.monotonic() - start
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"
    print(f"{rel(page)}: {len(todo)} blocks in {took:.1f} s")


def test_every_block_is_run_or_marked() -> None:
    """Nothing is skipped silently: a no-run mark gives a reason and sits on a runnable fence,
    and the count of marked blocks is stated here, so adding one is a visible change."""
    runs, marked = 0, []
    for page in PAGES:
        for b in blocks(page):
            if b.no_run is not None:
                assert b.lang in RUNNABLE, f"{rel(page)}:{b.line}: no-run on a ```{b.lang} block"
                assert b.no_run, f"{rel(page)}:{b.line}: no-run without a reason"
                marked.append(f"{rel(page)}:{b.line}")
            elif b.runs_in is not None:
                assert b.lang in RUNNABLE, f"{rel(page)}:{b.line}: runs-in on a ```{b.lang} block"
            elif b.lang in RUNNABLE:
                runs += 1
            else:
                # Other fences are output, configuration or shell sessions to read, not run.
                assert b.lang in ("text", "yaml", "toml", "json"), f"{rel(page)}:{b.line}"
    print(f"{runs} blocks run, {len(marked)} marked no-run: {marked}")
    assert runs >= 20
    assert len(marked) == EXPECTED_NO_RUN, marked


EXPECTED_NO_RUN = 4


def test_a_block_marked_runs_in_is_run_there_word_for_word() -> None:
    copies = [(page, b) for page in PAGES for b in blocks(page) if b.runs_in is not None]
    assert copies  # README's quick examples
    for page, b in copies:
        where = ROOT / b.runs_in
        assert where.is_file(), f"{rel(page)}:{b.line}: runs-in names {b.runs_in}, not a page"
        assert b.runs_in not in SLOW_PAGES, f"{rel(page)}:{b.line}: {b.runs_in} is not run in CI"
        run_there = [o.code for o in blocks(where) if o.runs_here and o.lang == b.lang]
        assert b.code in run_there, (
            f"{rel(page)}:{b.line}: this ```{b.lang} block is not, word for word, one that "
            f"{b.runs_in} runs; copy it from there again or drop the runs-in mark"
        )


def test_readme_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 170
    assert "make demo" in text and "make test" in text and "docs/" in text


def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "reference" / "ir" / "index.html").is_file()
