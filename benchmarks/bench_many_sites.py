"""Hundreds of sites on one coordinator: round time, coordinator CPU, memory and threads per N.

    python benchmarks/bench_many_sites.py                                  # plain and secure, N = 16..256
    python benchmarks/bench_many_sites.py --sites 16,64,128,256,512 --mode plain
    python benchmarks/bench_many_sites.py --sites 16,64 --mode secure --rounds 5 --workers 2
    python benchmarks/bench_many_sites.py --sites 256 --mode plain --profile   # + cProfile of N = 256
    python benchmarks/bench_many_sites.py --sites 64,512,1024 --mode plain --client light
                                                   # protocol-only sites: the coordinator at 1,024
    python benchmarks/bench_many_sites.py --sites 256 --mode secure \
        --study scenarios/privacy_frontier.toml --repeat 3 --simulator-runs 8 --simulator-seeds 3
                                                   # a study through real sites, beside the simulator

What runs, per mode and N (issue #30, "a load harness", as an operator would try it):

* one coordinator process: ``CoordinatorServer`` through the Python API, ``min_sites = max_sites
  = N``, port 0, checkpoints off, ``metrics.jsonl`` in a temporary folder, DiLoCo with one inner
  step and codec ``none`` both ways, the other settings (heartbeats, admission) their defaults;
* N sites: ``SiteAgent`` threads spread over ``--workers`` worker processes, each with its own
  channel and TCP connection (``_own_connections``), a tiny MLP (4,192 parameters), one SGD step
  on a fixed batch per round; or, with ``--client light``, threads that speak the protocol
  without training (``_role_light_worker``: plain and tls modes), so that a thousand sites fit
  on a small machine beside the coordinator;
* ``--rounds`` rounds, modes ``plain`` (no TLS), ``tls`` (mutual TLS, certificates from
  ``geoloco.scenarios.certs``) and ``secure`` (mutual TLS and ``[privacy] secure_aggregation``
  with the ``secagg+`` neighbour graph, clip 1.0, no DP).

``--study FILE`` runs a simulate file's study instead of the tiny MLP (issue #30's privacy
frontier point through the real system): the coordinator takes the file's algorithm, optimizers,
privacy, seed, rounds and workload (evaluating at the file's ``eval_every`` and the end), every
site the workload's model, the inner optimizer and its own share of the data
(``Workload.site_batches``), as the simulator's sites do; ``--set`` overrides the file and its
``sites.count`` is N. ``--simulator-runs K`` runs the same study K times in the simulator at its
own seed and ``--simulator-seeds K`` with seeds 0..K-1, and the report prints epsilon and the final
eval loss of every run side by side, with where each real loss lies in the simulator's spread.
Without DP the real system and the simulator end on the same loss; with DP the noise is drawn
from the OS, so every run differs (``--repeat R`` runs the real system R times).

Measured in the coordinator process (it writes them to ``coordinator.json``):

* round time: the median of ``round_time_s`` (``metrics.jsonl``: the round's opening to its
  close) and of the time between two broadcasts (``on_round_end``), rounds after the first;
* coordinator CPU per round: ``ru_utime + ru_stime`` of the whole process (all threads) between
  the end of round 0 and the end of the last round, divided by the rounds in between, so start-up,
  the N joins and the first download of the weights are left out; per site and as a ratio to the
  smallest N of the same mode, which stays near 1.0 while the cost is linear in N;
* where that CPU went, by thread group (``/proc/self/task``: Python threads by their name, gRPC's
  C threads by their kernel name, digits folded), over the same rounds (threads that ended
  meanwhile are missing from it);
* peak RSS (``ru_maxrss``) and the largest number of threads the process had (sampled every
  0.25 s);
* beside them, the CPU the worker processes (all N sites) used over the same rounds: on a small
  machine the sites share the cores with the coordinator, and the round time is theirs too.

``--profile`` runs the largest N of each mode once more with every coordinator thread under its
own ``cProfile`` profiler (``time.thread_time``, so blocked calls cost nothing), keeps only the
rounds after the first (stats at the end minus stats at the end of round 0) and prints the top 25
functions by cumulative and by own time. gRPC's C-core threads (TLS, HTTP/2) are not Python and
do not appear in it; the thread-group line shows their share. The profiled run's own figures are
printed beside the table, not in it (the profiler slows the coordinator, and code that makes
millions of tiny calls, list appends say, many times more than the rest). A generator's every
resumption counts as a call: ``AwaitBroadcast`` "calls" per round are one call plus its progress
messages.

Every process the driver starts is killed when it exits or fails, and the children also exit
when the driver's pipe to them closes (a killed driver leaves nothing behind). Writes
``results/many_sites.json`` (``--json``) and, with ``--profile``, ``many_sites-MODE-N.prof`` beside it
(``python -m pstats FILE`` browses it); ``--profile-sites`` profiles the first worker's sites in
that run too (``many_sites-MODE-N-sites.prof``), to see what the harness itself costs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import marshal
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = ("plain", "tls", "secure")
MODE_TITLES = {
    "plain": "plain",
    "tls": "mutual TLS",
    "secure": "mutual TLS + secure aggregation (secagg+)",
}
WIDTH = 32
"""The tiny model: Linear(32, 64), ReLU, Linear(64, 32): 4,192 parameters."""
OWN_THREAD_PREFIX = "bench-"
_OWN_THREADS = ("bench-sampler", "bench-parent-watch")
"""Threads of this benchmark in the coordinator whose CPU is taken out of its figures (the probe
thread's own is measured and taken out where it runs)."""
SAMPLE_S = 0.25
"""How often the coordinator counts its threads."""
TOP = 25


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))


def _loss(model: Any, batch: Any) -> Any:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _site_name(index: int) -> str:
    return f"s{index}"


