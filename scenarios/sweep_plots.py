"""The sweep's figures: the Pareto view (final loss vs uplink bytes) and the loss curves.

Each grid point is one colour; its seeds are averaged evaluation by evaluation (runs of one point
evaluate at the same inner steps), with the min..max band over the seeds around the mean. The
Pareto view draws the front of the points' means (``pareto_indices``: no other point has both
fewer bytes and a lower loss) as a step line and dims the dominated points.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from geoloco.scenarios.research import RunResult
from geoloco.scenarios.sweep_stats import pareto_front

__all__ = ["PARETO_OBJECTIVES", "PlotPoint", "mean_curve", "pareto_indices", "write_sweep_plots"]


class PlotPoint(Protocol):
    """What a plot needs of a grid point (``geoloco.scenarios.sweep.PointSummary``)."""

    @property
    def label(self) -> str: ...

    @property
    def runs(self) -> list[RunResult]: ...

    def stat(self, key: str) -> tuple[float, float, float] | None: ...

PARETO_FILE = "pareto.png"
PARETO_OBJECTIVES = ("bytes_up", "final_eval_loss")
"""The Pareto view's x and y, both minimized: total uplink bytes and final eval loss (means over seeds)."""
DOMINATED_ALPHA = 0.3
"""How strongly a dominated point is drawn (the front's points at full strength)."""
CURVE_FILES = {
    "inner_steps": ("inner steps per site (cumulative, warm-up included)", "loss_vs_steps.png"),
    "bytes_up": ("uplink bytes, all sites (cumulative)", "loss_vs_bytes.png"),
    "time_s": ("virtual wall-clock seconds", "loss_vs_time.png"),
}


def _mean(point: PlotPoint, key: str) -> float:
    stat = point.stat(key)
    assert stat is not None  # only called for points on the front, which have both
    return stat[0]


def mean_curve(point: PlotPoint, x: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(xs, mean loss, min loss, max loss)`` over the seeds, evaluation by evaluation, up to the
    shortest seed's curve (a run that stopped at its target has fewer)."""
    curves = [r.curve for r in point.runs]
    if not curves:
        return [], [], [], []
    n = min(len(c) for c in curves)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        losses = [c[i].eval_loss for c in curves]
        xs.append(statistics.fmean(float(getattr(c[i], x)) for c in curves))
        mean.append(statistics.fmean(losses))
        lo.append(min(losses))
        hi.append(max(losses))
    return xs, mean, lo, hi


def pareto_indices(points: Sequence[PlotPoint]) -> list[int]:
    """Indices of the points on the Pareto front of ``PARETO_OBJECTIVES`` (their means over the
    seeds; points without both are on no front), fewest bytes first."""
    x_key, y_key = PARETO_OBJECTIVES
    index: list[int] = []
    coords: list[tuple[float, float]] = []
    for i, p in enumerate(points):
        x, y = p.stat(x_key), p.stat(y_key)
        if x is not None and y is not None:
            index.append(i)
            coords.append((x[0], y[0]))
    return [index[k] for k in pareto_front(coords)]


def write_sweep_plots(out: Path, points: Sequence[PlotPoint], num_seeds: int) -> list[Path]:
    """``pareto.png`` and ``loss_vs_{steps,bytes,time}.png`` under ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in points if p.runs]
    colors = plt.get_cmap("tab10" if len(points) <= 10 else "tab20")
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    front = pareto_indices(points)
    for k, p in enumerate(points):
        loss, bytes_up = p.stat("final_eval_loss"), p.stat("bytes_up")
        if loss is None or bytes_up is None:
            continue
        ax.errorbar(
            [bytes_up[0]], [loss[0]], yerr=[[loss[0] - loss[1]], [loss[2] - loss[0]]],
            xerr=[[bytes_up[0] - bytes_up[1]], [bytes_up[2] - bytes_up[0]]],
            fmt="o", capsize=3, color=colors(k % colors.N), alpha=1.0 if k in front else DOMINATED_ALPHA,
            label=p.label if k in front else f"{p.label} (dominated)",
        )
    if front:
        xs = [_mean(points[k], PARETO_OBJECTIVES[0]) for k in front]
        ys = [_mean(points[k], PARETO_OBJECTIVES[1]) for k in front]
        # A step line: from each front point the loss holds until the next point's bytes buy a lower one.
        ax.step(xs, ys, where="post", color="black", linewidth=1.2, alpha=0.8, zorder=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("total uplink bytes, all sites (log)")
    ax.set_ylabel("final eval loss (mean, min..max over seeds)")
    ax.set_title(f"final loss vs uplink bytes ({num_seeds} seeds per point; dominated points dimmed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    path = out / PARETO_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    for x, (label, file_name) in CURVE_FILES.items():
        fig, ax = plt.subplots(figsize=(7.2, 4.8))
        for k, p in enumerate(points):
            xs, mean, lo, hi = mean_curve(p, x)
            if not xs:
                continue
            color = colors(k % colors.N)
            ax.plot(xs, mean, "o-", markersize=3, color=color, label=p.label)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15)
        if x == "bytes_up":
            ax.set_xscale("symlog")
        ax.set_xlabel(label)
        ax.set_ylabel("eval loss (mean, band: min..max over seeds)")
        ax.set_title(f"eval loss vs {label.split(' (')[0].split(',')[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
        fig.tight_layout()
        path = out / file_name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
