"""``geoloco simulate``: run the single-process simulator from a TOML file and flags.

The file's sections map one to one onto ``geoloco.algorithms.simulation.simulator.SimulatorConfig``
(``[algorithm]``, ``[inner_optimizer]``, ``[outer_optimizer]``, ``[sites]`` or ``[[sites]]``,
``[simulation]``), ``[run]`` (the run's length, seed and round policy, which ``SimulatorConfig``
keeps in ``simulation``) and ``[workload]`` (``name`` and the workload's options). See the shipped
``simulate.toml`` for every key with a comment. A bad value exits with status 2 and a message
naming the file, the key and what is allowed — never a traceback; a file of another kind (an
emulate scenario, a coordinator config) is refused naming the command that runs it
(``geoloco.scenarios.config_kinds``).

Outputs under ``--out``, a run folder ``geoloco.scenarios.research.RunResult.load`` reads back:
``metrics.jsonl`` (one JSON object per round, written as the run goes), ``config.json`` (the
fully resolved config, with the package version and git commit) and ``summary.json`` (totals,
written last); a summary table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from geoloco.algorithms.config import RUN_TABLE
from geoloco.scenarios.config_file import (
    COMMAND_LINE,
    ConfigFileError,
    from_config_error,
    positive_int,
    report_config_error,
    toml_text,
)
from geoloco.scenarios.config_kinds import SIMULATE, read_config
from geoloco.scenarios.overrides import add_set_argument
from geoloco.scenarios.plugins import add_plugin_argument
from geoloco.scenarios.progress import human_bytes
from geoloco.scenarios.research import (
    CONFIG_FILE,
    METRICS_FILE,
    SECTIONS,
    SUMMARY_FILE,
    ResearchConfig,
    load_research_config,
    load_run_config,
    prepare_raw,
    provenance,
    record_run,
    require_tensorboard,
    resolved_config,
    torch_threads,
    with_plugins,
)

logger = logging.getLogger(__name__)

__all__ = ["EXAMPLE_CONFIG", "SECTIONS", "config_file_text", "load_config", "register", "resolved_config", "run"]

EXAMPLE_CONFIG = Path(__file__).with_name("simulate.toml")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="run sites in one process on a virtual network clock (algorithm research)",
        description=(
            "Simulate N sites training one model with a DiLoCo-family algorithm (or the ddp "
            "baseline) in one process. Compute and transfers advance a virtual clock "
            "(latency + bytes/bandwidth per link, step time x speed factor per site), so sweeps "
            f"over many sites run fast. Example config with every key documented: {EXAMPLE_CONFIG}"
        ),
    )
    parser.add_argument("--config", type=Path, help="TOML config file (default: built-in defaults)")
    parser.add_argument("--workload", help="workload name, overrides [workload] name (gpt, mlp)")
    parser.add_argument("--rounds", type=positive_int, help="overrides [run] rounds")
    parser.add_argument("--sites", type=positive_int, help="number of identical sites, overrides [sites] count")
    parser.add_argument("--seed", type=int, help="overrides [run] seed")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="overrides [simulation] device")
    add_set_argument(parser)
    add_plugin_argument(parser)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the fully resolved config (every default filled in) as a TOML file that "
        "--config reads back, and exit",
    )
    parser.add_argument(
        "--out", type=Path, help="output folder (default: runs/simulate-<UTC time>)"
    )
    parser.add_argument(
        "--tensorboard", type=Path, nargs="?", const=Path(), metavar="DIR",
        help="also write each round's scalars (losses, bytes, utilization, epsilon) as TensorBoard "
        "events, stepped by inner steps, into DIR (default: OUT/tensorboard); needs "
        "`pip install 'geoloco[tensorboard]'`",
    )
    parser.set_defaults(handler=run)


def _apply_flags(raw: dict[str, Any], args: argparse.Namespace, source: str) -> None:
    """Fold the command-line overrides into the raw config dict (flags win over the file)."""
    for flag, table_name in (("rounds", RUN_TABLE), ("seed", RUN_TABLE), ("device", "simulation")):
        value = getattr(args, flag)
        if value is None:
            continue
        table = raw.setdefault(table_name, {})
        if not isinstance(table, dict):
            raise ConfigFileError(source, table_name, f"expected a [{table_name}] table")
        old = raw.get("simulation")
        if table_name == RUN_TABLE and isinstance(old, dict):
            old.pop(flag, None)  # the file's old layout ([simulation] rounds): the flag wins
        table[flag] = value
    if args.rounds is not None:
        for table in (raw.get(RUN_TABLE), raw.get("simulation")):
            if isinstance(table, dict):
                table.pop("total_inner_steps", None)  # the flag wins over the file's run length
    if args.workload is not None:
        workload = raw.setdefault("workload", {})
        if not isinstance(workload, dict):
            raise ConfigFileError(source, "workload", "expected a [workload] table")
        if workload.get("name", args.workload) != args.workload:
            # Options of one workload mean nothing to another.
            raw["workload"] = {"name": args.workload}
        else:
            workload["name"] = args.workload
    if args.sites is not None:
        sites = raw.get("sites")
        if isinstance(sites, list):
            raise ConfigFileError(
                source,
                "sites",
                "--sites cannot resize an explicit [[sites]] list; edit the list, or use a "
                "[sites] table with count",
            )
        sites = dict(sites) if isinstance(sites, dict) else {}
        sites["count"] = args.sites
        raw["sites"] = sites


def load_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(WorkloadSpec, SimulatorConfig)`` from ``--config`` and the flags."""
    return _load(args)[1:]


