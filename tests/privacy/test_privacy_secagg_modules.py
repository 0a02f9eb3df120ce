"""The secure-aggregation modules keep the layering: pure (no protobuf, no gRPC), and
``geoloco.algorithms.secagg`` still offers every public name of the split modules."""

from __future__ import annotations

import subprocess
import sys

import geoloco.algorithms.secagg as secagg
from geoloco.algorithms import secagg_client, secagg_crypto, secagg_messages, secagg_server, secagg_stages


def test_secagg_imports_neither_protos_nor_grpc() -> None:
    code = (
        "import sys\n"
        "import geoloco.algorithms.secagg, geoloco.algorithms.secagg_stages\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('geoloco.protos', 'grpc', 'google.protobuf')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


SHARED_INTERNALS = {
    "DOMAIN", "STAGE_DONE", "add_masks", "hkdf", "private_bytes", "advert_signed_bytes", "survivors_signed_bytes",
}
"""Names the split modules share among themselves; importable from them, not from the facade."""


def test_the_facade_re_exports_every_public_name_of_the_split_modules() -> None:
    for module in (secagg_crypto, secagg_messages, secagg_client, secagg_server, secagg_stages):
        for name in set(module.__all__) - SHARED_INTERNALS:
            assert getattr(secagg, name) is getattr(module, name), (module.__name__, name)
    assert set(secagg.__all__).isdisjoint(SHARED_INTERNALS)
