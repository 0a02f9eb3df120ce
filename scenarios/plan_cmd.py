"""``geoloco plan``: predict a run's wall clock, utilization, traffic and memory without training.

Two ways to describe the run:

- a config file of the run, whichever command runs it (``geoloco.scenarios.config_kinds``): an
  emulator scenario (``geoloco plan scenarios/quickstart.toml --step-time 0.2``) or a simulate
  file (``geoloco plan scenarios/simulate.toml``; its ``step_time_s`` is the default step time)
  bring their sites, links, algorithm, round policy and rounds; a coordinator file
  (``geoloco plan scenarios/coordinator.toml --link 100mbit,40ms --step-time 0.2``) brings all
  but the links, which the flags give (its ``allowed_sites`` name the sites). The parameter count
  comes from building the file's workload's model (or ``--params``). A relay file is refused,
  naming ``geoloco relay``;
- flags (``geoloco plan --params 1e9 --sites 8 --link 1gbit,50ms --step-time 0.5 --algorithm
  diloco --inner-steps 500 --codec int8 --total-steps 50000``).

``--compare diloco,streaming,ddp`` plans the same sites and the same inner steps per site with
each algorithm and prints them side by side. The numbers come from
``geoloco.algorithms.simulation.planner`` (the simulator's clock; see its docstring for what is assumed).
Bad input exits with status 2 and a message naming the flag or key and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geoloco.scenarios.config_file import (
    COMMAND_LINE,
    ConfigFileError,
    from_config_error,
    positive_int,
    report_config_error,
)
from geoloco.scenarios.config_kinds import COORDINATOR, SCENARIO, SIMULATE, read_config
from geoloco.scenarios.progress import human_bytes, human_seconds

if TYPE_CHECKING:  # torch; `geoloco --help` stays fast without it
    from geoloco.algorithms.simulation.clock import SiteConfig
    from geoloco.algorithms.simulation.sim_regions import TwoTierClock
    from geoloco.algorithms.training import TrainingConfig
    from geoloco.scenarios.workloads import WorkloadSpec

PLAN_ALGORITHMS = ("diloco", "streaming", "fedavg", "fedopt", "ddp")
"""``--algorithm`` / ``--compare`` names: the simulator's algorithms plus ``streaming``
(Streaming DiLoCo: diloco with ``[algorithm.streaming] enabled``)."""

_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict wall clock, utilization, bytes per link and memory of a run, without training",
        description=(
            "Predict a run with the simulator's virtual clock (latency + bytes/bandwidth per link, "
            "step time / speed factor per site, the real round policy and the codecs' exact sizes) "
            "without training: per-round and total wall clock, compute utilization per site, bytes "
            "per link and peak memory per process. Describe the run with a config file (an "
            "emulate scenario, a simulate or a coordinator config) or flags."
        ),
    )
    parser.add_argument("config", nargs="?", type=Path, metavar="CONFIG.toml",
                        help="the run's config file: an emulate scenario or a simulate file (sites, "
                        "links, algorithm, rounds), or a coordinator config (links from the flags)")
    parser.add_argument("--config", dest="config_flag", type=Path, metavar="CONFIG.toml",
                        help="the same file, spelled as the other commands take it")
    parser.add_argument("--params", type=_count, help="parameter count, e.g. 1e9, 124M, 1.3B "
                        "(default with a config file: its workload's model)")
    parser.add_argument("--step-time", type=_step_time, metavar="SECONDS|measure",
                        help="seconds per inner step at speed_factor 1, or 'measure' (time the "
                        "config file's workload's steps on this machine; an emulate scenario's as "
                        "the emulator runs them: every site's process at once, each at its speed "
                        "factor); default with a simulate file: its simulation.step_time_s")
    parser.add_argument("--sites", type=positive_int,
                        help="number of identical sites (flags or a coordinator file; default: the "
                        "coordinator file's allowed_sites, else 8)")
    parser.add_argument("--link", action="append", metavar="BANDWIDTH,LATENCY",
                        help="link of every site (once) or of each site (once per site), both "
                        "directions: e.g. 1gbit,50ms or 100mbit,0.03s (default 1gbit,50ms)")
    parser.add_argument("--speed-factors", type=_float_list, metavar="F,F,...",
                        help="compute speed of each site relative to the reference (default all 1)")
    parser.add_argument("--algorithm", choices=PLAN_ALGORITHMS, help="default diloco (or the config file's)")
    parser.add_argument("--inner-steps", type=positive_int, help="H (default 500, or the config file's)")
    parser.add_argument("--codec", help="codec both ways, e.g. int8, topk:0.01|int4 (default none)")
    parser.add_argument("--uplink-codec", help="uplink codec (overrides --codec)")
    parser.add_argument("--downlink-codec", help="downlink codec (overrides --codec)")
    parser.add_argument("--ddp-codec", default="none",
                        help="the ddp baseline's codec in --compare (default none: fp32 gradients)")
    parser.add_argument("--fragments", type=positive_int,
                        help="Streaming DiLoCo fragments P (default the config file's, else 4)")
    parser.add_argument("--overlap-steps", type=int,
                        help="Streaming DiLoCo overlap steps (default the config file's, else min(5, H/P))")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--rounds", type=positive_int, help="rounds to plan (default the config file's)")
    length.add_argument("--total-steps", type=positive_int,
                        help="inner steps per site over the run; rounds = ceil(steps / steps per round)")
    parser.add_argument("--compare", type=_algorithm_list, metavar="A,B,...",
                        help=f"plan each of these side by side ({', '.join(PLAN_ALGORITHMS)})")
    parser.add_argument("--json", action="store_true", help="print the plan(s) as JSON instead of tables")
    parser.set_defaults(handler=run)


# -- argument parsing ------------------------------------------------------------------------------


def _count(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match or float(match.group(1)) * _COUNT_SUFFIX[match.group(2)] < 1:
        raise argparse.ArgumentTypeError(f"expected a parameter count >= 1 such as 1e9, 124M or 1.3B, got {text!r}")
    return int(float(match.group(1)) * _COUNT_SUFFIX[match.group(2)])


def _step_time(text: str) -> float | str:
    if text == "measure":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'measure', got {text!r}")
    return value


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, e.g. 1,0.5, got {text!r}")
    return values


def _algorithm_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PLAN_ALGORITHMS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {bad[0] if bad else text!r}; allowed: {', '.join(PLAN_ALGORITHMS)}"
        )
    return names


def parse_link(text: str) -> tuple[float, float]:
    """``"1gbit,50ms"`` -> ``(1e9 bit/s, 0.05 s)``; raises ``ConfigFileError`` naming ``--link``."""
    parts = [p.strip().lower() for p in text.split(",")]
    bandwidth = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)(?:/s|ps)?", parts[0])
    latency = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-z]*)", parts[1]) if len(parts) == 2 else None
    if (
        bandwidth is None or latency is None
        or (bandwidth.group(2) or "bit") not in _BANDWIDTH_UNITS
        or (latency.group(2) or "s") not in _LATENCY_UNITS
    ):
        raise ConfigFileError(
            COMMAND_LINE, "--link",
            f"expected BANDWIDTH,LATENCY such as 1gbit,50ms or 1e8,0.03 (bandwidth units: "
            f"{', '.join(_BANDWIDTH_UNITS)}; latency units: {', '.join(_LATENCY_UNITS)}), got {text!r}",
        )
    bps = float(bandwidth.group(1)) * _BANDWIDTH_UNITS[bandwidth.group(2) or "bit"]
    seconds = float(latency.group(1)) * _LATENCY_UNITS[latency.group(2) or "s"]
    if bps <= 0:
        raise ConfigFileError(COMMAND_LINE, "--link", f"bandwidth must be > 0, got {text!r}")
    return bps, seconds


# -- the run's config file -------------------------------------------------------------------------

PLANNABLE = (SCENARIO, SIMULATE, COORDINATOR)
"""The config files ``geoloco plan`` reads (``geoloco.scenarios.config_kinds``); a file whose
keys do not tell which it is is read as a scenario."""


@dataclass(frozen=True, slots=True)
class RunFile:
    """What a config file says about the run to plan, whichever command's file it is."""

    source: str
    kind: str
    """``scenario``, ``simulate`` or ``coordinator``."""
    training: TrainingConfig
    """Algorithm, optimizers, privacy, round policy, seed and run length (``rounds`` 0: none)."""
    workload: WorkloadSpec
    sites: list[SiteConfig] | None
    """The file's sites on the planner's clock; ``None`` for a coordinator file, which names no
    links (the flags describe them)."""
    site_names: list[str] = field(default_factory=list)
    """A coordinator file's ``allowed_sites``: the names of the flags' sites."""
    step_time_s: float | str | None = None
    """A simulate file's ``simulation.step_time_s``: ``--step-time``'s default, so the plan
    reproduces ``geoloco simulate``'s clock."""
    faults: int = 0
    """A scenario's ``[[faults]]``: the plan is of the same run without them (said in its header)."""
    tiers: TwoTierClock | None = None
    """``[[regions]]`` and ``[coordinator_link]``: the relays and the coordinator's shared link."""
    regions: list[str] = field(default_factory=list)
    """The regions' names, for the header."""