def _study(args: argparse.Namespace) -> tuple[Any, Any, Any] | None:
    """``--study``: the simulate file's ``SimulatorConfig`` (its ``--set`` applied, and
    ``sites.count`` = N), workload spec and built workload, read once per process; None without."""
    if args.study is None:
        return None
    return _read_study(args.study, (*args.set, f"sites.count={args.sites}"))


@functools.cache
def _read_study(path: str, overrides: tuple[str, ...]) -> tuple[Any, Any, Any]:
    from geoloco.scenarios.config_file import read_toml
    from geoloco.scenarios.research import prepare_run

    prepared = prepare_run(read_toml(Path(path)), list(overrides), path)
    return prepared.simulator, prepared.workload, prepared.workload.build()


def _exit_with_parent() -> None:
    """Exit this child the moment the driver's end of our stdin closes (the driver ended, however)."""

    def watch() -> None:
        while os.read(sys.stdin.fileno(), 4096):  # the raw fd: no buffer lock held at shutdown
            pass
        os._exit(3)

    threading.Thread(target=watch, name="bench-parent-watch", daemon=True).start()


# --- coordinator process ---------------------------------------------------------------------


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread group: a Python thread's name
    (or, for gRPC's C threads, the kernel's), digits replaced by ``N``."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
        name = names.get(int(tid), f"C:{comm}")
        group = re.sub(r"\d+", "N", name)
        groups[group] = groups.get(group, 0.0) + cpu
    return groups


def _connections(port: int) -> int:
    """Established TCP connections to ``port`` on this machine (``/proc/net/tcp``, IPv4 and 6)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


def _connections_settled(port: int, reads: int = 3, gap_s: float = 0.02) -> int:
    """The median of ``reads`` counts ``gap_s`` apart: ``/proc/net/tcp`` is produced a page at a
    time, not as one snapshot, so a read while other sockets open or close can skip or repeat a
    line, and a channel's reconnect holds one connection too many or too few for a moment."""
    counts = []
    for k in range(reads):
        if k:
            time.sleep(gap_s)
        counts.append(_connections(port))
    return sorted(counts)[reads // 2]


def _processes_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads) of the processes ``pids`` so far; 0 for any gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _ThreadProfiles:
    """One ``cProfile`` profiler per thread started after ``install()`` (cProfile follows only the
    thread that enabled it), timed by ``time.thread_time``: CPU, not waiting."""

    def __init__(self) -> None:
        self.profiles: list[Any] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        import cProfile

        def start(*_: Any) -> None:
            profile = cProfile.Profile(time.thread_time)
            with self._lock:
                self.profiles.append(profile)
            profile.enable()  # replaces this hook for the rest of the thread

        threading.setprofile(start)

    def snapshot(self) -> dict[Any, tuple[Any, ...]]:
        """The stats of every profiler so far, merged in pstats' layout (completed calls only)."""
        merged: dict[Any, tuple[Any, ...]] = {}
        with self._lock:
            profiles = list(self.profiles)
        for profile in profiles:
            profile.snapshot_stats()  # unlike create_stats(), does not disable
            merged = _combine(merged, profile.stats, 1)
        return merged


_Stats = dict[Any, tuple[Any, ...]]
"""pstats' layout: ``func -> (primitive calls, calls, own time, cumulative, {caller: (the same four)})``."""


