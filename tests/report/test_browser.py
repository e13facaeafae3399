"""The report of the GPT example at 50% opened in headless Chromium: the screenshot shows both
plots drawn, each declared series found by its colour, no undeclared series colour.

Runs where Debian's ``chromium`` is installed (``make test-all`` installs it: the ``browser``
target); skipped elsewhere. With ``REMAT_ARTIFACTS=DIR`` the page and the screenshot are kept
there (``make test-all`` keeps them in ``artifacts/``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _pages import Page

pytestmark = pytest.mark.slow

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
TOLERANCE = 10
"""Largest difference per channel for a pixel to count as a series colour."""
MIN_PIXELS = 40
"""A drawn series covers at least this many pixels of its exact colour (1.6 px lines)."""


def chromium_screenshot(page: Path, out: Path, profile: Path, size: tuple[int, int]) -> None:
    """Open ``page`` headless with a fresh profile and nothing reached over the network."""
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        "--force-color-profile=srgb",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        f"--window-size={size[0]},{size[1]}",
        f"--screenshot={out}",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]


def pixels_of(img: np.ndarray, colour: str) -> int:
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return int((np.abs(img.astype(np.int16) - rgb).max(axis=2) <= TOLERANCE).sum())


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (make test-all installs it)"
)
def test_gpt_report_draws_in_headless_chromium(tmp_path: Path) -> None:
    from PIL import Image

    import remat
    from examples.models import gpt_demo
    from remat.report import compute_frontier, render_html
    from remat.report.plots import SOLVER_COLOURS, TIMELINE_COLOURS

    graph = remat.trace(*gpt_demo(), cost="cpu")
    result = remat.solve(graph, "50%", time_limit_s=20)
    assert result.fits, result
    frontier = compute_frontier(graph)
    page = tmp_path / "gpt-50.html"
    page.write_text(render_html(graph, result, frontier=frontier))
    shot = tmp_path / "gpt-50.png"
    chromium_screenshot(page, shot, tmp_path / "profile", (1200, 2400))
    if os.environ.get("REMAT_ARTIFACTS"):
        keep = Path(os.environ["REMAT_ARTIFACTS"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, keep / page.name)
        shutil.copy(shot, keep / shot.name)

    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[:2] == (2400, 1200)
    white = (img >= 250).all(axis=2).mean()
    assert 0.3 < white < 0.97, f"{white:.1%} of the screenshot is white: blank, or not a page"
    figures = Page(page.read_text()).figures
    declared = {s["colour"] for f in figures.values() for s in json.loads(f["series"])}
    # The timeline's three series and one line per solver with a plan on the frontier.
    assert len(json.loads(figures["timeline"]["series"])) == 3
    assert len(json.loads(figures["frontier"]["series"])) == len(
        {p.solver for p in frontier if p.fits}
    )
    counts = {c: pixels_of(img, c) for c in {*TIMELINE_COLOURS.values(), *SOLVER_COLOURS}}
    drawn = {c for c, n in counts.items() if n >= MIN_PIXELS}
    assert drawn == declared, f"pixels per series colour: {counts}"
