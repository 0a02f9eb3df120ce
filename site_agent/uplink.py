"""A site's uplink: how one round's pseudo-gradient becomes upload bytes, and back on failure.

Two kinds behind one interface, used by every round runner (``geoloco.site_agent.rounds``):

* ``StrategyUplink`` — the strategy's own encoders (``strategy.build_uplink()``: one
  ``UpdateEncoder`` with its error-feedback residual per fragment; plain DiLoCo has one), seeded
  per site and round with ``uplink_seed(round_seed, site, codec)`` as in the
  simulator, so the bytes are the simulator's bit for bit.
* ``MaskedUplink`` — secure aggregation (``geoloco.site_agent.secure_site.SecureUplink``): key
  stages beside the inner steps, the update masked with this site's private encoder (its own
  residual per fragment), unmask stages after the upload.

Per round a runner calls ``begin_round`` before training, ``encode`` after it, ``upload`` and
then ``uploaded`` (secure: the unmask stages, before the broadcast exists); ``restore`` puts an
update that the round did not aggregate back into its residual (``keep_or_drop``: unless the round
refused it), ``reset`` drops a fragment's residual (after a non-finite update).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from geoloco.algorithms.diloco import LOSSLESS_SPEC
from geoloco.algorithms.link_codec import switch_codec
from geoloco.algorithms.strategy import Strategy, uplink_seed
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.compression import Encoded
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import CoordinatorClient
from geoloco.site_agent.persist import SiteStateError, prefixed, unprefixed
from geoloco.site_agent.secure_site import SecureUplink

__all__ = ["MaskedUplink", "SiteUplink", "StrategyUplink", "UplinkUpdate", "keep_or_drop"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class UplinkUpdate:
    """One round's encoded update, ready for ``CoordinatorClient.upload``."""

    fragment: int
    """The Streaming DiLoCo fragment it covers (0: the whole model)."""
    data: bytes
    """The upload bytes."""
    sample_weight: float
    """``w_k`` sent with it."""
    wire: dict[str, Any] = field(default_factory=dict)
    """How the bytes are read: ``codec`` and ``shape`` (and, masked, ``dtype`` and ``chunk_size``)."""
    masked: bool = False
    """A secure-aggregation input: it belongs to its own round's secure sum."""

    def encoded(self) -> Encoded:
        """The plain encoding, parsed from ``data`` when ``restore`` needs it (rarely: a round
        that did not aggregate the update). Kept only as bytes meanwhile: holding the
        ``Encoded`` too would keep its payload, a second copy of every byte (for ``none``, a
        model-sized one), alive for the whole round."""
        if self.masked:
            raise ValueError("a masked update has no plain encoding")
        return Encoded.from_bytes(self.data)


class SiteUplink(Protocol):
    """What a round runner needs from an uplink (see the module docstring)."""

    folds_late: bool
    """An update that missed its round may be offered to the next one (``late_updates =
    "fold"``); a masked update belongs to its own round's sum and never is."""

    def begin_round(
        self, client: CoordinatorClient, *, round_number: int, round_seed: int, numel: int
    ) -> None: ...

    def encode(
        self, update: torch.Tensor, *, round_seed: int, fragment: int, samples: float
    ) -> UplinkUpdate | None: ...

    def upload(
        self, client: CoordinatorClient, update: UplinkUpdate, *, round_number: int,
        inner_steps: int, metrics: dict[str, float],
    ) -> pb.UploadResponse: ...

    def uploaded(self) -> None: ...

    def restore(self, update: UplinkUpdate) -> None: ...

    def reset(self, fragment: int) -> None: ...

    def residual(self, fragment: int = 0) -> torch.Tensor | None: ...


def _upload(
    client: CoordinatorClient, update: UplinkUpdate, *, round_number: int, inner_steps: int,
    metrics: dict[str, float],
) -> pb.UploadResponse:
    return client.upload(
        round_number=round_number, data=update.data, **update.wire,
        sample_weight=update.sample_weight, inner_steps=inner_steps, metrics=metrics,
        fragment=update.fragment,
    )


