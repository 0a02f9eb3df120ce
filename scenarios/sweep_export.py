"""A sweep's runs and per-round curves as flat tables: rows, CSV, pandas, Parquet.

Analysis outside geoloco (a notebook, R, a spreadsheet) wants one row per run and one row per
round, not a folder of JSON files. Two tables, built from the finished run folders:

- **runs**: one row per finished run: the grid point's keys (dotted, as swept; typed when every
  value of an axis is a number or a boolean, text otherwise), ``label``, ``seed``, ``folder``,
  the run's totals (``RunResult.totals``) and its real ``runtime_s``;
- **curves**: one row per round record of every finished run: the same point columns, then the
  record's scalar fields under their ``metrics.jsonl`` names (``round``, ``phase``,
  ``inner_steps_total``, ``eval_loss``, ``bytes_up_total``, ``wall_clock_s``, ...). Per-site
  tables (bytes, utilization per site) stay in each run's ``metrics.jsonl``: a key whose value is
  a table or a list in any record is left out.

CSV needs nothing beyond the standard library; ``to_dataframe`` and Parquet need pandas (and
pyarrow), the ``analysis`` extra, imported only here and only when asked for.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from geoloco.scenarios.overrides import parse_value

if TYPE_CHECKING:
    from geoloco.scenarios.research import RunResult

__all__ = [
    "EXPORT_FORMATS",
    "ExportPoint",
    "Table",
    "curve_table",
    "missing_for",
    "run_table",
]

logger = logging.getLogger(__name__)

ANALYSIS_EXTRA = "analysis"
EXPORT_FORMATS = ("csv", "parquet")
"""What ``geoloco sweep --export`` writes: ``DIR/runs.<format>`` and ``DIR/curves.<format>``."""
RUN_FIELDS = ("label", "seed", "folder")
"""Columns after the point's keys that say which run a row belongs to."""


class ExportPoint(Protocol):
    """What an export needs of a grid point (``geoloco.scenarios.sweep.PointSummary``)."""

    @property
    def point(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def label(self) -> str: ...

    @property
    def runs(self) -> list[RunResult]: ...


def missing_for(fmt: str) -> str | None:
    """What installing the ``analysis`` extra would add for ``fmt`` (``"pandas"``, ``"pyarrow"``
    or ``"pandas"`` for ``"dataframe"``); ``None`` when nothing is missing."""
    import importlib.util

    needed = {"csv": (), "dataframe": ("pandas",), "parquet": ("pandas", "pyarrow")}[fmt]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"{fmt} needs {' and '.join(missing)}: pip install 'geoloco[{ANALYSIS_EXTRA}]'"
    )


def _pandas(what: str) -> Any:
    try:
        import pandas
    except ImportError as err:
        raise ImportError(f"{what} needs pandas ({err}): pip install 'geoloco[{ANALYSIS_EXTRA}]'") from None
    return pandas


@dataclass(frozen=True, slots=True)
class Table:
    """Rows under named columns; a row may lack a column (an empty cell, a missing value)."""

    columns: list[str]
    rows: list[dict[str, Any]]

    def write_csv(self, path: Path) -> Path:
        """RFC 4180 CSV with a header row; ``None`` as an empty cell, floats written so that they
        read back to the same float."""
        with path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        return path

    def to_dataframe(self) -> Any:
        """A ``pandas.DataFrame`` of the rows (``ImportError`` naming the extra without pandas)."""
        pandas = _pandas("a DataFrame")
        return pandas.DataFrame.from_records(self.rows, columns=self.columns)

    def write_parquet(self, path: Path) -> Path:
        """Parquet through pandas and pyarrow (``ImportError`` naming the extra without them)."""
        problem = missing_for("parquet")
        if problem is not None:
            raise ImportError(problem)
        self.to_dataframe().to_parquet(path, index=False)
        return path

    def write(self, path: Path, fmt: str) -> Path:
        """``path`` in ``fmt`` (one of ``EXPORT_FORMATS``)."""
        if fmt == "csv":
            return self.write_csv(path)
        if fmt == "parquet":
            return self.write_parquet(path)
        raise ValueError(f"unknown export format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")


def _axis_values(points: Sequence[ExportPoint]) -> dict[str, dict[str, Any]]:
    """Per swept key, each value text -> the value a column holds: the TOML literal when every
    value of the axis is a number (or every one a boolean), so a column sorts and plots as
    numbers; the text otherwise (``none``, ``int8``), so a column never mixes types."""
    texts: dict[str, list[str]] = {}
    for p in points:
        for key, text in p.point:
            texts.setdefault(key, []).append(text)
    typed: dict[str, dict[str, Any]] = {}
    for key, values in texts.items():
        parsed = {text: parse_value(text) for text in values}
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed.values())
        flags = all(isinstance(v, bool) for v in parsed.values())
        typed[key] = parsed if numbers or flags else {text: text for text in values}
    return typed


def _run_fields(point: ExportPoint, run: RunResult, axes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        **{key: axes[key][text] for key, text in point.point},
        "label": point.label,
        "seed": run.config.get("simulation", {}).get("seed"),
        "folder": None if run.folder is None else str(run.folder),
    }


def _point_columns(points: Sequence[ExportPoint]) -> list[str]:
    return list(dict.fromkeys(key for p in points for key, _ in p.point))


def run_table(points: Sequence[ExportPoint]) -> Table:
    """One row per finished run (see the module docstring)."""
    axes = _axis_values(points)
    rows = [
        {**_run_fields(p, r, axes), **r.totals, "runtime_s": r.runtime_s}
        for p in points for r in p.runs
    ]
    columns = [*_point_columns(points), *RUN_FIELDS]
    for row in rows:
        columns += [key for key in row if key not in columns]
    return Table(columns=columns, rows=rows)


def curve_table(points: Sequence[ExportPoint]) -> Table:
    """One row per round record of every finished run (see the module docstring)."""
    axes = _axis_values(points)
    tables = {
        key for p in points for r in p.runs for record in r.records
        for key, value in record.items() if isinstance(value, (dict, list))
    }
    columns = [*_point_columns(points), *RUN_FIELDS]
    rows: list[dict[str, Any]] = []
    for p in points:
        for r in p.runs:
            fields = _run_fields(p, r, axes)
            for record in r.records:
                scalars = {k: v for k, v in record.items() if k not in tables and k not in fields}
                columns += [key for key in scalars if key not in columns]
                rows.append({**fields, **scalars})
    return Table(columns=columns, rows=rows)