def _load(args: argparse.Namespace) -> tuple[ResearchConfig, Any, Any]:
    """``(ResearchConfig, WorkloadSpec, SimulatorConfig)`` from ``--config`` and the flags, the
    plug-ins imported before the rest is read."""
    source = str(args.config) if args.config is not None else COMMAND_LINE
    raw = read_config(args.config, (SIMULATE,))[0] if args.config is not None else {}
    raw = with_plugins(prepare_raw(raw, getattr(args, "overrides", []), source), getattr(args, "plugins", []))
    _apply_flags(raw, args, source)
    research = load_research_config(raw, source)
    workload, config = load_run_config(raw, source)
    return research, workload, config


def config_file_text(resolved: dict[str, Any]) -> str:
    """``--print-config``: a ``resolved_config`` as a simulate file that ``--config`` reads back
    to the same config. The device ``auto`` resolved to and the run length in rounds are derived,
    not keys of the file (the file would be refused with them), so they are comments on top."""
    from geoloco.algorithms.simulation.sim_config import SIMULATE_RUN

    table = dict(resolved)
    device = table.pop("resolved_device")
    rounds = table.pop("run_rounds")
    asked = table["simulation"]["device"]
    table = SIMULATE_RUN.lower(table)
    return toml_text(
        table,
        comments=[
            "geoloco simulate --print-config: the resolved config, every default filled in.",
            "Run it with `geoloco simulate --config FILE`. A key left out is unset (TOML has no null).",
            f'Resolved: runs on {device} (simulation.device = "{asked}"), {rounds} rounds.',
        ],
    )


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigFileError as err:
        return report_config_error("simulate", err)


def _run(args: argparse.Namespace) -> int:
    source = str(args.config) if args.config is not None else COMMAND_LINE
    research, spec, config = _load(args)
    with torch_threads(research.threads):
        return _simulate(args, source, research, spec, config)