def _raw_fp32(update: torch.Tensor) -> bool:
    return update.dtype == torch.float32 and update.is_contiguous() and update.device.type == "cpu"


class StrategyUplink:
    """The strategy's per-fragment encoders with error feedback (see the module docstring)."""

    folds_late = True

    def __init__(self, strategy: Strategy, site: str) -> None:
        self.strategy = strategy
        self.site = site
        self.encoders: FragmentUplink = strategy.build_uplink(site)

    def begin_round(
        self, client: CoordinatorClient, *, round_number: int, round_seed: int, numel: int
    ) -> None:
        """Nothing to prepare: plain updates need no key exchange."""

    def use_codec(self, spec: str, fragment: int = 0) -> None:
        """Encode ``fragment``'s next update with ``spec`` (the round's codec the coordinator
        assigned with adaptive uplink codecs); the error-feedback residual carries over."""
        config = self.strategy.config
        encoders = self.encoders.encoders
        encoders[fragment] = switch_codec(
            encoders[fragment], spec, error_feedback=config.error_feedback, decay=config.error_feedback_decay
        )

    def encode(
        self, update: torch.Tensor, *, round_seed: int, fragment: int, samples: float
    ) -> UplinkUpdate:
        encoder = self.encoders.encoders[fragment]
        # Partial updates: only the site's group's subset travels (the coordinator knows which).
        part = self.strategy.upload_part(update, self.site)
        if encoder.error_feedback is None and encoder.spec == LOSSLESS_SPEC and _raw_fp32(part):
            # What the lossless codec's encode would give, bit for bit, with the update's own
            # memory as the payload instead of a model-sized copy of it (the caller checked
            # the update is finite, which is all ``none`` checks).
            flat = part.detach().reshape(-1)
            encoded = Encoded(encoder.spec, tuple(part.shape), part.dtype, flat.view(torch.uint8))
        else:
            # The encoder's own codec: with adaptive uplink codecs, the one assigned this round.
            seed = uplink_seed(round_seed, self.site, encoder.spec)
            encoded = self.encoders.encode(part, seed=seed, fragment=fragment)
        return UplinkUpdate(
            fragment=fragment, data=encoded.to_bytes(), sample_weight=float(max(samples, 1)),
            wire={"codec": encoded.spec, "shape": list(encoded.shape)},
        )

    def encode_added(
        self, pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]], numel: int, *,
        device: torch.device, round_seed: int, fragment: int, samples: float,
    ) -> UplinkUpdate | None:
        """``encode`` of an update given piece by piece (``UpdateEncoder.encode_added``): the
        pseudo-gradient is added into the error-feedback residual and never held whole. None
        where the dense ``encode`` must do it (no error feedback; pieces that are not finite
        or not encodable, which ``encode`` then reports as it always has; partial updates,
        whose upload is a subset the pieces do not follow)."""
        if self.strategy.partial is not None:
            return None
        encoder = self.encoders.encoders[fragment]
        seed = uplink_seed(round_seed, self.site, encoder.spec)
        encoded = encoder.encode_added(pieces, numel, device=device, seed=seed)
        if encoded is None:
            return None
        return UplinkUpdate(
            fragment=fragment, data=encoded.to_bytes(), sample_weight=float(max(samples, 1)),
            wire={"codec": encoded.spec, "shape": list(encoded.shape)},
        )

    def upload(
        self, client: CoordinatorClient, update: UplinkUpdate, *, round_number: int,
        inner_steps: int, metrics: dict[str, float],
    ) -> pb.UploadResponse:
        return _upload(client, update, round_number=round_number, inner_steps=inner_steps, metrics=metrics)

    def uploaded(self) -> None:
        """Nothing follows a plain upload until the broadcast."""

    def restore(self, update: UplinkUpdate) -> None:
        if self.encoders.encoders[update.fragment].error_feedback is None:
            return  # nothing to keep without error feedback: no need to parse the bytes
        self.encoders.restore(update.encoded(), fragment=update.fragment)

    def reset(self, fragment: int) -> None:
        self.encoders.encoders[fragment] = self.strategy.uplink_encoder(self.site)

    def residual(self, fragment: int = 0) -> torch.Tensor | None:
        return self.encoders.encoders[fragment].residual

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every fragment's error-feedback state (for ``geoloco.site_agent.persist``)."""
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for fragment, encoder in enumerate(self.encoders.encoders):
            tensors.update(prefixed(f"{fragment}.", encoder.state_tensors()))
            meta[str(fragment)] = encoder.state_meta()
        return tensors, meta

    def load_state(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device
    ) -> None:
        """Take a ``state`` back (its tensors moved to ``device``, where updates are encoded)."""
        encoders = self.encoders.encoders
        if len(meta) != len(encoders):
            raise SiteStateError(
                f"the saved uplink has {len(meta)} fragments, this run's has {len(encoders)}"
            )
        for fragment, encoder in enumerate(encoders):
            saved = meta[str(fragment)]
            if self.strategy.config.adaptive_uplink.enabled and isinstance(saved.get("codec"), str):
                self.use_codec(saved["codec"], fragment)  # the codec of the saved pending update
                encoder = encoders[fragment]
            if saved.get("codec") != encoder.spec:
                raise SiteStateError(
                    f"the saved uplink of fragment {fragment} used codec {saved.get('codec')!r}, "
                    f"this run uses {encoder.spec!r}"
                )
            own = {k: v.to(device) for k, v in unprefixed(f"{fragment}.", tensors).items()}
            encoder.load_state(own, saved)


