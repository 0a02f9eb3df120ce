"""Simulator runs as results: ``run(config) -> RunResult``, saved to and loaded from a run folder.

The simulator (``geoloco.algorithms.simulator``) yields round records and does no I/O; research
code wants the finished run instead: the resolved config with the package version and commit it
ran on, the evaluation curve against cumulative inner steps, bytes and virtual time, the totals,
and the step, byte and time cost of reaching a loss. A run folder holds ``config.json`` (the
resolved config), ``metrics.jsonl`` (one record per round, written as the run goes) and
``summary.json`` (totals, written last: its presence marks a finished run, which is what the
sweep runner resumes by). ``geoloco simulate --out`` writes the same folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError, from_config_error, read_toml
from geoloco.scenarios.overrides import apply_overrides, parse_override

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "SECTIONS",
    "SUMMARY_FILE",
    "CurvePoint",
    "RunResult",
    "is_finished",
    "load_run_config",
    "prepare_raw",
    "provenance",
    "require_tensorboard",
    "resolved_config",
    "run",
]

logger = logging.getLogger(__name__)

SECTIONS = (
    "workload", "algorithm", "inner_optimizer", "outer_optimizer", "sites", "simulation", "privacy",
    "regions", "coordinator_link",
)
"""Top-level keys of a simulate config file."""
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_FORMAT = 1
"""Version of ``summary.json``'s layout, so a later reader can tell old folders apart."""

RUN_LENGTH_PAIRS = (("rounds", "total_inner_steps"), ("eval_every", "eval_every_steps"))
"""``[simulation]`` keys that say the same thing in rounds or in inner steps: exactly one of
each pair may be set, so an override of one replaces the file's other."""


# -- provenance ------------------------------------------------------------------------------------


