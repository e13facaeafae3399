from __future__ import annotations

import pytest
from handmade import chain_step

from remat.ir import format_bytes, parse_budget, parse_bytes, resolve_budget


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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1e9", 10**9),  # above 1: bytes
        ("12884901888", 12884901888),  # exact, beyond float precision
        ("100", 100),
        ("0", 0),
        ("0.7", 0.7),  # below 1: a fraction
        (".5", 0.5),
        ("1.0", 1.0),  # written with a point: the whole eager peak
        ("1B", 1),
        ("100%", 1.0),
    ],
)
def test_parse_budget_reads_bare_numbers_by_value(text: str, expected: float) -> None:
    got = parse_budget(text)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("text", ["1", " 1 ", "1e0"])
def test_parse_budget_refuses_a_bare_one_naming_both_spellings(text: str) -> None:
    with pytest.raises(ValueError, match=r'"1B".*"100%"'):
        parse_budget(text)


def test_parse_budget_refuses_fractional_bytes() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_budget("2.5")
