"""``benchmarks/bench_secagg_scale.py``: the whole secure protocol in one process, per stage.

Its figures are not asserted (README, "Benchmarks"); what is checked is that it runs end to end
as a user would start it, checks its sums, and reports every stage's time and bytes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_secagg_scale.py"


def test_the_secure_scale_benchmark_reports_every_stage() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--sites", "8,16", "--params", "64"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 8 |", "| 16 |"))]
    assert len(rows) == 2, done.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3 + 5 + 3 and all(c.endswith(" s") for c in cells[2:8]), row
    assert "Seconds per site, relative to 8 sites" in done.stdout