def load_run_file(path: Path) -> RunFile:
    """The run a scenario, simulate or coordinator file describes; ``ConfigFileError`` for any
    other file (naming the command that runs it) or a bad key."""
    raw, kind = read_config(path, PLANNABLE)
    source = str(path)
    if kind == SIMULATE:
        from geoloco.scenarios.research import load_run_config, prepare_raw

        workload, config = load_run_config(prepare_raw(raw, [], source), source)
        return RunFile(source, kind, config.training, workload, list(config.sites),
                       step_time_s=config.simulation.step_time_s, tiers=config.tier_clock(),
                       regions=[r.name for r in config.regions])
    if kind == COORDINATOR:
        from geoloco.scenarios.coordinator_cmd import parse_config

        coordinator, workload = parse_config(raw, source)
        return RunFile(source, kind, coordinator.training, workload, None, list(coordinator.allowed_sites or []))
    from geoloco.scenarios.scenario import parse_scenario

    scenario = parse_scenario(raw, source)
    return RunFile(
        source, kind, scenario.training, scenario.workload, [s.clock_site() for s in scenario.sites],
        faults=len(scenario.faults), tiers=scenario.tier_clock(), regions=[r.name for r in scenario.regions],
    )


# -- building the plans ----------------------------------------------------------------------------