def provenance() -> dict[str, Any]:
    """``{"version", "commit", "commit_dirty"}`` of the code that runs: the installed package's
    version, and the git commit of the source folder when it is a git checkout (else ``None``),
    so a result can be traced to the code that produced it."""
    from importlib import metadata

    try:
        version: str | None = metadata.version("geoloco")
    except metadata.PackageNotFoundError:
        version = None
    source = Path(__file__).resolve().parent
    commit = _git(source, "rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git(source, "status", "--porcelain", "--untracked-files=no"))
    return {"version": version, "commit": commit, "commit_dirty": dirty}


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# -- config ----------------------------------------------------------------------------------------


def prepare_raw(raw: Mapping[str, Any], overrides: Sequence[str], source: str) -> dict[str, Any]:
    """A copy of the file's dict with ``--set`` overrides applied and the sections checked.

    An override of ``simulation.rounds`` drops the file's ``total_inner_steps`` (and the other
    pairs alike), so the command line wins over the file instead of setting both."""
    from geoloco.algorithms.simulator import SimulatorConfig

    prepared: dict[str, Any] = copy.deepcopy(dict(raw))
    overridden = {parse_override(text)[0] for text in overrides}
    simulation = prepared.get("simulation")
    if isinstance(simulation, dict):
        for a, b in RUN_LENGTH_PAIRS:
            for mine, other in ((a, b), (b, a)):
                if f"simulation.{mine}" in overridden and f"simulation.{other}" not in overridden:
                    simulation.pop(other, None)
    apply_overrides(prepared, overrides, source, SimulatorConfig)
    unknown = sorted(set(prepared) - set(SECTIONS))
    if unknown:
        raise ConfigFileError(source, unknown[0], f"unknown section; allowed: {', '.join(SECTIONS)}")
    return prepared


def load_run_config(raw: dict[str, Any], source: str) -> tuple[Any, Any]:
    """``(WorkloadSpec, SimulatorConfig)`` from a prepared dict (``prepare_raw``); consumes it."""
    from geoloco.algorithms.config import ConfigError
    from geoloco.algorithms.simulator import SimulatorConfig
    from geoloco.scenarios.workloads import WORKLOAD_TABLE, parse_workload

    try:
        workload = parse_workload(raw.pop(WORKLOAD_TABLE, None))
        config = SimulatorConfig.from_dict(raw)
    except ConfigError as err:
        raise from_config_error(source, err) from None
    return workload, config


def resolved_config(name: str, workload: Any, config: Any, device: str) -> dict[str, Any]:
    """The full config as run: every default filled in, outer optimizer resolved."""
    from geoloco.algorithms.strategy import ALGORITHMS

    data: dict[str, Any] = config.to_dict()
    default_outer = ALGORITHMS[config.algorithm.name].default_outer_optimizer
    data["outer_optimizer"] = config.outer_optimizer.resolved(default_outer).to_dict()
    workload_config = getattr(workload, "config", None)
    options = (
        dataclasses.asdict(workload_config)
        if dataclasses.is_dataclass(workload_config) and not isinstance(workload_config, type)
        else {}
    )
    data["workload"] = {"name": name, **options}
    data["resolved_device"] = device
    data["run_rounds"] = config.run_rounds
    return data


# -- the result ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One evaluation of the global model, with what it cost so far."""

    inner_steps: int
    """Cumulative inner steps per site (warm-up included): comparable across H."""
    round: int
    eval_loss: float
    train_loss: float
    bytes_up: int
    """Cumulative bytes every site uploaded."""
    bytes_down: int
    """Cumulative bytes every site downloaded."""
    time_s: float
    """Virtual wall-clock seconds."""


@dataclass(slots=True)
class RunResult:
    """A finished (or read back) simulated run; see the module docstring for its folder."""

    config: dict[str, Any]
    """The resolved config (``resolved_config``) plus ``version``, ``commit``, ``commit_dirty``."""
    records: list[dict[str, Any]]
    """Every ``RoundRecord.to_dict()``, warm-up first."""
    runtime_s: float = 0.0
    """Real seconds the run took (not part of any comparison: the machine may be shared)."""
    folder: Path | None = field(default=None, compare=False)
    """Where it was saved or loaded from."""

    @property
    def version(self) -> str | None:
        return self.config.get("version")

    @property
    def commit(self) -> str | None:
        return self.config.get("commit")

    @property
    def curve(self) -> list[CurvePoint]:
        """The evaluations in order, indexed by cumulative inner steps, bytes and virtual time."""
        return [
            CurvePoint(
                inner_steps=int(r["inner_steps_total"]),
                round=int(r["round"]),
                eval_loss=float(r["eval_loss"]),
                train_loss=float(r["train_loss"]),
                bytes_up=int(r["bytes_up_total"]),
                bytes_down=int(r["bytes_down_total"]),
                time_s=float(r["wall_clock_s"]),
            )
            for r in self.records
            if r.get("eval_loss") is not None
        ]

    @property
    def final_eval_loss(self) -> float | None:
        curve = self.curve
        return curve[-1].eval_loss if curve else None

    @property
    def totals(self) -> dict[str, Any]:
        """What the whole run cost and reached (``summary.json``'s ``totals``)."""
        last = self.records[-1] if self.records else {}
        target = self.config.get("simulation", {}).get("target_eval_loss")
        final = self.final_eval_loss
        return {
            "rounds": sum(1 for r in self.records if r.get("phase") == "train"),
            "inner_steps": int(last.get("inner_steps_total", 0)),
            "bytes_up": int(last.get("bytes_up_total", 0)),
            "bytes_down": int(last.get("bytes_down_total", 0)),
            "time_s": float(last.get("wall_clock_s", 0.0)),
            "final_eval_loss": final,
            "final_train_loss": last.get("train_loss"),
            "weights_digest": last.get("weights_digest"),
            "epsilon": last.get("epsilon"),
            "reached_target": None if target is None else final is not None and final <= target,
        }

    def _first(self, loss: float, attribute: str) -> Any:
        for point in self.curve:
            if point.eval_loss <= loss:
                return getattr(point, attribute)
        return None

    def time_to(self, loss: float) -> float | None:
        """Virtual seconds until an evaluation first reached ``loss`` or lower; ``None``: never."""
        value = self._first(loss, "time_s")
        return None if value is None else float(value)

    def bytes_to(self, loss: float, direction: str = "up") -> int | None:
        """Cumulative bytes (``"up"``, ``"down"`` or ``"both"``) until an evaluation first
        reached ``loss`` or lower; ``None``: never."""
        if direction not in ("up", "down", "both"):
            raise ValueError(f"direction must be 'up', 'down' or 'both', got {direction!r}")
        for point in self.curve:
            if point.eval_loss <= loss:
                return {"up": point.bytes_up, "down": point.bytes_down,
                        "both": point.bytes_up + point.bytes_down}[direction]
        return None

    def steps_to(self, loss: float) -> int | None:
        """Inner steps per site until an evaluation first reached ``loss`` or lower."""
        value = self._first(loss, "inner_steps")
        return None if value is None else int(value)

    def summary(self) -> dict[str, Any]:
        """``summary.json``: provenance, totals and the real runtime."""
        return {
            "format": SUMMARY_FORMAT,
            "version": self.version,
            "commit": self.commit,
            "commit_dirty": self.config.get("commit_dirty"),
            "totals": self.totals,
            "runtime_s": self.runtime_s,
        }

    def save(self, folder: Path) -> Path:
        """Write the run folder (config, every record, then the summary that marks it finished)."""
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / CONFIG_FILE, self.config)
        with (folder / METRICS_FILE).open("w") as out:
            for record in self.records:
                out.write(json.dumps(record) + "\n")
        self.write_summary(folder)
        self.folder = folder
        return folder

    def write_summary(self, folder: Path) -> None:
        """Write ``summary.json`` atomically: a folder with one holds a complete run."""
        _write_json(folder / SUMMARY_FILE, self.summary())

    @classmethod
    def load(cls, folder: Path) -> RunResult:
        """Read a finished run folder back (``ValueError`` naming the file when one is missing or bad)."""
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
            summary = json.loads((folder / SUMMARY_FILE).read_text())
            records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines() if line]
        except FileNotFoundError as err:
            missing = Path(str(err.filename)).name
            raise ValueError(f"{folder}: not a finished run folder, {missing} is missing") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{folder}: unreadable run file: {err}") from None
        if not isinstance(summary, dict) or summary.get("format") != SUMMARY_FORMAT:
            raise ValueError(f"{folder / SUMMARY_FILE}: unknown summary format, expected {SUMMARY_FORMAT}")
        return cls(config=config, records=records, runtime_s=float(summary.get("runtime_s", 0.0)), folder=folder)


