"""The CUDA paths, checked in one run on one GPU machine, with a CPU fallback that CI runs.

    bash benchmarks/gpu_check.sh            # on a machine with a GPU: the full check (<= 8 min)
    bash benchmarks/gpu_check.sh --quick    # small sizes; on a machine without CUDA, on the CPU

Tests and CI never need a GPU, so the CUDA branches of geoloco (codecs on device tensors, the
outer step on the coordinator's device, a site training on ``device = "cuda"``, FSDP sites over
NCCL) are exercised only when a GPU machine is at hand. This script is what to run then, as one
command, and it prints one table. Without CUDA it runs every check it can on the CPU (smaller),
so the script itself cannot rot unnoticed: ``.ci/run`` runs ``--quick``.

What it checks, in order (each row of the table):

1. ``codec <spec>``: encode and decode on the device, the decoded tensor on that device, the
   round-trip error within the codec's bound, and encode / decode throughput (GB of fp32 input
   per second, CUDA-synchronised, best of 3 after a warm-up);
2. ``outer step``: one DiLoCo outer step (Nesterov) of a strategy built on the device against
   the same step on the CPU: the new weights agree to float rounding (max |diff| reported);
3. ``round <codec>``: a whole single-site round over real gRPC (loopback, plain text) with
   coordinator and site computing on the device (``benchmarks/bench_round_phases.py``), beside
   raw TCP moving the same bytes: 1B parameters on a GPU, 256K on the fallback;
4. ``fsdp site``: a 2-rank FSDP site under torchrun (NCCL on a GPU, gloo on the CPU) through one
   round (``benchmarks/bench_sharded.py``); only on a GPU or with ``--sharded``;
5. ``cuda tests``: the tests with CUDA branches (device resolution, NCCL process groups); not in
   ``--quick``.

Exit status 1 when any check failed (the table says which and why).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from geoloco.algorithms.aggregation import RunningSum
from geoloco.algorithms.strategy import AlgorithmConfig, build_strategy
from geoloco.compression import parse_codec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CODECS = ("none", "bf16", "int8", "topk:0.01|int4")
ERROR_BOUNDS = {"none": 0.0, "bf16": 1e-2, "int8": 2e-2, "topk:0.01|int4": 1.0}
"""Largest relative L2 error of a round trip per codec (``topk`` keeps 1 % of the values, so
only ``<= 1`` is promised: it never adds energy)."""
CUDA_TESTS = (
    "tests/site_agent/test_distributed.py",
    "tests/coordinator/test_round_core_in_coordinator.py",
)

Row = tuple[str, bool, str]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(function: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    function()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def check_codec(spec: str, numel: int, device: torch.device) -> Row:
    codec = parse_codec(spec)
    x = torch.randn(numel, device=device)
    encoded = codec.encode(x, seed=0)
    y = codec.decode(encoded, device=device)
    if y.device.type != device.type:
        return f"codec {spec}", False, f"decoded on {y.device}, expected {device}"
    error = float(torch.linalg.vector_norm(y.float() - x) / torch.linalg.vector_norm(x))
    bound = ERROR_BOUNDS[spec]
    if not error <= bound:
        return f"codec {spec}", False, f"relative error {error:.3g} above {bound:g}"
    encode_s = _best_s(lambda: codec.encode(x, seed=0), device)
    decode_s = _best_s(lambda: codec.decode(encoded, device=device), device)
    gb = numel * 4 / 1e9
    return f"codec {spec}", True, f"error {error:.2g}; encode {gb / encode_s:.1f} GB/s, decode {gb / decode_s:.1f} GB/s"


def check_outer_step(numel: int, device: torch.device) -> Row:
    """The same outer step on the device and on the CPU."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(numel, generator=generator)
    updates = [torch.randn(numel, generator=generator) * 1e-2 for _ in range(2)]
    results = []
    for where in (torch.device("cpu"), device):
        strategy = build_strategy(AlgorithmConfig(inner_steps=1), numel=numel, device=where)
        aggregation = RunningSum(numel, device=where)
        for k, update in enumerate(updates):
            aggregation.add(update.to(where), 1.0, site=str(k))
        plan = strategy.configure_round(0, ["0", "1"])
        results.append(strategy.aggregate_round(weights.to(where), aggregation, plan).global_flat.cpu())
    diff = float((results[0] - results[1]).abs().max())
    ok = diff <= 1e-5
    return "outer step", ok, f"max |device - cpu| {diff:.2g} on {device}" + ("" if ok else " (above 1e-5)")


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def check_rounds(numel: int, device: torch.device, codecs: str, rounds: int, timeout_s: float) -> list[Row]:
    command = [
        sys.executable, str(HERE / "bench_round_phases.py"), "--plain", "--codecs", codecs, "--numel", str(numel),
        "--rounds", str(rounds), "--device", device.type, "--timeout", str(timeout_s),
    ]
    try:
        result = _run(command, timeout_s + 60)
    except subprocess.TimeoutExpired:
        return [(f"round {codecs}", False, f"no result within {timeout_s:.0f} s")]
    if result.returncode != 0:
        return [(f"round {codecs}", False, (result.stderr or result.stdout).strip().splitlines()[-1][:200])]
    rows: list[Row] = []
    for record in json.loads(result.stdout.strip().splitlines()[-1]):
        ratio = record["round_s"] / record["raw_tcp_s"]
        rows.append((
            f"round {record['codec']}", True,
            f"{numel / 1e6:.3g}M params: {record['round_s']:.2f} s a round, raw TCP {record['raw_tcp_s']:.2f} s "
            f"({ratio:.1f}x); coordinator peak {record['coordinator_peak_rss_mib']:.0f} MiB",
        ))
    return rows


