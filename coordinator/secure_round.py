"""The coordinator's side of one secure-aggregation round, as stage calls from named sites.

``geoloco.algorithms.privacy.secagg_server.SecAggServer`` is the protocol; this class adapts it to the real
system: sites are names (``site_index`` maps them to protocol ids), stages close when every live
site has answered or a stage deadline passes (a site that vanished is waited for no longer than
that, or than the heartbeat timeout that drops it), and stage calls carry the dataclasses of
``geoloco.algorithms.privacy.secagg_stages`` both ways (the servicer translates them from and to
``SecureStageRequest`` / ``SecureStageResponse`` with ``geoloco.protos.secagg_wire``). It is not
thread-safe: ``RoundStateMachine`` calls it under its lock and runs ``result()`` (the unmasking,
the heavy part) outside the lock.

Stage calls of a site, in order (``stage`` names from ``geoloco.algorithms.privacy.secagg_messages``):

1. ``advertise_keys`` with ``AdvertiseKeys`` (advertisement + identity binding) -> ``Advertisements``.
2. ``share_keys`` with its ``ShareBundle`` -> a ``ShareBundle`` of the shares addressed to it.
3. the masked upload, through the ordinary ``Upload`` RPC (codec ``"secagg"``) -> ``receive_upload``.
4. ``consistency`` (no message) -> the ``SurvivorList`` (complete uploads), once uploads close.
5. ``unmask`` with its ``SurvivorSignature`` over that list -> the ``UnmaskRequest``.
6. ``unmask_response`` with its ``UnmaskResponse`` -> acknowledged (no message).

At any point, ``withdraw`` (no message) -> acknowledged: the site refused the round.

No method stores a site's update: masked chunks go straight into the protocol's sum.

Hostile sites. A stage message that cannot be right (an advertisement not signed by the key its
identity binding carries, a binding that fails the run's CA, a survivor signature that does not
verify, an unmask answer with missing, extra or malformed shares) is refused with the reason and
its sender is left out of the stages still to come, so no honest site refuses the round over it
and no stage waits for it. A site that refuses the round says so (``withdraw``) and is no
longer waited for; as soon as fewer sites than the quorum
can still upload, the round aborts with "no change". Key and unmask stages close after
``stage_timeout_s`` whether or not a site calls (``advance`` runs from the coordinator's poll).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from geoloco.algorithms.fixed_point import FixedPoint, lift
from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyConfig,
    decode_secure_sum,
    effective_noise_multiplier,
    secure_context,
    secure_fixed_point,
)
from geoloco.algorithms.privacy.secagg_crypto import site_index
from geoloco.algorithms.privacy.secagg_messages import (
    MIN_SITES,
    STAGE_ADVERTISE_KEYS,
    STAGE_CONSISTENCY,
    STAGE_SHARE_KEYS,
    STAGE_UNMASK,
    STAGE_UNMASK_RESPONSE,
    STAGE_WITHDRAW,
    RoundContext,
    SecAggAbort,
    SecAggViolation,
    UnmaskResponse,
)
from geoloco.algorithms.privacy.secagg_server import SecAggServer
from geoloco.algorithms.privacy.secagg_stages import (
    AdvertiseKeys,
    Advertisements,
    IdentityBinding,
    ShareBundle,
    StageMessage,
    StageReply,
    SurvivorList,
    SurvivorSignature,
    check_stage_message,
)
from geoloco.protos.secagg_identity import load_ca, verify_binding

__all__ = ["SecureRound", "StageReply"]

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Stage:
    opened_s: float
    answered: dict[str, StageMessage] = field(default_factory=dict)
    """Site -> the message it sent (a repeated call must send an equal one)."""
    closed: bool = False


class SecureRound:
    """One round of secure aggregation over the sites that advertise keys in time."""

    def __init__(
        self,
        privacy: PrivacyConfig,
        uplink_codec: str,
        *,
        numel: int,
        session: str,
        round_number: int,
        index_seed: int,
        stage_timeout_s: float,
        now: float,
        ca_pem: bytes | None = None,
    ) -> None:
        """``ca_pem``: the run's CA; with it every identity binding is required and checked
        against it before it is relayed (None: --insecure, bindings are relayed when offered)."""
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.numel = numel
        self.round_number = round_number
        self.index_seed = index_seed
        self.stage_timeout_s = stage_timeout_s
        self.context: RoundContext = secure_context(
            privacy, uplink_codec, numel=numel, session=session, round_index=round_number
        )
        self.fixed: FixedPoint | None = None
        """The shared encoding, fixed when advertisement closes (it depends on how many sites)."""
        self.server = SecAggServer(self.context)
        self.aborted = ""
        self._names: dict[int, str] = {}
        self._bindings: dict[str, IdentityBinding] = {}
        self._stages: dict[str, _Stage] = {STAGE_ADVERTISE_KEYS: _Stage(opened_s=now)}
        self._replies: dict[str, dict[str, StageMessage]] = {}
        self._survivors: list[str] = []
        self._uploaded: list[str] = []
        self._withdrawn: set[str] = set()
        """Live sites known not to advertise keys in this round (see ``withdraw``)."""
        self._left_out: dict[str, str] = {}
        """Site -> why it takes no further part (a refused message, or it gave up the round)."""
        self._ca = load_ca(ca_pem)

    # ------------------------------------------------------------------------------------------
    # Stage calls

    def submit(self, site: str, stage: str, message: StageMessage) -> None:
        """Record a site's stage message (a repeated identical call is a no-op).

        ``message`` must be what ``stage`` takes (``STAGE_REQUESTS``): anything else raises
        ``SecAggViolation``, an unknown stage ``ValueError``.
        """
        check_stage_message(stage, message)
        if self.aborted:
            return
        if stage == STAGE_WITHDRAW:
            self._give_up(site)
            return
        if stage == STAGE_CONSISTENCY:
            # A pure wait for the survivor list; sites may call it before uploads close.
            if self._survivors and site not in self._survivors:
                raise SecAggViolation(f"site {site} did not upload in round {self.round_number}")
            return
        current = self._stages.get(stage)
        if current is None:
            raise SecAggViolation(f"site {site}: stage {stage} is not open yet in round {self.round_number}")
        if site in current.answered:
            if current.answered[site] != message:
                raise SecAggViolation(f"site {site} sent a different {stage} message twice")
            return
        if current.closed:
            raise SecAggViolation(f"site {site}: stage {stage} of round {self.round_number} is closed")
        if site in self._left_out:
            raise SecAggViolation(f"site {site} was left out of round {self.round_number}: {self._left_out[site]}")
        try:
            self._record(site, message)
        except ValueError as why:  # SecAggViolation included
            # Its sender takes no further part; the stages stop waiting for it.
            self._leave_out(site, str(why))
            raise
        current.answered[site] = message

    def _leave_out(self, site: str, why: str) -> None:
        if site not in self._left_out:
            logger.warning("round %d: site %s left out of secure aggregation: %s", self.round_number, site, why)
            self._left_out[site] = why
        if not self._stages[STAGE_ADVERTISE_KEYS].closed:
            self._withdrawn.add(site)

    def _identity(self, site: str, binding: IdentityBinding | None) -> Ed25519PublicKey | None:
        """The identity key ``site``'s binding vouches for (None: no binding, --insecure only)."""
        if binding is None:
            if self._ca is not None:
                raise SecAggViolation(f"site {site} advertised keys without an identity binding")
            return None
        if binding.name != site:
            raise SecAggViolation(f"site {site} offered the identity binding of site {binding.name!r}")
        return verify_binding(binding, self._ca)

    def _record(self, site: str, message: StageMessage) -> None:
        index = site_index(site)
        if isinstance(message, AdvertiseKeys):
            ad = message.advertisement
            if ad.site != index:
                raise SecAggViolation(f"site {site} must advertise keys as protocol site {index}")
            other = self._names.get(index)
            if other is not None and other != site:
                raise SecAggViolation(
                    f"sites {other!r} and {site!r} map to the same protocol id; rename one of them"
                )
            self.server.receive_advertisement(ad, self._identity(site, message.binding))
            self._names[index] = site
            if message.binding is not None:
                self._bindings[site] = message.binding
        elif isinstance(message, ShareBundle):
            self.server.receive_shares(index, message.shares)
        elif isinstance(message, SurvivorSignature):
            self.server.receive_signature(index, message.signature)
        elif isinstance(message, UnmaskResponse):
            if message.site != index:
                raise SecAggViolation(f"site {site} sent an unmask response for another site")
            self.server.receive_unmask(message)

    def progress(self) -> tuple[int, int, bool, bool]:
        """Changes exactly when a waiting stage call's reply may have: stages opened, closed,
        the survivor list set, the round aborted."""
        closed = sum(1 for stage in self._stages.values() if stage.closed)
        return len(self._stages), closed, bool(self._survivors), bool(self.aborted)

    def reply(self, site: str, stage: str) -> StageReply:
        """The reply to ``site``'s ``stage`` call if the stage has closed."""
        if self.aborted:
            return StageReply(ready=True, aborted=self.aborted)
        if stage == STAGE_WITHDRAW:
            return StageReply(ready=True)
        current = self._stages.get(stage)
        if stage == STAGE_CONSISTENCY and self._survivors:
            return StageReply(ready=True, message=SurvivorList(tuple(self._survivors)))
        if current is None or not current.closed:
            return StageReply(ready=False)
        return StageReply(ready=True, message=self._replies.get(stage, {}).get(site))

    def receive_upload(self, site: str, data: memoryview | bytes) -> None:
        """Add a complete masked upload chunk by chunk into the protocol sum."""
        if self.aborted:
            raise SecAggAbort(f"secure aggregation of round {self.round_number} was aborted: {self.aborted}")
        index = site_index(site)
        width = self.context.modulus_bits // 8
        expected = self.context.numel * width
        if len(data) != expected:
            raise ValueError(f"site {site}: masked upload of {len(data)} bytes, expected {expected}")
        step = self.context.chunk_size * width
        view = memoryview(data)
        for chunk, start in enumerate(range(0, expected, step)):
            self.server.receive_masked_chunk(index, chunk, bytes(view[start : start + step]))
        self._uploaded.append(site)

    # ------------------------------------------------------------------------------------------
    # Driving the stages

    def advance(self, live: set[str], now: float) -> None:
        """Close whatever stage is complete (every live site answered) or past its deadline."""
        if self.aborted:
            return
        try:
            self._advance(live, now)
        except SecAggAbort as why:
            self.abort(str(why))

    def abort(self, reason: str) -> None:
        if not self.aborted:
            logger.warning("round %d: secure aggregation aborted: %s", self.round_number, reason)
            self.aborted = reason

    def withdraw(self, site: str) -> None:
        """``site`` will not advertise keys in this round while advertisement is still open: it
        sent a masked upload or waits for the broadcast without having advertised, i.e. its
        masks and key stages belong to another protocol instance (typically this coordinator's
        predecessor, before a restart) or it sat the round out. Advertisement stops waiting for
        it; if no live site is left to wait for, it closes now (and the round aborts at once
        when too few advertised) instead of after ``stage_timeout_s``."""
        ads = self._stages[STAGE_ADVERTISE_KEYS]
        if not ads.closed and site not in self._names.values():
            self._withdrawn.add(site)

    def _give_up(self, site: str) -> None:
        """A ``withdraw`` stage call: ``site`` refused the round and takes no further part; no
        stage waits for it, it may not upload, and ``uploads_close`` aborts the round as soon as
        too few sites can still upload. An upload it already completed stays in the sum."""
        self._leave_out(site, "it withdrew from the round")

    def _due(self, stage: _Stage, expected: set[str], now: float) -> bool:
        expected = expected - set(self._left_out)
        return (bool(expected) and expected <= set(stage.answered)) or now - stage.opened_s >= self.stage_timeout_s

    def _advance(self, live: set[str], now: float) -> None:
        ads = self._stages[STAGE_ADVERTISE_KEYS]
        # Fewer than MIN_SITES live members (a site missed a heartbeat and was dropped for a
        # moment): closing now would abort a round that can still gather its sites, so only the
        # stage deadline closes it.
        enough = len(live) >= MIN_SITES or now - ads.opened_s >= self.stage_timeout_s
        expected = live - self._withdrawn
        nobody_left = bool(live) and expected <= set(ads.answered)
        if not ads.closed and enough and (self._due(ads, expected, now) or nobody_left):
            ads.closed = True
            adverts = self.server.advertisements()
            try:
                self.fixed = secure_fixed_point(self.privacy, len(adverts))
            except ValueError as err:
                raise SecAggAbort(str(err)) from None
            # Each site gets every name (its graph is derived from them) but only its own and
            # its neighbours' keys and identity bindings, the ones it uses and checks: with
            # SecAgg+'s graph O(log n) of them per site, not n (n^2 bytes and checks a round).
            names = dict(self._names)
            replies: dict[str, StageMessage] = {}
            for index, name in names.items():
                mine = tuple(self.server.advertisements_for(index))
                replies[name] = Advertisements(
                    names=names,
                    advertisements=mine,
                    bindings=tuple(
                        self._bindings[names[ad.site]] for ad in mine if names[ad.site] in self._bindings
                    ),
                )
            self._replies[STAGE_ADVERTISE_KEYS] = replies
            self._stages[STAGE_SHARE_KEYS] = _Stage(opened_s=now)
        shares = self._stages.get(STAGE_SHARE_KEYS)
        if shares is not None and not shares.closed and self._due(
            shares, live & set(self._names.values()), now
        ):
            shares.closed = True
            self.server.close_share_keys()
            self._replies[STAGE_SHARE_KEYS] = {
                n: ShareBundle(tuple(self.server.shares_for(i))) for i, n in self._names.items()
            }
        signatures = self._stages.get(STAGE_UNMASK)
        if signatures is not None and not signatures.closed and self._due(
            signatures, live & set(self._survivors), now
        ):
            signatures.closed = True
            request = self.server.unmask_request()
            indices = {name: index for index, name in self._names.items()}
            self._replies[STAGE_UNMASK] = {
                n: self.server.unmask_request_for(indices[n], request) for n in signatures.answered
            }
            self._stages[STAGE_UNMASK_RESPONSE] = _Stage(opened_s=now)
        responses = self._stages.get(STAGE_UNMASK_RESPONSE)
        if responses is not None and not responses.closed and self._due(
            responses, live & set(self._stages[STAGE_UNMASK].answered), now
        ):
            responses.closed = True

    def uploads_close(self, live: set[str], contributed: set[str], quorum: int, now: float) -> bool:
        """Whether uploads close now: every live site that may upload did, with at least the
        quorum; or the round aborted (a key stage timed out, too few sites can still upload).

        ``contributed``: sites whose masked upload is complete. Also advances the key stages, so
        their deadlines hold when no site calls (the coordinator's poll calls this).
        """
        self.advance(live, now)
        if self.aborted:
            return True
        need = max(quorum, MIN_SITES)
        if not self.keys_shared:
            if STAGE_SHARE_KEYS not in self._stages:
                return False
            # Keys are being shared: only the advertised sites not yet left out can upload, so
            # sites refusing at this stage (e.g. a threshold below their own bound) end the round
            # now rather than at the stage deadline.
            can_upload = set(self._names.values()) - set(self._left_out)
        else:
            can_upload = {s for s in self._stages[STAGE_SHARE_KEYS].answered if s not in self._left_out}
        if len(can_upload | contributed) < need:
            self.abort(
                f"only {len(can_upload | contributed)} sites can still upload "
                f"({sorted(can_upload | contributed)}); the round needs {need}: no change this round"
            )
            return True
        if not self.keys_shared:
            return False
        expected = {s for s in live if s in can_upload}
        return len(contributed) >= need and expected <= contributed

    @property
    def keys_shared(self) -> bool:
        """Whether uploads may start (the share-keys stage closed)."""
        stage = self._stages.get(STAGE_SHARE_KEYS)
        return stage is not None and stage.closed

    def may_upload(self, site: str) -> bool:
        """Only sites that shared keys in time can be unmasked, so only they may upload (and not
        once they were left out)."""
        return self.keys_shared and site in self._stages[STAGE_SHARE_KEYS].answered and site not in self._left_out

    def close_upload(self, now: float) -> list[str]:
        """Freeze the survivors (complete uploads); opens the consistency and unmask stages."""
        if self.aborted:
            return []
        try:
            if not self.keys_shared:
                raise SecAggAbort("the round closed before the sites finished sharing keys")
            survivors = self.server.close_upload()
        except SecAggAbort as why:
            self.abort(str(why))
            return []
        self._survivors = sorted(self._names[i] for i in survivors)
        self._stages[STAGE_UNMASK] = _Stage(opened_s=now)
        return list(self._survivors)

    @property
    def survivors(self) -> list[str]:
        return list(self._survivors)

    @property
    def unmask_answered(self) -> list[str]:
        """Sites that answered the unmask request (survivors missing here dropped after uploading)."""
        stage = self._stages.get(STAGE_UNMASK_RESPONSE)
        return sorted(stage.answered) if stage is not None else []

    @property
    def done(self) -> bool:
        """Unmasking can run (or the round was aborted)."""
        if self.aborted:
            return True
        stage = self._stages.get(STAGE_UNMASK_RESPONSE)
        return stage is not None and stage.closed

    def result(self) -> torch.Tensor:
        """The mean update of the survivors (fp32, full length); raises ``SecAggAbort``."""
        if self.aborted:
            raise SecAggAbort(self.aborted)
        try:
            total = self.server.result()
        except SecAggAbort as why:
            self.abort(str(why))
            raise
        except (ValueError, TypeError) as err:
            # Unmask answers were checked on arrival; whatever still fails costs the round only.
            self.abort(f"unmasking failed: {err}")
            raise SecAggAbort(self.aborted) from None
        assert self.fixed is not None
        return decode_secure_sum(
            lift(total, self.context.modulus_bits), self.fixed, count=len(self._survivors),
            numel=self.numel, uplink_codec=self.uplink_codec, index_seed=self.index_seed,
        )

    def noise_multiplier(self) -> float:
        """What the accountant composes for this round."""
        if self.fixed is None:
            raise SecAggAbort("no encoding was fixed: the round ended before keys were advertised")
        return effective_noise_multiplier(self.privacy, self.fixed, self.context.numel)
