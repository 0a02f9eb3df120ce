"""What the manifest checksum costs: CRC-32 (the old default) beside SHA-256 (the new one).

A manifest's checksum must identify its bytes (resume and MANIFEST_CONFLICT compare manifests),
which CRC-32 cannot for encoded updates (they end with their own CRC-32). This measures the price
of SHA-256 on both sides of an upload, in one process, one core:

* sender: ``wire_manifests.blob_manifest`` of the update (the site hashes it once per upload);
* receiver: ``BlobAssembler`` fed the update in 1 MiB chunks and ``finish()`` (the coordinator
  copies each chunk into place and hashes it while chunks arrive).

    python benchmarks/bench_manifest_checksum.py --size-mib 256 --repeats 5

CPU seconds per GiB (``time.process_time``), best of ``--repeats``, with the SHA-256/CRC-32 ratio.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_assembly import BlobAssembler
from geoloco.protos.wire_manifests import blob_manifest

MiB = 1 << 20
GiB = 1 << 30
ALGORITHMS = {"crc32": pb.CHECKSUM_ALGORITHM_CRC32, "sha256": pb.CHECKSUM_ALGORITHM_SHA256}


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="update size (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell; best is kept")
    args = parser.parse_args()
    nbytes = args.size_mib * MiB
    block = os.urandom(MiB)
    data = bytes(block) * args.size_mib
    chunk = MiB
    rows: dict[str, tuple[float, float]] = {}
    for name, algorithm in ALGORITHMS.items():
        # A raw buffer, so CRC-32 is allowed; for the cost the content does not matter.
        manifest = blob_manifest(data, chunk_size=chunk, checksum_algorithm=algorithm)

        def describe(a: pb.ChecksumAlgorithm = algorithm) -> None:
            blob_manifest(data, chunk_size=chunk, checksum_algorithm=a)

        send = _best(describe, args.repeats)

        def receive(m: pb.BlobManifest = manifest) -> None:
            assembler = BlobAssembler(m)
            view = memoryview(data)
            for index in range(m.num_chunks):
                assembler.add(index, view[index * chunk : (index + 1) * chunk])
            assembler.finish()

        rows[name] = (send * GiB / nbytes, _best(receive, args.repeats) * GiB / nbytes)
    crc, sha = rows["crc32"], rows["sha256"]
    print(f"{args.size_mib} MiB update, 1 MiB chunks, best of {args.repeats}, CPU s/GiB")
    print("| side | CRC-32 | SHA-256 | SHA-256 / CRC-32 |")
    print("|---|---:|---:|---:|")
    print(f"| sender: blob_manifest | {crc[0]:.3f} | {sha[0]:.3f} | {sha[0] / crc[0]:.2f} |")
    print(f"| receiver: assemble + verify | {crc[1]:.3f} | {sha[1]:.3f} | {sha[1] / crc[1]:.2f} |")


if __name__ == "__main__":
    main()