def is_finished(folder: Path) -> bool:
    """Whether ``folder`` holds a finished run (its summary is written last, atomically)."""
    try:
        return json.loads((folder / SUMMARY_FILE).read_text()).get("format") == SUMMARY_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# -- running ---------------------------------------------------------------------------------------


def require_tensorboard(source: str, key: str) -> None:
    """Fail with a config error naming ``key`` when the ``tensorboard`` package is missing, before
    a run starts rather than after it trained."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigFileError(
            source, key, "TensorBoard output needs the `tensorboard` package: pip install 'geoloco[tensorboard]'"
        ) from None


def run(
    config: Mapping[str, Any] | Path | str,
    *,
    overrides: Sequence[str] = (),
    out: Path | None = None,
    on_record: Callable[[Any], None] | None = None,
    tensorboard: Path | None = None,
) -> RunResult:
    """Run the simulator on ``config`` and return the finished run.

    ``config`` is a simulate TOML file or the same thing as a dict (``[workload]`` included);
    ``overrides`` are ``--set`` texts (``"algorithm.inner_steps=50"``). With ``out`` the run
    folder is written as the run goes (records flushed per round, the summary last).
    ``on_record`` sees every ``RoundRecord`` (progress bars). With ``tensorboard`` each record's
    scalars also go to TensorBoard event files in that folder, stepped by cumulative inner steps
    (``geoloco.coordinator.tensorboard``). Bad config: ``ConfigFileError``.
    """
    from geoloco.algorithms.config import ConfigError
    from geoloco.algorithms.simulator import Simulator

    if isinstance(config, (str, Path)):
        source, raw = str(config), read_toml(Path(config))
    else:
        source, raw = COMMAND_LINE, dict(config)
    spec, sim_config = load_run_config(prepare_raw(raw, overrides, source), source)
    if tensorboard is not None:
        require_tensorboard(source, "tensorboard")
    try:
        workload = spec.build()
    except ValueError as err:  # e.g. the GPT corpus is missing
        raise ConfigFileError(source, "workload", str(err)) from None
    try:
        simulator = Simulator(sim_config, workload)
    except ConfigError as err:
        raise from_config_error(source, err) from None
    resolved = {**resolved_config(spec.name, workload, sim_config, str(simulator.device)), **provenance()}
    return record_run(resolved, simulator.run(), out=out, on_record=on_record, tensorboard=tensorboard)


def record_run(
    resolved: dict[str, Any],
    records: Iterable[Any],
    *,
    out: Path | None = None,
    on_record: Callable[[Any], None] | None = None,
    tensorboard: Path | None = None,
) -> RunResult:
    """Consume a simulator's records into a ``RunResult``; with ``out``, write the run folder as
    it goes (what ``geoloco simulate`` does too), and with ``tensorboard`` the records' scalars."""
    from geoloco.coordinator.tensorboard import TensorBoardWriter

    started = time.perf_counter()
    collected: list[dict[str, Any]] = []
    board = None if tensorboard is None else TensorBoardWriter(tensorboard, step_key="inner_steps_total")
    metrics = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / SUMMARY_FILE).unlink(missing_ok=True)  # a rerun into a folder is unfinished until done
        _write_json(out / CONFIG_FILE, resolved)
        metrics = (out / METRICS_FILE).open("w")
    try:
        for record in records:
            data = record.to_dict()
            collected.append(data)
            if metrics is not None:
                metrics.write(json.dumps(data) + "\n")
                metrics.flush()
            if board is not None:
                board.write(data)
            if on_record is not None:
                on_record(record)
    finally:
        if metrics is not None:
            metrics.close()
        if board is not None:
            board.close()
    result = RunResult(config=resolved, records=collected, runtime_s=time.perf_counter() - started)
    if out is not None:
        result.write_summary(out)
        result.folder = out
    return result
