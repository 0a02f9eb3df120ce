"""Regional relays (``geoloco relay``): a region's sites talk to a relay, the relay talks to the
coordinator.

A relay serves the coordinator's own protocol (same messages, same mutual TLS) to its sites,
verifies their uploads, combines them into one weighted partial sum and uploads that upward
with the combined weight and the list of sites it contains; it receives each round's broadcast
once and serves it to its sites. The coordinator's traffic per round is then proportional to the
number of relays, not of sites. See ``docs/architecture.md`` ("Regional relays").

The relay sits above ``coordinator`` and ``site_agent`` (it reuses the coordinator's upload
checks and errors) and below ``scenarios`` (which starts it as a process).
"""

from geoloco.relay.config import RelayConfig
from geoloco.relay.server import RelayServer

__all__ = ["RelayConfig", "RelayServer"]