def _combine(into: _Stats, other: _Stats, sign: int) -> _Stats:
    """``into + sign x other``, entries and callers alike; entries left without calls dropped."""

    def add(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(x + sign * y for x, y in zip(a, b))

    out = dict(into)
    for func, (cc, nc, tt, ct, callers) in other.items():
        base = out.get(func, (0, 0, 0.0, 0.0, {}))
        merged_callers = dict(base[4])
        for caller, value in callers.items():
            merged_callers[caller] = add(merged_callers.get(caller, (0, 0, 0.0, 0.0)), value)
        merged_callers = {k: v for k, v in merged_callers.items() if v[1] > 0}
        out[func] = (*add(base[:4], (cc, nc, tt, ct)), merged_callers)
    return {func: entry for func, entry in out.items() if entry[1] > 0}


def _role_coordinator(args: argparse.Namespace) -> None:
    _exit_with_parent()
    from geoloco.algorithms.optimizers import InnerOptimizerConfig
    from geoloco.algorithms.params import ParamLayout
    from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
    from geoloco.algorithms.record import RoundRecord
    from geoloco.algorithms.strategy import AlgorithmConfig
    from geoloco.coordinator import events as ev
    from geoloco.coordinator.config import CoordinatorConfig
    from geoloco.coordinator.server import CoordinatorServer

    out = Path(args.out)
    plain = args.mode == "plain"
    study = _study(args)
    common: dict[str, Any] = {
        "min_sites": args.sites, "max_sites": args.sites, "insecure": plain,
        **({} if args.heartbeat_s is None else {
            "heartbeat_interval_s": args.heartbeat_s, "heartbeat_timeout_s": max(15.0, 7.5 * args.heartbeat_s),
        }),
        "certs_dir": None if plain else args.certs, "metrics_path": str(out / "metrics.jsonl"),
    }
    eval_fn = None
    if study is None:
        model = _model()
        privacy = (
            PrivacyConfig(secure_aggregation=True, neighbours="secagg+", clip_norm=1.0)
            if args.mode == "secure" else PrivacyConfig()
        )
        config = CoordinatorConfig(
            algorithm=AlgorithmConfig(inner_steps=1, uplink_codec="none", downlink_codec="none"),
            inner_optimizer=InnerOptimizerConfig(lr=1e-2), total_rounds=args.rounds, privacy=privacy, **common,
        )
    else:  # the study's run, as `geoloco simulate` would run it, through the real system
        simulated, spec, workload = study
        rounds = simulated.run_rounds
        model = workload.build_model(simulated.simulation.seed)
        config = CoordinatorConfig(
            algorithm=simulated.algorithm, inner_optimizer=simulated.inner_optimizer,
            outer_optimizer=simulated.outer_optimizer, privacy=simulated.privacy, seed=simulated.simulation.seed,
            total_rounds=rounds, eval_every=simulated.simulation.eval_every or rounds, workload=spec.to_table(),
            **common,
        )

        def eval_fn(flat: Any) -> float:
            layout.load_(model, flat)
            return float(workload.eval_loss(model))

    layout = ParamLayout.from_model(model)
    profiles = _ThreadProfiles() if args.profile else None
    marks: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    probe_cpu_s = 0.0
    # The probes run on a thread of their own, started before the profilers are installed, so
    # that neither the profile nor the CPU figures count them (their CPU time is subtracted).
    probe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-probe")
    probe.submit(lambda: None).result()

    def probe_round(round_number: int) -> tuple[dict[str, float], float]:
        start = time.thread_time()
        # At every round's end: one count can catch a site's channel reconnecting (a loaded
        # machine misses a keepalive) with its old and new connection both open for a moment.
        baseline.setdefault("connections", []).append(_connections_settled(server.port))
        if round_number == 0 and profiles is not None:
            baseline["profile"] = profiles.snapshot()
        return _thread_cpu(), time.thread_time() - start

    pids_file = out / "worker-pids"

    def on_round_end(record: RoundRecord) -> None:
        nonlocal probe_cpu_s
        now, cpu = time.monotonic(), _process_cpu()
        workers = [int(pid) for pid in pids_file.read_text().split()] if pids_file.exists() else []
        threads, cost = probe.submit(probe_round, record.round).result()
        marks.append({"round": record.round, "t": now, "cpu_s": cpu - probe_cpu_s,
                      "workers_cpu_s": _processes_cpu(workers), "threads": threads,
                      "participants": len(record.participants)})
        probe_cpu_s += cost

    server = CoordinatorServer(config, layout.flatten(model), layout, eval_fn, on_round_end=on_round_end)
    if eval_fn is None:
        del model
    seen: Counter[str] = Counter()
    rejections: Counter[str] = Counter()

    def count(event: Any) -> None:
        if event.kind == ev.SITE_DROPPED:
            seen[event.kind] += 1
        elif event.kind == ev.REQUEST_REJECTED:
            seen[event.kind] += 1
            rejections[f"{event.data.get('method', '?').rsplit('/', 1)[-1]} {event.data.get('code', '?')}"] += 1

    server.rounds.events.add_listener(count)
    max_threads = 0
    sampling = threading.Event()

    def sample() -> None:
        nonlocal max_threads
        while not sampling.wait(SAMPLE_S):
            max_threads = max(max_threads, len(os.listdir("/proc/self/task")))

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    if profiles is not None:
        profiles.install()  # before start(): every server thread is created after this
    started = time.monotonic()
    server.start()
    (out / "port").write_text(str(server.port))
    finished = False
    try:
        finished = server.wait_until_finished(args.timeout)
    finally:
        sampling.set()
        server.stop(grace=1.0)
    result: dict[str, Any] = {
        "finished": finished,
        "elapsed_s": time.monotonic() - started,
        "marks": marks,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "max_threads": max(max_threads, len(os.listdir("/proc/self/task"))),
        "dropped": seen[ev.SITE_DROPPED],
        "rejected": seen[ev.REQUEST_REJECTED],
        "rejections": dict(rejections.most_common(8)),
        "connections": min(baseline.get("connections") or [0]),
        "connections_max": max(baseline.get("connections") or [0]),
    }
    (out / "coordinator.json").write_text(json.dumps(result))
    if profiles is not None and "profile" in baseline:
        stats = probe.submit(lambda: _combine(profiles.snapshot(), baseline["profile"], -1)).result()
        (out / "profile.marshal").write_bytes(marshal.dumps(stats))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without the shutdown's waits on threads gRPC may still hold


# --- worker process: many sites as threads ---------------------------------------------------


def _agent(args: argparse.Namespace, index: int) -> Any:
    import torch

    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.site_agent.agent import SiteAgent
    from geoloco.site_agent.config import SiteAgentConfig

    name = _site_name(index)
    plain = args.mode == "plain"
    study = _study(args)
    if study is None:
        model = _model()
        generator = torch.Generator().manual_seed(index)
        batch = (torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator))

        def fixed() -> Iterator[Any]:
            while True:
                yield batch

        optimizer, batches, loss = torch.optim.SGD(model.parameters(), lr=1e-2), fixed(), _loss
    else:  # the study's model, inner optimizer and this site's share of the data
        simulated, _, workload = study
        seed = simulated.simulation.seed
        model = workload.build_model(seed)
        optimizer = simulated.inner_optimizer.build(model.parameters())
        batches, loss = workload.site_batches(index, int(args.sites), seed), workload.loss
    return SiteAgent(
        model, optimizer, batches, loss,
        coordinator=f"localhost:{args.port}", site=name,
        tls=None if plain else TLSFiles.from_dir(Path(args.certs), name), insecure=plain,
        config=SiteAgentConfig(device="cpu"),
    )


def _own_connections() -> None:
    """Give every site channel of this process its own TCP connection, as sites on their own
    hosts have. gRPC shares one connection among a process's channels whose target and options
    are equal (its global subchannel pool): plain-text sites in one worker would otherwise
    multiplex over one socket (TLS sites differ by their credentials). The option is added to
    the channels' own (``transport_endpoints.client_channel``) in this process only."""
    from geoloco.protos import transport_endpoints
    from geoloco.site_agent import client, client_streams

    def own_channel(*args: Any, extra_options: Any = (), **kwargs: Any) -> Any:
        options = [("grpc.use_local_subchannel_pool", 1), *extra_options]
        return transport_endpoints.client_channel(*args, extra_options=options, **kwargs)

    client.client_channel = own_channel
    client_streams.client_channel = own_channel