def _sites(args: argparse.Namespace, run_file: RunFile | None) -> list[Any]:
    from geoloco.algorithms.simulation.clock import SiteConfig

    if run_file is not None and run_file.sites is not None:
        if args.sites is not None or args.link or args.speed_factors:
            raise ConfigFileError(
                COMMAND_LINE, "--sites/--link/--speed-factors",
                f"a {run_file.kind} file brings its own sites ([[sites]] or [sites]); edit the file or "
                "plan with flags only",
            )
        return run_file.sites
    names = run_file.site_names if run_file is not None else []
    count = args.sites or (len(args.link) if args.link and len(args.link) > 1 else len(names) or 8)
    links = [parse_link(text) for text in (args.link or ["1gbit,50ms"])]
    if len(links) not in (1, count):
        raise ConfigFileError(
            COMMAND_LINE, "--link", f"give one --link for all sites or one per site ({count}), got {len(links)}"
        )
    speeds = args.speed_factors or [1.0]
    if len(speeds) not in (1, count):
        raise ConfigFileError(
            COMMAND_LINE, "--speed-factors",
            f"give one factor for all sites or one per site ({count}), got {len(speeds)}",
        )
    if len(names) != count:
        names = [f"site-{k}" for k in range(count)]
    return [
        SiteConfig(
            name=names[k], uplink_bps=links[k % len(links)][0], downlink_bps=links[k % len(links)][0],
            latency_s=links[k % len(links)][1], speed_factor=speeds[k % len(speeds)],
        )
        for k in range(count)
    ]


