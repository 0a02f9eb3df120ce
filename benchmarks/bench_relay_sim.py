"""Round time and coordinator bytes, flat vs regional relays, on the two-tier virtual clock
(``geoloco.algorithms.simulation.sim_regions``): the issue's 64 sites in 4 regions, coordinator link
1 Gbit/s, intra-region 10 Gbit/s, a 100M-parameter model's bytes with int8 up and down.

    python benchmarks/bench_relay_sim.py [--numel N] [--sites 64] [--regions 4] [--compute-s 60]

Printed side by side: the flat round, the relayed round with a float32 partial (the real relay's
``none`` upward codec) and with an int8 partial (an upward codec the real relay does not have
yet). Times are from the sites' compute start; the clock is pure arithmetic, so the numbers do not
depend on the machine.
"""

from __future__ import annotations

import argparse
import sys

from geoloco.algorithms.simulation.clock import SiteConfig
from geoloco.algorithms.simulation.planner_sizes import encoded_nbytes
from geoloco.algorithms.simulation.sim_regions import CoordinatorLink, RegionConfig, flat_round, relayed_round


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flat vs relayed rounds on the two-tier virtual clock")
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--sites", type=int, default=64)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--compute-s", type=float, default=60.0, help="inner steps' time per round")
    parser.add_argument("--coordinator-bps", type=float, default=1e9)
    parser.add_argument("--intra-bps", type=float, default=10e9)
    args = parser.parse_args(argv)
    per = args.sites // args.regions
    up = encoded_nbytes("int8", args.numel)
    sites = [
        SiteConfig(uplink_bps=args.intra_bps, downlink_bps=args.intra_bps, latency_s=0.005) for _ in range(args.sites)
    ]
    regions = [
        RegionConfig(
            name=f"r{r}", sites=list(range(per * r, per * r + per)), uplink_bps=args.coordinator_bps,
            downlink_bps=args.coordinator_bps, latency_s=0.05,
        )
        for r in range(args.regions)
    ]
    link = CoordinatorLink(ingress_bps=args.coordinator_bps, egress_bps=args.coordinator_bps)
    computed = [args.compute_s] * args.sites
    rows = {
        "flat": flat_round(computed, [up] * args.sites, up, sites, link),
        "relayed, fp32 partial": relayed_round(computed, [up] * args.sites, up, 4 * args.numel, sites, regions, link),
        "relayed, int8 partial": relayed_round(computed, [up] * args.sites, up, up, sites, regions, link),
    }
    flat = rows["flat"]
    print(
        f"{args.sites} sites in {args.regions} regions, {args.numel:,} parameters (int8 upload {up:,} B), "
        f"coordinator link {args.coordinator_bps / 1e9:g} Gbit/s, intra-region {args.intra_bps / 1e9:g} Gbit/s, "
        f"compute {args.compute_s:g} s"
    )
    print(f"{'':24} {'round s':>9} {'x flat':>7} {'comm s':>8} {'x flat':>7} {'coord in GB':>12} {'coord out GB':>13}")
    for name, r in rows.items():
        comm, flat_comm = r.end_s - args.compute_s, flat.end_s - args.compute_s
        print(
            f"{name:24} {r.end_s:>9.1f} {r.end_s / flat.end_s:>7.3f} {comm:>8.1f} {comm / flat_comm:>7.3f} "
            f"{r.coordinator_bytes_in / 1e9:>12.2f} {r.coordinator_bytes_out / 1e9:>13.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
