"""Emulator: 2 regions x 3 sites behind relays vs the same 6 sites flat, the coordinator's link
shaped (``scenarios/regions.toml``; flat = the same file without its ``[[regions]]``).

    python benchmarks/bench_regions_emulated.py [--scenario scenarios/regions.toml] [--rounds N] [--out DIR]

Printed side by side, one row per run: mean round time (coordinator, rounds after the first),
coordinator egress and ingress payload bytes per round (its metrics, rounds after the first: the
first also carries each site's full-weights fetch), bytes through the shaped coordinator link
(wire, whole run), the two-tier clock's communication time per round for the same bytes
(``geoloco.algorithms.simulation.sim_regions``, compute left out), and the emulator-vs-simulator fidelity
check of ``geoloco emulate``'s report (measured / simulated communication time per link, mean;
with relays the links are each site's link to its relay and each relay's link).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from geoloco.algorithms.simulation.sim_regions import TwoTierClock
from geoloco.scenarios.emulation import Emulation
from geoloco.scenarios.report import fidelity
from geoloco.scenarios.scenario import Scenario, load_scenario


def _per_round(records: list[dict[str, Any]], key: str) -> float:
    rounds = [r for r in records if r.get("participants")][1:]
    return statistics.mean(sum(int(v) for v in r[key].values()) for r in rounds) if rounds else float("nan")


def _clock_comm_s(scenario: Scenario, records: list[dict[str, Any]], numel: int) -> float:
    """The two-tier clock's round time with no compute, for the bytes the run moved."""
    names = [s.name for s in scenario.sites]
    clock = TwoTierClock.from_specs(
        [s.clock_site() for s in scenario.sites], names, scenario.regions, scenario.coordinator_link
    )
    rounds = [r for r in records if r.get("participants")][1:]
    times = []
    for r in rounds:
        ups = [int(r["bytes_up"].get(n, 0)) for n in names]
        if scenario.regions:  # the sites' own uploads are not in the coordinator's metrics
            ups = [int(max(r["bytes_up"].values()))] * len(names)
        arrivals = clock.arrivals([0.0] * len(names), ups, numel)
        times.append(max(clock.ends(max(arrivals), int(r["downlink_bytes"]))))
    return statistics.mean(times) if times else float("nan")


def run(scenario: Scenario, out: Path) -> dict[str, Any]:
    result = Emulation(scenario, out).run()
    if not result.ok:
        raise SystemExit(f"{out}: {result.status}: {result.reason}")
    records = [r for r in result.records if r.get("participants")]
    round_times = [float(r["round_time_s"]) for r in records[1:] if r.get("round_time_s") is not None]
    fid = fidelity(result)
    # A float32 partial (upward_codec = "none") is 4 bytes a parameter: read the size back.
    numel = max((int(v) for r in records for v in r["bytes_up"].values()), default=0) // 4
    return {
        "round_s": statistics.mean(round_times) if round_times else float("nan"),
        "egress": _per_round(result.records, "bytes_down"),
        "ingress": _per_round(result.records, "bytes_up"),
        "link_wire": result.tier_bytes.get("coordinator", (0, 0)),
        "clock_s": _clock_comm_s(scenario, result.records, numel),
        "fidelity": fid.ratio,
        "fidelity_ok": fid.within_tolerance,
        "fidelity_lines": fid.lines(),
        "wall_s": result.wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=Path("scenarios/regions.toml"))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_regions"))
    args = parser.parse_args(argv)
    relayed = load_scenario(args.scenario)
    if args.rounds is not None:
        relayed.run.rounds = args.rounds
    flat = dataclasses.replace(relayed, regions=[])
    rows = {"flat": run(flat, args.out / "flat"), "relays": run(relayed, args.out / "relays")}
    link = relayed.coordinator_link
    print(
        f"{args.scenario}: {len(relayed.sites)} sites, {len(relayed.regions)} regions, coordinator link "
        f"{(link.ingress_bps or 0) / 1e6:g}/{(link.egress_bps or 0) / 1e6:g} Mbit/s in/out, {relayed.run.rounds} rounds"
    )
    print(
        f"{'':8} {'round s':>8} {'x flat':>7} {'egress B/round':>15} {'x flat':>7} {'ingress B/round':>16} "
        f"{'link wire out B':>16} {'clock comm s':>13} {'fidelity':>9} {'wall s':>7}"
    )
    base = rows["flat"]
    for name, r in rows.items():
        print(
            f"{name:8} {r['round_s']:>8.2f} {r['round_s'] / base['round_s']:>7.3f} {r['egress']:>15,.0f} "
            f"{r['egress'] / base['egress']:>7.3f} {r['ingress']:>16,.0f} {r['link_wire'][1]:>16,} "
            f"{r['clock_s']:>13.3f} {r['fidelity']:>8.2f}{'' if r['fidelity_ok'] else '*'} {r['wall_s']:>7.1f}"
        )
    print(f"relays / sites = {len(relayed.regions) / len(relayed.sites):.3f}; * = fidelity outside tolerance")
    for name, r in rows.items():
        print(f"-- fidelity, {name}")
        print("\n".join(r["fidelity_lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