def check_fsdp(params: float, timeout_s: float) -> Row:
    command = [
        sys.executable, str(HERE / "bench_sharded.py"), "--params", f"{params:g}", "--modes", "sharded",
        "--sites", "1", "--ranks", "2", "--rounds", "1", "--timeout", str(timeout_s),
    ]
    try:
        result = _run(command, timeout_s + 60)
    except subprocess.TimeoutExpired:
        return "fsdp site", False, f"no result within {timeout_s:.0f} s"
    last = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode != 0:
        return "fsdp site", False, (result.stderr or result.stdout).strip().splitlines()[-1][:200]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return "fsdp site", True, f"2 ranks ({backend}), {params:.3g} params: {last[:160]}"


def check_cuda_tests(timeout_s: float) -> Row:
    result = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS], timeout_s)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    return "cuda tests", result.returncode == 0, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, no torchrun, no pytest (what CI runs)")
    parser.add_argument("--cpu", action="store_true", help="check the CPU paths even when CUDA is present")
    parser.add_argument("--sharded", action="store_true", help="run the FSDP check without a GPU too")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    where = torch.cuda.get_device_name(0) if gpu else "CPU (no CUDA: the fallback)"
    print(f"torch {torch.__version__}, {where}", flush=True)
    codec_numel = 4 * 2**20 if args.quick else (256 * 2**20 if gpu else 16 * 2**20)
    round_numel = 256 * 2**10 if args.quick else (2**30 if gpu else 16 * 2**20)
    rows: list[Row] = []
    for spec in CODECS:
        rows.append(check_codec(spec, codec_numel, device))
    rows.append(check_outer_step(2**20, device))
    if args.quick:
        rows += check_rounds(round_numel, device, "none", 1, 300)
    else:
        rows += check_rounds(round_numel, device, "none,int8", 2, 420 if gpu else 300)
    if not args.quick and (gpu or args.sharded):
        rows.append(check_fsdp(250e6 if gpu else 1e6, 300))
    if not args.quick:
        rows.append(check_cuda_tests(300))
    print("\n| check | result | figures |\n|---|---|---|")
    for name, ok, text in rows:
        cells = (name, "ok" if ok else "FAILED", text)
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    failed = [name for name, ok, _ in rows if not ok]
    if failed:
        print(f"\n{len(failed)} failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
