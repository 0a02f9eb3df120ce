"""How the simulator's sites upload and how their uploads are aggregated, for each kind of round.

One interface, two implementations, chosen once per run by ``build_uplinks``:

- ``PlainUplinks``: each site encodes with its own uplink (error feedback per fragment) and the
  round adds the decoded update into the sum ``new_aggregation`` builds: a ``RunningSum``, with
  central DP a ``CentralDPSum`` (clip each, noise the sum), or with a robust rule in
  ``[algorithm]`` a ``RobustAggregation`` (``geoloco.algorithms.robust``), as the coordinator does.
  With partial updates (``geoloco.algorithms.partial``) a site encodes only its group's
  coordinates and the round's ``PartialMean`` averages each coordinate over the sites that
  trained it.
- ``SecureUplinks``: each site's update is clipped, fixed-point encoded and masked by the secure
  aggregation protocol (``InMemorySecureSum``: every party in this process); the upload sizes are
  those of the protocol's messages, known once every site has encoded.

``AttackedUplinks`` wraps either for poisoned sites (a research hook, ``SiteConfig.attack``).

The simulator's round asks ``begin`` for the round's aggregation, ``encode`` for each site's
payload, ``nbytes`` for its size on the wire (``traffic``: a secure upload's bytes stage by
stage, which the secure round's clock times and of which a relay sums the masked vector), and
``keep`` for an update that missed its round; it never asks which kind of round it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from geoloco.algorithms.aggregation import Aggregation, new_aggregation
from geoloco.algorithms.config import require
from geoloco.algorithms.engine import UNSCREENED, Screen
from geoloco.algorithms.privacy.dp_accountant import PrivacyAccountant
from geoloco.algorithms.privacy.private_aggregation import (
    PrivacyConfig,
    PrivateUpdateEncoder,
    effective_noise_multiplier,
    plan_secure_round,
    secure_index_seed,
)
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.algorithms.privacy.secure_sum import InMemorySecureSum
from geoloco.algorithms.round import RoundOutcome
from geoloco.algorithms.simulation.robust_attack import Attack
from geoloco.algorithms.strategy import RoundPlan, Strategy
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.compression import Encoded

__all__ = [
    "AttackedUplinks",
    "Payload",
    "PlainUplinks",
    "PrivacyBudget",
    "SecureUplinks",
    "SimUplinks",
    "build_uplinks",
    "drop_refused",
    "keep_aborted",
    "round_noise_multiplier",
    "simulation_session",
]

logger = logging.getLogger(__name__)

Payload = Encoded | torch.Tensor


class SimUplinks(Protocol):
    """The sites' side and the aggregation of one kind of round."""

    def begin(self, plan: RoundPlan) -> Aggregation:
        """The aggregation of round ``plan.round`` (sized for its fragment)."""
        ...

    def encode(self, site: str, update: torch.Tensor, plan: RoundPlan, aggregation: Aggregation) -> Payload:
        """Site ``site``'s upload of ``update`` (consumed)."""
        ...

    def nbytes(self, site: str, payload: Payload, aggregation: Aggregation) -> int:
        """Bytes site ``site`` sent this round (available once every site has encoded)."""
        ...

    def nbytes_now(self, payload: Payload) -> int | None:
        """The upload's size as soon as it is encoded, or None when only the round's protocol
        tells it (then the round holds every update until all sites have encoded)."""
        ...

    def traffic(self, site: str, aggregation: Aggregation) -> SiteTraffic | None:
        """A secure round's upload stage by stage (``nbytes`` is its ``up``; ``masked_up`` is
        what a relay adds into its ring sum instead of passing it on), or None for a plain
        upload: one transfer, which a relay decodes into its partial sum."""
        ...

    def screen(self, payload: Payload) -> Screen:
        """What the coordinator's update guard would measure of the upload (nothing of a
        masked one)."""
        ...

    def keep(self, site: str, payload: Payload, fragment: int) -> None:
        """An upload that missed its round goes back into the site's residual."""
        ...

    def keeps(self, site: str, fragment: int) -> bool:
        """Whether ``give_back`` puts anything back for ``site`` (error feedback): only then is
        an admitted upload held until the round's step, for ``keep_aborted``."""
        ...

    def give_back(self, site: str, payload: Payload, fragment: int) -> None:
        """The round took ``site``'s upload and then aborted: back into the site's residual."""
        ...

    def drop(self, site: str, fragment: int) -> None:
        """The round refused ``site``'s upload: its residual, which holds what the codec left
        of that upload, starts afresh (the real site resets it on ``BroadcastHeader.refused``)."""
        ...


