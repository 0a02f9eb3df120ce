"""Tuning a few continuous knobs of a simulate config with optuna, pruning on the eval losses.

A sweep tries every point of a grid; tuning the outer learning rate, the outer momentum or the
error-feedback decay wants a search instead: each trial is one simulator run whose knobs optuna's
sampler (TPE, seeded) picks from the given ranges. Every evaluation of the run is reported to the
trial at its cumulative inner step, and the pruner (median by default) stops a trial whose loss
is worse than the earlier trials' at the same step, so bad settings cost a fraction of a run. A
diverged run (a non-finite loss) is pruned at once.

The objective is the final eval loss. Under ``out``: ``study.db`` (optuna's SQLite storage: a
rerun of the same command resumes the study and runs only the missing trials), ``trials/NNN/``
(each trial's run folder, ``geoloco.scenarios.research``; a pruned trial's has no summary),
``best.json`` (the best trial's params and the ``--set`` texts that rerun it), ``trials.md`` (one
row per trial) and ``tune.png`` (the loss per trial with the best so far, and every trial's eval
curve, pruned ones dashed).

optuna is an optional extra (``pip install 'geoloco[optuna]'``), imported only when tuning runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError
from geoloco.scenarios.config_kinds import SIMULATE, read_config
from geoloco.scenarios.overrides import parse_override
from geoloco.scenarios.research import prepare_run, run, run_identity, with_plugins

__all__ = ["TrialRow", "TuneParam", "TuneResult", "parse_param", "tune", "write_tune_plot"]

logger = logging.getLogger(__name__)

STUDY_FILE = "study.db"
STUDY_NAME = "geoloco-tune"
BEST_FILE = "best.json"
TRIALS_TABLE = "trials.md"
PLOT_FILE = "tune.png"
TRIALS_DIR = "trials"
PRUNERS = ("median", "none")


@dataclass(frozen=True, slots=True)
class TuneParam:
    """One tuned key and its range (both ends included)."""

    key: str
    low: float
    high: float
    log: bool = False
    """Sample on a log scale (learning rates)."""
    integer: bool = False

    def value_text(self, value: float) -> str:
        """``value`` as ``--set`` text (a TOML literal)."""
        return str(int(value)) if self.integer else repr(float(value))


def parse_param(text: str) -> TuneParam:
    """``KEY=LOW:HIGH`` with optional ``:log`` and ``:int`` (``outer_optimizer.lr=0.1:1.0:log``)."""
    key, value = parse_override(text)
    parts = [p.strip() for p in value.split(":")]
    flags = set(parts[2:])
    usage = f"expected KEY=LOW:HIGH[:log][:int] such as outer_optimizer.lr=0.1:1.0:log, got {text!r}"
    if len(parts) < 2 or not flags <= {"log", "int"} or len(flags) != len(parts) - 2:
        raise ConfigFileError(COMMAND_LINE, "--param", usage)
    try:
        low, high = (int(p) if "int" in flags else float(p) for p in parts[:2])
    except ValueError:
        raise ConfigFileError(COMMAND_LINE, "--param", usage) from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigFileError(COMMAND_LINE, "--param", f"{key}: LOW must be below HIGH, got {text!r}")
    if "log" in flags and low <= 0:
        raise ConfigFileError(COMMAND_LINE, "--param", f"{key}: a log range needs LOW > 0, got {text!r}")
    return TuneParam(key, low, high, log="log" in flags, integer="int" in flags)


@dataclass(frozen=True, slots=True)
class TrialRow:
    """One trial as the table shows it."""

    number: int
    state: str
    """``complete``, ``pruned``, ``fail`` (or ``running`` while a trial is under way)."""
    params: dict[str, float]
    value: float | None
    """The final eval loss (complete trials)."""
    curve: list[tuple[int, float]]
    """``(inner steps, eval loss)`` of every reported evaluation."""
    folder: str | None


@dataclass(slots=True)
class TuneResult:
    """What ``tune`` produced."""

    out: Path
    params: list[TuneParam]
    trials: list[TrialRow]
    best: TrialRow | None
    ran: int = 0
    resumed: int = 0
    files: list[Path] = field(default_factory=list)

    def table(self) -> str:
        """Markdown: one row per trial (params, state, final loss, the last evaluation's step)."""
        keys = [p.key for p in self.params]
        header = ["trial", "state", *(k.rsplit(".", 1)[-1] for k in keys), "final eval loss", "last eval at step"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for t in self.trials:
            mark = " (best)" if self.best is not None and t.number == self.best.number else ""
            cells = [f"{t.number}{mark}", t.state, *(_number(t.params.get(k)) for k in keys),
                     _number(t.value), str(t.curve[-1][0]) if t.curve else "n/a"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def tune(
    base: Mapping[str, Any] | Path | str,
    *,
    params: Sequence[TuneParam],
    trials: int,
    out: Path,
    overrides: Sequence[str] = (),
    seed: int = 0,
    pruner: Any = "median",
    enqueue: Sequence[Mapping[str, float]] = (),
    plots: bool = True,
    workload: Any = None,
    plugins: Sequence[str] = (),
) -> TuneResult:
    """Run trials until ``out`` holds ``trials`` finished ones (complete or pruned; a rerun
    resumes, and runs a new trial for each failed or interrupted one), then write ``best.json``,
    ``trials.md`` and ``tune.png``.

    ``pruner``: ``"median"``, ``"none"`` or an optuna pruner. ``enqueue``: trials to run first
    with the given values (optuna's ``enqueue_trial``), e.g. a known-good setting. Both ends of
    every range are checked against the config before anything runs (``ConfigFileError``).
    ``workload`` (an object implementing ``geoloco.algorithms.workload.Workload``) and ``plugins``
    as for ``research.run``; the study resumes only with the same thread count, plug-in sources
    and workload."""
    if not params:
        raise ConfigFileError(COMMAND_LINE, "--param", "give at least one KEY=LOW:HIGH to tune")
    if len({p.key for p in params}) != len(params):
        raise ConfigFileError(COMMAND_LINE, "--param", "a key is tuned twice")
    if trials < 1:
        raise ConfigFileError(COMMAND_LINE, "--trials", f"must be >= 1, got {trials}")
    source = str(base) if isinstance(base, (str, Path)) else COMMAND_LINE
    raw = read_config(Path(base), (SIMULATE,))[0] if isinstance(base, (str, Path)) else dict(base)
    raw = with_plugins(raw, plugins)
    for end in ("low", "high"):
        texts = [*overrides, *(f"{p.key}={p.value_text(getattr(p, end))}" for p in params)]
        research = prepare_run(raw, texts, source, workload=workload).research
    identity = run_identity(research, workload)
    optuna = _import_optuna()
    out.mkdir(parents=True, exist_ok=True)
    study = _open_study(optuna, out, raw, overrides, params, seed, pruner, identity)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = [t for t in study.trials if t.state in finished]  # a failed trial is tried again
    for values in enqueue if not done else ():
        study.enqueue_trial(dict(values))
    missing = max(0, trials - len(done))
    logger.info("tune: %d trials wanted, %d already finished, running %d", trials, len(done), missing)
    if missing:
        study.optimize(
            _objective(optuna, raw, overrides, params, out, workload), n_trials=missing, catch=(ConfigFileError,)
        )
    rows = [_row(t) for t in study.trials]
    complete = [r for r in rows if r.state == "complete" and r.value is not None]
    best = min(complete, key=lambda r: r.value if r.value is not None else math.inf) if complete else None
    result = TuneResult(out=out, params=list(params), trials=rows, best=best, ran=missing, resumed=len(done))
    (out / TRIALS_TABLE).write_text(result.table() + "\n")
    result.files = [out / TRIALS_TABLE, out / STUDY_FILE]
    if best is not None:
        (out / BEST_FILE).write_text(json.dumps({
            "trial": best.number, "final_eval_loss": best.value, "params": best.params,
            "set": [f"{p.key}={p.value_text(best.params[p.key])}" for p in params], "folder": best.folder,
        }, indent=2) + "\n")
        result.files.insert(0, out / BEST_FILE)
    if plots:
        result.files.append(write_tune_plot(out / PLOT_FILE, rows, best))
    return result


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigFileError(
            COMMAND_LINE, "tune", "needs the `optuna` package: pip install 'geoloco[optuna]'"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _open_study(
    optuna: Any, out: Path, raw: Mapping[str, Any], overrides: Sequence[str], params: Sequence[TuneParam],
    seed: int, pruner: Any, run_identity: Mapping[str, Any],
) -> Any:
    if isinstance(pruner, str):
        if pruner not in PRUNERS:
            raise ConfigFileError(COMMAND_LINE, "--pruner", f"unknown pruner {pruner!r}; allowed: {', '.join(PRUNERS)}")
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if pruner == "median" else optuna.pruners.NopPruner()
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / STUDY_FILE}")
    study = optuna.create_study(
        study_name=STUDY_NAME, storage=storage, load_if_exists=True,
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner,
    )
    identity = hashlib.sha256(json.dumps(
        [raw, list(overrides), [[p.key, p.low, p.high, p.log, p.integer] for p in params], run_identity],
        sort_keys=True, default=str,
    ).encode()).hexdigest()
    known = study.user_attrs.get("identity")
    if known is None:
        study.set_user_attr("identity", identity)
    elif known != identity:
        raise ConfigFileError(
            COMMAND_LINE, "--out", f"{out} holds a study of another base config, --set, --param "
            "ranges, thread count, plug-in source or workload; give a new --out (or the same arguments "
            "to resume it)"
        )
    study_id = storage.get_study_id_from_name(STUDY_NAME)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # A trial left running by an interrupted process never finishes by itself.
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
    return study


def _objective(optuna: Any, raw: Mapping[str, Any], overrides: Sequence[str], params: Sequence[TuneParam],
               out: Path, workload: Any) -> Any:
    def objective(trial: Any) -> float:
        values = {
            p.key: trial.suggest_int(p.key, int(p.low), int(p.high), log=p.log) if p.integer
            else trial.suggest_float(p.key, p.low, p.high, log=p.log)
            for p in params
        }
        folder = out / TRIALS_DIR / f"{trial.number:03d}"
        trial.set_user_attr("folder", str(folder.relative_to(out)))

        def on_record(record: Any) -> None:
            loss = record.eval_loss
            if loss is None:
                return
            if not math.isfinite(loss):
                logger.info("trial %d pruned: eval loss %s at step %d (diverged)", trial.number, loss,
                            record.inner_steps_total)
                raise optuna.TrialPruned(f"eval loss {loss} at step {record.inner_steps_total}: diverged")
            trial.report(loss, step=record.inner_steps_total)
            if trial.should_prune():
                logger.info("trial %d pruned: eval loss %.4f at step %d", trial.number, loss, record.inner_steps_total)
                raise optuna.TrialPruned(f"eval loss {loss:.4f} at step {record.inner_steps_total}")

        texts = [*overrides, *(f"{p.key}={p.value_text(values[p.key])}" for p in params)]
        result = run(dict(raw), overrides=texts, out=folder, on_record=on_record, workload=workload)
        final = result.final_eval_loss
        if final is None:
            raise ConfigFileError(COMMAND_LINE, "run.eval_every", "the run made no evaluation to tune on")
        logger.info("trial %d: final eval loss %.4f with %s", trial.number, final, " ".join(texts[len(overrides):]))
        return final

    return objective


def _row(trial: Any) -> TrialRow:
    state = trial.state.name.lower()
    return TrialRow(
        number=trial.number, state=state, params=dict(trial.params),
        value=trial.value if state == "complete" else None,
        curve=sorted((int(s), float(v)) for s, v in trial.intermediate_values.items()),
        folder=trial.user_attrs.get("folder"),
    )


def write_tune_plot(path: Path, trials: Sequence[TrialRow], best: TrialRow | None) -> Path:
    """Left: each trial's final (complete) or last reported (pruned) eval loss, and the best so
    far; right: every trial's eval loss against inner steps, pruned trials dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (history, curves) = plt.subplots(1, 2, figsize=(11, 4.4))
    complete = [t for t in trials if t.state == "complete" and t.value is not None]
    pruned = [t for t in trials if t.state == "pruned" and t.curve]
    history.plot([t.number for t in complete], [t.value for t in complete], "o", label="complete: final eval loss")
    history.plot([t.number for t in pruned], [t.curve[-1][1] for t in pruned], "x", color="grey",
                 label="pruned: last eval loss")
    best_so_far: list[tuple[int, float]] = []
    for t in complete:
        if t.value is not None and (not best_so_far or t.value < best_so_far[-1][1]):
            best_so_far.append((t.number, t.value))
    if best_so_far:
        xs = [n for n, _ in best_so_far] + [max(t.number for t in trials)]
        ys = [v for _, v in best_so_far] + [best_so_far[-1][1]]
        history.step(xs, ys, where="post", color="black", label="best so far")
    history.set_xlabel("trial")
    history.set_ylabel("eval loss")
    history.set_title("trials" + (f" (best: trial {best.number}, {best.value:.4f})" if best and best.value else ""))
    history.grid(alpha=0.3)
    history.legend(fontsize="small")
    for t in trials:
        if not t.curve:
            continue
        steps, losses = zip(*t.curve, strict=True)
        is_best = best is not None and t.number == best.number
        # Markers: a trial pruned at its first evaluation is a single point.
        curves.plot(steps, losses, "x--" if t.state == "pruned" else "o-", markersize=4,
                    linewidth=2.2 if is_best else 1.0,
                    color="black" if is_best else None, alpha=1.0 if is_best else 0.6,
                    label=f"trial {t.number} (best)" if is_best else None)
    curves.set_xlabel("inner steps per site (cumulative)")
    curves.set_ylabel("eval loss")
    curves.set_title("eval curves (dashed: pruned)")
    curves.grid(alpha=0.3)
    if best is not None:
        curves.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
