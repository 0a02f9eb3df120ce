"""``human_bytes``: the one byte formatter of the commands, the reports and the benchmarks."""

from __future__ import annotations

import pytest

from geoloco.scenarios.progress import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"), (999, "999 B"), (999.6, "1.00 kB"), (1500, "1.50 kB"), (12_345, "12.3 kB"),
        (99_960, "100 kB"), (999_600, "1.00 MB"), (4_000_033, "4.00 MB"), (2.5e9, "2.50 GB"),
        (1.5e12, "1.50 TB"), (2.5e15, "2500 TB"), (-2048, "-2.05 kB"),
    ],
)
def test_three_significant_digits_in_decimal_units(n: float, text: str) -> None:
    assert human_bytes(n) == text
