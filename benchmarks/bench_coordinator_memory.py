"""Peak memory (RSS) of a real coordinator process while many sites upload compressed updates.

A ``CoordinatorServer`` (the object ``geoloco coordinator`` runs) serves a model laid out as 50
equal fp32 tensors (``--params``, default 50M). ``--sites`` sites (default 16) run as threads of
``--site-processes`` processes (default 4); each process draws a random pseudo-gradient per
round, encodes it with the run's uplink codec (default ``topk:0.01|int4``), and every site of it
uploads those bytes through the real client path (``CoordinatorClient``: Join, chunked resumable
Upload, AwaitBroadcast), for ``--rounds`` rounds. The sites never fetch the model (they only need
the protocol), so all traffic is uploads plus each round's broadcast. The coordinator writes a
checkpoint after every round (into a temporary folder), as a deployment would. ``--params`` and
``--sites`` take comma lists: every combination runs, one after the other.

The coordinator process records its RSS every 20 ms (``/proc/self/statm``) together with the
round phase, its high-water mark (``ru_maxrss``), and the aggregating thread's stack each time
RSS reaches a new high (``peak_stack``: where the peak is). Reported against the issue's target::

    target = 3 x fp32 model (weights, outer optimizer state, aggregation buffer)
             + every site's compressed upload + 300 MB (interpreter, torch, gRPC)

and its resident *anonymous* memory (``RssAnon``, sampled with RSS) against issue #26's floor,
baseline + 3 x model (weights, momentum, running sum): an upload that arrives in a file-backed
buffer (``BlobSpill``) is page cache, which RSS counts while it is mapped and the kernel can
write back and reclaim, and anonymous memory does not count.

    python benchmarks/bench_coordinator_memory.py                   # both downlink codecs
    python benchmarks/bench_coordinator_memory.py --downlink none   # one configuration
    python benchmarks/bench_coordinator_memory.py --downlink none --baseline-ref main
        # the coordinator of git ref ``main`` too, side by side with this tree's
    python benchmarks/bench_coordinator_memory.py --params 50000000 --sites 4,16,64 \
        --downlink 'topk:0.01|int4' --json sites.json --plot memory.png
        # a sweep, its rows as JSON, and peak RSS against sites and model size as a PNG
    python benchmarks/bench_coordinator_memory.py --plot-only a.json b.json --plot memory.png

Processes run with ``transport_malloc.recommended_env()`` (the malloc tunables the CLI applies). Needs
about 2.5x the model per site process at its peak (the random update and its encoding) and
about 6.5x the model for the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1_000_000
PAGE = os.sysconf("SC_PAGE_SIZE")
TENSORS = 50
"""The model is TENSORS tensors of equal size (a simple layout, like a stack of layers)."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _anon_bytes() -> int:
    """Resident anonymous memory (``RssAnon``): what the kernel cannot write back to a file and
    drop; an upload arriving in a file-backed buffer is page cache, counted in RSS, not here."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _aggregation_stack() -> list[str]:
    """Where the coordinator's threads are in the project's code (innermost frames first, a
    line per thread, the aggregating thread first), or []: what the coordinator was doing when
    its RSS reached a new high (a sampling profile of the peak)."""
    import traceback

    root = str(Path(__file__).resolve().parents[1])
    lines: list[tuple[bool, str]] = []
    for frames in sys._current_frames().values():
        stack = traceback.extract_stack(frames)
        inner = [f for f in reversed(stack) if f.filename.startswith(root) and "benchmarks" not in f.filename]
        if inner:
            where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in inner[:5])
            lines.append((any(frame.name == "aggregate" for frame in stack), where))
    return [where for _, where in sorted(lines, key=lambda line: not line[0])]


# --- roles (each runs in its own process) ----------------------------------------------------


def _role_coordinator(args: argparse.Namespace) -> None:
    import torch

    from geoloco.algorithms.params import ParamEntry, ParamLayout
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer

    per_tensor = args.params // TENSORS
    layout = ParamLayout(
        entries=tuple(
            ParamEntry(name=f"layer{i}.weight", shape=(per_tensor,), offset=i * per_tensor)
            for i in range(TENSORS)
        ),
        numel=per_tensor * TENSORS,
    )
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(
            inner_steps=1, uplink_codec=args.codec, downlink_codec=args.downlink
        ),
        insecure=True,
        min_sites=args.sites,
        total_rounds=args.rounds,
        heartbeat_timeout_s=120.0,
        max_sites=args.sites,
        drain_timeout_s=60.0,
        checkpoint_dir=args.checkpoint_dir,
    )
    baseline = _rss_bytes()  # interpreter, torch, gRPC: before any model-sized buffer
    initial = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    server = CoordinatorServer(config, initial, layout)
    del initial  # the server keeps its own copy, as with the CLI
    samples: list[tuple[float, int, str]] = []
    stop = threading.Event()

    peak_stack: list[str] = []

    peak_anon = [0]

    def sample() -> None:
        t0 = time.perf_counter()
        highest = 0
        while not stop.wait(0.02):
            peak_anon[0] = max(peak_anon[0], _anon_bytes())
            rss = _rss_bytes()
            samples.append((time.perf_counter() - t0, rss, server.rounds.phase.value))
            if rss > highest:
                highest = rss
                peak_stack[:] = _aggregation_stack()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    port = server.start()
    after_start = _rss_bytes()
    print(port, flush=True)
    finished = server.wait_until_finished(timeout=1800)
    stop.set()
    sampler.join()
    server.stop(grace=1)
    by_phase: dict[str, int] = {}
    for _, rss, phase in samples:
        by_phase[phase] = max(by_phase.get(phase, 0), rss)
    print(
        json.dumps(
            {
                "finished": finished,
                "baseline_rss": baseline,
                "after_start_rss": after_start,
                "peak_rss": _peak_rss_bytes(),
                "peak_anon": peak_anon[0],
                "peak_rss_by_phase": by_phase,
                "peak_stack": peak_stack,
                "numel": layout.numel,
            }
        ),
        flush=True,
    )


def _role_site(args: argparse.Namespace) -> None:
    """``args.count`` sites as threads of one process, each its own client (channel, Join,
    uploads, broadcasts). They upload the same bytes: one encoding per round per process keeps
    64 sites within a few GB on the driver's side, and the coordinator cannot tell."""
    import threading as th

    import torch

    from geoloco.compression import parse_codec
    from geoloco.site_agent.client import CoordinatorClient
    from geoloco.site_agent.config import SiteAgentConfig

    codec = parse_codec(args.codec)
    generator = torch.Generator().manual_seed(1000 + args.index)
    uploads = []
    for _ in range(args.rounds):
        pseudo_gradient = torch.randn(args.params, generator=generator).mul_(1e-3)
        encoded = codec.encode(pseudo_gradient, seed=args.index)
        del pseudo_gradient
        uploads.append((encoded.to_bytes(), encoded.spec, list(encoded.shape)))
        del encoded
    failures: list[BaseException] = []

    def one_site(index: int) -> None:
        client = CoordinatorClient(
            f"localhost:{args.port}",
            site=f"site{index}",
            tls=None,
            insecure=True,
            config=SiteAgentConfig(device="cpu", backoff_max_s=1.0, give_up_after_s=1800.0),
            stop_event=th.Event(),
        )
        try:
            joined = client.join(has_weights=False, weights_round=0, digest_hex=None)
            first_round = joined.round.round
            for offset, (data, spec, shape) in enumerate(uploads):
                round_number = first_round + offset
                client.upload(
                    round_number=round_number, data=data, codec=spec, shape=shape,
                    sample_weight=1.0, metrics={},
                )
                _, delta = client.await_broadcast(round_number)
                del delta  # a site would apply it; here only the coordinator is measured
            client.leave("benchmark done")
        except BaseException as exc:  # noqa: BLE001 - reported below, the process exits 1
            failures.append(exc)
        finally:
            client.close()

    threads = [th.Thread(target=one_site, args=(args.index + k,)) for k in range(args.count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    print(json.dumps({"upload_bytes": len(uploads[0][0]), "spec": uploads[0][1]}), flush=True)


# --- driver ------------------------------------------------------------------------------------


def _baseline_env(ref: str, env: dict[str, str], folder: Path) -> dict[str, str]:
    """An environment whose ``geoloco`` is git ref ``ref`` of this repository: the ref's tree
    exported under ``folder`` and laid out as the package (``PYTHONPATH`` comes before the
    editable install), so one run measures the old and the new coordinator alike."""
    root = Path(__file__).resolve().parent.parent
    source = folder / "source"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = folder / "package" / "geoloco"
    package.mkdir(parents=True)
    for name in ("protos", "compression", "algorithms", "coordinator", "site_agent", "scenarios"):
        (package / name).symlink_to(source / name)
    return {**env, "PYTHONPATH": str(folder / "package")}


def _spawn(role: str, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _run_config(args: argparse.Namespace, downlink: str, env: dict[str, str]) -> dict:
    common = ["--params", str(args.params), "--codec", args.codec, "--rounds", str(args.rounds)]
    checkpoints = tempfile.mkdtemp(prefix="geoloco-bench-checkpoints-")
    coordinator = _spawn(
        "coordinator", env, *common, "--sites", str(args.sites), "--downlink", downlink,
        "--checkpoint-dir", checkpoints,
    )
    sites: list[subprocess.Popen[str]] = []
    try:
        assert coordinator.stdout is not None
        port = coordinator.stdout.readline().strip()
        if not port:
            raise RuntimeError("the coordinator did not start")
        t0 = time.perf_counter()
        processes = max(1, min(args.sites, args.site_processes))
        shares = [args.sites // processes + (1 if k < args.sites % processes else 0) for k in range(processes)]
        sites = [
            _spawn("site", env, *common, "--port", port, "--index", str(sum(shares[:k])), "--count", str(n))
            for k, n in enumerate(shares)
        ]
        site_results = []
        for site in sites:
            out, _ = site.communicate(timeout=1800)
            if site.returncode != 0:
                raise RuntimeError(f"a site failed (exit status {site.returncode})")
            site_results.append(json.loads(out.strip().splitlines()[-1]))
        out, _ = coordinator.communicate(timeout=600)
        elapsed = time.perf_counter() - t0
        if coordinator.returncode != 0:
            raise RuntimeError(f"the coordinator failed (exit status {coordinator.returncode})")
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        for process in [coordinator, *sites]:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(checkpoints, ignore_errors=True)
    model = 4 * result["numel"]
    upload = max(r["upload_bytes"] for r in site_results)
    target = 3 * model + args.sites * upload + 300 * MB
    return {
        "downlink": downlink,
        "sites": args.sites,
        "uplink": site_results[0]["spec"],
        "model_bytes": model,
        "upload_bytes_per_site": upload,
        "target_bytes": target,
        "seconds": elapsed,
        **result,
    }


def _counts(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def _print_table(rows: list[dict]) -> None:
    print(
        "| code | params | sites | downlink | model MB | upload MB/site | baseline RSS MB | peak RSS MB "
        "| target MB | peak / target | peak while receiving MB | peak while aggregating MB "
        "| peak anonymous MB | floor MB | anonymous / floor | seconds |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        aggregating = row["peak_rss_by_phase"].get("aggregating")
        receiving = row["peak_rss_by_phase"].get("running")
        print(
            f"| {row['code']} | {row['numel'] / 1e6:.0f}M | {row['sites']} | {row['downlink']} "
            f"| {row['model_bytes'] / MB:.0f} | {row['upload_bytes_per_site'] / MB:.2f} "
            f"| {row['baseline_rss'] / MB:.0f} | {row['peak_rss'] / MB:.0f} | {row['target_bytes'] / MB:.0f} "
            f"| {row['peak_rss'] / row['target_bytes']:.2f} "
            f"| {'-' if receiving is None else f'{receiving / MB:.0f}'} "
            f"| {'-' if aggregating is None else f'{aggregating / MB:.0f}'} "
            f"| {row.get('peak_anon', 0) / MB:.0f} | {_floor(row) / MB:.0f} "
            f"| {row.get('peak_anon', 0) / _floor(row):.2f} "
            f"| {row['seconds']:.0f} |"
        )


def _floor(row: dict) -> float:
    """What the coordinator cannot do without: the interpreter (baseline), the weights, the
    outer optimizer's momentum and the round's running sum, a model each (Nesterov, ``none``
    downlink: no downlink residual); chunk buffers and thread stacks come on top."""
    return row["baseline_rss"] + 3 * row["model_bytes"]


def _plot(rows: list[dict], path: Path) -> None:
    """Peak RSS and its target (MB) against sites (left) and against model size (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_sites, by_params) = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, x_key, other_key in ((by_sites, "sites", "numel"), (by_params, "numel", "sites")):
        groups: dict[tuple[int, str, str], list[dict]] = {}
        for row in rows:
            groups.setdefault((row[other_key], row["downlink"], row["code"]), []).append(row)
        for (other, downlink, code), group in sorted(groups.items()):
            if len({r[x_key] for r in group}) < 2:
                continue
            group.sort(key=lambda r: r[x_key])
            xs = [r[x_key] / (1e6 if x_key == "numel" else 1) for r in group]
            fixed = f"{other / 1e6:.0f}M params" if other_key == "numel" else f"{other} sites"
            label = f"{fixed}, downlink {downlink}" + ("" if code == "this tree" else f" ({code})")
            line = ax.plot(xs, [r["peak_rss"] / MB for r in group], "o-", label=f"peak RSS, {label}")[0]
            ax.plot(xs, [r["target_bytes"] / MB for r in group], "--", color=line.get_color(), label=f"target, {label}")
        if x_key == "sites":
            ax.set_xscale("log", base=2)
        ax.set_xlim(left=0 if x_key == "numel" else None)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("coordinator peak RSS (MB)")
        ax.legend(fontsize=7)
    by_sites.set_xlabel("sites uploading topk:0.01|int4 at once")
    by_sites.set_title("against the number of sites")
    by_params.set_xlabel("model parameters (millions)")
    by_params.set_title("against the model size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--role", choices=["driver", "coordinator", "site"], default="driver")
    parser.add_argument("--params", default="50000000", help="parameters, or a comma list (a sweep)")
    parser.add_argument("--sites", default="16", help="sites, or a comma list (a sweep)")
    parser.add_argument("--site-processes", type=int, default=4, help="processes the sites run in (as threads)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--codec", default="topk:0.01|int4", help="uplink codec")
    parser.add_argument(
        "--downlink", default="both", help="downlink codec, or 'both' for 'none' and the uplink codec"
    )
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int)
    parser.add_argument("--index", type=int)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plot", type=Path, help="also plot peak RSS against sites and model size into this PNG")
    parser.add_argument("--plot-only", type=Path, nargs="+", help="plot these --json files into --plot, run nothing")
    parser.add_argument(
        "--baseline-ref", help="also run the coordinator and sites of this git ref, before each configuration"
    )
    args = parser.parse_args()
    if args.plot_only:
        _plot([row for file in args.plot_only for row in json.loads(file.read_text())], args.plot)
        return None
    if args.role != "driver":
        args.params, args.sites = _counts(args.params)[0], _counts(args.sites)[0]
        return _role_coordinator(args) if args.role == "coordinator" else _role_site(args)

    from geoloco.protos.transport_malloc import recommended_env

    env = recommended_env()
    env["OMP_NUM_THREADS"] = "1"
    downlinks = ["none", args.codec] if args.downlink == "both" else [args.downlink]
    rows = []
    with tempfile.TemporaryDirectory(prefix="geoloco-bench-baseline-") as folder:
        baseline_env = _baseline_env(args.baseline_ref, env, Path(folder)) if args.baseline_ref else None
        for params in _counts(args.params):
            for sites in _counts(args.sites):
                point = argparse.Namespace(**{**vars(args), "params": params, "sites": sites})
                for downlink in downlinks:
                    if baseline_env is not None:
                        rows.append({**_run_config(point, downlink, baseline_env), "code": args.baseline_ref})
                    rows.append({**_run_config(point, downlink, env), "code": "this tree"})
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "peak_rss_by_phase"}), flush=True)
    print(f"\nCoordinator peak RSS: {args.rounds} rounds, {TENSORS} tensors, uplink {rows[0]['uplink']}\n")
    _print_table(rows)
    print(
        "\ntarget = 3 x model + sites x upload + 300 MB; baseline = RSS after importing torch and "
        "gRPC, before the model exists. Peak RSS is the process's high-water mark (ru_maxrss); "
        "a checkpoint is written after every round. Receiving: the round is open (uploads are "
        "verified and added); RSS there also holds what the previous round's close left allocated."
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        _plot(rows, args.plot)


if __name__ == "__main__":
    main()
