"""``geoloco emulate SCENARIO.toml [--out DIR]``: a whole WAN experiment on this machine.

Starts one coordinator and one process per site, real gRPC with mutual TLS over loopback, each
site's link shaped by a userspace relay (bandwidth, latency, jitter, loss; ``shaping.py``) or, with
``--shaping kernel``, by tc in a network namespace per site (``netns.py``), fires
the scenario's faults on schedule, shows live progress and writes a report (``report.py``) into
the output folder. The scenario format is described in ``geoloco.scenarios.scenario`` and the
shipped ``scenarios/*.toml``.

Exit status: 0 when the run completed (or its time budget ran out), 2 for a bad scenario or
flag (the message names the file, the key and what is allowed; no process is started), 1 when a
process failed, 130 on Ctrl-C. Every child is stopped in every case; children also die with the
emulator if it is killed (parent-death signal).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from geoloco.scenarios.config_file import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RUNTIME_ERROR,
    ConfigFileError,
    report_config_error,
)
from geoloco.scenarios.overrides import add_set_argument, apply_overrides
from geoloco.scenarios.stop_signals import StopSignals

if TYPE_CHECKING:
    from geoloco.scenarios.netns import ShapingPlan

logger = logging.getLogger(__name__)

SHAPING_RELAY = "relay"
SHAPING_KERNEL = "kernel"
SCENARIO_DIR = Path(__file__).parent


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "emulate",
        help="run a scenario: coordinator + sites as real processes over shaped links, with a report",
        description=(
            "Emulate a geo-distributed run on this machine: the coordinator and one process per "
            "site talk real gRPC with mutual TLS through per-site shaped links (bandwidth, "
            "latency, jitter, loss); faults fire on schedule; progress is shown live; metrics, "
            f"summary.md and PNG plots go to the output folder. Shipped scenarios are in {SCENARIO_DIR} "
            "(the README's 'Shipped scenarios' says what each shows); a simulate or coordinator "
            "config there is refused, naming the command that runs it."
        ),
    )
    parser.add_argument("scenario", type=Path, metavar="SCENARIO.toml", help="scenario file")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/emulate-<name>-<UTC time>)")
    add_set_argument(parser)
    parser.add_argument(
        "--shaping",
        choices=[SHAPING_RELAY, SHAPING_KERNEL],
        default=SHAPING_RELAY,
        help="relay (default, portable): a userspace TCP relay per site shapes the link; kernel: "
        "each site in its own network namespace behind a veth pair shaped by tc (tbf for the "
        "rate, netem for latency, jitter and loss); needs root. What the machine lacks falls "
        "back to the relay, and the run says so (log line and summary.md)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only validate the scenario file and print what would run",
    )
    parser.set_defaults(handler=run)


def _default_out(scenario_path: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"emulate-{scenario_path.stem}-{stamp}"


def describe(scenario: object) -> list[str]:
    from geoloco.scenarios.scenario import Scenario

    assert isinstance(scenario, Scenario)
    run = scenario.run
    lines = [
        f"{scenario.workload_name} {scenario.workload_options}, {scenario.algorithm.name} "
        f"H={scenario.algorithm.inner_steps}, uplink {scenario.algorithm.uplink_codec}, "
        f"{run.rounds or 'unlimited'} rounds"
        + (f", time budget {run.time_budget_s:g} s" if run.time_budget_s else ""),
    ]
    for site in scenario.sites:
        lines.append(
            f"  site {site.name}: up {site.uplink_bps / 1e6:g} Mbit/s, down "
            f"{site.downlink_bps / 1e6:g} Mbit/s, latency {site.latency_s * 1000:g} ms, jitter "
            f"{site.jitter_s * 1000:g} ms, loss {site.loss:g}, speed {site.speed_factor:g}x"
        )
    for fault in scenario.faults:
        lines.append(f"  fault: {fault.describe()}")
    return lines


def run(args: argparse.Namespace) -> int:
    from geoloco.scenarios.config_kinds import SCENARIO, read_config
    from geoloco.scenarios.scenario import Scenario, parse_scenario

    try:
        raw = apply_overrides(read_config(args.scenario, (SCENARIO,))[0], args.overrides, str(args.scenario), Scenario)
        scenario = parse_scenario(raw, str(args.scenario))
    except ConfigFileError as err:
        return report_config_error("emulate", err)
    print(f"geoloco emulate: {args.scenario}")
    for line in describe(scenario):
        print(f"  {line}")
    # From here on a stop signal is handled: the shaping probe below already creates a namespace.
    stop = StopSignals().install()
    try:
        plan = shaping_plan(args.shaping)
        if args.check:
            print("scenario is valid (--check: nothing started)")
            return EXIT_OK
        out = args.out or _default_out(args.scenario)
        return emulate(scenario, out, log_level=args.log_level, shaping=plan, stop=stop)
    finally:
        stop.restore()


def shaping_plan(requested: str) -> ShapingPlan:
    """``--shaping``'s plan; for ``kernel`` what this machine allows is tried first, and a
    fallback is said in one line (and named in summary.md)."""
    from geoloco.scenarios.netns import choose_shaping, detect_support

    plan = choose_shaping(requested, detect_support() if requested == SHAPING_KERNEL else None)
    if plan.fallback:
        print(f"geoloco emulate: {plan.fallback}", file=sys.stderr)
    print(f"  link shaping: {plan.description}")
    return plan


def emulate(
    scenario: object,
    out: Path,
    *,
    log_level: str = "INFO",
    shaping: ShapingPlan | None = None,
    stop: StopSignals | None = None,
) -> int:
    """Run the emulation and write its report; ``stop``: the installed stop-signal handler
    (installed here when not given)."""
    from geoloco.scenarios.emulation import Emulation
    from geoloco.scenarios.progress import Progress
    from geoloco.scenarios.report import write_report

    if out.exists() and any(out.iterdir()):
        # A previous run's checkpoints would make the coordinator resume instead of start.
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.rmtree(out / "site-state", ignore_errors=True)  # the sites' too (site_state_dir)
    progress = Progress()
    # Both signals are handled explicitly, SIGINT included: Python installs its Ctrl-C handler only
    # when SIGINT is not ignored at start-up, and a shell without job control starts background
    # commands with SIGINT ignored; the emulator would then ignore Ctrl-C / ``kill -INT`` and
    # keep training until killed.
    own_stop = stop is None
    stop = stop or StopSignals().install()
    emulation = Emulation(
        scenario, out, progress=progress, log_level=log_level, shaping=shaping, stop=stop  # type: ignore[arg-type]
    )
    try:
        result = emulation.run()
    finally:
        if own_stop:
            stop.restore()
        emulation.shutdown()
    progress.close()
    print(f"geoloco emulate: {result.status}: {result.reason}")
    print(f"  wall-clock {result.wall_s:.1f} s, {len(result.records)} rounds aggregated")
    epsilon = next((r["epsilon"] for r in reversed(result.records) if r.get("epsilon") is not None), None)
    if epsilon is not None:
        from geoloco.algorithms.privacy.dp_accountant import describe_epsilon

        print(f"  privacy: {describe_epsilon(epsilon, result.scenario.privacy.delta)}")
    summary, fid = write_report(result)
    for line in fid.lines():
        print(f"  {line}")
    print(f"  report: {summary} (plots and metrics.jsonl next to it)")
    if result.status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_RUNTIME_ERROR
