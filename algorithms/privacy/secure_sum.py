"""The secure (masked) sum as an aggregation, with every party in this process (the simulator).

The real system runs the same ``SecAggClient``/``SecAggServer`` stages over gRPC; here one object
holds the sites' updates of a round, runs the whole protocol once every expected site has
submitted, and then behaves like any other aggregation: ``add`` marks a site as counted (its
update is already inside the masked sum), ``take_result`` hands over the unmasked mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyConfig,
    PrivateUpdateEncoder,
    central_dp_mean,
    private_round_in_memory,
)
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.compression import Encoded

__all__ = ["InMemorySecureSum"]


class InMemorySecureSum:
    """One secure round over ``expected`` sites (names); the protocol runs at the last submit."""

    def __init__(
        self,
        privacy: PrivacyConfig,
        uplink_codec: str,
        encoders: Mapping[str, PrivateUpdateEncoder],
        identity_keys: Mapping[str, Ed25519PrivateKey],
        *,
        expected: Sequence[str],
        session: str,
        round_index: int,
        index_seed: int,
    ) -> None:
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.encoders = encoders
        self.identity_keys = identity_keys
        self.expected = list(expected)
        # The protocol numbers parties 0..n-1 (Shamir evaluation points derive from them).
        self._index = {site: k for k, site in enumerate(self.expected)}
        self.session = session
        self.round_index = round_index
        self.index_seed = index_seed
        self._updates: dict[str, torch.Tensor] = {}
        self._sites: list[str] = []
        self._mean: torch.Tensor | None = None
        self.survivors: tuple[str, ...] = ()
        self.traffic: dict[str, SiteTraffic] = {}
        """site -> its bytes in each stage of the protocol (keys, shares, masked vector, unmask)."""

    @property
    def sites(self) -> list[str]:
        return list(self._sites)

    def submit(self, site: str, update: torch.Tensor) -> None:
        """Site ``site``'s pseudo-gradient; the last expected one runs the protocol."""
        if site not in self._index:
            raise ValueError(f"site {site!r} is not one of this round's sites ({', '.join(self.expected)})")
        self._updates[site] = update
        if len(self._updates) == len(self.expected):
            self._run()

    def _run(self) -> None:
        by_index = {self._index[s]: u for s, u in self._updates.items()}
        traffic: dict[int, SiteTraffic] = {}
        mean, survivors = private_round_in_memory(
            self.privacy, self.uplink_codec, dict(sorted(by_index.items())),
            {self._index[s]: e for s, e in self.encoders.items()},
            {self._index[s]: k for s, k in self.identity_keys.items()},
            session=self.session, round_index=self.round_index, index_seed=self.index_seed,
            traffic=traffic,
        )
        if self.privacy.dp == "central":
            mean = central_dp_mean(mean, len(survivors), self.privacy)
        self._mean = mean
        self._updates.clear()
        self.survivors = tuple(self.expected[k] for k in survivors)
        self.traffic = {self.expected[k]: t for k, t in traffic.items()}

    def add(
        self, update: Encoded | torch.Tensor, weight: float = 1.0, *, site: str, stale: bool = False
    ) -> None:
        """Count ``site`` in the round: its update is inside the sum already (uniform weight)."""
        if stale:
            raise ValueError("secure aggregation does not fold late updates")
        if site not in self.survivors:
            raise ValueError(f"site {site!r} is not among the secure round's survivors")
        self._sites.append(site)

    def take_result(self) -> torch.Tensor:
        if self._mean is None:
            missing = sorted(set(self.expected) - set(self._updates))
            raise ValueError(f"the secure round has not run: waiting for {', '.join(missing)}")
        mean, self._mean = self._mean, None
        return mean
