"""Secure aggregation, the coordinator's side: the ``SecAggServer`` workflow of one round.

The protocol is described in ``geoloco.algorithms.privacy.secagg_messages``. The server relays advertisements and
encrypted shares, adds masked chunks into one aggregate buffer in ``Z_{2^b}`` (keeping CRC-32s of
chunks, never a site's vector), freezes the survivor list, and with ``t`` unmask answers removes
the survivors' self-masks and the pairwise masks shared with dropped sites. Too few sites at any
stage raises ``SecAggAbort``: nothing is revealed.

Against hostile sites: a message that cannot be right (a badly signed advertisement or survivor
signature when the sender's identity key is known, an unmask answer with missing, extra,
truncated or out-of-field shares) raises ``SecAggViolation`` and is not recorded, so its sender is
left out instead of every site refusing the round; a share that is well formed but wrong (a
consistent lie) is caught when the rebuilt seed misses the commitment its owner signed, or the
rebuilt mask key misses its advertised public key: ``SecAggAbort``, the model stays unchanged.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy import shamir
from geoloco.algorithms.privacy.secagg_crypto import (
    add_masks,
    check_threshold,
    mask_key,
    neighbour_graph,
    num_chunks,
    public_bytes,
    seed_commitment,
)
from geoloco.algorithms.privacy.secagg_messages import (
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
    survivors_signed_bytes,
)

__all__ = ["SecAggServer"]

_KEY_NBYTES = 32
"""Raw X25519 public keys and seed commitments (SHA-256) are 32 bytes."""


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
        self._partials: dict[int, tuple[int, ...]] = {}
        """site -> the sites of the relay's partial sum it arrived in (``receive_masked_partial``)."""
        self._aggregate: np.ndarray | None = None
        self._survivors: tuple[int, ...] = ()
        self._dropped: tuple[int, ...] = ()
        self._signatures: dict[int, bytes] = {}
        self._responses: dict[int, UnmaskResponse] = {}
        self._identities: dict[int, Ed25519PublicKey] = {}
        self._chunks = num_chunks(context.numel, context.chunk_size)

    def _expect(self, *stages: str) -> None:
        if self.stage not in stages:
            raise ValueError(f"secure aggregation: expected stage {' or '.join(stages)}, at {self.stage}")

    # stage 1
    def receive_advertisement(self, ad: KeyAdvertisement, identity: Ed25519PublicKey | None = None) -> None:
        """Record a site's keys; with its ``identity`` key, a badly signed advertisement is refused
        here (``SecAggViolation``) rather than relayed for every honest site to refuse the round."""
        self._expect(STAGE_ADVERTISE_KEYS)
        if ad.round_index != self.context.round_index or ad.session != self.context.session:
            raise SecAggViolation(f"advertisement of site {ad.site} is for another round or session")
        for what, value in (
            ("cipher public key", ad.cipher_public_key),
            ("mask public key", ad.mask_public_key),
            ("seed commitment", ad.seed_commitment),
        ):
            if len(value) != _KEY_NBYTES:
                raise SecAggViolation(f"advertisement of site {ad.site}: its {what} has {len(value)} bytes, not 32")
        if identity is not None:
            try:
                identity.verify(ad.signature, ad.signed_bytes())
            except InvalidSignature:
                raise SecAggViolation(
                    f"advertisement of site {ad.site} is not signed by its identity key; it is left out"
                ) from None
            self._identities[ad.site] = identity
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
            graph = neighbour_graph(self._ads, c.neighbours, session=c.session, round_index=c.round_index)
            for holders in sorted({len(v) + 1 for v in graph.values()}):
                unsafe = check_threshold(c.threshold_for(holders), holders, c.colluding_sites)
                if unsafe:
                    raise SecAggAbort(f"{len(self._ads)} sites advertised keys, but {unsafe}; skipping the round")
            self._graph = graph
            self.stage = STAGE_SHARE_KEYS
        return [self._ads[s] for s in sorted(self._ads)]

    def advertisements_for(self, site: int) -> list[KeyAdvertisement]:
        """What ``site`` must receive of the advertisements (after ``advertisements`` closed
        the stage): its own and its neighbours', the only keys it uses; with the round's site
        list (``sites``) it derives the same graph (``SecAggClient.share_keys``)."""
        self._expect(STAGE_SHARE_KEYS, STAGE_MASKED_INPUT, STAGE_CONSISTENCY, STAGE_UNMASK)
        return [self._ads[s] for s in sorted(self._graph[site] | {site})]

    @property
    def sites(self) -> tuple[int, ...]:
        """Every site that advertised keys this round, sorted."""
        return tuple(sorted(self._ads))

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
        if site in self._partials:
            raise ValueError(f"site {site}'s input already arrives in a relay's partial sum; it cannot upload alone")
        self._add_chunk((site,), chunk_index, data)

    def receive_masked_partial(self, sites: Sequence[int], chunk_index: int, data: bytes) -> None:
        """Add one chunk of a relay's partial sum: the ring sum of ``sites``' masked chunks.

        Masked inputs add in ``Z_{2^b}``, so the partial enters the aggregate like one input and
        each of ``sites`` counts as having sent that chunk: a site in a complete partial is a
        survivor, a site missing from every upload is dropped (its pairwise masks are removed
        from its mask-key shares as usual). A site is in one upload only (its own or one
        partial); a resent identical chunk is ignored.
        """
        self._expect(STAGE_MASKED_INPUT)
        group = tuple(sorted(sites))
        if not group or len(set(group)) != len(group):
            raise ValueError(f"a partial sum must name distinct sites, got {list(sites)}")
        for site in group:
            if site not in self._shared:
                raise ValueError(f"site {site} did not share keys this round and cannot be in a partial sum")
            if self._partials.get(site, group) != group or (site in self._uploads and site not in self._partials):
                raise ValueError(f"site {site}'s input already arrived in another upload this round")
        for site in group:
            self._partials[site] = group
        self._add_chunk(group, chunk_index, data)

    def _add_chunk(self, sites: tuple[int, ...], chunk_index: int, data: bytes) -> None:
        """Add a chunk sent for ``sites`` (one site, or a relay's partial) into the aggregate."""
        c = self.context
        start, stop = c.chunk_bounds(chunk_index)
        digest = zlib.crc32(data)
        who = f"site {sites[0]}" if len(sites) == 1 else f"the partial sum of sites {list(sites)}"
        uploads = [self._uploads.setdefault(site, _Upload()) for site in sites]
        previous = uploads[0].chunks.get(chunk_index)
        if previous is not None:
            if previous != digest:
                raise ValueError(f"{who} resent chunk {chunk_index} with different bytes")
            return
        dtype = MODULUS_DTYPES[c.modulus_bits]
        if len(data) != (stop - start) * dtype.itemsize:
            raise ValueError(
                f"{who} chunk {chunk_index}: {len(data)} bytes, expected {(stop - start) * dtype.itemsize}"
            )
        if self._aggregate is None:
            self._aggregate = np.zeros(c.numel, dtype=dtype)
        self._aggregate[start:stop] += np.frombuffer(data, dtype=dtype)
        for upload in uploads:
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
        """Record a survivor's signature over the list; one that fails against the site's known
        identity key is refused (the honest sites would only not count it)."""
        self._expect(STAGE_CONSISTENCY)
        if site not in self._survivors:
            raise ValueError(f"site {site} is not a survivor")
        identity = self._identities.get(site)
        if identity is not None:
            c = self.context
            try:
                identity.verify(signature, survivors_signed_bytes(c.session, c.round_index, self._survivors))
            except InvalidSignature:
                raise SecAggViolation(f"site {site}'s survivor-list signature is invalid; it is left out") from None
        self._signatures[site] = signature

    def unmask_request(self) -> UnmaskRequest:
        """Close the consistency check: the request with every survivor's signature."""
        self._expect(STAGE_CONSISTENCY, STAGE_UNMASK)
        self._check_enough(len(self._signatures), "signed the survivor list")
        self.stage = STAGE_UNMASK
        return UnmaskRequest(self.context.round_index, self._survivors, self._dropped, dict(self._signatures))

    def unmask_request_for(self, site: int, request: UnmaskRequest) -> UnmaskRequest:
        """``request`` as ``site`` needs it: the signatures of its share holders only, the ones
        it counts (``SecAggClient.unmask``); with SecAgg+'s graph, O(log n) of them instead of n."""
        holders = self._graph.get(site, frozenset()) | {site}
        return dataclasses.replace(
            request, signatures={u: sig for u, sig in request.signatures.items() if u in holders}
        )

    # stage 5
    def receive_unmask(self, response: UnmaskResponse) -> None:
        """Record an unmask answer after checking every share in it (``SecAggViolation`` names
        what is wrong; a refused answer is not recorded, so unmasking goes on without it)."""
        self._expect(STAGE_UNMASK)
        if response.round_index != self.context.round_index or response.site not in self._survivors:
            raise ValueError(f"unexpected unmask response from site {response.site}")
        v = response.site
        held = {u for u in self._shared if u == v or v in self._graph[u]}
        for what, table, owners in (
            ("self-mask seed", response.self_mask_shares, held & set(self._survivors)),
            ("mask key", response.mask_key_shares, held & set(self._dropped)),
        ):
            if not isinstance(table, Mapping) or set(table) != owners:
                got = sorted(table) if isinstance(table, Mapping) else type(table).__name__
                raise SecAggViolation(
                    f"the unmask answer of site {v} must carry its {what} shares of sites {sorted(owners)}, got {got}"
                )
            for u, share in table.items():
                if not shamir.is_share(share):
                    raise SecAggViolation(
                        f"the unmask answer of site {v} carries a malformed {what} share of site {u}: "
                        f"{shamir.SHARE_NBYTES} bytes below the field prime are allowed"
                    )
        self._responses[v] = response

    def result(self) -> np.ndarray:
        """The exact sum of the survivors' inputs in ``Z_{2^b}`` (lift it to signed values)."""
        self._expect(STAGE_UNMASK)
        assert self._aggregate is not None
        c = self.context
        total = self._aggregate
        pair_keys: list[tuple[bytes, int]] = []
        self_keys: list[bytes] = []
        for u in self._survivors:
            seed = self._rebuild(u, self_mask=True)
            if seed_commitment(seed, c.session, c.round_index, u) != self._ads[u].seed_commitment:
                raise SecAggAbort(
                    f"the self-mask seed of site {u} rebuilt from the unmask answers does not match the "
                    "commitment it signed: a site lied about its share; the round is aborted and the "
                    "model is unchanged"
                )
            self_keys.append(mask_key(seed, c.session, c.round_index, site=u))
        for u in self._dropped:
            key = X25519PrivateKey.from_private_bytes(self._rebuild(u, self_mask=False))
            if public_bytes(key.public_key()) != self._ads[u].mask_public_key:
                raise SecAggAbort(
                    f"reconstructed mask key of site {u} does not match its advertisement: a site lied "
                    "about its share; the round is aborted and the model is unchanged"
                )
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

    def _rebuild(self, u: int, *, self_mask: bool) -> bytes:
        try:
            return shamir.reconstruct(self._collect(u, self_mask=self_mask), self._threshold(u))
        except ValueError as err:
            what = "self-mask seed" if self_mask else "mask key"
            raise SecAggAbort(f"the {what} of site {u} cannot be rebuilt ({err}); the round is aborted") from None

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