class MaskedUplink:
    """Secure aggregation's uplink over ``SecureUplink`` (see the module docstring)."""

    folds_late = False

    def __init__(self, secure: SecureUplink) -> None:
        self.secure = secure

    def begin_round(
        self, client: CoordinatorClient, *, round_number: int, round_seed: int, numel: int
    ) -> None:
        """Start the key stages; they overlap the inner steps."""
        self.secure.begin_round(
            client, session=client.session_id, round_number=round_number, round_seed=round_seed,
            numel=numel,
        )

    def encode(
        self, update: torch.Tensor, *, round_seed: int, fragment: int, samples: float
    ) -> UplinkUpdate | None:
        """The masked update (None: the site is not part of this round's secure sum; the
        update then went whole into the fragment's residual)."""
        masked = self.secure.masked_update(update, fragment=fragment)
        if masked is None:
            return None
        return UplinkUpdate(
            fragment=fragment, data=masked, sample_weight=1.0, wire=self.secure.upload_kwargs(),
            masked=True,
        )

    def upload(
        self, client: CoordinatorClient, update: UplinkUpdate, *, round_number: int,
        inner_steps: int, metrics: dict[str, float],
    ) -> pb.UploadResponse:
        return _upload(client, update, round_number=round_number, inner_steps=inner_steps, metrics=metrics)

    def uploaded(self) -> None:
        """The survivor list and the unmask answer, before the broadcast."""
        self.secure.unmask()

    def restore(self, update: UplinkUpdate) -> None:
        """The masked update was not in the sum (aborted, refused): back into the residual."""
        self.secure.restore()

    def reset(self, fragment: int) -> None:
        self.secure.reset(fragment)

    def residual(self, fragment: int = 0) -> torch.Tensor | None:
        encoder = self.secure.encoders.get(fragment)
        return None if encoder is None else encoder.residual


def keep_or_drop(uplink: SiteUplink, update: UplinkUpdate, *, refused: bool, site: str, round_number: int) -> None:
    """An update its round did not aggregate: back into the residual when it missed the round
    (late, or the round aborted: nothing was wrong with it); dropped when the round refused it
    (``BroadcastHeader.refused``: beyond the update guard's bounds, or refused at the relay),
    with the fragment's residual, which holds what the codec left of it. Kept, a refused update
    would go up again next round inside a larger one, and be refused again. The simulator
    follows the same rule (``geoloco.algorithms.simulation.sim_uplinks``)."""
    if refused:
        logger.warning(
            "site %s: round %d refused its update; it is dropped with its error-feedback residual, "
            "not kept for the next round", site, round_number,
        )
        uplink.reset(update.fragment)
        return
    uplink.restore(update)
