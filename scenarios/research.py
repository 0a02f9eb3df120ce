"""Simulator runs as results: ``run(config) -> RunResult``, saved to and loaded from a run folder.

The simulator (``geoloco.algorithms.simulation.simulator``) yields round records and does no I/O; research
code wants the finished run instead: the resolved config with the package version and commit it
ran on, the evaluation curve against cumulative inner steps, bytes and virtual time, the totals,
and the step, byte and time cost of reaching a loss. A run folder holds ``config.json`` (the
resolved config), ``metrics.jsonl`` (one record per round, written as the run goes) and
``summary.json`` (totals, written last: its presence marks a finished run, which is what the
sweep runner resumes by). ``geoloco simulate --out`` writes the same folder.

The ``[research]`` table (``ResearchConfig``) sets up the process a run happens in: the plug-in
modules imported before the config is read (``geoloco.scenarios.plugins``) and the torch thread
count the run computes with. Results depend on both, so both are in ``config.json`` (with each
plug-in's source hash) and in a sweep run's identity.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.algorithms.config import RUN_TABLE, ConfigError, config_from_dict, config_to_dict, require
from geoloco.scenarios.config_file import COMMAND_LINE, ConfigFileError, from_config_error, read_toml
from geoloco.scenarios.overrides import apply_overrides, parse_override
from geoloco.scenarios.plugins import import_plugins, module_provenance, plugin_modules, workload_identity

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_THREADS",
    "METRICS_FILE",
    "RESEARCH_TABLE",
    "SECTIONS",
    "SUMMARY_FILE",
    "CurvePoint",
    "ResearchConfig",
    "RunConfig",
    "RunResult",
    "is_finished",
    "load_research_config",
    "load_run_config",
    "prepare_raw",
    "prepare_run",
    "provenance",
    "require_tensorboard",
    "resolved_config",
    "run",
    "run_identity",
    "torch_threads",
    "with_plugins",
]

logger = logging.getLogger(__name__)

SECTIONS = (
    "workload", "algorithm", "inner_optimizer", "outer_optimizer", "sites", RUN_TABLE, "simulation", "privacy",
    "regions", "coordinator_link", "update_guard", "research",
)
"""Top-level keys of a simulate config file."""
RESEARCH_TABLE = "research"
DEFAULT_THREADS = 1
"""``research.threads`` unless set: see ``ResearchConfig.threads`` for why one."""
CODE_PROVENANCE = ("version", "commit", "commit_dirty")
"""``config.json`` keys that say which geoloco code ran, not what ran: a resumed run may differ
in them (as a sweep's folder hash ignores the commit)."""
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_FORMAT = 1
"""Version of ``summary.json``'s layout, so a later reader can tell old folders apart."""

RUN_LENGTH_PAIRS = (("rounds", "total_inner_steps"), ("eval_every", "eval_every_steps"))
"""``[run]`` keys that say the same thing in rounds or in inner steps: exactly one of each pair
may be set, so an override of one replaces the file's other."""


# -- provenance ------------------------------------------------------------------------------------


def provenance(plugins: Sequence[str] = (), workload: Any = None) -> dict[str, Any]:
    """``{"version", "commit", "commit_dirty", "torch", "torch_threads", "plugins"}`` of the code
    that runs: the installed package's version, the git commit of the source folder when it is a
    git checkout (else ``None``), torch's version and the intra-op threads it computes with now,
    and each plug-in module's name, version and source hash (``plugin_modules``: the ``plugins``
    and a workload object's module), so a result can be traced to the code that produced it."""
    from importlib import metadata

    import torch

    try:
        version: str | None = metadata.version("geoloco")
    except metadata.PackageNotFoundError:
        version = None
    source = Path(__file__).resolve().parent
    commit = _git(source, "rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git(source, "status", "--porcelain", "--untracked-files=no"))
    return {
        "version": version, "commit": commit, "commit_dirty": dirty,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "plugins": [module_provenance(name) for name in plugin_modules(plugins, workload)],
    }


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# -- config ----------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ResearchConfig:
    """``[research]``: how the process a simulated run happens in is set up. Not training math,
    but the results depend on it: it is written into ``config.json`` and is part of a sweep
    run's identity (its folder name)."""

    plugins: list[str] = field(default_factory=list)
    """Modules imported before the rest of the config is read, in this process and in every
    worker a sweep or a tuner runs on: a plug-in registers its outer optimizers, codecs and
    workloads when imported (``geoloco.scenarios.plugins``). Each must be importable by name
    where it runs (installed, or on ``PYTHONPATH``; a sweep's local workers inherit this
    process's ``sys.path``, the Ray backend ships modules that are not installed)."""
    threads: int = DEFAULT_THREADS
    """torch intra-op threads the run computes with (set for the run, restored after). The
    order of float sums in matmuls follows the thread count, so losses differ in their last
    digits between counts. 1 unless set, on every machine and backend (``--jobs 1``, worker
    processes, Ray): a run then repeats bit for bit anywhere, and a sweep uses the cores by
    running runs side by side (``--jobs``), which scales better on the small research models
    than threads inside one run. Raise it for one big run on an otherwise idle machine."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        for i, name in enumerate(self.plugins):
            require(
                all(part.isidentifier() for part in name.split(".")),
                f"plugins[{i}]",
                f"a plug-in is an importable module name such as 'my_plugins.signsgd', got {name!r}",
            )
        require(len(set(self.plugins)) == len(self.plugins), "plugins", f"a module is listed twice: {self.plugins}")

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def load_research_config(raw: dict[str, Any], source: str) -> ResearchConfig:
    """The ``[research]`` table of a prepared dict (taken out of it), with its plug-ins imported
    into this process: a config's names of plug-in parts resolve only after that."""
    table = raw.pop(RESEARCH_TABLE, None)
    try:
        research = config_from_dict(ResearchConfig, {} if table is None else table, prefix=RESEARCH_TABLE)
    except ConfigError as err:
        raise from_config_error(source, err) from None
    import_plugins(research.plugins, source)
    return research


def with_plugins(raw: Mapping[str, Any], plugins: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` whose ``research.plugins`` also lists ``plugins`` (``--plugin``), each
    once, the file's first."""
    result = copy.deepcopy(dict(raw))
    if plugins:
        table = result.setdefault(RESEARCH_TABLE, {})
        if isinstance(table, dict):  # anything else: the schema says what is wrong
            known = table.get("plugins", [])
            if isinstance(known, list):
                table["plugins"] = list(dict.fromkeys([*known, *plugins]))
    return result


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch computes with ``threads`` intra-op threads inside the block; the process's count
    before it is restored after (``research.run`` may be one call of a longer session)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prepare_raw(raw: Mapping[str, Any], overrides: Sequence[str], source: str) -> dict[str, Any]:
    """A copy of the file's dict with ``--set`` overrides applied and the sections checked.

    An override of ``run.rounds`` drops the file's ``total_inner_steps`` (and the other
    pairs alike), so the command line wins over the file instead of setting both."""
    from geoloco.algorithms.simulation.simulator import SimulatorConfig

    prepared: dict[str, Any] = copy.deepcopy(dict(raw))
    overridden = {parse_override(text)[0] for text in overrides}
    overridden = {key.replace("simulation.", f"{RUN_TABLE}.", 1) for key in overridden}  # the old layout's
    for table in (prepared.get(RUN_TABLE), prepared.get("simulation")):
        if isinstance(table, dict):
            for a, b in RUN_LENGTH_PAIRS:
                for mine, other in ((a, b), (b, a)):
                    if f"{RUN_TABLE}.{mine}" in overridden and f"{RUN_TABLE}.{other}" not in overridden:
                        table.pop(other, None)
    apply_overrides(prepared, overrides, source, SimulatorConfig)
    unknown = sorted(set(prepared) - set(SECTIONS))
    if unknown:
        raise ConfigFileError(source, unknown[0], f"unknown section; allowed: {', '.join(SECTIONS)}")
    return prepared


def load_run_config(raw: dict[str, Any], source: str) -> tuple[Any, Any]:
    """``(WorkloadSpec, SimulatorConfig)`` from a prepared dict (``prepare_raw``); consumes it.
    A ``[research]`` table still in it is read first (``load_research_config``: its plug-ins are
    imported, so the names they register resolve) and dropped."""
    from geoloco.algorithms.simulation.simulator import SimulatorConfig
    from geoloco.scenarios.workloads import WORKLOAD_TABLE, parse_workload

    if RESEARCH_TABLE in raw:
        load_research_config(raw, source)
    try:
        workload = parse_workload(raw.pop(WORKLOAD_TABLE, None))
        config = SimulatorConfig.from_dict(raw)
    except ConfigError as err:
        raise from_config_error(source, err) from None
    return workload, config


@dataclass(frozen=True, slots=True)
class RunConfig:
    """A simulate config read for one run: ``prepare_run``'s result."""

    research: ResearchConfig
    workload: Any
    """The ``WorkloadSpec`` of the ``[workload]`` table; ``None`` when a workload object runs."""
    simulator: Any
    """The ``SimulatorConfig``."""


def prepare_run(
    raw: Mapping[str, Any], overrides: Sequence[str], source: str, *, workload: Any = None
) -> RunConfig:
    """Read a simulate config (a file's dict) with ``overrides`` as one run would: the plug-ins
    imported first, then every section checked. With a ``workload`` object the config must not
    have a ``[workload]`` table (one of the two says what trains). Bad config: ``ConfigFileError``."""
    from geoloco.scenarios.workloads import WORKLOAD_TABLE

    prepared = prepare_raw(raw, overrides, source)
    research = load_research_config(prepared, source)
    if workload is not None:
        check_workload_object(workload, source)
        if WORKLOAD_TABLE in prepared:
            raise ConfigFileError(
                source, WORKLOAD_TABLE,
                "both a workload object and a [workload] table say what trains: drop the table, or the object",
            )
    spec, simulator = load_run_config(prepared, source)
    return RunConfig(research=research, workload=None if workload is not None else spec, simulator=simulator)


def check_workload_object(workload: Any, source: str) -> None:
    """Refuse an object that does not implement ``geoloco.algorithms.workload.Workload``, naming
    what it lacks."""
    from geoloco.algorithms.workload import Workload

    if isinstance(workload, Workload):
        return
    needed = ("name", "build_model", "site_batches", "loss", "eval_loss")
    missing = [attr for attr in needed if not hasattr(workload, attr)]
    raise ConfigFileError(
        source, "workload",
        f"a workload object implements geoloco.algorithms.workload.Workload ({', '.join(needed)}); "
        f"{type(workload).__name__} lacks {', '.join(missing)}",
    )


def run_identity(research: ResearchConfig, workload: Any = None) -> dict[str, Any]:
    """What a run depends on beyond its config's text: the thread count it computes with, the
    source of its plug-ins, and a workload object. A sweep hashes it into each run folder's name,
    so a resumed sweep never mixes thread counts or plug-in versions."""
    return {
        "threads": research.threads,
        "plugins": [
            {key: p[key] for key in ("module", "source_sha256")}
            for p in (module_provenance(name) for name in plugin_modules(research.plugins, workload))
        ],
        "workload": None if workload is None else workload_identity(workload),
    }


def resolved_config(
    name: str, workload: Any, config: Any, device: str, research: ResearchConfig | None = None,
    *, custom_workload: bool = False,
) -> dict[str, Any]:
    """The full config as run: every default filled in, outer optimizer resolved, the
    ``[research]`` table (``research``, else its defaults); a ``custom_workload`` object's table
    is ``workload_identity`` (its class named too)."""
    from geoloco.algorithms.algorithm_config import DEFAULT_OUTER_OPTIMIZERS

    data: dict[str, Any] = config.to_dict()
    default_outer = DEFAULT_OUTER_OPTIMIZERS.get(config.algorithm.name, "nesterov")
    data["outer_optimizer"] = config.outer_optimizer.resolved(default_outer).to_dict()
    if custom_workload:
        data["workload"] = workload_identity(workload)
    else:
        workload_config = getattr(workload, "config", None)
        options = (
            dataclasses.asdict(workload_config)
            if dataclasses.is_dataclass(workload_config) and not isinstance(workload_config, type)
            else {}
        )
        data["workload"] = {"name": name, **options}
    data["resolved_device"] = device
    data["run_rounds"] = config.run_rounds
    data[RESEARCH_TABLE] = (research or ResearchConfig()).to_dict()
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
    """The resolved config (``resolved_config``) plus ``provenance()``: ``version``, ``commit``,
    ``commit_dirty``, ``torch``, ``torch_threads``, ``plugins``."""
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
    workload: Any = None,
    plugins: Sequence[str] = (),
    resume: bool = False,
) -> RunResult:
    """Run the simulator on ``config`` and return the finished run.

    ``config`` is a simulate TOML file or the same thing as a dict (``[workload]`` included);
    ``overrides`` are ``--set`` texts (``"algorithm.inner_steps=50"``). With ``out`` the run
    folder is written as the run goes (records flushed per round, the summary last).
    ``on_record`` sees every ``RoundRecord`` (progress bars). With ``tensorboard`` each record's
    scalars also go to TensorBoard event files in that folder, stepped by cumulative inner steps
    (``geoloco.protos.tensorboard``). Bad config: ``ConfigFileError``.

    ``workload`` trains an object implementing ``geoloco.algorithms.workload.Workload`` (any
    ``nn.Module`` and data) instead of the ``[workload]`` table's, which the config must then
    leave out. ``plugins`` adds modules to ``[research] plugins`` (imported first). The run
    computes with ``research.threads`` torch threads. With ``resume``, a finished run folder at
    ``out`` of the same run (the same resolved config, thread count and plug-in sources; the
    geoloco commit may differ) is loaded instead of run again; a finished folder of another run
    is refused rather than overwritten.
    """
    from geoloco.algorithms.simulation.async_sim import build_simulator

    if isinstance(config, (str, Path)):
        source, raw = str(config), read_toml(Path(config))
    else:
        source, raw = COMMAND_LINE, dict(config)
    prepared = prepare_run(with_plugins(raw, plugins), overrides, source, workload=workload)
    if tensorboard is not None:
        require_tensorboard(source, "tensorboard")
    with torch_threads(prepared.research.threads):
        if workload is None:
            name = prepared.workload.name
            try:
                workload = prepared.workload.build()
            except ValueError as err:  # e.g. the GPT corpus is missing
                raise ConfigFileError(source, "workload", str(err)) from None
            custom = False
        else:
            name, custom = workload.name, True
        try:
            # The round-by-round simulator, or the event-driven one for asynchronous merges or
            # chaos: a sweep or tune study runs the same simulator as `geoloco simulate`.
            simulator = build_simulator(prepared.simulator, workload)
        except ConfigError as err:
            raise from_config_error(source, err) from None
        resolved = {
            **resolved_config(name, workload, prepared.simulator, str(simulator.device), prepared.research,
                              custom_workload=custom),
            **provenance(prepared.research.plugins, workload if custom else None),
        }
        if resume and out is not None and is_finished(out):
            return _resumed(out, resolved)
        return record_run(resolved, simulator.run(), out=out, on_record=on_record, tensorboard=tensorboard)


def _resumed(out: Path, resolved: Mapping[str, Any]) -> RunResult:
    """The finished run in ``out`` when it is the run ``resolved`` describes; else a refusal
    naming the keys that differ."""
    done = RunResult.load(out)
    as_written = json.loads(json.dumps(dict(resolved)))  # tuples as lists, as config.json holds them
    mine = {k: v for k, v in as_written.items() if k not in CODE_PROVENANCE}
    theirs = {k: v for k, v in done.config.items() if k not in CODE_PROVENANCE}
    if mine == theirs:
        logger.info("run: %s already holds this finished run; loaded, not run again", out)
        return done
    differs = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    raise ConfigFileError(
        COMMAND_LINE, "out",
        f"{out} holds a finished run of another config (it differs in {', '.join(differs)}); "
        "give another out, or resume=False to run again into it",
    )


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
    from geoloco.protos.tensorboard import TensorBoardWriter

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
