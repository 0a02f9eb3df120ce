"""The version of geoloco's wire protocol, which a site sends in Join.

The coordinator refuses a site whose version differs (``geoloco.coordinator.membership``): the
meaning of ``geoloco.proto`` changed between them in a way that protobuf's compatibility rules do
not cover, so the round would fail later and less clearly.
"""

from __future__ import annotations

__all__ = ["COUNTED_HISTORY_ROUNDS", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 4
"""Sent in Join; bump on incompatible changes to the meaning of geoloco.proto.

2: SecureStage carries typed ``SecAgg*`` messages in oneofs instead of JSON in a ``payload``
field (now reserved), so a version-1 peer cannot take part in a secure round.
3: Blob manifests carry SHA-256 by default and a CRC-32 equal to ``CRC32_RESIDUE`` (what every
version-2 upload and delta carried) is refused, so a version-2 peer's uploads would fail.
4: A secure round's ``advertise_keys`` reply carries every site's name but only the receiving
site's and its neighbours' advertisements and identity bindings, and the unmask request only
its share holders' signatures; a version-3 site derives the neighbour graph from the
advertisements it receives and would refuse the round.
"""

COUNTED_HISTORY_ROUNDS = 64
"""Rounds back for which a coordinator still answers a site's AwaitBroadcast with whether its
update counted or was refused (``BroadcastHeader.included``/``refused``), a restarted one too:
what a site may ask after it skipped a round's broadcast."""
