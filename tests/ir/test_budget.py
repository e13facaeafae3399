from __future__ import annotations

import pytest
from handmade import chain_step

from remat.ir import format_bytes, parse_bytes, resolve_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * 2**30),
        ("1.5 GB", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("100", 100),
        ("2kb", 2000),
        (4096, 4096),
        ("1e3", 1000),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "", "-5GiB", "GiB", -1, True])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_resolve_budget_fractions_apply_to_the_dynamic_part() -> None:
    g = chain_step()  # static 100, eager dynamic peak 91
    assert resolve_budget(g, 1.0) == 191
    assert resolve_budget(g, "50%") == 100 + 45
    assert resolve_budget(g, 0.5) == 145
    assert resolve_budget(g, "1KiB") == 1024
    assert resolve_budget(g, 77) == 77
    for bad in (0.0, 1.5, "150%", "abc%", -3, "-1GiB"):
        with pytest.raises(ValueError, match="budget"):
            resolve_budget(g, bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
