"""The secure-aggregation modules keep the layering: pure (no protobuf, no gRPC)."""

from __future__ import annotations

import subprocess
import sys


def test_secagg_imports_neither_protos_nor_grpc() -> None:
    code = (
        "import sys\n"
        "import geoloco.algorithms.privacy.secagg_in_memory, geoloco.algorithms.privacy.secagg_stages\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('geoloco.protos', 'grpc', 'google.protobuf')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