def _role_worker(args: argparse.Namespace) -> None:
    _exit_with_parent()
    import torch

    torch.set_num_threads(1)
    first, last = (int(x) for x in args.range.split(":"))
    _own_connections()
    agents = [_agent(args, index) for index in range(first, last)]
    outcomes: dict[str, str] = {}

    def run(agent: Any) -> None:
        try:
            summary = agent.run()
            outcomes[agent.site] = "finished" if summary.run_finished else "stopped"
        except BaseException as error:  # noqa: BLE001 (reported in the worker's result)
            outcomes[agent.site] = f"{type(error).__name__}: {error}"[:300]

    profiles = _ThreadProfiles() if args.profile else None
    if profiles is not None:
        profiles.install()  # every site thread, and every thread gRPC starts for them
    threads = [threading.Thread(target=run, args=(a,), name=f"site-{a.site}", daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + args.timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for agent in agents:
        agent.stop()
    if profiles is not None:
        Path(args.out).with_suffix(".prof").write_bytes(marshal.dumps(profiles.snapshot()))
    failures = {site: o for site, o in outcomes.items() if o != "finished"}
    failures.update({a.site: "did not end in time" for a in agents if a.site not in outcomes})
    _worker_result(args, len(agents), outcomes, failures)


def _worker_result(args: argparse.Namespace, sites: int, outcomes: dict[str, str], failures: dict[str, str]) -> None:
    """Write a worker's result for the driver and exit: daemon site threads that did not end (a
    call stuck) would hold up a normal exit."""
    Path(args.out).write_text(json.dumps({
        "sites": sites,
        "finished": sum(o == "finished" for o in outcomes.values()),
        "failures": dict(list(failures.items())[:10]),
        "failed": len(failures),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cpu_s": _process_cpu(),
    }))
    sys.stdout.flush()
    os._exit(0)


# --- worker process: many light sites -----------------------------------------------------


def _role_light_worker(args: argparse.Namespace) -> None:
    """``--client light``: every site of this process is a thread with its own channel (and TCP
    connection, a real site's channel options) that speaks the protocol directly: Join, per round
    one Upload of a fixed encoded update (codec ``none``) and one AwaitBroadcast read to its end,
    then Leave; a small pool sends every site's heartbeats at the run's interval. No model, no
    training, no fetch: what the coordinator serves is the same, while a site costs a few
    milliseconds of CPU a round (heartbeats included), so two cores hold a thousand of them beside
    the coordinator. (An asyncio version on one event loop per worker lost
    connections at 1,024 sites: the page of this benchmark says what was seen.)"""
    _exit_with_parent()
    import uuid

    import grpc
    import torch

    from geoloco.compression import parse_codec
    from geoloco.protos import geoloco_pb2 as pb
    from geoloco.protos import geoloco_pb2_grpc as pb_grpc
    from geoloco.protos.protocol_version import PROTOCOL_VERSION
    from geoloco.protos.transport_endpoints import client_channel
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.protos.wire_chunks import iter_chunks
    from geoloco.protos.wire_manifests import blob_manifest

    torch.set_num_threads(1)
    first, last = (int(x) for x in args.range.split(":"))
    names = [_site_name(i) for i in range(first, last)]
    TRANSIENT = {  # noqa: N806 (a constant of this worker)
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
    }
    outcomes: dict[str, str] = {}
    doing: dict[str, str] = {}
    """site -> the call it is in (what a failure names)."""
    beating: dict[str, tuple[Any, pb.HeartbeatRequest]] = {}
    """site -> (stub, its heartbeat) while it is in the run."""
    lock = threading.Lock()
    stop = threading.Event()
    interval = [2.0]
    retried: Counter[str] = Counter()
    """Calls retried after a transport failure, by what failed (a real site retries them too)."""

    def retrying(name: str, call: Any, attempts: int = 8) -> Any:
        for attempt in range(attempts):
            try:
                return call()
            except grpc.RpcError as error:
                if error.code() not in TRANSIENT or attempt == attempts - 1:
                    raise
                with lock:
                    retried[f"{doing.get(name, '?')}: {error.code().name}"] += 1
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def site(name: str, index: int) -> None:
        plain = args.mode == "plain"
        tls = None if plain else TLSFiles.from_dir(Path(args.certs), name)
        channel = client_channel(
            f"127.0.0.1:{args.port}", tls=tls, insecure=plain, server_name=None if plain else "localhost",
            extra_options=[("grpc.use_local_subchannel_pool", 1)],
        )
        instance = uuid.uuid4().hex
        try:
            stub = pb_grpc.CoordinatorStub(channel)
            doing[name] = "Join"
            joined = retrying(name, lambda: stub.Join(
                pb.JoinRequest(site=name, protocol_version=PROTOCOL_VERSION, instance_id=instance)
            ))
            session, numel = joined.session_id, int(joined.layout.numel)
            update = torch.randn(numel, generator=torch.Generator().manual_seed(index)).mul_(1e-3)
            data = parse_codec("none").encode(update).to_bytes()
            interval[0] = max(0.05, joined.config.heartbeat_interval_ms / 1000)
            round_number = int(joined.round.round)
            heartbeat = pb.HeartbeatRequest(
                site=name, session_id=session, phase=pb.SITE_PHASE_WAITING, instance_id=instance
            )
            with lock:
                beating[name] = (stub, heartbeat)
            while not stop.is_set():
                heartbeat.round = round_number
                manifest = pb.UploadManifest(
                    site=name, session_id=session, round=round_number, sample_weight=8.0, inner_steps=1,
                    instance_id=instance, blob=blob_manifest(data, codec="none", shape=[numel], dtype="float32"),
                )
                requests = [pb.UploadRequest(manifest=manifest)] + [
                    pb.UploadRequest(chunk=pb.Chunk(index=c.index, data=bytes(c.data))) for c in iter_chunks(data)
                ]
                doing[name] = f"Upload of round {round_number}"
                try:
                    retrying(name, lambda requests=requests: stub.Upload(iter(requests)))
                except grpc.RpcError as error:  # late: the broadcast still comes
                    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                doing[name] = f"AwaitBroadcast of round {round_number}"
                request = pb.AwaitBroadcastRequest(
                    site=name, session_id=session, round=round_number, instance_id=instance
                )
                header = retrying(name, lambda request=request: _header(stub.AwaitBroadcast(request)))
                if header is None:
                    raise RuntimeError(f"round {round_number}: the broadcast stream ended without a header")
                if header.run_finished:
                    break
                round_number = int(header.next_round.round)
            with lock:
                beating.pop(name, None)
            doing[name] = "Leave"
            stub.Leave(pb.LeaveRequest(site=name, session_id=session, reason="run finished", instance_id=instance))
            outcomes[name] = "finished"
        except Exception as error:  # noqa: BLE001 (reported in the worker's result)
            what = (
                f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError)
                else f"{type(error).__name__}: {error}"
            )
            outcomes[name] = f"{doing.get(name, '?')}: {what}"[:300]
        finally:
            with lock:
                beating.pop(name, None)
            channel.close()

    def heartbeats() -> None:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="light-heartbeat") as pool:
            while not stop.wait(interval[0]):
                with lock:
                    due = list(beating.values())
                list(pool.map(lambda sh: _quietly(lambda: sh[0].Heartbeat(sh[1], timeout=10)), due))

    beater = threading.Thread(target=heartbeats, name="light-heartbeats", daemon=True)
    beater.start()
    threads = [
        threading.Thread(target=site, args=(name, index), name=f"site-{name}", daemon=True)
        for index, name in enumerate(names, first)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + args.timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    failures = {site: o for site, o in outcomes.items() if o != "finished"}
    failures.update({n: f"did not end in time ({doing.get(n, '?')})" for n in names if n not in outcomes})
    kinds = Counter(re.sub(r"\d+", "N", why)[:160] for why in failures.values())
    for why, count in kinds.most_common(5):
        sys.stderr.write(f"worker {args.range}: {count} sites failed: {why}\n")
    for why, count in Counter(re.sub(r"\d+", "N", why) for why in retried.elements()).most_common(5):
        sys.stderr.write(f"worker {args.range}: {count} calls retried: {why}\n")
    _worker_result(args, len(names), outcomes, failures)


def _header(stream: Any) -> Any:
    """A broadcast stream read to its end; its header (None when it had none)."""
    header = None
    for answer in stream:
        if answer.HasField("header"):
            header = answer.header
    return header


def _quietly(call: Any) -> None:
    """A heartbeat: a failed one is retried at the next tick, as a real site's is."""
    with contextlib.suppress(Exception):
        call()


# --- driver ----------------------------------------------------------------------------------


class _Children:
    """The processes of one run; every one is killed on exit, whatever happened."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, role: str, *extra: str) -> subprocess.Popen[bytes]:
        from geoloco.protos.transport_malloc import recommended_env

        process = subprocess.Popen(
            [sys.executable, __file__, "--role", role, *extra], env=recommended_env(), stdin=subprocess.PIPE
        )
        self.processes.append(process)
        return process

    def __enter__(self) -> _Children:
        return self

    def __exit__(self, *_: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()


def _role_of(process: subprocess.Popen[bytes]) -> str:
    return str(list(process.args)[3])  # type: ignore[arg-type]  # [python, file, --role, ROLE, ...]


def _wait_file(path: Path, process: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        if process.poll() is not None:
            raise RuntimeError(f"{_role_of(process)} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear within {timeout_s} s")
        time.sleep(0.05)
    return path.read_text()


def _wait_all(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{_role_of(process)} did not end within {timeout_s:.0f} s") from None


def run_one(mode: str, sites: int, args: argparse.Namespace, work: Path, *, profile: bool = False) -> dict[str, Any]:
    """One coordinator and ``sites`` sites in ``args.workers`` processes; the coordinator's figures."""
    from geoloco.coordinator.metrics import read_metrics

    out = Path(tempfile.mkdtemp(prefix=f"{mode}-{sites}{'-profile' if profile else ''}-", dir=work))
    certs = work / "certs"
    common = ["--mode", mode, "--certs", str(certs), "--timeout", str(args.timeout), "--sites", str(sites),
              "--client", args.client, *([] if args.heartbeat_s is None else ["--heartbeat-s", str(args.heartbeat_s)])]
    if args.study is not None:
        common += ["--study", args.study, *(word for text in args.set for word in ("--set", text))]
    load_before = os.getloadavg()
    started = time.monotonic()
    with _Children() as children:
        coordinator = children.spawn(
            "coordinator", *common, "--out", str(out), "--rounds", str(args.rounds),
            *(["--profile"] if profile else []),
        )
        port = _wait_file(out / "port", coordinator, 120)
        workers = min(args.workers, sites)
        bounds = [sites * w // workers for w in range(workers + 1)]
        worker_processes = [
            children.spawn("worker", *common, "--port", port, "--range", f"{bounds[w]}:{bounds[w + 1]}",
                           "--out", str(out / f"worker-{w}.json"),
                           *(["--profile"] if profile and args.profile_sites and w == 0 else []))
            for w in range(workers)
        ]
        (out / "worker-pids").write_text(" ".join(str(p.pid) for p in worker_processes))
        _wait_all([coordinator, *worker_processes], args.timeout + 120)
    wall = time.monotonic() - started
    coordinator_result = json.loads((out / "coordinator.json").read_text())
    worker_results = [json.loads((out / f"worker-{w}.json").read_text()) for w in range(workers)]
    records = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    marks = coordinator_result["marks"]
    later = records[1:] or records
    between = [b["t"] - a["t"] for a, b in itertools.pairwise(marks)]
    cpu_rounds = len(marks) - 1
    cpu_per_round = (marks[-1]["cpu_s"] - marks[0]["cpu_s"]) / cpu_rounds if cpu_rounds else float("nan")
    sites_cpu = (marks[-1]["workers_cpu_s"] - marks[0]["workers_cpu_s"]) / cpu_rounds if cpu_rounds else float("nan")
    thread_cpu: dict[str, float] = {}
    if cpu_rounds:
        first, last = marks[0]["threads"], marks[-1]["threads"]
        thread_cpu = {k: (v - first.get(k, 0.0)) / cpu_rounds for k, v in last.items()}
        cpu_per_round -= sum(v for k, v in thread_cpu.items() if k in _OWN_THREADS)
    result = {
        "mode": mode,
        "sites": sites,
        "workers": workers,
        "rounds": len(records),
        "finished": coordinator_result["finished"],
        "round_s": statistics.median(r["round_time_s"] for r in later) if later else float("nan"),
        "round_times_s": [r["round_time_s"] for r in records],
        "between_broadcasts_s": statistics.median(between) if between else float("nan"),
        "first_round_cpu_s": marks[0]["cpu_s"] if marks else float("nan"),
        "cpu_per_round_s": cpu_per_round,
        "cpu_per_site_round_ms": 1000 * cpu_per_round / sites,
        "sites_cpu_per_round_s": sites_cpu,
        "thread_cpu_per_round_s": dict(sorted(thread_cpu.items(), key=lambda kv: -kv[1])),
        "peak_rss_mib": coordinator_result["peak_rss_mib"],
        "max_threads": coordinator_result["max_threads"],
        "participants": [m["participants"] for m in marks],
        "dropped": coordinator_result["dropped"],
        "rejected": coordinator_result["rejected"],
        "rejections": coordinator_result["rejections"],
        "connections": coordinator_result["connections"],
        "connections_max": coordinator_result["connections_max"],
        "site_failures": sum(w["failed"] for w in worker_results),
        "site_failure_examples": {k: v for w in worker_results for k, v in w["failures"].items()},
        "worker_peak_rss_mib": [w["peak_rss_mib"] for w in worker_results],
        "worker_cpu_s": [w["cpu_s"] for w in worker_results],
        "wall_s": wall,
        "final_eval_loss": records[-1]["eval_loss"] if records else None,
        "epsilon": records[-1]["epsilon"] if records else None,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    if profile and (out / "profile.marshal").exists():
        result["profile"] = marshal.loads((out / "profile.marshal").read_bytes())
    if profile and (out / "worker-0.prof").exists():
        result["sites_profile"] = marshal.loads((out / "worker-0.prof").read_bytes())
    return result


def _failed(mode: str, sites: int, error: BaseException) -> dict[str, Any]:
    return {"mode": mode, "sites": sites, "error": f"{type(error).__name__}: {error}"}


def _load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _report(
    results: list[dict[str, Any]], rounds: int, workers: int, study: str | None = None, client: str = "agent"
) -> None:
    tiny = f"tiny MLP ({4 * WIDTH * WIDTH + 3 * WIDTH:,} parameters), {rounds} rounds"
    what = f"the run of {study}" if study else tiny
    kind = "SiteAgent threads" if client == "agent" else "light site threads (protocol only)"
    print(f"\none coordinator process, N sites as {kind} in {workers} worker processes, {what}, "
          "min_sites = max_sites = N, checkpoints off; medians and CPU over the rounds after the first\n")
    print("| mode | N | round (median) | between broadcasts | coordinator CPU per round | per site | "
          "vs smallest N | sites' CPU per round | coordinator peak RSS | max threads | dropped / site failures "
          "| load before |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    smallest: dict[str, float] = {}
    for r in results:
        if "error" in r:
            print(f"| {MODE_TITLES[r['mode']]} | {r['sites']} | failed: {r['error']} ||||||||||")
            continue
        per_site = r["cpu_per_site_round_ms"]
        base = smallest.setdefault(r["mode"], per_site)
        unfinished = "" if r["finished"] else " (did not finish)"
        print(
            f"| {MODE_TITLES[r['mode']]}{unfinished} | {r['sites']} | {r['round_s']:.2f} s "
            f"| {r['between_broadcasts_s']:.2f} s | {r['cpu_per_round_s']:.2f} s | {per_site:.2f} ms "
            f"| {per_site / base:.2f}x | {r['sites_cpu_per_round_s']:.2f} s | {r['peak_rss_mib']:.0f} MiB "
            f"| {r['max_threads']} "
            f"| {r['dropped']} / {r['site_failures']} | {_load(r['load_before'])} |"
        )
    for r in results:
        if "error" in r:
            continue
        theirs = [(k, v) for k, v in r["thread_cpu_per_round_s"].items() if not k.startswith(OWN_THREAD_PREFIX)]
        groups = ", ".join(f"{k} {v:.2f}" for k, v in theirs[:6])
        print(f"\n{r['mode']} N={r['sites']}: rounds {', '.join(f'{t:.2f}' for t in r['round_times_s'])} s; "
              f"participants {r['participants']}; round 0 incl. start-up and joins: "
              f"{r['first_round_cpu_s']:.1f} CPU s; wall {r['wall_s']:.0f} s; worker peak RSS "
              f"{', '.join(f'{m:.0f}' for m in r['worker_peak_rss_mib'])} MiB, CPU over their life "
              f"{', '.join(f'{c:.0f}' for c in r['worker_cpu_s'])} s; "
              f"rejected calls {r['rejected']} {r['rejections'] or ''}; "
              f"TCP connections to the coordinator at round ends: {r['connections']} "
              f"(at most {r['connections_max']}); "
              f"load after {_load(r['load_after'])}"
              f"\n  coordinator CPU s per round by thread: {groups}")
        if r["site_failure_examples"]:
            print(f"  site failures: {r['site_failure_examples']}")


def _report_study(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The study's epsilon and final eval loss through the real system, beside the simulator's.

    Two simulator spreads, because the real runs vary for one reason only: ``--simulator-runs``
    repeats the study's own seed (the real runs' data and initial weights; only the DP noise and
    the stochastic rounding, drawn from the OS, differ, as between two real runs), and
    ``--simulator-seeds`` varies the seed as well (the spread a paper's error bar would show).
    Returns the simulator's runs (spread, seed, sites counted per round, epsilon, final eval loss).
    """
    from geoloco.scenarios.research import run

    print(f"\n{args.study} ({', '.join(args.set) or 'as written'}), N = {args.sites}:\n")
    print("| run | seed | sites counted per round | epsilon | final eval loss |")
    print("|---|---:|---|---:|---:|")
    real = [r for r in results if "error" not in r]
    seed = _study(args)[0].simulation.seed  # type: ignore[index]
    for r in real:
        counted = ", ".join(str(n) for n in r["participants"])
        print(f"| real system ({r['mode']}) | {seed} | {counted} | {r['epsilon']} | {r['final_eval_loss']} |")
    spreads: dict[str, list[float]] = {}
    rows: list[dict[str, Any]] = []
    plan = [(f"simulator, run {k + 1}", "same seed", seed) for k in range(args.simulator_runs)]
    plan += [(f"simulator, seed {k}", "seeds", k) for k in range(args.simulator_seeds)]
    for label, spread, run_seed in plan:
        print(f"simulating ({label}) ...", file=sys.stderr, flush=True)
        simulated = run(Path(args.study), overrides=[*args.set, f"sites.count={args.sites}", f"run.seed={run_seed}"])
        last = simulated.records[-1]
        spreads.setdefault(spread, []).append(last["eval_loss"])
        counted = [len(record["participants"]) for record in simulated.records]
        rows.append({"spread": spread, "seed": run_seed, "participants": counted,
                     "epsilon": last["epsilon"], "final_eval_loss": last["eval_loss"]})
        print(f"| {label} | {run_seed} | {', '.join(map(str, counted))} | {last['epsilon']} | {last['eval_loss']} |")
    print()
    for spread, losses in spreads.items():
        if len(losses) < 2:
            continue
        mean, std = statistics.mean(losses), statistics.stdev(losses)
        print(f"simulator over {len(losses)} runs ({spread}): final eval loss {min(losses):.4f} .. "
              f"{max(losses):.4f}, mean {mean:.4f}, std {std:.4f}")
        for r in real:
            if min(r["participants"]) < int(args.sites):
                print(f"  real {r['final_eval_loss']:.4f}: not comparable, a round counted fewer than "
                      f"{args.sites} sites (epsilon and loss are another run's)")
                continue
            loss = r["final_eval_loss"]
            inside = "inside" if min(losses) <= loss <= max(losses) else "OUTSIDE"
            if std == 0:  # no noise (dp off): every run ends on one loss, and the real one should too
                print(f"  real {loss!r}: {'equal to' if loss == mean else 'DIFFERENT from'} every simulator run")
            else:
                print(f"  real {loss:.4f}: {inside} the range, {(loss - mean) / std:+.1f} std from the mean")
    return rows


DEFAULT_ROUNDS = 5

RPCS = ("Join", "FetchModel", "Upload", "UploadStatus", "AwaitBroadcast", "Heartbeat", "SecureStage", "Leave")


def _print_profile(result: dict[str, Any], path: Path) -> None:
    """The top of the profile saved at ``path`` (``pstats``' format), and the RPCs per site and round."""
    import io
    import pstats

    rounds = max(1, result["rounds"] - 1)
    print(f"\ncProfile of the coordinator, {result['mode']} N={result['sites']}, rounds after the first "
          f"({rounds}), thread CPU time, all Python threads (profiled run: round {result['round_s']:.2f} s, "
          f"CPU per round {result['cpu_per_round_s']:.2f} s); saved in {path}")
    stats = pstats.Stats(str(path), stream=io.StringIO())
    calls = {name: (nc, ct) for (file, _, name), (_, nc, _, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
             if file.endswith("servicer.py") and name in RPCS}
    per = rounds * result["sites"]
    busiest = sorted(calls.items(), key=lambda kv: -kv[1][0])
    print("RPCs served per site and round (CPU ms per call, the handler's Python only): " + ", ".join(
        f"{name} {nc / per:.2f} ({1000 * ct / nc:.2f} ms)" for name, (nc, ct) in busiest
    ))
    for order in ("cumulative", "tottime"):
        buffer = io.StringIO()
        pstats.Stats(str(path), stream=buffer).strip_dirs().sort_stats(order).print_stats(TOP)
        text = buffer.getvalue()
        print(f"\n--- top {TOP} by {order} (seconds over {rounds} rounds) ---")
        print(text[text.find("   ncalls"):].rstrip() if "   ncalls" in text else text)


def _print_sites_profile(result: dict[str, Any], path: Path) -> None:
    """The top of the first worker's profile (its sites, the whole run, start-up included)."""
    import io
    import pstats

    buffer = io.StringIO()
    pstats.Stats(str(path), stream=buffer).strip_dirs().sort_stats("tottime").print_stats(TOP)
    text = buffer.getvalue()
    print(f"\n--- the first worker's {result['sites'] // max(1, result['workers'])} sites, whole run, "
          f"top {TOP} by own thread CPU time; saved in {path} ---")
    print(text[text.find("   ncalls"):].rstrip() if "   ncalls" in text else text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="16,64,128,256", help="comma-separated N")
    parser.add_argument("--mode", default="plain,secure", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, help=f"{DEFAULT_ROUNDS} unless given (with --study: the file's)")
    parser.add_argument("--workers", type=int, default=2, help="processes the sites are spread over")
    parser.add_argument("--heartbeat-s", type=float, metavar="S",
                        help="the coordinator's heartbeat_interval_s (timeout 7.5 x S, at least 15 s); default "
                             "its own 2 s. Heartbeats per round grow with the round's length, which grows with N "
                             "where the sites share the machine")
    parser.add_argument("--client", choices=["agent", "light"], default="agent",
                        help="agent: SiteAgent threads that train; light: threads that only speak the "
                             "protocol (plain and tls modes), for N in the thousands on a small machine")
    parser.add_argument("--profile", action="store_true", help="run each mode's largest N again under cProfile")
    parser.add_argument("--profile-sites", action="store_true",
                        help="with --profile: profile the first worker's sites too (slows the profiled run)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "many_sites.json", help="where the results go")
    parser.add_argument("--study", help="a simulate file (e.g. scenarios/privacy_frontier.toml) whose workload, "
                        "algorithm, optimizers, privacy, seed and rounds the coordinator and the sites run "
                        "instead of the tiny MLP; its sites.count is set to N")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --study: an override of the file, as `geoloco simulate --set` takes it")
    parser.add_argument("--simulator-seeds", type=int, default=0, metavar="K",
                        help="with --study: also run the study in the simulator with run.seed = 0..K-1 and "
                             "print its epsilon and final eval loss beside the real system's")
    parser.add_argument("--simulator-runs", type=int, default=0, metavar="K",
                        help="with --study: also run the study K times in the simulator at its own seed "
                             "(the real runs' data; fresh DP noise each time)")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="run every mode and N R times (with DP, every real run draws its own noise)")
    parser.add_argument("--role", choices=["coordinator", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    parser.add_argument("--range", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "coordinator":
        args.sites = int(args.sites)
        _role_coordinator(args)
        return
    if args.role == "worker":
        if args.client == "light":
            _role_light_worker(args)
        else:
            _role_worker(args)
        return
    modes = args.mode.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    counts = sorted({int(n) for n in args.sites.split(",")})
    if counts[0] < 3 and "secure" in modes:
        parser.error("secure aggregation needs at least 3 sites; raise --sites")
    if args.study is not None:
        args.sites = str(counts[-1])  # one N for the study (the file's sites.count is set to it)
        from geoloco.scenarios.config_file import ConfigFileError

        try:
            simulated = _study(args)[0]  # type: ignore[index]
        except ConfigFileError as err:
            parser.error(str(err))
        secure = simulated.privacy.secure_aggregation
        if modes != ["secure" if secure else "tls"]:
            parser.error(f"--study {args.study} runs {'with' if secure else 'without'} secure aggregation: "
                         f"give --mode {'secure' if secure else 'tls'}")
        if args.rounds not in (None, simulated.run_rounds):
            parser.error(f"--study {args.study} runs {simulated.run_rounds} rounds: give --set run.rounds="
                         f"{args.rounds} to change them, not --rounds")
        args.rounds = simulated.run_rounds
        counts = counts[-1:]
    elif args.set or args.simulator_seeds or args.simulator_runs:
        parser.error("--set, --simulator-seeds and --simulator-runs go with --study")
    if args.heartbeat_s is not None and not args.heartbeat_s > 0:
        parser.error(f"--heartbeat-s must be > 0 seconds, got {args.heartbeat_s}")
    if args.client == "light" and (args.study is not None or "secure" in modes or args.profile_sites):
        parser.error("--client light runs the plain and tls modes of the tiny model (its sites neither train "
                     "nor mask); use --client agent for secure, --study and --profile-sites")
    args.rounds = DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is left out of the figures)")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    # SIGTERM unwinds like Ctrl-C: the children are killed and the temporary folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: list[dict[str, Any]] = []
    profiled: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="geoloco-many-sites-") as tmp:
        work = Path(tmp)
        if any(m != "plain" for m in modes):
            certs = work / "certs"
            init_ca(certs)
            issue_coordinator(certs)
            for index in range(counts[-1]):
                issue_site(certs, _site_name(index))
        for mode in modes:
            for sites in [n for n in counts for _ in range(args.repeat)]:
                print(f"running {mode} N={sites} ...", file=sys.stderr, flush=True)
                try:
                    results.append(run_one(mode, sites, args, work))
                except Exception as error:  # noqa: BLE001 (reported as a row; the other runs go on)
                    results.append(_failed(mode, sites, error))
            if args.profile:
                print(f"running {mode} N={counts[-1]} under cProfile ...", file=sys.stderr, flush=True)
                try:
                    profiled.append(run_one(mode, counts[-1], args, work, profile=True))
                except Exception as error:  # noqa: BLE001 (reported after the table)
                    profiled.append(_failed(mode, counts[-1], error))
    _report(results, args.rounds, args.workers, args.study, args.client)
    simulator = _report_study(args, results) if args.study is not None else []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for result in profiled:
        if "error" in result:
            print(f"\nprofiled run {result['mode']} N={result['sites']} failed: {result['error']}")
        elif not result.get("profile"):
            print(f"\nprofiled run {result['mode']} N={result['sites']}: no profile (it did not pass round 0)")
        else:
            path = args.json.with_name(f"{args.json.stem}-{result['mode']}-{result['sites']}.prof")
            path.write_bytes(marshal.dumps(result["profile"]))  # what pstats.Stats(path) loads
            _print_profile(result, path)
        if result.get("sites_profile"):
            path = args.json.with_name(f"{args.json.stem}-{result['mode']}-{result['sites']}-sites.prof")
            path.write_bytes(marshal.dumps(result["sites_profile"]))
            _print_sites_profile(result, path)
    args.json.write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "json"},  # not this machine's paths
         "platform": platform.platform(), "cpus": os.cpu_count(), "results": results,
         "profiled": [{k: v for k, v in r.items() if k not in ("profile", "sites_profile")} for r in profiled],
         "simulator": simulator},
        indent=2, default=str,
    ))


if __name__ == "__main__":
    main()