def _simulate(args: argparse.Namespace, source: str, research: ResearchConfig, spec: Any, config: Any) -> int:
    from tqdm import tqdm

    from geoloco.algorithms.config import ConfigError
    from geoloco.algorithms.privacy.dp_accountant import describe_epsilon
    from geoloco.algorithms.simulation.async_sim import build_simulator

    name = spec.name
    try:
        workload = spec.build()
    except ValueError as err:  # e.g. the GPT corpus is missing
        raise ConfigFileError(source, "workload", str(err)) from None
    if args.print_config:
        from geoloco.algorithms.device import resolve_device

        try:
            device = resolve_device(config.simulation.device, "simulation.device")
        except ConfigError as err:
            raise from_config_error(source, err) from None
        print(config_file_text(resolved_config(name, workload, config, str(device), research)), end="")
        return 0
    try:
        simulator = build_simulator(config, workload)  # event-driven for asynchronous merges or chaos
    except ConfigError as err:
        raise from_config_error(source, err) from None

    out = args.out or Path("runs") / datetime.now(timezone.utc).strftime("simulate-%Y%m%d-%H%M%S")
    board = getattr(args, "tensorboard", None)
    if board is not None:
        require_tensorboard(COMMAND_LINE, "--tensorboard")
        board = out / "tensorboard" if board == Path() else board
    resolved = {**resolved_config(name, workload, config, str(simulator.device), research),
                **provenance(research.plugins)}

    sim = config.simulation
    algo = config.algorithm
    logger.info(
        "simulating %s on %s: %d sites, up to %d rounds of H=%d, writing to %s",
        algo.name, name, len(config.sites), config.run_rounds, algo.inner_steps, out,
    )
    last_eval: float | None = None
    last: Any = None
    compute_total = [0.0] * len(config.sites)
    peak_in_flight = 0
    event_driven = config.event_driven
    total = None if event_driven and sim.max_wall_clock_s is not None else config.run_rounds
    with tqdm(total=total, file=sys.stderr, unit="round", desc="simulate") as progress:

        def on_record(record: Any) -> None:
            nonlocal last, last_eval, compute_total, peak_in_flight
            last = record
            if not event_driven:  # an event-driven record holds only its merge's sites
                compute_total = [c + r for c, r in zip(compute_total, record.compute_s.values(), strict=True)]
            peak_in_flight = max([peak_in_flight, *(record.peak_bytes_in_flight or {}).values()])
            if record.eval_loss is not None:
                last_eval = record.eval_loss
            if record.phase == "train":
                progress.update(1)
            postfix = {"train": f"{record.train_loss:.4f}"}
            if last_eval is not None:
                postfix["eval"] = f"{last_eval:.4f}"
            progress.set_postfix(postfix)

        result = record_run(resolved, simulator.run(), out=out, on_record=on_record, tensorboard=board)
    runtime = result.runtime_s
    assert last is not None  # rounds >= 1 is validated

    n = len(config.sites)
    if event_driven:
        print("geoloco simulate: summary")
        print(summary_table(_event_driven_rows(simulator, result.records, last, name, out, board, runtime)))
        return 0
    utilization = [c / last.wall_clock_s if last.wall_clock_s > 0 else 1.0 for c in compute_total]
    rows = [
        ("workload", f"{name} ({simulator.layout.numel:,} parameters)"),
        ("algorithm", f"{algo.name}, H={algo.inner_steps}, {n} sites, "
                      f"uplink {algo.uplink_codec}, downlink {algo.downlink_codec}"),
        *([("streaming", f"{algo.streaming.fragments} fragments, one synced every "
                          f"{simulator.strategy.inner_steps} steps, overlap "
                          f"{algo.streaming.overlap_steps} steps, mix {algo.streaming.mix:g}")]
          if algo.streaming.enabled else []),
        ("rounds", f"{last.round + 1}" + (
            f" (target eval loss {sim.target_eval_loss} reached)"
            if sim.target_eval_loss is not None and last_eval is not None
            and last_eval <= sim.target_eval_loss else "")),
        ("final eval loss", "n/a" if last_eval is None else f"{last_eval:.4f}"),
        ("final train loss", f"{last.train_loss:.4f}"),
        *([("privacy", describe_epsilon(last.epsilon, config.privacy.delta))] if last.epsilon is not None else []),
        ("bytes up (total)", human_bytes(last.bytes_up_total)),
        ("bytes down (total)", human_bytes(last.bytes_down_total)),
        ("virtual wall-clock", f"{last.wall_clock_s:.2f} s"),
        ("compute utilization", f"{100 * sum(utilization) / n:.1f} % mean, "
                                f"{100 * min(utilization):.1f} % min over sites"),
        ("peak bytes in flight", human_bytes(peak_in_flight) + " per site (largest transfer)"),
        ("real runtime", f"{runtime:.1f} s on {simulator.device}"),
        ("inner steps per site", f"{last.inner_steps_total}"),
        ("output", f"{out}/{METRICS_FILE}, {out}/{CONFIG_FILE}, {out}/{SUMMARY_FILE}"
                   + (f", TensorBoard events in {board}" if board is not None else "")),
    ]
    print("geoloco simulate: summary")
    print(summary_table(rows))
    return 0


