"""A site's side of secure aggregation over stage calls, with its identity bound to its TLS certificate.

``geoloco.algorithms.privacy.secagg_client.SecAggClient`` is the protocol; this adapts it to the real system:

* **Identity binding** (``geoloco.protos.secagg_identity``). Each site process makes an Ed25519
  identity key and signs ``(site name, identity public key)`` with its TLS private key; the
  binding carries its TLS certificate. Other sites check that the certificate was issued by the
  run's CA, names the site (URI SAN ``geoloco:site:NAME``) and signed the binding, so a
  coordinator cannot substitute an identity key (and hence advertised keys) without the CA's key.
  Without TLS (``--insecure``) bindings are unsigned and identities are taken on the
  coordinator's word: the protocol still hides updates from a coordinator that follows it, but
  substitution can no longer be detected.
* **Stage calls.** ``StageCall(stage, message) -> (reply, aborted)`` is the transport (the gRPC
  client, retrying until the stage is ready; it translates the ``geoloco.algorithms.privacy.secagg_stages``
  dataclasses with ``geoloco.protos.secagg_wire``); ``SecureSite`` runs the key stages before
  training, masks the encoded update chunk by chunk, and runs the unmask stages after upload.
  A reply that is not what its stage answers with is refused (``SecAggViolation``).
* **The threshold is checked against the site's own assumption** (``ThresholdPolicy``, from
  ``SiteAgentConfig.colluding_sites`` / ``min_threshold``), not the ``colluding_sites`` the
  coordinator declares: a round whose threshold a colluding site could break is refused before
  any share or masked value leaves the site.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from geoloco.algorithms.fixed_point import MODULUS_DTYPES, FixedPoint
from geoloco.algorithms.privacy.private_aggregation import (
    SECURE_UPLOAD_CODEC,
    PrivacyConfig,
    PrivateUpdateEncoder,
    secure_context,
    secure_fixed_point,
    secure_index_seed,
)
from geoloco.algorithms.privacy.secagg_client import SecAggClient
from geoloco.algorithms.privacy.secagg_crypto import ThresholdPolicy, public_bytes, site_index
from geoloco.algorithms.privacy.secagg_messages import (
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    SecAggAbort,
    SecAggViolation,
    UnmaskRequest,
)
from geoloco.algorithms.privacy.secagg_stages import (
    STAGE_REPLIES,
    AdvertiseKeys,
    Advertisements,
    IdentityBinding,
    ShareBundle,
    StageMessage,
    SurvivorList,
    SurvivorSignature,
    check_stage_message,
)
from geoloco.protos.secagg_identity import IDENTITY_DOMAIN, binding_bytes, verify_bindings
from geoloco.protos.transport_tls import TLSFiles
from geoloco.site_agent.client import RoundClosed, UpdateRejected

__all__ = ["IDENTITY_DOMAIN", "SecureSite", "SecureUplink", "SiteIdentity", "StageCall", "verify_bindings"]

logger = logging.getLogger(__name__)

StageCall = Callable[[str, StageMessage], tuple[StageMessage, str]]
"""``(stage, message) -> (reply, abort reason or "")``, blocking until the stage closes."""

_Reply = TypeVar("_Reply")


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    """A site's Ed25519 identity key and its binding to the site's TLS certificate."""

    name: str
    key: Ed25519PrivateKey
    binding: IdentityBinding

    @classmethod
    def create(cls, name: str, tls_cert_pem: bytes | None = None, tls_key_pem: bytes | None = None) -> SiteIdentity:
        """A fresh identity; signed with the TLS key when one is given (unsigned for --insecure)."""
        key = Ed25519PrivateKey.generate()
        public = public_bytes(key.public_key())
        if tls_cert_pem is None or tls_key_pem is None:
            return cls(name=name, key=key, binding=IdentityBinding(name, public))
        tls_key = serialization.load_pem_private_key(tls_key_pem, password=None)
        if not isinstance(tls_key, ec.EllipticCurvePrivateKey):
            raise ValueError("the site's TLS key must be an EC key (as `geoloco certs` issues)")
        signature = tls_key.sign(binding_bytes(name, public), ec.ECDSA(hashes.SHA256()))
        return cls(name=name, key=key, binding=IdentityBinding(name, public, tls_cert_pem, signature))


class SecureSite:
    """One site's secure round: key stages, the masked upload bytes, unmask stages."""

    def __init__(
        self,
        identity: SiteIdentity,
        privacy: PrivacyConfig,
        uplink_codec: str,
        *,
        numel: int,
        session: str,
        round_number: int,
        index_seed: int,
        call: StageCall,
        ca_pem: bytes | None,
        policy: ThresholdPolicy | None = None,
    ) -> None:
        self.identity = identity
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.index_seed = index_seed
        self.numel = numel
        self._call = call
        self._ca_pem = ca_pem
        self.index = site_index(identity.name)
        self.context = secure_context(privacy, uplink_codec, numel=numel, session=session, round_index=round_number)
        self.client = SecAggClient(
            self.index, self.context, identity.key, {self.index: identity.key.public_key()},
            policy=policy if policy is not None else ThresholdPolicy(),
        )
        self.fixed: FixedPoint | None = None
        self.num_sites = 0

    def _stage(self, stage: str, message: StageMessage, reply_type: type[_Reply]) -> _Reply:
        """One stage call; its reply must be what ``stage`` answers with (``reply_type``)."""
        assert (STAGE_REPLIES[stage] or type(None)) is reply_type, (stage, reply_type)
        reply, aborted = self._call(stage, message)
        if aborted:
            raise SecAggAbort(aborted)
        check_stage_message(stage, reply, reply=True)
        return reply  # type: ignore[return-value]

    def share_keys(self) -> None:
        """Stages 1-2 (before training): advertise, verify identities, share keys, get shares."""
        ad = self.client.advertise()
        reply = self._stage(STAGE_ADVERTISE_KEYS, AdvertiseKeys(ad, self.identity.binding), Advertisements)
        # The coordinator sends every site's name but only this site's and its neighbours' keys
        # and identity bindings (the ones the protocol uses here), so those are what is checked.
        identities = verify_bindings(reply.bindings, self._ca_pem)
        adverts = reply.advertisements
        by_index: dict[int, Ed25519PublicKey] = {}
        for index, name in reply.names.items():
            if site_index(name) != index:
                raise SecAggViolation(f"site {self.identity.name}: site {name!r} is not protocol site {index}")
        for ad in adverts:
            named = reply.names.get(ad.site)
            if named is None or named not in identities:
                raise SecAggViolation(f"site {self.identity.name}: no valid identity for site {named or ad.site!r}")
            by_index[ad.site] = identities[named]
        self.client.add_identities(by_index)
        self.num_sites = len(reply.names)
        shares = self.client.share_keys(adverts, reply.names.keys())
        self.fixed = secure_fixed_point(self.privacy, self.num_sites)
        mine = self._stage(STAGE_SHARE_KEYS, ShareBundle(tuple(shares)), ShareBundle)
        self.client.receive_shares(mine.shares)

    def masked_upload(self, update: torch.Tensor, encoder: PrivateUpdateEncoder) -> bytes:
        """The masked, encoded update as upload bytes (masks made chunk by chunk)."""
        if self.fixed is None:
            raise SecAggViolation("masked_upload before share_keys")
        ints = encoder.encode(update, self.fixed, self.context, index_seed=self.index_seed, num_sites=self.num_sites)
        return b"".join(data for _, data in self.client.masked_chunks(ints))

    def unmask(self) -> None:
        """Stages 4-5 (after upload): sign the survivor list, answer the unmask request."""
        survivors = self._stage(STAGE_CONSISTENCY, None, SurvivorList).sites
        signature = self.client.sign_survivors(self.context.round_index, sorted(site_index(n) for n in survivors))
        request = self._stage(STAGE_UNMASK, SurvivorSignature(signature), UnmaskRequest)
        self._stage(STAGE_UNMASK_RESPONSE, self.client.unmask(request), type(None))

    def withdraw(self) -> None:
        """Tell the coordinator this site takes no further part in the round, so no stage and no
        upload waits for it (best effort: a coordinator that cannot be told finds out at its
        stage deadlines)."""
        try:
            self._call(STAGE_WITHDRAW, None)
        except Exception as err:  # noqa: BLE001 (the round goes on without this site either way)
            logger.warning("site %s: could not withdraw from secure round %d: %s", self.identity.name,
                           self.context.round_index, err)