class PlainUplinks:
    """Sites encode with their own uplink; the round sums the decoded updates, plainly or with
    central DP (clip each, noise the sum)."""

    def __init__(self, strategy: Strategy, uplinks: dict[str, FragmentUplink], privacy: PrivacyConfig) -> None:
        self.strategy = strategy
        self.uplinks = uplinks
        self.privacy = privacy

    def begin(self, plan: RoundPlan) -> Aggregation:
        return new_aggregation(
            self.strategy.update_numel(plan.round), central_dp=self.privacy.unmasked_central_dp,
            robust=self.strategy.config.robust_rule, device=self.strategy.device, partial=self.strategy.partial,
        )

    def encode(self, site: str, update: torch.Tensor, plan: RoundPlan, aggregation: Aggregation) -> Payload:
        update = self.strategy.upload_part(update, site)  # partial updates: only the site's group travels
        return self.uplinks[site].encode(update, seed=plan.uplink_seed(site), fragment=plan.fragment)

    def nbytes(self, site: str, payload: Payload, aggregation: Aggregation) -> int:
        assert isinstance(payload, Encoded)
        return payload.nbytes

    def nbytes_now(self, payload: Payload) -> int | None:
        assert isinstance(payload, Encoded)
        return payload.nbytes

    def traffic(self, site: str, aggregation: Aggregation) -> SiteTraffic | None:
        return None

    def screen(self, payload: Payload) -> Screen:
        return Screen.of(payload, device=self.strategy.device)

    def keep(self, site: str, payload: Payload, fragment: int) -> None:
        assert isinstance(payload, Encoded)
        self.uplinks[site].restore(payload, fragment=fragment)

    def keeps(self, site: str, fragment: int) -> bool:
        return self.uplinks[site].encoders[fragment].error_feedback is not None

    def give_back(self, site: str, payload: Payload, fragment: int) -> None:
        self.keep(site, payload, fragment)

    def drop(self, site: str, fragment: int) -> None:
        self.uplinks[site].encoders[fragment] = self.strategy.uplink_encoder(site)


