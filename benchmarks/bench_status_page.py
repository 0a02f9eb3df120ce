"""What the status page costs the coordinator per poll, against sites and rounds.

    python benchmarks/bench_status_page.py [--sites 64,256,1024] [--rounds 1000] [--polls 20]

For each site count N, a ``StatusBoard`` is fed what a real run emits (each site joins, then per
round a heartbeat, its upload bytes and the round's record with every site's phases), and then
answers ``/api/status`` as the page asks every second: the first answer (the first page of sites
and every kept round), then the steady poll (``rounds_after`` the last round it saw). It reports
the milliseconds per answer, built and serialised to JSON under the board's lock as the HTTP
handler does, and the bytes; ``/metrics`` rendered from the same events (per-site series); and
the process's peak RSS so far (site counts run in increasing order, so the row of the largest
holds the largest board).

On a tree older than the paged table (no ``StatusQuery``) it measures the one answer that tree
has, every site's row and every round's per-site phases: run it on both to compare.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from geoloco.coordinator import events as ev
from geoloco.coordinator.prometheus import CoordinatorMetrics
from geoloco.coordinator.status_board import StatusBoard
from geoloco.protos.round_phases import SITE_PHASES

try:
    from geoloco.coordinator.status_board import StatusQuery
except ImportError:  # a tree from before the paged site table
    StatusQuery = None  # type: ignore[assignment,misc]


ROUND_S = 1.0
"""Seconds between the fed rounds (the board keeps a site's transfers of the last few seconds)."""


def fed(sites: int, rounds: int) -> tuple[StatusBoard, CoordinatorMetrics]:
    now = [0.0]
    board = StatusBoard({"relays": {}}, heartbeat_interval_s=2.0, clock=lambda: now[0])
    metrics = CoordinatorMetrics(clock=lambda: now[0])
    names = [f"s{i}" for i in range(sites)]

    def emit(kind: str, site: str | None, round_number: int, **data: object) -> None:
        now[0] = round_number * ROUND_S
        event = ev.RoundEvent(kind=kind, time_s=now[0], site=site, round=round_number, data=data)
        board.on_event(event)
        if kind != ev.ROUND_AGGREGATED:
            metrics.on_event(event)

    for name in names:
        emit(ev.SITE_JOINED, name, 0)
    phases = dict.fromkeys(SITE_PHASES, 0.1)
    for r in range(rounds):
        for name in names:
            emit(ev.HEARTBEAT, name, r, phase="training")
            emit(ev.BYTES_RECEIVED, name, r, nbytes=1000)
            emit(ev.BYTES_SENT, name, r, nbytes=1000)
        emit(
            ev.ROUND_AGGREGATED, None, r, round=r, participants=names, excluded=[],
            bytes_up=dict.fromkeys(names, 1000), site_metrics={n: {"train_loss": 1.0} for n in names},
            phases_s={"receive": 0.1}, site_phases_s=dict.fromkeys(names, phases),
        )
    return board, metrics


def timed(answer, polls: int) -> tuple[float, int]:
    """(ms per answer, bytes of the last)."""
    start = time.perf_counter()
    for _ in range(polls):
        body = json.dumps(answer()).encode()
    return (time.perf_counter() - start) / polls * 1e3, len(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="64,256,1024")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--polls", type=int, default=20)
    args = parser.parse_args()
    print("| sites | rounds | first answer | steady poll | /metrics | peak RSS so far |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.sites.split(",")):
        board, metrics = fed(n, args.rounds)
        common = {"round_number": args.rounds, "phase": "running", "session_id": "bench"}
        if StatusQuery is None:
            first = timed(lambda: board.snapshot(**common), args.polls)
            steady = first
        else:
            first = timed(lambda: board.snapshot(**common, query=StatusQuery()), args.polls)
            last = StatusQuery(rounds_after=args.rounds - 2)
            steady = timed(lambda: board.snapshot(**common, query=last), args.polls)
        start = time.perf_counter()
        for _ in range(args.polls):
            text = metrics.render()
        scrape_ms = (time.perf_counter() - start) / args.polls * 1e3
        print(
            f"| {n:,} | {args.rounds:,} | {first[0]:.1f} ms, {first[1] / 1e3:,.0f} kB "
            f"| {steady[0]:.1f} ms, {steady[1] / 1e3:,.1f} kB | {scrape_ms:.1f} ms, {len(text) / 1e3:,.0f} kB "
            f"| {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB |"
        )


if __name__ == "__main__":
    main()
