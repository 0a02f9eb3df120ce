"""A site process's peak memory in whole rounds, and where in the round it is reached.

One coordinator process and one site process (``benchmarks/bench_round_phases.py``'s roles:
mutual TLS over loopback, a model of ``--numel`` fp32 parameters in 16 tensors, SGD inner
optimizer, trivial inner step) run ``--rounds`` rounds per codec. Inside the site a thread
samples the resident set (``/proc/self/statm``) every few milliseconds and, whenever it reaches a
new high, records the main thread's stack: the peak's place in the round. Reported per codec:
the site's peak RSS, its multiple of the model above the baseline (the interpreter with torch
and gRPC imported and the model built), the issue's target (weights + global copy + inner
optimizer state (none for SGD) + one residual (lossy codecs only) + 300 MB), and the stack at
the peak.

    python benchmarks/bench_site_memory.py --numel 16777216 --codecs none,int8
    python benchmarks/bench_site_memory.py --numel 67108864 --codecs none,int8
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_round_phases as phases

MiB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _anon_bytes() -> int:
    """Resident anonymous memory (``RssAnon``): a broadcast that arrives in a file buffer is page
    cache, which RSS counts while it is mapped and the kernel can write back and reclaim."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakSampler:
    """Samples RSS in a thread; keeps the highest value and the main thread's stack there."""

    def __init__(self, interval_s: float = 0.002, *, census: bool = False) -> None:
        self.interval_s = interval_s
        self.census = census
        self.peak = 0
        self.peak_anon = 0
        self.stack: list[str] = []
        self.tensors_mib: list[float] = []
        """With ``census``: the live tensors' storages (deduplicated) at the peak, largest first."""
        self.malloc_mib: dict[str, float] = {}
        """With ``census``: glibc's heap at the peak (``mallinfo2``): in use, free but kept, mmapped."""
        self._census_at = 0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, _anon_bytes())
            rss = _rss_bytes()
            if rss > self.peak:
                self.peak = rss
                frame = sys._current_frames().get(self._main or 0)
                if frame is not None:
                    self.stack = [
                        f"{Path(f.filename).name}:{f.lineno} {f.name}"
                        for f in traceback.extract_stack(frame)[-12:]
                    ]
                if self.census and rss > self._census_at * 1.02:
                    self._census_at = rss
                    self.tensors_mib = _live_storages_mib()
                    self.malloc_mib = _mallinfo_mib()
            time.sleep(self.interval_s)


def _live_storages_mib() -> list[float]:
    """Sizes of the storages of every live tensor (gc walk; shared storages once), in MiB."""
    import torch

    sizes: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    storage = obj.untyped_storage()
                    sizes[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, ReferenceError):
                continue
    return sorted((n / MiB for n in sizes.values() if n >= MiB), reverse=True)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]


def _mallinfo_mib() -> dict[str, float]:
    """glibc's heap: bytes in use, free but kept (not given back), and in mmapped blocks."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"heap_in_use": info.uordblks / MiB, "heap_free_kept": info.fordblks / MiB,
            "mmapped": info.hblkhd / MiB}


def _role_site(args: argparse.Namespace) -> None:
    import grpc  # noqa: F401 (the baseline includes it)
    import torch  # noqa: F401

    baseline = _rss_bytes()
    model_bytes = 4 * args.numel
    sampler = _PeakSampler(census=args.census)
    sampler.start()
    phases._role_site(args)
    sampler.stop()
    out = Path(args.out)
    result = json.loads((out / "site.json").read_text())
    result.update(baseline_mib=baseline / MiB, sampled_peak_mib=sampler.peak / MiB,
                  peak_anon_mib=sampler.peak_anon / MiB,
                  peak_stack=sampler.stack, model_mib=model_bytes / MiB,
                  tensors_at_peak_mib=sampler.tensors_mib, malloc_at_peak_mib=sampler.malloc_mib)
    (out / "site.json").write_text(json.dumps(result))


def _spawn(role: str, *extra: str) -> subprocess.Popen[bytes]:
    from geoloco.protos.transport_malloc import recommended_env

    env = {**os.environ, **recommended_env()}
    return subprocess.Popen([sys.executable, __file__, "--role", role, *extra], env=env)


def _run_codec(codec: str, args: argparse.Namespace, certs: Path, work: Path) -> dict[str, Any]:
    out = work / codec.replace("|", "_").replace(":", "_")
    out.mkdir()
    common = ["--codec", codec, "--numel", str(args.numel), "--rounds", str(args.rounds),
              "--certs", str(certs), "--out", str(out), "--timeout", str(args.timeout)]
    coordinator = phases._spawn("coordinator", *common)
    port = phases._wait_file(out / "port", coordinator, 300)
    site = _spawn("site", *common, "--port", port, *(["--census"] if args.census else []))
    for process in (site, coordinator):
        if process.wait(args.timeout) != 0:
            raise SystemExit(f"{process.args!r} exited with {process.returncode}")
    result = json.loads((out / "site.json").read_text())
    result["codec"] = codec
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["site"])
    parser.add_argument("--codecs", default="none,int8", help="comma-separated uplink=downlink codecs")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--numel", type=int, default=16 * MiB)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--certs")
    parser.add_argument("--out")
    parser.add_argument("--port")
    parser.add_argument("--census", action="store_true",
                        help="also list the live tensors at the peak (a gc walk per new high: slower)")
    args = parser.parse_args()
    if args.role == "site":
        _role_site(args)
        return
    if args.numel % phases.TENSORS:
        raise SystemExit(f"--numel must be a multiple of {phases.TENSORS}")
    from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

    with tempfile.TemporaryDirectory(prefix="geoloco-site-memory-") as tmp:
        work = Path(tmp)
        certs = work / "certs"
        init_ca(certs)
        issue_coordinator(certs)
        issue_site(certs, phases._SITE)
        results = [_run_codec(codec, args, certs, work) for codec in args.codecs.split(",")]
    model_mib = 4 * args.numel / MiB
    print(f"\n{args.numel:,} parameters ({model_mib:.0f} MiB fp32), 1 site, SGD, mutual TLS, loopback\n")
    print("| codec | site peak RSS | peak anonymous | baseline | (peak - baseline) / model | target | peak / target |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        residual = 0 if r["codec"] == "none" else 1
        target = (2 + residual) * model_mib + 300 * 1e6 / MiB
        peak = r["peak_rss_mib"]
        print(f"| {r['codec']} | {peak:.0f} MiB | {r.get('peak_anon_mib', 0):.0f} MiB | {r['baseline_mib']:.0f} MiB "
              f"| {(peak - r['baseline_mib']) / model_mib:.2f} | {target:.0f} MiB | {peak / target:.2f} |")
    for r in results:
        print(f"\ncodec {r['codec']}: stack at the sampled peak ({r['sampled_peak_mib']:.0f} MiB)")
        for line in r["peak_stack"]:
            print("   ", line)
        if r.get("tensors_at_peak_mib"):
            sizes = r["tensors_at_peak_mib"]
            print(f"  live tensor storages >= 1 MiB at the peak: {len(sizes)}, {sum(sizes):.0f} MiB: "
                  + ", ".join(f"{n:.0f}" for n in sizes[:12]))
            print("  malloc at the peak: " + ", ".join(
                f"{k} {v:.0f} MiB" for k, v in r.get("malloc_at_peak_mib", {}).items()))
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