def _event_driven_rows(
    simulator: Any, records: list[dict[str, Any]], last: Any, name: str, out: Path, board: Path | None,
    runtime: float,
) -> list[tuple[str, str]]:
    """The summary of an event-driven run (asynchronous merges or chaos): merges, goodput,
    global downtime, staleness and what the sites held in memory."""
    config = simulator.config
    sim, algo = config.simulation, config.algorithm
    merge = algo.asynchronous
    grace = "adaptive grace window" if merge.adaptive_grace else f"grace {merge.grace_window_s:g} s"
    mode = (
        f"asynchronous: min_quorum {merge.min_quorum}, {grace}"
        + (", dynamic local updates" if merge.dynamic_local_updates else "")
        + (", rebase" if merge.rebase else "")
        if merge.enabled
        else f"synchronous rounds, on failure: {sim.chaos.sync_on_failure}"
    )
    staleness = [v for record in records for v in (record.get("staleness") or {}).values()]
    lost = simulator.ledger.lost_by_reason
    memory = simulator.memory()
    per_site = memory["site_state_bytes"]
    return [
        ("workload", f"{name} ({simulator.layout.numel:,} parameters)"),
        ("algorithm", f"{algo.name}, H={algo.inner_steps}, {len(config.sites)} sites, outer "
                      f"{simulator.strategy.outer_optimizer_config.name}, uplink {algo.uplink_codec}"),
        ("mode", mode),
        ("merges", f"{sum(1 for r in records if r.get('participants'))}"),
        ("final eval loss", "n/a" if last.eval_loss is None else f"{last.eval_loss:.4f}"),
        ("goodput", f"{100 * simulator.ledger.goodput:.1f} % of inner steps reached the model "
                    f"({simulator.ledger.useful_steps} useful, "
                    + (", ".join(f"{v} {k}" for k, v in lost.items() if v) or "none") + " lost)"),
        ("global downtime", f"{last.global_downtime_s or 0.0:.2f} s of {simulator.clock_s:.2f} s virtual"),
        ("staleness", "n/a" if not staleness else
                      f"{sum(staleness) / len(staleness):.2f} mean, {max(staleness)} max (merges behind)"),
        ("bytes up (total)", human_bytes(last.bytes_up_total)),
        ("bytes down (total)", human_bytes(last.bytes_down_total)),
        ("memory", f"{human_bytes(per_site) if per_site is not None else 'n/a'} per site up (optimizer "
                   f"state + residual), {memory['peak_site_states']} sites at once, "
                   f"{memory['peak_versions']} global versions, {memory['peak_uploads_in_flight']} uploads "
                   "in flight at the peak"),
        ("real runtime", f"{runtime:.1f} s on {simulator.device}"),
        ("output", f"{out}/{METRICS_FILE}, {out}/{CONFIG_FILE}, {out}/{SUMMARY_FILE}"
                   + (f", TensorBoard events in {board}" if board is not None else "")),
    ]