class SecureUplinks:
    """Secure aggregation (optionally with distributed or central DP), all parties in-process.

    Each site keeps one ``PrivateUpdateEncoder`` per fragment (its own error-feedback residual)
    and an Ed25519 identity key, as the real site agent does.
    """

    def __init__(
        self, privacy: PrivacyConfig, uplink_codec: str, *, error_feedback: bool,
        sites: Sequence[str], fragments: int, session: str,
    ) -> None:
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.session = session
        self.sites = list(sites)
        self.encoders = [
            {site: PrivateUpdateEncoder(privacy, uplink_codec, error_feedback=error_feedback) for site in sites}
            for _ in range(fragments)
        ]
        self.identity_keys = {site: Ed25519PrivateKey.generate() for site in sites}

    def begin(self, plan: RoundPlan) -> Aggregation:
        return InMemorySecureSum(
            self.privacy, self.uplink_codec, self.encoders[plan.fragment], self.identity_keys,
            expected=self.sites, session=self.session, round_index=plan.round,
            index_seed=secure_index_seed(plan.seed),
        )

    def encode(self, site: str, update: torch.Tensor, plan: RoundPlan, aggregation: Aggregation) -> Payload:
        assert isinstance(aggregation, InMemorySecureSum)
        aggregation.submit(site, update.to("cpu"))
        return update

    def nbytes(self, site: str, payload: Payload, aggregation: Aggregation) -> int:
        assert isinstance(aggregation, InMemorySecureSum)
        return aggregation.traffic[site].up

    def nbytes_now(self, payload: Payload) -> int | None:
        return None

    def traffic(self, site: str, aggregation: Aggregation) -> SiteTraffic | None:
        assert isinstance(aggregation, InMemorySecureSum)
        return aggregation.traffic[site]

    def screen(self, payload: Payload) -> Screen:
        return UNSCREENED  # a masked update: nobody may measure it

    def keep(self, site: str, payload: Payload, fragment: int) -> None:
        raise ValueError("a secure round waits for every site (no deadline): nothing can miss it")

    def keeps(self, site: str, fragment: int) -> bool:
        return bool(self.encoders[fragment][site].error_feedback)

    def give_back(self, site: str, payload: Payload, fragment: int) -> None:
        # What the site masked and sent is in its encoder: back into its residual, as the real
        # masked site does when its round did not sum it (``SecureUplink.restore``).
        self.encoders[fragment][site].restore()

    def drop(self, site: str, fragment: int) -> None:
        raise ValueError("a masked upload cannot be refused for its values: nobody may measure it")


class AttackedUplinks:
    """Poisoned sites (``SiteConfig.attack``, ``geoloco.algorithms.simulation.robust_attack``): their
    honest update is replaced before it reaches the wrapped uplinks' encoder; everything else
    is the wrapped kind of round's."""

    def __init__(self, inner: SimUplinks, attacks: Mapping[str, Attack]) -> None:
        self.inner = inner
        self.attacks = dict(attacks)

    def begin(self, plan: RoundPlan) -> Aggregation:
        return self.inner.begin(plan)

    def encode(self, site: str, update: torch.Tensor, plan: RoundPlan, aggregation: Aggregation) -> Payload:
        attack = self.attacks.get(site)
        if attack is not None:
            update = attack.apply(update, round_seed=plan.seed, site=site)
        return self.inner.encode(site, update, plan, aggregation)

    def nbytes(self, site: str, payload: Payload, aggregation: Aggregation) -> int:
        return self.inner.nbytes(site, payload, aggregation)

    def nbytes_now(self, payload: Payload) -> int | None:
        return self.inner.nbytes_now(payload)

    def traffic(self, site: str, aggregation: Aggregation) -> SiteTraffic | None:
        return self.inner.traffic(site, aggregation)

    def screen(self, payload: Payload) -> Screen:
        return self.inner.screen(payload)

    def keep(self, site: str, payload: Payload, fragment: int) -> None:
        self.inner.keep(site, payload, fragment)

    def keeps(self, site: str, fragment: int) -> bool:
        return self.inner.keeps(site, fragment)

    def give_back(self, site: str, payload: Payload, fragment: int) -> None:
        self.inner.give_back(site, payload, fragment)

    def drop(self, site: str, fragment: int) -> None:
        self.inner.drop(site, fragment)


def drop_refused(uplinks: SimUplinks, outcome: RoundOutcome, fragment: int) -> None:
    """Every update the round refused is dropped with what its encoding left in the residual,
    as the real site drops it (``BroadcastHeader.refused``); a site that withheld a non-finite
    update has a fresh residual already, and gets another."""
    for name in outcome.rejected:
        uplinks.drop(name, fragment)


def keep_aborted(
    uplinks: SimUplinks, outcome: RoundOutcome, fragment: int, *, early: Mapping[str, Payload],
    names: Sequence[str], payloads: Sequence[Payload | None],
) -> None:
    """An aborted round's counted updates go back into their sites' residuals, as the real site
    keeps an update whose round did not aggregate it without refusing it (the broadcast's
    ``included`` and ``refused`` both false); refused updates are dropped on both sides. An
    update is in ``early`` (site -> upload admitted as it arrived, held for this when the site
    ``keeps``) or still in ``payloads`` (admitted at the close)."""
    for name in outcome.contributors:
        payload = early.get(name)
        if payload is None:
            payload = payloads[list(names).index(name)]
        if payload is not None and uplinks.keeps(name, fragment):
            uplinks.give_back(name, payload, fragment)


