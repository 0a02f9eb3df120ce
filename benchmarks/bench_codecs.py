"""Codec throughput beside ``tensor.copy_`` on the same machine, in the same run.

    python benchmarks/bench_codecs.py [--numel N] [--quick] [--repeats R] [--threads T]

Prints markdown tables: encode and decode GB/s per codec (GB of float32 input per second), the
ratio of each to ``copy_`` bandwidth, and bits per value on the wire; then ``torch.topk`` over
the whole tensor against our per-chunk ``topk`` encode. Every time is the best of ``--repeats``
runs after one warm-up, which filters out noise from other processes on a shared machine.
Nothing here asserts speed; the numbers are for reading. Decode is measured twice: returning a
fresh tensor (what ``decode`` does by default, and where first-touch page faults of the new
memory can dominate) and into a preallocated ``out=`` tensor.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from geoloco.compression import parse_codec

CODEC_SPECS = (
    "none",
    "bf16",
    "int8",
    "int4",
    "int2",
    "int1",
    "int8:stochastic",
    "topk:0.01",
    "topk:0.01|int4",
    "randk:0.01|int8",
)


def best_time(function: Callable[[int], object], repeats: int) -> float:
    """Best wall time in seconds over ``repeats`` runs of ``function(run)``, after a warm-up run."""
    function(repeats)
    best = float("inf")
    for run in range(repeats):
        start = time.perf_counter()
        function(run)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="float32 values per tensor (default 64M)")
    parser.add_argument("--quick", action="store_true", help="4M values and 2 repeats, for a smoke run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best is kept)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    numel = 4 * 2**20 if args.quick else args.numel
    repeats = 2 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    source = torch.randn(numel)
    gigabytes = source.numel() * source.element_size() / 1e9
    destination = torch.empty_like(source)
    copy_gbps = gigabytes / best_time(lambda run: destination.copy_(source), repeats)

    print(f"numel={numel:,} float32 ({gigabytes * 1e3:.0f} MB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best of {repeats}")
    print()
    print(f"`copy_` bandwidth: {copy_gbps:.2f} GB/s")
    print()
    print("| codec (canonical spec) | bits/value | encode GB/s | x copy_ | decode GB/s | x copy_ "
          "| decode out= GB/s | x copy_ |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    topk_encode_seconds = None
    for spec in CODEC_SPECS:
        codec = parse_codec(spec)
        # Each run gets its own round seed, as in training: randk must regenerate its indices
        # (a repeated seed would hit its cache). Decoding cycles through distinct encodings for
        # the same reason; other codecs ignore the seed, so one encoding serves them.
        seeded = spec.startswith("randk")
        encodings = [codec.encode(source, seed=run) for run in range(repeats + 1 if seeded else 1)]
        encode_seconds = best_time(lambda run, codec=codec: codec.encode(source, seed=1000 + run), repeats)
        decode_seconds = best_time(
            lambda run, codec=codec, encodings=encodings: codec.decode(encodings[run % len(encodings)]), repeats
        )
        decode_out_seconds = best_time(
            lambda run, codec=codec, encodings=encodings: codec.decode(
                encodings[(run + 1) % len(encodings)], out=destination
            ),
            repeats,
        )
        if spec == "topk:0.01":
            topk_encode_seconds = encode_seconds
        encode_gbps = gigabytes / encode_seconds
        decode_gbps = gigabytes / decode_seconds
        decode_out_gbps = gigabytes / decode_out_seconds
        bits = 8 * encodings[0].nbytes / numel
        print(f"| `{codec.spec}` | {bits:.3f} | {encode_gbps:.2f} | {encode_gbps / copy_gbps:.2f} "
              f"| {decode_gbps:.2f} | {decode_gbps / copy_gbps:.2f} "
              f"| {decode_out_gbps:.2f} | {decode_out_gbps / copy_gbps:.2f} |")
        del encodings

    keep = max(1, numel // 100)
    magnitude = torch.empty_like(source)

    def plain_topk(run: int) -> None:
        torch.abs(source, out=magnitude)
        torch.topk(magnitude, keep, sorted=False)

    plain_seconds = best_time(plain_topk, min(2, repeats))
    assert topk_encode_seconds is not None
    print()
    print("| top-1% selection | seconds | speed-up |")
    print("|---|---:|---:|")
    print(f"| `torch.topk` over the whole tensor (k={keep:,}) | {plain_seconds:.3f} | 1.00 |")
    print(f"| `{parse_codec('topk:0.01').spec}` encode | {topk_encode_seconds:.3f} "
          f"| {plain_seconds / topk_encode_seconds:.2f} |")


if __name__ == "__main__":
    main()