class _Client(Protocol):
    """The part of ``CoordinatorClient`` a secure round uses."""

    def secure_stage(
        self, round_number: int, stage: str, message: StageMessage
    ) -> tuple[StageMessage, str]: ...


class SecureUplink:
    """A site's secure-aggregation state across rounds (behind ``geoloco.site_agent.uplink.MaskedUplink``).

    Per round: ``begin_round`` starts the key stages on a background thread (they overlap the
    inner steps: advertisement closes once every live site advertised); ``masked_update`` waits
    for them, encodes (error feedback with this site's own residual, the round's shared random-k
    coordinates, clip, fixed point, distributed noise), masks chunk by chunk for an upload whose
    wire chunks equal the protocol's chunks (``upload_kwargs``); ``unmask`` answers the survivor list and the
    unmask request. Misbehaviour detected by the protocol (a substituted key, a replayed
    message, a request for both shares of one site) is refused and logged with the reason: the
    site then sits the round out (its update is not unmasked) and waits for the broadcast. So is
    a round whose threshold ``policy`` (this site's own assumption) does not accept.
    """

    def __init__(
        self,
        site: str,
        privacy: PrivacyConfig,
        uplink_codec: str,
        *,
        tls: TLSFiles | None,
        policy: ThresholdPolicy | None = None,
    ) -> None:
        self.site = site
        self.privacy = privacy
        self.policy = policy if policy is not None else ThresholdPolicy()
        self.uplink_codec = uplink_codec
        if tls is not None:
            ca, cert, key = tls.read()
            self.identity = SiteIdentity.create(site, cert, key)
            self.ca_pem: bytes | None = ca
        else:
            logger.warning(
                "site %s: secure aggregation without TLS (--insecure): updates stay hidden from a "
                "coordinator that follows the protocol, but identity keys are not bound to "
                "certificates, so a coordinator that substitutes keys is no longer detected", site,
            )
            self.identity = SiteIdentity.create(site)
            self.ca_pem = None
        self.encoders: dict[int, PrivateUpdateEncoder] = {0: PrivateUpdateEncoder(privacy, uplink_codec)}
        """One encoder (own error-feedback residual) per Streaming DiLoCo fragment; 0 without."""
        self._last: PrivateUpdateEncoder | None = None
        """The encoder of this round's update (for ``restore``)."""
        self._round: SecureSite | None = None
        self._keys: threading.Thread | None = None
        self._keys_error: BaseException | None = None
        self.refusals: list[str] = []
        """Reasons this site refused a round (substitution, replay, double-share request, a
        threshold below ``policy``)."""

    def encoder_for(self, fragment: int) -> PrivateUpdateEncoder:
        """Fragment ``fragment``'s encoder (Streaming DiLoCo: error feedback per fragment)."""
        if fragment not in self.encoders:
            self.encoders[fragment] = PrivateUpdateEncoder(self.privacy, self.uplink_codec)
        return self.encoders[fragment]

    def reset(self, fragment: int) -> None:
        """Drop ``fragment``'s residual (after a non-finite update): a fresh encoder next time."""
        self.encoders.pop(fragment, None)

    def begin_round(self, client: _Client, *, session: str, round_number: int, round_seed: int, numel: int) -> None:
        """Start this round's key stages beside the training (``numel``: the round's update
        size, a fragment's with Streaming DiLoCo: each fragment sync is its own secure sum)."""
        self._round = SecureSite(
            self.identity, self.privacy, self.uplink_codec, numel=numel, session=session,
            round_number=round_number, index_seed=secure_index_seed(round_seed),
            call=lambda stage, message: client.secure_stage(round_number, stage, message), ca_pem=self.ca_pem,
            policy=self.policy,
        )
        self._keys_error = None
        self._last = None
        secure = self._round

        def share_keys() -> None:
            try:
                secure.share_keys()
            except BaseException as err:  # noqa: BLE001 (reported by upload(), on the agent's thread)
                self._keys_error = err

        self._keys = threading.Thread(target=share_keys, name=f"geoloco-secagg-keys-{self.site}", daemon=True)
        self._keys.start()

    def _refuse(self, why: BaseException) -> None:
        text = f"site {self.site}: refusing secure round: {why}"
        logger.error("%s", text)
        self.refusals.append(str(why))
        assert self._round is not None
        self._round.withdraw()

    def masked_update(self, update: torch.Tensor, *, fragment: int = 0) -> bytes | None:
        """Wait for the key stages, then the masked upload bytes (None: not in this round).

        When the site is not in the round, ``update`` goes whole into ``fragment``'s residual
        (error feedback), so the work is sent in the fragment's next round, not lost.
        """
        assert self._keys is not None and self._round is not None
        encoder = self.encoder_for(fragment)
        self._last = None
        self._keys.join()
        error = self._keys_error
        if error is not None:
            encoder.keep(update)
        if isinstance(error, SecAggViolation):
            self._refuse(error)
            return None
        if isinstance(error, SecAggAbort):
            logger.warning("site %s: secure round %d aborted: %s", self.site, self._round.context.round_index, error)
            return None
        if error is not None:
            # E.g. the site joined after key advertisement closed: it sits this round out.
            logger.warning(
                "site %s: not part of secure round %d (%s)", self.site, self._round.context.round_index, error
            )
            if not isinstance(error, Exception):
                raise error
            self._round.withdraw()
            return None
        self._last = encoder
        return self._round.masked_upload(update, encoder)

    def restore(self) -> None:
        """This round's masked update was not in the sum (the round aborted, or the coordinator
        refused the upload or left the site out of the survivors; the broadcast's ``included``
        says so): its values go back into the residual, like a plain update that missed its
        round (``UpdateEncoder.restore``)."""
        if self._last is not None:
            self._last.restore()
            self._last = None

    def upload_kwargs(self) -> dict[str, Any]:
        """What ``CoordinatorClient.upload`` needs besides the bytes for a masked upload."""
        assert self._round is not None
        width = self.privacy.modulus_bits // 8
        return {
            "codec": SECURE_UPLOAD_CODEC,
            "shape": [self._round.context.numel],
            "dtype": MODULUS_DTYPES[self.privacy.modulus_bits].name,
            "chunk_size": self.privacy.chunk_size * width,
        }

    def unmask(self) -> bool:
        """The survivor list and the unmask answer; False when the round aborted or was refused."""
        assert self._round is not None
        try:
            self._round.unmask()
            return True
        except SecAggViolation as why:
            self._refuse(why)
        except SecAggAbort as why:
            logger.warning("site %s: secure round %d aborted: %s", self.site, self._round.context.round_index, why)
        except RoundClosed as why:
            # The unmask stage closed without this answer (its deadline passed, or the
            # coordinator stopped waiting for this site): the broadcast says whether this site's
            # update counted.
            logger.info(
                "site %s: round %d finished without this site's unmask answer (%s); the broadcast "
                "says whether its update counted", self.site, self._round.context.round_index, why,
            )
        except UpdateRejected as why:
            # E.g. the coordinator says this site is not among the survivors: it waits for the
            # broadcast, which says whether its update counted.
            logger.warning(
                "site %s: unmasking of round %d refused: %s", self.site, self._round.context.round_index, why
            )
        return False