def simulation_session(seed: int) -> str:
    """The secure-aggregation session of a simulated run (its protocol messages name it, so the
    planner sizes them with the same one)."""
    return f"simulation-{seed}"


def build_uplinks(
    strategy: Strategy, privacy: PrivacyConfig, sites: Sequence[str], *, uplink_codec: str,
    error_feedback: bool, session: str, attacks: Mapping[str, Attack] | None = None,
) -> tuple[SimUplinks, dict[str, FragmentUplink]]:
    """The run's uplinks and, for plain and central-DP rounds, each site's own encoders;
    ``attacks``: site -> the poisoned update it uploads instead of its own."""
    uplinks: dict[str, FragmentUplink] = {}
    kind: SimUplinks
    if strategy.partial is not None:
        require(
            len(sites) >= strategy.partial.groups,
            "algorithm.partial_updates.groups",
            f"{strategy.partial.groups} groups need at least as many sites (site k trains group "
            f"k mod groups), got {len(sites)} sites",
        )
    if privacy.secure_aggregation:
        kind = SecureUplinks(
            privacy, uplink_codec, error_feedback=error_feedback, sites=sites,
            fragments=len(strategy.partition), session=session,
        )
    else:
        uplinks = {site: strategy.build_uplink(site) for site in sites}
        kind = PlainUplinks(strategy, uplinks, privacy)
    return (AttackedUplinks(kind, attacks) if attacks else kind), uplinks


def round_noise_multiplier(privacy: PrivacyConfig, uplink_codec: str, *, numel: int, num_sites: int) -> float:
    """What the accountant composes for one release of a ``numel``-element update (see
    ``effective_noise_multiplier``): distributed DP's noise in fixed-point units."""
    if privacy.dp != "distributed":
        return privacy.noise_multiplier
    context, fixed = plan_secure_round(
        privacy, uplink_codec, numel=numel, num_sites=num_sites, session="simulation", round_index=0,
    )
    return effective_noise_multiplier(privacy, fixed, context.numel)


class PrivacyBudget:
    """A simulated run's privacy accounting and its stop on ``[privacy] epsilon_budget``: no round
    whose release would push the accounted epsilon past the budget. The simulator and the planner
    both ask it before each DiLoCo-family round, so they stop at the same round."""

    def __init__(
        self, privacy: PrivacyConfig, uplink_codec: str, *, update_numel: Callable[[int], int], num_sites: int
    ) -> None:
        self.privacy = privacy
        self.uplink_codec = uplink_codec
        self.update_numel = update_numel
        """Round -> the size of its released update (a Streaming DiLoCo round's: its fragment's)."""
        self.num_sites = num_sites
        self.accountant = PrivacyAccountant(privacy.delta) if privacy.dp != "off" else None

    def noise_multiplier(self, round_number: int) -> float:
        """What the accountant composes for round ``round_number``: one release of its update."""
        return round_noise_multiplier(
            self.privacy, self.uplink_codec, numel=self.update_numel(round_number), num_sites=self.num_sites
        )

    def allows(self, round_number: int) -> bool:
        """Whether round ``round_number`` runs; if it does, its release is accounted now."""
        if self.accountant is None:
            return True
        z = self.noise_multiplier(round_number)
        if not self.accountant.allows(z, self.privacy.epsilon_budget):
            logger.info(
                "stopping before round %d: epsilon would reach %.3f, budget %.3f",
                round_number, self.accountant.epsilon_after(z), self.privacy.epsilon_budget,
            )
            return False
        self.accountant.step(z)
        return True
