"""Secure aggregation, the coordinator's side: the ``SecAggServer`` workflow of one round.

The protocol is described in ``geoloco.algorithms.secagg``. The server relays advertisements and
encrypted shares, adds masked chunks into one aggregate buffer in ``Z_{2^b}`` (keeping CRC-32s of
chunks, never a site's vector), freezes the survivor list, and with ``t`` unmask answers removes
the survivors' self-masks and the pairwise masks shared with dropped sites. Too few sites at any
stage raises ``SecAggAbort``: nothing is revealed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from geoloco.algorithms import shamir
from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.secagg_crypto import add_masks, mask_key, neighbour_graph, num_chunks, public_bytes
from geoloco.algorithms.secagg_messages import (
    MIN_SITES,
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_DONE,
    STAGE_MASKED_INPUT,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    EncryptedShare,
    KeyAdvertisement,
    RoundContext,
    SecAggAbort,
    SecAggViolation,
    UnmaskRequest,
    UnmaskResponse,
)

__all__ = ["SecAggServer"]


@dataclass(slots=True)
class _Upload:
    chunks: dict[int, int] = field(default_factory=dict)
    """chunk index -> CRC-32 of the masked bytes (a resent identical chunk is ignored), never values."""


class SecAggServer:
    """The coordinator's side of one secure round: relays keys and shares, sums masked chunks.

    It holds one aggregate buffer in ``Z_{2^b}`` and digests of received chunks, never a site's
    vector (masked or not). ``result()`` is the exact integer sum of the survivors' inputs.
    """

    def __init__(self, context: RoundContext) -> None:
        self.context = context
        self.stage = STAGE_ADVERTISE_KEYS
        self._ads: dict[int, KeyAdvertisement] = {}
        self._graph: dict[int, frozenset[int]] = {}
        self._mailbox: dict[int, list[EncryptedShare]] = {}
        self._shared: set[int] = set()
        self._uploads: dict[int, _Upload] = {}
        self._aggregate: np.ndarray | None = None
        self._survivors: tuple[int, ...] = ()
        self._dropped: tuple[int, ...] = ()
        self._signatures: dict[int, bytes] = {}
        self._responses: dict[int, UnmaskResponse] = {}
        self._chunks = num_chunks(context.numel, context.chunk_size)

    def _expect(self, *stages: str) -> None:
        if self.stage not in stages:
            raise ValueError(f"secure aggregation: expected stage {' or '.join(stages)}, at {self.stage}")

    # stage 1
    def receive_advertisement(self, ad: KeyAdvertisement) -> None:
        self._expect(STAGE_ADVERTISE_KEYS)
        if ad.round_index != self.context.round_index or ad.session != self.context.session:
            raise SecAggViolation(f"advertisement of site {ad.site} is for another round or session")
        self._ads[ad.site] = ad

    def advertisements(self) -> list[KeyAdvertisement]:
        """Close key advertisement and return what every site must receive (U1)."""
        if self.stage == STAGE_ADVERTISE_KEYS:
            if len(self._ads) < MIN_SITES:
                raise SecAggAbort(
                    f"only {len(self._ads)} sites advertised keys; secure aggregation needs at "
                    f"least {MIN_SITES}, skipping the round"
                )
            c = self.context
            self._graph = neighbour_graph(self._ads, c.neighbours, session=c.session, round_index=c.round_index)
            self.stage = STAGE_SHARE_KEYS
        return [self._ads[s] for s in sorted(self._ads)]

    # stage 2
    def receive_shares(self, sender: int, shares: Sequence[EncryptedShare]) -> None:
        self._expect(STAGE_SHARE_KEYS)
        if sender not in self._ads:
            raise ValueError(f"site {sender} sent shares without advertising keys")
        expected = self._graph[sender]
        recipients = {s.recipient for s in shares}
        if any(s.sender != sender for s in shares) or recipients != set(expected) or len(shares) != len(expected):
            raise ValueError(f"site {sender} must send one share to each of its neighbours {sorted(expected)}")
        self._shared.add(sender)
        for share in shares:
            self._mailbox.setdefault(share.recipient, []).append(share)

    def close_share_keys(self) -> list[int]:
        """Freeze U2 (sites that shared keys); those are the only ones that may upload."""
        self._expect(STAGE_SHARE_KEYS)
        if len(self._shared) < MIN_SITES:
            raise SecAggAbort(f"only {len(self._shared)} sites shared keys; need at least {MIN_SITES}")
        self.stage = STAGE_MASKED_INPUT
        return sorted(self._shared)

    def shares_for(self, site: int) -> list[EncryptedShare]:
        self._expect(STAGE_MASKED_INPUT)
        return [s for s in self._mailbox.get(site, []) if s.sender in self._shared]

    # stage 3
    def receive_masked_chunk(self, site: int, chunk_index: int, data: bytes) -> None:
        """Add one masked chunk into the aggregate; a resent identical chunk is ignored."""
        self._expect(STAGE_MASKED_INPUT)
        if site not in self._shared:
            raise ValueError(f"site {site} did not share keys this round and cannot upload")
        c = self.context
        start, stop = c.chunk_bounds(chunk_index)
        digest = zlib.crc32(data)
        upload = self._uploads.setdefault(site, _Upload())
        previous = upload.chunks.get(chunk_index)
        if previous is not None:
            if previous != digest:
                raise ValueError(f"site {site} resent chunk {chunk_index} with different bytes")
            return
        dtype = MODULUS_DTYPES[c.modulus_bits]
        if len(data) != (stop - start) * dtype.itemsize:
            raise ValueError(
                f"site {site} chunk {chunk_index}: {len(data)} bytes, expected {(stop - start) * dtype.itemsize}"
            )
        if self._aggregate is None:
            self._aggregate = np.zeros(c.numel, dtype=dtype)
        self._aggregate[start:stop] += np.frombuffer(data, dtype=dtype)
        upload.chunks[chunk_index] = digest

    def uploaded(self) -> list[int]:
        return sorted(s for s, u in self._uploads.items() if len(u.chunks) == self._chunks)

    def close_upload(self) -> list[int]:
        """Freeze U3 (complete uploads) and return it; every survivor must sign it."""
        self._expect(STAGE_MASKED_INPUT)
        incomplete = set(self._uploads) - set(self.uploaded())
        if incomplete:
            # A partial upload cannot be subtracted chunk-wise without its masks; the round
            # only survives if those sites are treated as complete-or-absent, so refuse.
            raise SecAggAbort(f"sites {sorted(incomplete)} uploaded only part of their input; aborting the round")
        self._survivors = tuple(self.uploaded())
        self._dropped = tuple(sorted(self._shared - set(self._survivors)))
        self._check_enough(len(self._survivors), "uploaded")
        self.stage = STAGE_CONSISTENCY
        return list(self._survivors)

    def _check_enough(self, count: int, what: str) -> None:
        holders = min(len(self._graph[s]) + 1 for s in self._shared)
        t = self.context.threshold_for(holders)
        if count < max(t, MIN_SITES):
            raise SecAggAbort(
                f"only {count} sites {what}; the threshold is {t} (and at least {MIN_SITES}): "
                "the round is aborted and nothing is revealed"
            )

    # stage 4
    def receive_signature(self, site: int, signature: bytes) -> None:
        self._expect(STAGE_CONSISTENCY)
        if site not in self._survivors:
            raise ValueError(f"site {site} is not a survivor")
        self._signatures[site] = signature

    def unmask_request(self) -> UnmaskRequest:
        self._expect(STAGE_CONSISTENCY, STAGE_UNMASK)
        self._check_enough(len(self._signatures), "signed the survivor list")
        self.stage = STAGE_UNMASK
        return UnmaskRequest(self.context.round_index, self._survivors, self._dropped, dict(self._signatures))

    # stage 5
    def receive_unmask(self, response: UnmaskResponse) -> None:
        self._expect(STAGE_UNMASK)
        if response.round_index != self.context.round_index or response.site not in self._survivors:
            raise ValueError(f"unexpected unmask response from site {response.site}")
        self._responses[response.site] = response

    def result(self) -> np.ndarray:
        """The exact sum of the survivors' inputs in ``Z_{2^b}`` (lift it to signed values)."""
        self._expect(STAGE_UNMASK)
        assert self._aggregate is not None
        c = self.context
        total = self._aggregate
        pair_keys: list[tuple[bytes, int]] = []
        self_keys: list[bytes] = []
        for u in self._survivors:
            seed = shamir.reconstruct(self._collect(u, self_mask=True), self._threshold(u))
            self_keys.append(mask_key(seed, c.session, c.round_index, site=u))
        for u in self._dropped:
            private = shamir.reconstruct(self._collect(u, self_mask=False), self._threshold(u))
            key = X25519PrivateKey.from_private_bytes(private)
            if public_bytes(key.public_key()) != self._ads[u].mask_public_key:
                raise SecAggAbort(f"reconstructed mask key of site {u} does not match its advertisement")
            for v in sorted(self._graph[u] & set(self._survivors)):
                secret = key.exchange(X25519PublicKey.from_public_bytes(self._ads[v].mask_public_key))
                # Survivor v added sign(v, u) * PRG(s_uv): + when v < u.
                pair_keys.append((mask_key(secret, c.session, c.round_index, pair=(u, v)), 1 if v < u else -1))
        for index in range(self._chunks):
            start, stop = c.chunk_bounds(index)
            view = total[start:stop]
            add_masks([(k, 1) for k in self_keys] + pair_keys, index, view, subtract=True)
        self.stage = STAGE_DONE
        self._aggregate = None
        return total

    def _threshold(self, u: int) -> int:
        return self.context.threshold_for(len(self._graph[u]) + 1)

    def _collect(self, u: int, *, self_mask: bool) -> dict[int, bytes]:
        shares = {}
        for site, response in self._responses.items():
            table = response.self_mask_shares if self_mask else response.mask_key_shares
            if u in table:
                shares[site] = table[u]
        t = self._threshold(u)
        if len(shares) < t:
            raise SecAggAbort(
                f"only {len(shares)} shares of site {u}'s {'self-mask seed' if self_mask else 'mask key'} "
                f"arrived, the threshold is {t}: the round is aborted and nothing is revealed"
            )
        return shares

    @property
    def survivors(self) -> tuple[int, ...]:
        return self._survivors

    @property
    def dropped(self) -> tuple[int, ...]:
        return self._dropped
