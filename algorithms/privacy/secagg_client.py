"""Secure aggregation, a site's side: the ``SecAggClient`` state machine of one round.

The protocol is described in ``geoloco.algorithms.privacy.secagg_messages``. The client verifies every
advertisement against the sites' identity keys, Shamir-shares its self-mask seed and mask key
(each share AES-GCM encrypted for its holder), masks its input chunk by chunk, signs the survivor
list once, and answers one unmask request, never revealing both secrets of one site. Any detected
misbehaviour raises ``SecAggViolation`` with the reason.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from geoloco.algorithms.fixed_point import MODULUS_DTYPES
from geoloco.algorithms.privacy import shamir
from geoloco.algorithms.privacy.secagg_crypto import (
    DOMAIN,
    PURPOSE_SHARE_KEY,
    RandomBytes,
    ThresholdPolicy,
    add_masks,
    hkdf,
    mask_key,
    neighbour_graph,
    num_chunks,
    private_bytes,
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
    advert_signed_bytes,
    survivors_signed_bytes,
)

__all__ = ["SecAggClient"]

_SHARE_PLAINTEXT: Final = struct.Struct("<II")
"""(sender, recipient) at the head of a share's plaintext, and the AES-GCM nonce's first 8 bytes."""


@dataclass(slots=True)
class _Peer:
    cipher_public_key: X25519PublicKey
    mask_public_key: X25519PublicKey


class SecAggClient:
    """One site's side of one secure round; methods must be called in stage order.

    ``identities`` maps every site id to its Ed25519 identity public key (bound to its TLS
    certificate by the deployment), which is what makes key substitution detectable. ``random_bytes``
    is the entropy source (``os.urandom``); tests pass a seeded one for reproducible statistics.
    ``policy`` is the least threshold this site accepts, from the site's own settings: a real site
    must pass it, since ``context`` comes from the coordinator, which could declare no colluding
    sites and a threshold a colluding site breaks. Unset, the context's declared assumption is
    taken, which is right only where one config holds every party (the simulator, tests).
    """

    def __init__(
        self,
        site: int,
        context: RoundContext,
        identity_key: Ed25519PrivateKey,
        identities: Mapping[int, Ed25519PublicKey],
        *,
        random_bytes: RandomBytes = os.urandom,
        policy: ThresholdPolicy | None = None,
    ) -> None:
        if site not in identities:
            raise ValueError(f"site {site} has no identity key among {sorted(identities)}")
        self.site = site
        self.context = context
        self.policy = policy if policy is not None else ThresholdPolicy(colluding_sites=context.colluding_sites)
        self.stage = STAGE_ADVERTISE_KEYS
        self._identity = identity_key
        self._identities = dict(identities)
        self._cipher_key = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._mask_key = X25519PrivateKey.from_private_bytes(random_bytes(32))
        self._self_seed = random_bytes(32)
        self._advertisement: KeyAdvertisement | None = None
        self._peers: dict[int, _Peer] = {}
        """The neighbours' verified keys (``share_keys``)."""
        self._advertised: frozenset[int] = frozenset()
        """Every site that advertised keys this round: who may be a survivor or dropped."""
        self._graph: dict[int, frozenset[int]] = {}
        self._own_shares: tuple[bytes, bytes] | None = None
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self._mask_keys: list[tuple[bytes, int]] = []
        self._self_key = b""
        self._survivors: tuple[int, ...] | None = None
        self._uploaded = False

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggViolation(
                f"site {self.site}, round {self.context.round_index}: got a {stage} message while "
                f"at stage {self.stage}; out-of-order or repeated protocol messages are refused"
            )

    def _check_round(self, round_index: int, what: str) -> None:
        if round_index != self.context.round_index:
            raise SecAggViolation(
                f"site {self.site}: {what} is for round {round_index}, this is round "
                f"{self.context.round_index}; refusing a replayed message"
            )

    def add_identities(self, identities: Mapping[int, Ed25519PublicKey]) -> None:
        """Learn other sites' verified identity keys (before ``share_keys``); never replace one."""
        if self.stage not in (STAGE_ADVERTISE_KEYS, STAGE_SHARE_KEYS):
            raise SecAggViolation(f"site {self.site}: identities arrive before keys are shared")
        for site, key in identities.items():
            known = self._identities.get(site)
            if known is not None and public_bytes(known) != public_bytes(key):
                raise SecAggViolation(f"site {self.site}: a second identity key for site {site} was offered")
            self._identities[site] = key

    # stage 1
    def advertise(self) -> KeyAdvertisement:
        self._expect(STAGE_ADVERTISE_KEYS)
        c = self.context
        cpk = public_bytes(self._cipher_key.public_key())
        spk = public_bytes(self._mask_key.public_key())
        commitment = seed_commitment(self._self_seed, c.session, c.round_index, self.site)
        signature = self._identity.sign(advert_signed_bytes(c.session, c.round_index, self.site, cpk, spk, commitment))
        self._advertisement = KeyAdvertisement(self.site, c.session, c.round_index, cpk, spk, signature, commitment)
        self.stage = STAGE_SHARE_KEYS
        return self._advertisement

    # stage 2
    def share_keys(
        self, advertisements: Sequence[KeyAdvertisement], sites: Collection[int] | None = None
    ) -> list[EncryptedShare]:
        """Verify the neighbours' advertisements, then Shamir-share ``b_u`` and ``s_u``
        encrypted per holder.

        ``sites``: every site that advertised keys this round (the neighbour graph is derived
        from them); ``None``: the sites of ``advertisements``, which must then be all of them.
        Only a neighbour's keys are used here, so ``advertisements`` need hold only this site's
        and its neighbours' (``SecAggServer.advertisements_for``), and only those are verified
        and kept: with SecAgg+'s graph a site receives and checks O(log n) advertisements
        instead of n, and every site's is still checked by each of its neighbours (with
        ``full``, every site by every site)."""
        self._expect(STAGE_SHARE_KEYS)
        c = self.context
        seen: set[int] = set()
        by_site: dict[int, KeyAdvertisement] = {}
        for ad in advertisements:
            if ad.site in seen:
                raise SecAggViolation(f"site {self.site}: two advertisements for site {ad.site}")
            seen.add(ad.site)
            if ad.session != c.session:
                raise SecAggViolation(
                    f"site {self.site}: advertisement of site {ad.site} is from session "
                    f"{ad.session!r}, not {c.session!r}; refusing a replayed message"
                )
            self._check_round(ad.round_index, f"the advertisement of site {ad.site}")
            if ad.site not in self._identities:
                raise SecAggViolation(f"site {self.site}: advertisement from unknown site {ad.site}")
            by_site[ad.site] = ad
        if sites is not None:
            if not seen <= set(sites):
                raise SecAggViolation(
                    f"site {self.site}: advertisements of sites {sorted(seen - set(sites))} that the "
                    "round's site list does not name"
                )
            seen = set(sites)
        if by_site.get(self.site) != self._advertisement:
            raise SecAggViolation(f"site {self.site}: its own advertisement is missing or altered")
        if len(seen) < MIN_SITES:
            raise SecAggAbort(
                f"only {len(seen)} sites advertised keys; secure aggregation needs at least "
                f"{MIN_SITES} (with 2, the sum reveals the other site's update)"
            )
        self._advertised = frozenset(seen)
        self._graph = neighbour_graph(seen, c.neighbours, session=c.session, round_index=c.round_index)
        missing = sorted(self._graph[self.site] - set(by_site))
        if missing:
            raise SecAggViolation(
                f"site {self.site}: no advertisement from its neighbours {missing}; the coordinator "
                "withheld keys this site must mask with"
            )
        for peer in sorted(self._graph[self.site]):
            ad = by_site[peer]
            try:
                self._identities[peer].verify(ad.signature, ad.signed_bytes())
            except InvalidSignature:
                raise SecAggViolation(
                    f"site {self.site}: the keys advertised for site {ad.site} are not signed by its "
                    "identity key; the coordinator substituted or corrupted them"
                ) from None
            self._peers[peer] = _Peer(
                X25519PublicKey.from_public_bytes(ad.cipher_public_key),
                X25519PublicKey.from_public_bytes(ad.mask_public_key),
            )
        holders = self._graph[self.site] | {self.site}
        t = c.threshold_for(len(holders))
        if len(holders) < t:
            raise SecAggAbort(f"only {len(holders)} share holders for threshold {t}")
        unsafe = self.policy.refusal(t, len(holders), c.colluding_sites)
        if unsafe:
            raise SecAggViolation(f"site {self.site}: refusing to share keys: {unsafe}")
        b_shares = shamir.split(self._self_seed, holders, t)
        s_shares = shamir.split(private_bytes(self._mask_key), holders, t)
        self._own_shares = (b_shares[self.site], s_shares[self.site])
        out = []
        for v in sorted(holders - {self.site}):
            plaintext = _SHARE_PLAINTEXT.pack(self.site, v) + b_shares[v] + s_shares[v]
            out.append(EncryptedShare(self.site, v, c.round_index, self._seal(v, self.site, v, plaintext)))
        self.stage = STAGE_MASKED_INPUT
        return out

    def _share_cipher(self, peer: int, sender: int, recipient: int) -> tuple[AESGCM, bytes, bytes]:
        c = self.context
        secret = self._cipher_key.exchange(self._peers[peer].cipher_public_key)
        key = hkdf(secret, PURPOSE_SHARE_KEY, c.session, c.round_index, min(sender, recipient), max(sender, recipient))
        nonce = _SHARE_PLAINTEXT.pack(sender, recipient) + b"\x00" * 4
        aad = DOMAIN + c.session.encode() + struct.pack("<qII", c.round_index, sender, recipient)
        return AESGCM(key), nonce, aad

    def _seal(self, peer: int, sender: int, recipient: int, plaintext: bytes) -> bytes:
        aead, nonce, aad = self._share_cipher(peer, sender, recipient)
        return aead.encrypt(nonce, plaintext, aad)

    # stage 3
    def receive_shares(self, shares: Sequence[EncryptedShare]) -> None:
        """Decrypt the shares addressed to this site; their senders are the neighbours that mask."""
        self._expect(STAGE_MASKED_INPUT)
        if self._held:
            raise SecAggViolation(f"site {self.site}: shares were already delivered this round")
        for share in shares:
            self._check_round(share.round_index, f"the share from site {share.sender}")
            if share.recipient != self.site or share.sender not in self._graph.get(self.site, ()):
                raise SecAggViolation(
                    f"site {self.site}: got a share from {share.sender} for {share.recipient}, "
                    "which is not a neighbour's share for this site"
                )
            if share.sender in self._held:
                raise SecAggViolation(f"site {self.site}: two shares from site {share.sender}")
            aead, nonce, aad = self._share_cipher(share.sender, share.sender, self.site)
            try:
                plaintext = aead.decrypt(nonce, share.ciphertext, aad)
            except InvalidTag:
                raise SecAggViolation(
                    f"site {self.site}: the share from site {share.sender} fails authentication "
                    "(tampered, or encrypted for another round or session)"
                ) from None
            sender, recipient = _SHARE_PLAINTEXT.unpack_from(plaintext)
            if (sender, recipient) != (share.sender, self.site):
                raise SecAggViolation(f"site {self.site}: share routing fields were altered")
            n = shamir.SHARE_NBYTES
            body = plaintext[_SHARE_PLAINTEXT.size :]
            self._held[share.sender] = (body[:n], body[n : 2 * n])
        c = self.context
        self._mask_keys = []
        for v in sorted(self._held):
            secret = self._mask_key.exchange(self._peers[v].mask_public_key)
            sign = 1 if self.site < v else -1
            self._mask_keys.append((mask_key(secret, c.session, c.round_index, pair=(self.site, v)), sign))
        self._self_key = mask_key(self._self_seed, c.session, c.round_index, site=self.site)

    @property
    def masking_neighbours(self) -> list[int]:
        """The neighbours whose pairwise masks this site adds (those that shared keys with it)."""
        return sorted(self._held)

    def mask_chunk(self, chunk_index: int, values: np.ndarray | Sequence[int]) -> bytes:
        """``y = x + PRG(b_u) + Σ ±PRG(s_uv)`` for one chunk, packed at the modulus width.

        ``values`` are the chunk's integers (any integer dtype; reduced mod ``2^b``). Memory is
        O(chunk): each mask is generated for this chunk only and added in place.
        """
        if self.stage != STAGE_MASKED_INPUT or not self._self_key:
            raise SecAggViolation(f"site {self.site}: mask_chunk before the shares were received")
        c = self.context
        start, stop = c.chunk_bounds(chunk_index)
        values = np.asarray(values)
        if values.shape != (stop - start,):
            raise ValueError(f"chunk {chunk_index} must hold {stop - start} values, got shape {values.shape}")
        dtype = MODULUS_DTYPES[c.modulus_bits]
        out = values.astype(dtype)  # C cast: wraps modulo 2^b, as modular arithmetic needs
        add_masks([(self._self_key, 1), *self._mask_keys], chunk_index, out, subtract=False)
        return out.tobytes()

    def masked_chunks(self, chunks: Iterable[np.ndarray]) -> Iterator[tuple[int, bytes]]:
        """``(chunk_index, masked bytes)`` for each integer chunk, in order; marks the upload done."""
        count = 0
        for index, values in enumerate(chunks):
            yield index, self.mask_chunk(index, values)
            count += 1
        expected = num_chunks(self.context.numel, self.context.chunk_size)
        if count != expected:
            raise ValueError(f"the upload had {count} chunks, expected {expected}")
        self.finish_upload()

    def finish_upload(self) -> None:
        self._expect(STAGE_MASKED_INPUT)
        self._uploaded = True
        self.stage = STAGE_CONSISTENCY

    # stage 4
    def sign_survivors(self, round_index: int, survivors: Sequence[int]) -> bytes:
        """Sign the survivor list (once); the unmask request must carry the same list."""
        self._expect(STAGE_CONSISTENCY)
        self._check_round(round_index, "the survivor list")
        self._check_survivors(survivors)
        self._survivors = tuple(sorted(survivors))
        self.stage = STAGE_UNMASK
        return self._identity.sign(survivors_signed_bytes(self.context.session, round_index, self._survivors))

    def _check_survivors(self, survivors: Sequence[int]) -> None:
        if self.site not in survivors:
            raise SecAggViolation(
                f"site {self.site} uploaded its masked input but is not listed as a survivor; "
                "answering would let the coordinator strip its masks"
            )
        if len(set(survivors)) != len(survivors) or not set(survivors) <= self._advertised:
            raise SecAggViolation(f"site {self.site}: invalid survivor list {list(survivors)}")
        t = self.context.threshold_for(len(self._graph[self.site]) + 1)
        if len(survivors) < t:
            raise SecAggViolation(
                f"site {self.site}: only {len(survivors)} survivors, below the threshold {t}; "
                "refusing to reveal shares"
            )

    # stage 5
    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Reveal shares for the request, after checking it cannot unmask any single site."""
        self._expect(STAGE_UNMASK)
        c = self.context
        self._check_round(request.round_index, "the unmask request")
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = survivors & dropped
        if both:
            raise SecAggViolation(
                f"site {self.site}: the coordinator asked for both the self-mask share and the "
                f"mask-key share of site(s) {sorted(both)}, which would unmask their input; refusing"
            )
        if tuple(sorted(survivors)) != self._survivors:
            raise SecAggViolation(
                f"site {self.site}: unmask request lists survivors {sorted(survivors)} but this site "
                f"signed {list(self._survivors or ())}; refusing"
            )
        message = survivors_signed_bytes(c.session, c.round_index, self._survivors)
        valid, invalid = 0, []
        holders = self._graph[self.site] | {self.site}
        for signer, signature in request.signatures.items():
            # An invalid signature only fails to count: refusing over it would let one hostile
            # site abort every round. What protects the sites is that t valid ones are needed,
            # from the holders of this site's shares (SecAgg+'s rule: with the sparse graph, a
            # site checks O(log n) signatures; with ``full`` every site holds shares).
            identity = self._identities.get(signer)
            if signer not in survivors or identity is None:
                invalid.append(signer)
                continue
            if signer not in holders:
                continue
            try:
                identity.verify(signature, message)
                valid += 1
            except InvalidSignature:
                invalid.append(signer)
        t = c.threshold_for(len(self._graph[self.site]) + 1)
        if valid < t:
            raise SecAggViolation(
                f"site {self.site}: the unmask request carries {valid} valid survivor signatures "
                f"(invalid or foreign: {sorted(invalid)}), fewer than the threshold {t}; refusing"
            )
        if not dropped <= self._advertised:
            raise SecAggViolation(f"site {self.site}: unknown dropped sites {sorted(dropped - self._advertised)}")
        held = dict(self._held)
        assert self._own_shares is not None
        held[self.site] = self._own_shares
        self_shares = {u: held[u][0] for u in sorted(survivors) if u in held}
        key_shares = {u: held[u][1] for u in sorted(dropped) if u in held}
        self.stage = STAGE_DONE
        return UnmaskResponse(self.site, c.round_index, self_shares, key_shares)
