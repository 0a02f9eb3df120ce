"""A big model through sharded (FSDP2) sites and through data-parallel sites, beside raw TCP.

One coordinator process (``CoordinatorServer``, mutual TLS on loopback, port 0) and ``--sites``
sites, each a ``torchrun`` job of ``--ranks`` processes on gloo/CPU, run ``--rounds`` DiLoCo
rounds of a model of ``--params`` fp32 parameters: ``LAYERS`` square ``nn.Linear`` layers (no
bias), batch ``BATCH``, plain SGD inner optimizer (no optimizer state), ``--inner-steps`` inner
steps, so the round is the system's cost (shard pseudo-gradient, encode, upload, verify,
aggregate, outer step, broadcast, apply), not training's. Two modes, one after the other:

* ``sharded``: every rank wraps each layer with ``fully_shard`` over the site's 1-D mesh, builds
  the model on the meta device (no rank materialises it whole) and runs ``ShardedSite.rounds()``:
  each rank uploads its own shard and applies its rows of the broadcast;
* ``dp``: every rank builds the whole model and runs ``SiteAgent`` with an ``IntraSiteGroup``
  (DDP inside the site, rank 0 alone moves the whole update).

Per mode: the round time (slowest rank of the slowest site, from the start of training to the
broadcast applied; median over the rounds after the first), the raw TCP time of the same bytes
(``bench_round_phases._raw_tcp_s``: one connection per uploader, all at once, each sending the
largest upload and receiving the largest download a rank or leader moved), the ratio, the
coordinator's peak RSS against the fp32 model, and each rank's peak RSS (``ru_maxrss``) against
its shard (sharded) or the model (dp). A watchdog in the driver kills the run when the machine's
``MemAvailable`` falls below ``--min-free-gib`` and reports that mode as not finished.

    python benchmarks/bench_sharded.py --params 16e6                       # quick check, ~1 min
    python benchmarks/bench_sharded.py --params 64e6                       # both modes, 2 x 2
    python benchmarks/bench_sharded.py --params 250e6 --dp-ranks 1         # the issue's size
    python benchmarks/bench_sharded.py --params 64e6 --modes sharded --where   # where the peaks are

Memory at 250M (measured, benchmarks/README.md): the coordinator ~8x the fp32 model with two
sites, a sharded rank ~8x its shard, a data-parallel rank ~6x the model (a second rank per
data-parallel site adds DDP's buckets): the peaks of two 2-rank sharded sites and the coordinator
add up to ~23 GiB (~19 GiB was in use at once), so at that size a 23 GiB machine takes two-rank
sharded sites but only one-rank data-parallel ones (``--dp-ranks 1``). ``--where``
samples each rank's RSS and keeps the stack, the live tensors and glibc's heap at its peak;
``--site-malloc`` starts the ranks with other malloc tunables. ``--json`` writes the results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_round_phases as phases

MiB = 1 << 20
GiB = 1 << 30
LAYERS = 16
BATCH = 2
LR = 1e-3
WIDTH_STEP = 64


def _width(params: float) -> int:
    """The layers' width: the smallest multiple of ``WIDTH_STEP`` with ``LAYERS`` x width^2 >=
    ``params``."""
    return WIDTH_STEP * math.ceil(math.sqrt(params / LAYERS) / WIDTH_STEP)


def _model(width: int) -> Any:
    from torch import nn

    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))


def _loss(model: Any, batch: Any) -> Any:
    return model(batch).square().mean()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


# --- roles (each runs in its own process) ----------------------------------------------------


def _role_coordinator(args: argparse.Namespace) -> None:
    import torch

    from geoloco.algorithms.optimizers import InnerOptimizerConfig
    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer

    out = Path(args.out)
    torch.manual_seed(0)
    model = _model(args.width)
    layout = ParamLayout.from_model(model)
    flat = layout.flatten(model)
    del model
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=args.inner_steps, uplink_codec=args.codec, downlink_codec=args.codec),
        inner_optimizer=InnerOptimizerConfig(lr=LR),
        total_rounds=args.rounds, min_sites=args.sites, certs_dir=args.certs,
        checkpoint_dir=str(out / "checkpoints") if args.checkpoint else None,
        metrics_path=str(out / "metrics.jsonl"),
    )
    server = CoordinatorServer(config, flat, layout)
    del flat
    phases.serve_run(server, out, args.timeout)


def _role_rank(args: argparse.Namespace) -> None:
    """One rank of a site under torchrun; writes ``<mode>-site<s>-rank<r>.json``."""
    import grpc  # noqa: F401 (in the baseline)
    import torch

    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.site_agent.config import SiteAgentConfig

    baseline = _rss_mib()
    sampler = None
    if args.where:
        from bench_site_memory import _PeakSampler

        sampler = _PeakSampler()  # the census (a gc walk) from round 1 on: earlier it races
        sampler.start()           # torch's lazy imports (SystemError in a tuple being built)
        args.sampler = sampler
    tls = TLSFiles.from_dir(Path(args.certs), args.site)
    config = SiteAgentConfig(device="cpu")
    batch = torch.randn(BATCH, args.width, generator=torch.Generator().manual_seed(int(args.site)))
    coordinator = f"localhost:{args.port}"
    run = _run_sharded if args.mode == "sharded" else _run_dp
    result = run(args, coordinator, tls, config, batch)
    result.update(peak_rss_mib=_peak_rss_mib(), baseline_mib=baseline, site=args.site)
    if sampler is not None:
        sampler.stop()
        result.update(peak_stack=sampler.stack, tensors_at_peak_mib=sampler.tensors_mib,
                      malloc_at_peak_mib=sampler.malloc_mib)
    name = f"{args.mode}-site{args.site}-rank{result['rank']}.json"
    (Path(args.out) / name).write_text(json.dumps(result))


def _run_sharded(args: argparse.Namespace, coordinator: str, tls: Any, config: Any, batch: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geoloco.site_agent.sharded import ShardedSite, local_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = _model(args.width)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # the rows only; the join loads the coordinator's weights
    with torch.no_grad():
        for param in model.parameters():
            local_shard(param).zero_()
    site = ShardedSite(model, torch.optim.SGD(model.parameters(), lr=LR), coordinator=coordinator,
                       site=args.site, tls=tls, config=config)
    sent: list[int] = []
    upload = site.client.upload

    def counted_upload(**kwargs: Any) -> Any:
        sent.append(len(kwargs["data"]))
        return upload(**kwargs)

    site.client.upload = counted_upload  # type: ignore[method-assign]
    starts: list[float] = []
    trained: list[float] = []
    received: list[int] = []
    for current in site.rounds():
        if len(starts) == 1 and getattr(args, "sampler", None) is not None:
            args.sampler.census = True
        starts.append(time.perf_counter())
        received.append(site.client.stats.received)
        for _ in range(current.inner_steps):
            site.optimizer.zero_grad(set_to_none=True)
            _loss(model, batch).backward()
            site.optimizer.step()
        current.samples += BATCH * current.inner_steps
        trained.append(time.perf_counter() - starts[-1])
    starts.append(time.perf_counter())
    received.append(site.client.stats.received)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "shard_bytes": 4 * site.shard_numel,
        "round_time_s": [b - a for a, b in itertools.pairwise(starts)],
        "train_time_s": trained,
        "bytes_up": sent,
        "bytes_down": [b - a for a, b in itertools.pairwise(received)],
    }


def _run_dp(args: argparse.Namespace, coordinator: str, tls: Any, config: Any, batch: Any) -> dict[str, Any]:
    import torch

    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import RoundResult, SiteHooks
    from geoloco.site_agent.distributed import init_from_env

    results: list[RoundResult] = []
    with init_from_env(backend="gloo", device="cpu", timeout=timedelta(seconds=args.timeout)) as group:
        model = _model(args.width)
        agent = SiteAgent(
            model, torch.optim.SGD(model.parameters(), lr=LR), itertools.repeat(batch), _loss,
            coordinator=coordinator, site=args.site, tls=tls, config=config, group=group,
            hooks=SiteHooks(on_round_end=results.append),
        )
        agent.run()
        rank = group.rank
    return {  # the hooks run on the leader only: the other ranks report memory alone
        "rank": rank,
        "shard_bytes": 4 * sum(p.numel() for p in model.parameters()),
        "round_time_s": [r.round_time_s for r in results],
        "train_time_s": [r.inner_time_s for r in results],
        "bytes_up": [r.bytes_up for r in results],
        "bytes_down": [r.bytes_down for r in results],
    }


# --- driver ----------------------------------------------------------------------------------


class _Watchdog:
    """Kills every process it was given, and their descendants, when ``MemAvailable`` falls below
    a floor: a run that would take the shared machine out of memory is stopped and reported."""

    def __init__(self, floor_gib: float) -> None:
        self.floor = floor_gib * GiB
        self.pids: list[int] = []
        self.fired = False
        self.lowest = math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process started and all their descendants: torchrun starts its workers
        in sessions of their own, so killing its process group alone leaves the ranks running."""
        for pid in [*_descendants(self.pids), *self.pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            available = _mem_available()
            self.lowest = min(self.lowest, available)
            if available < self.floor:
                self.fired = True
                self.kill()
                return


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of ``roots`` (from ``/proc/*/stat``), children before parents."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    frontier = list(roots)
    while frontier:
        kids = [k for pid in frontier for k in children.get(pid, [])]
        found.extend(kids)
        frontier = kids
    return found[::-1]


def _mem_available() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0
    return math.inf


def _spawn(command: list[str], watchdog: _Watchdog, tunables: str = "recommended") -> subprocess.Popen[bytes]:
    """Start a role in a session of its own; ``tunables``: ``recommended`` (the malloc tunables
    of ``transport_malloc.recommended_env()``), ``none`` (glibc's defaults) or a ``GLIBC_TUNABLES`` string."""
    from geoloco.protos.transport_malloc import recommended_env

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GLIBC_TUNABLES")}
    if tunables == "recommended":
        env = recommended_env(env)
    elif tunables != "none":
        env["GLIBC_TUNABLES"] = tunables
    env["OMP_NUM_THREADS"] = "1"
    process = subprocess.Popen(command, env=env, start_new_session=True)
    watchdog.pids.append(process.pid)
    return process


def _wait_all(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every process; the first to fail (or the deadline) ends the wait: the others
    of a run with a dead site would wait for it until their own timeouts."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes):
        failed = [p for p in processes if p.returncode not in (None, 0)]
        if failed:
            raise RuntimeError(f"{_name(failed[0])} exited with {failed[0].returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run did not finish within {timeout_s:.0f} s")
        time.sleep(0.2)
    failed = [p for p in processes if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{_name(failed[0])} exited with {failed[0].returncode}")


def _name(process: subprocess.Popen[bytes]) -> str:
    """``coordinator`` or ``site N`` from a process's command line."""
    command = [str(a) for a in process.args] if isinstance(process.args, list) else [str(process.args)]
    return f"site {command[command.index('--site') + 1]}" if "--site" in command else "coordinator"


def _run_mode(mode: str, args: argparse.Namespace, certs: Path, work: Path) -> dict[str, Any]:
    out = work / mode
    out.mkdir()
    common = ["--width", str(args.width), "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
              "--codec", args.codec, "--certs", str(certs), "--out", str(out), "--timeout", str(args.timeout),
              "--sites", str(args.sites), *(["--where"] if args.where else [])]
    load_before = os.getloadavg()
    available_before = _mem_available()
    started = time.perf_counter()
    with _Watchdog(args.min_free_gib) as watchdog:
        try:
            coordinator = _spawn([sys.executable, __file__, "--role", "coordinator", *common,
                                  *(["--checkpoint"] if args.checkpoint else [])], watchdog)
            port = phases._wait_file(out / "port", coordinator, 600)
            nproc = args.dp_ranks if mode == "dp" else args.ranks
            sites = [
                _spawn([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", "--max-restarts=0", __file__, "--role", "rank",
                        "--mode", mode, "--site", str(s), "--port", port, *common], watchdog,
                       tunables=args.site_malloc)
                for s in range(args.sites)
            ]
            _wait_all([*sites, coordinator], args.timeout)
        except (RuntimeError, SystemExit) as why:
            reason = "memory watchdog (MemAvailable below the floor)" if watchdog.fired else str(why)
            return {"mode": mode, "failed": reason, "lowest_available_gib": watchdog.lowest / GiB,
                    "load_before": load_before}
    wall = time.perf_counter() - started
    from geoloco.coordinator.metrics import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-site*-rank*.json"))]
    movers = [r for r in ranks if r["round_time_s"]]  # sharded: every rank; dp: the leaders
    per_round = [max(times) for times in zip(*(r["round_time_s"] for r in movers), strict=False)]
    per_round_train = [max(times) for times in zip(*(r["train_time_s"] for r in movers), strict=False)]
    up = max(max(r["bytes_up"]) for r in movers)
    down = max(max(r["bytes_down"]) for r in movers)
    raw_s = phases._raw_tcp_s(up, down, out, len(movers))
    return {
        "mode": mode,
        "round_s": statistics.median(per_round[1:] or per_round),
        "round_times_s": per_round,
        "train_s": statistics.median(per_round_train[1:] or per_round_train),
        "raw_tcp_s": raw_s,
        "connections": len(movers),
        "upload_bytes": up,
        "download_bytes": down,
        "coordinator_peak_rss_mib": json.loads((out / "coordinator.json").read_text())["peak_rss_mib"],
        "coordinator_phases_s": records[-1].get("phases_s", {}),
        "round_wall_s": records[-1].get("round_wall_s") or 0.0,
        "ranks": [{k: r[k] for k in ("site", "rank", "peak_rss_mib", "baseline_mib", "shard_bytes", "peak_stack",
                                     "tensors_at_peak_mib", "malloc_at_peak_mib") if k in r} for r in ranks],
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "available_before_gib": available_before / GiB,
        "lowest_available_gib": watchdog.lowest / GiB,
    }


def _report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    numel = LAYERS * args.width * args.width
    model_mib = 4 * numel / MiB
    print(f"\n{numel:,} parameters ({model_mib:.0f} MiB fp32; {LAYERS} x Linear({args.width}, {args.width})), "
          f"{args.sites} sites x {args.ranks} ranks (dp: x {args.dp_ranks}), codec {args.codec}, "
          f"{args.inner_steps} inner step(s), "
          f"{args.rounds} rounds, checkpoints {'on' if args.checkpoint else 'off'}, mutual TLS, loopback\n")
    print("| mode | round (median) | of which training | raw TCP same bytes | round / raw | up / down per mover | "
          "coordinator peak (/ model) | rank peak (max) | rank peak / shard | (peak - baseline) / shard | "
          "lowest MemAvailable | load before |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    done = {r["mode"]: r for r in results if "failed" not in r}
    for r in results:
        load = "/".join(f"{x:.1f}" for x in r["load_before"])
        if "failed" in r:
            print(f"| {r['mode']} | not finished: {r['failed']} | | | | | | | | | "
                  f"{r['lowest_available_gib']:.1f} GiB | {load} |")
            continue
        worst = max(r["ranks"], key=lambda k: k["peak_rss_mib"])
        shard_mib = worst["shard_bytes"] / MiB
        print(
            f"| {r['mode']} | {r['round_s']:.2f} s | {r['train_s']:.2f} s "
            f"| {r['raw_tcp_s']:.2f} s ({r['connections']} conn.) "
            f"| **{r['round_s'] / r['raw_tcp_s']:.1f}x** "
            f"| {r['upload_bytes'] / MiB:.0f} / {r['download_bytes'] / MiB:.0f} MiB "
            f"| {r['coordinator_peak_rss_mib']:.0f} MiB ({r['coordinator_peak_rss_mib'] / model_mib:.1f}x) "
            f"| {worst['peak_rss_mib']:.0f} MiB | {worst['peak_rss_mib'] / shard_mib:.1f}x of {shard_mib:.0f} MiB "
            f"| {(worst['peak_rss_mib'] - worst['baseline_mib']) / shard_mib:.1f}x "
            f"| {r['lowest_available_gib']:.1f} GiB | {load} |"
        )
    if "sharded" in done and "dp" in done:
        ratio = done["sharded"]["round_s"] / done["dp"]["round_s"]
        print(f"\nsharded round / data-parallel round: **{ratio:.2f}x**")
    for r in done.values():
        print(f"\n{r['mode']}: rounds {', '.join(f'{t:.2f}' for t in r['round_times_s'])} s; per rank peak RSS "
              + ", ".join(f"s{k['site']}r{k['rank']} {k['peak_rss_mib']:.0f} (base {k['baseline_mib']:.0f})"
                          for k in r["ranks"]) + " MiB")
        for k in r["ranks"]:
            if k.get("peak_stack"):
                stack = " <- ".join(k["peak_stack"][::-1][:8])
                print(f"  site {k['site']} rank {k['rank']}: stack at the peak: {stack}")
                sizes = k.get("tensors_at_peak_mib") or []
                print(f"    live tensors >= 1 MiB (from round 1 on): {sum(sizes):.0f} MiB: "
                      + ", ".join(f"{n:.0f}" for n in sizes[:12]) + "; malloc: "
                      + ", ".join(f"{a} {b:.0f}" for a, b in (k.get("malloc_at_peak_mib") or {}).items()))
        phases_s = r["coordinator_phases_s"]
        print("  coordinator, last round: " + ", ".join(f"{k} {v:.2f}" for k, v in phases_s.items())
              + f"; wall {r['round_wall_s']:.2f} s")
    print("\n" + json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--role", choices=["coordinator", "rank"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["sharded", "dp"], help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=float, default=250e6, help="model parameters, at least (default 250e6)")
    parser.add_argument("--modes", default="sharded,dp", help="comma-separated: sharded, dp")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="torchrun processes per site")
    parser.add_argument("--dp-ranks", type=int, help="processes per data-parallel site (default: --ranks)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--codec", default="none", help="uplink = downlink codec (default none)")
    parser.add_argument("--checkpoint", action="store_true", help="coordinator checkpoints every round")
    parser.add_argument("--min-free-gib", type=float, default=2.0,
                        help="kill the run when MemAvailable falls below this (default 2.0)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--site-malloc", default="recommended",
                        help="the ranks' glibc malloc: recommended (transport_malloc.recommended_env(), as deployed), "
                             "none (glibc's defaults) or a GLIBC_TUNABLES string")
    parser.add_argument("--where", action="store_true",
                        help="sample each rank's RSS and keep the stack and live tensors at its peak (slower)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.role == "coordinator":
        _role_coordinator(args)
        return
    if args.role == "rank":
        _role_rank(args)
        return
    args.width = _width(args.params)
    args.dp_ranks = args.dp_ranks or args.ranks
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    work = Path(tempfile.mkdtemp(prefix="geoloco-sharded-"))
    try:
        certs = work / "certs"
        init_ca(certs)
        issue_coordinator(certs)
        for site in range(args.sites):
            issue_site(certs, str(site))
        results = [_run_mode(mode, args, certs, work) for mode in args.modes.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