def _algorithm_table(args: argparse.Namespace, base: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``[algorithm]`` table of one planned algorithm: ``base`` (the file's, or defaults)
    with the flags applied."""
    table = dict(base)
    table.pop("streaming", None)
    streaming = dict(base.get("streaming") or {})
    table["inner_steps"] = args.inner_steps or base.get("inner_steps", 500)
    for key, flag in (("uplink_codec", args.uplink_codec), ("downlink_codec", args.downlink_codec)):
        value = flag or args.codec
        if value is not None:
            table[key] = value
    if name == "ddp":
        table.update(name="ddp", uplink_codec=args.ddp_codec, downlink_codec=args.ddp_codec,
                     round_time_budget_s=None, warmup_steps=0, late_updates="drop")
        return table
    if name == "streaming":
        fragments = args.fragments or (streaming.get("fragments") if streaming.get("enabled") else None) or 4
        interval = max(1, table["inner_steps"] // fragments)
        overlap = args.overlap_steps
        if overlap is None:
            overlap = streaming["overlap_steps"] if streaming.get("enabled") else min(5, interval)
        table.update(name=base.get("name", "diloco") if base.get("name") != "ddp" else "diloco",
                     round_time_budget_s=None, late_updates="drop")
        table["streaming"] = {**streaming, "enabled": True, "fragments": fragments, "overlap_steps": overlap}
        return table
    table["name"] = name
    return table


def _training(args: argparse.Namespace, run_file: RunFile | None, name: str) -> Any:
    from geoloco.algorithms.algorithm_config import AlgorithmConfig
    from geoloco.algorithms.config import ConfigError, config_from_dict
    from geoloco.algorithms.optimizers import InnerOptimizerConfig, OuterOptimizerConfig
    from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
    from geoloco.algorithms.training import TrainingConfig

    base = (
        run_file.training.algorithm.to_dict() if run_file is not None
        else {"uplink_codec": "none", "downlink_codec": "none"}
    )
    try:
        algorithm = config_from_dict(AlgorithmConfig, _algorithm_table(args, base, name), prefix="algorithm")
    except ConfigError as err:
        raise from_config_error(COMMAND_LINE, err) from None
    if run_file is None:
        return TrainingConfig(
            algorithm=algorithm, inner_optimizer=InnerOptimizerConfig(),
            outer_optimizer=OuterOptimizerConfig(), privacy=PrivacyConfig(), rounds=1,
        )
    training = run_file.training
    outer = training.outer_optimizer if algorithm.name == training.algorithm.name else OuterOptimizerConfig()
    return dataclasses.replace(training, algorithm=algorithm, outer_optimizer=outer)


def _with_rounds(args: argparse.Namespace, training: Any, run_file: RunFile | None) -> Any:
    from geoloco.algorithms.simulation.planner import rounds_for_steps

    if args.total_steps is not None:
        rounds = rounds_for_steps(training, args.total_steps)
    elif args.rounds is not None:
        rounds = args.rounds
    elif run_file is not None and run_file.training.rounds:
        rounds = run_file.training.rounds
    else:
        raise ConfigFileError(
            COMMAND_LINE, "--rounds", "how long is the run? give --rounds or --total-steps"
            + (" (the scenario runs on a time budget: run.rounds = 0)"
               if run_file is not None and run_file.kind == SCENARIO else "")
        )
    return dataclasses.replace(training, rounds=rounds)


def _step_time_s(args: argparse.Namespace, run_file: RunFile | None, sites: list[SiteConfig]) -> tuple[float, str]:
    """``--step-time``, else a simulate file's ``step_time_s``; ``measure`` times the file's
    workload here (``geoloco.scenarios.step_timing``). Also says where the value came from."""
    value = args.step_time if args.step_time is not None else run_file.step_time_s if run_file else None
    if value is None:
        raise ConfigFileError(
            COMMAND_LINE, "--step-time",
            "give the seconds per inner step at speed_factor 1 (e.g. --step-time 0.5), or 'measure' "
            "to time a config file's workload here",
        )
    if value != "measure":
        return float(value), "given" if args.step_time is not None else "the file's simulation.step_time_s"
    if run_file is None:
        raise ConfigFileError(COMMAND_LINE, "--step-time", "'measure' times a config file's workload; give seconds")
    from geoloco.scenarios.step_timing import time_steps_alone, time_steps_together

    try:
        if run_file.kind == SCENARIO:  # every site will be a process on this machine
            timing = time_steps_together(run_file.workload, run_file.training, [s.speed_factor for s in sites])
        else:
            timing = time_steps_alone(run_file.workload, run_file.training, len(sites))
    except RuntimeError as err:
        raise ConfigFileError(COMMAND_LINE, "--step-time", f"could not measure it: {err}") from None
    return timing.seconds, timing.how


def build_plans(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """The plans the flags ask for, and what they were built from (for the header)."""
    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.simulation.planner import PlanError, plan

    if args.config is not None and args.config_flag is not None and args.config != args.config_flag:
        raise ConfigFileError(COMMAND_LINE, "--config", "give the config file once: as an argument or with --config")
    config = args.config if args.config is not None else args.config_flag
    run_file = load_run_file(config) if config is not None else None
    if run_file is None and args.params is None:
        raise ConfigFileError(
            COMMAND_LINE, "--params",
            "give the model size (e.g. --params 1e9) or a scenario, simulate or coordinator file",
        )
    sites = _sites(args, run_file)
    layout = None
    numel = args.params
    if run_file is not None and numel is None:
        layout = ParamLayout.from_model(run_file.workload.build().build_model(run_file.training.seed))
        numel = layout.numel
    step_time, step_time_source = _step_time_s(args, run_file, sites)
    algorithm = run_file.training.algorithm if run_file is not None else None
    default_name = "diloco" if algorithm is None else "streaming" if algorithm.streaming.enabled else algorithm.name
    names = args.compare or [args.algorithm or default_name]
    source = run_file.source if run_file is not None else COMMAND_LINE
    plans = []
    for name in names:
        training = _with_rounds(args, _training(args, run_file, name), run_file)
        try:
            plans.append(plan(
                training, numel=numel, sites=sites, step_time_s=step_time, layout=layout,
                tiers=run_file.tiers if run_file is not None else None,
            ))
        except (PlanError, ValueError) as err:
            raise ConfigFileError(source, f"algorithm {name}", str(err)) from None
    return plans, {
        "numel": numel, "sites": sites, "step_time_s": step_time, "step_time_source": step_time_source,
        "faults": run_file.faults if run_file is not None else 0,
        "tiers": run_file.tiers if run_file is not None else None,
        "regions": run_file.regions if run_file is not None else [],
    }


# -- output ----------------------------------------------------------------------------------------


def _shaped_rate(bps: float) -> str:
    return "unshaped" if math.isinf(bps) else _rate(bps)


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]


def _site_lines(p: Any, sites: list[Any]) -> list[str]:
    util = p.site_utilization()
    traffic = p.site_bytes()
    rows = [["site", "link (up / down, latency)", "speed", "util", "bytes up", "bytes down"]]
    for site, name in zip(sites, p.sites, strict=True):
        rows.append([
            name, f"{_rate(site.uplink_bps)} / {_rate(site.downlink_bps)}, {site.latency_s * 1000:g} ms",
            f"{site.speed_factor:g}", f"{util[name]:.1%}", human_bytes(traffic[name][0]), human_bytes(traffic[name][1]),
        ])
    return ["per site, whole run:", *_table(rows)]


def format_plans(plans: list[Any], info: dict[str, Any]) -> str:
    """What ``geoloco plan`` prints: one line per algorithm, per-site detail for a single plan, and
    each plan's peak-memory breakdown."""
    sites = info["sites"]
    lines = [
        f"plan: {info['numel']:,} parameters, {len(sites)} sites, {info['step_time_s']:.4g} s per inner "
        f"step at speed 1 ({info['step_time_source']}; virtual clock: latency + bytes/bandwidth, no training)",
    ]
    tiers = info.get("tiers")
    if tiers is not None:
        link = tiers.link
        through = f"relays {', '.join(info['regions'])}, then " if info["regions"] else ""
        lines.append(
            f"two tiers: sites -> {through}the coordinator's link ({_shaped_rate(link.ingress_bps)} in / "
            f"{_shaped_rate(link.egress_bps)} out, shared fairly by the transfers on it)"
        )
    if info["faults"]:
        lines.append(
            f"the scenario's {info['faults']} [[faults]] are not on the planner's clock: this is the same run "
            "without them (crashes, restarts and link outages add their recovery time)"
        )
    lines.append("")
    rows = [["algorithm", "syncs", "steps/site", "per sync", "total", "mean util", "up/site/sync",
             "down/site/sync", "site mem", "coord mem"]]
    for p in plans:
        train = p.train_rounds
        n = len(p.sites)
        # A sync is one exchange with the coordinator: a round, a fragment's round, a ddp step.
        syncs = sum(r.inner_steps if p.algorithm == "ddp" else 1 for r in train)
        up = sum(sum(r.bytes_up) for r in train) / max(1, syncs * n)
        down = sum(sum(r.bytes_down) for r in train) / max(1, syncs * n)
        util = p.site_utilization()
        rows.append([
            p.algorithm, str(syncs), str(p.inner_steps_total),
            human_seconds(sum(r.round_time_s for r in train) / max(1, syncs)),
            human_seconds(p.total_s), f"{sum(util.values()) / n:.1%}", human_bytes(up), human_bytes(down),
            human_bytes(p.memory.site_total), human_bytes(p.memory.coordinator_total),
        ])
    lines += _table(rows)
    for p in plans:
        lines.append("")
        if len(plans) > 1:
            lines.append(f"{p.algorithm}:")
        else:
            lines += _site_lines(p, sites)
        memory = p.memory
        lines.append("  peak memory per site:        " + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in memory.site.items() if v) + " (activations not included)")
        lines.append("  peak memory at coordinator:  " + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in memory.coordinator.items() if v))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plans, info = build_plans(args)
    except ConfigFileError as err:
        return report_config_error("plan", err)
    if args.json:
        print(json.dumps({
            "step_time_s": info["step_time_s"], "step_time_source": info["step_time_source"],
            "faults_left_out": info["faults"],
            "plans": [p.to_dict() for p in plans],
        }, indent=2))
    else:
        print(format_plans(plans, info))
    return 0
