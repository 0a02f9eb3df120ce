"""What a site knows about the run: the global weights it holds and where the coordinator is.

``SiteState`` is the site's replica of ``θ_t`` (flat fp32, with its digest), the round it holds,
the round the coordinator is at (and that round's ``RoundInfo`` with its seed), the run config
the coordinator sent (and the algorithm and privacy sections parsed from it), and the site's
tally of rounds trained and included. Its methods change the replica only in the ways the
protocol allows — adopt fetched weights, apply a broadcast (digest-checked), take a broadcast
header's news about the next round — and say what changed; what the *model* does with new
global weights (load them, or merge a fragment into the site's own weights) is the round
runner's business (``geoloco.site_agent.rounds``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from geoloco.algorithms.config import config_from_dict
from geoloco.algorithms.params import weights_digest
from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
from geoloco.algorithms.strategy import AlgorithmConfig, Strategy
from geoloco.compression import Encoded, PipelineCodec, parse_codec
from geoloco.protos import geoloco_pb2 as pb
from geoloco.site_agent.client import SiteAgentError
from geoloco.site_agent.persist import b64decode, b64encode

__all__ = ["RunConfigChange", "SiteState"]


@dataclass(frozen=True, slots=True)
class RunConfigChange:
    """What a (re-)join's run config changed compared with the one the site held."""

    first: bool
    """No run config was held before (the site's first join)."""
    algorithm: bool
    """The ``[algorithm]`` section differs (or ``first``)."""
    privacy: bool
    """The ``[privacy]`` section differs (or ``first``)."""


class SiteState:
    """The site's global weights, rounds and run config (see the module docstring).

    Written by the leader's loop (join, round runner); the heartbeat thread only reads
    ``held_round`` and ``phase``.
    """

    def __init__(self) -> None:
        self._global: torch.Tensor | None = None
        self._digest: str | None = None
        self._held_round = 0
        self._coordinator_round = 0
        self._round_info = pb.RoundInfo()
        self._run_config = pb.RunConfig()
        self._algorithm: AlgorithmConfig | None = None
        self._privacy: PrivacyConfig | None = None
        self._finished = False
        self._rounds_trained = 0
        self._rounds_included = 0
        self.phase: pb.SitePhase = pb.SITE_PHASE_UNSPECIFIED
        """What the site is doing (``pb.SITE_PHASE_*``), reported with each heartbeat."""

    # ---------------------------------------------------------------------------------------
    # Reading

    @property
    def has_weights(self) -> bool:
        return self._global is not None

    @property
    def global_weights(self) -> torch.Tensor:
        """``θ_held_round`` (flat fp32 on the site's device); only once the site has weights."""
        if self._global is None:
            raise SiteAgentError("internal error: the site holds no global weights yet")
        return self._global

    @property
    def global_weights_or_none(self) -> torch.Tensor | None:
        return self._global

    @property
    def digest(self) -> str | None:
        return self._digest

    @property
    def held_round(self) -> int:
        """The site holds ``θ_held_round``."""
        return self._held_round

    @property
    def coordinator_round(self) -> int:
        """The round the coordinator was at when the site last heard (never below ``held_round``
        after a broadcast)."""
        return self._coordinator_round

    @property
    def is_behind(self) -> bool:
        """The coordinator moved past the held round: chase its broadcasts without training."""
        return self._held_round < self._coordinator_round

    @property
    def run_config(self) -> pb.RunConfig:
        return self._run_config

    @property
    def algorithm(self) -> AlgorithmConfig:
        if self._algorithm is None:
            raise SiteAgentError("internal error: the site has no run config before joining")
        return self._algorithm

    @property
    def privacy(self) -> PrivacyConfig:
        if self._privacy is None:
            raise SiteAgentError("internal error: the site has no run config before joining")
        return self._privacy

    @property
    def total_rounds(self) -> int:
        """Rounds in the run (0: unbounded)."""
        return int(self._run_config.total_rounds)

    @property
    def at_end(self) -> bool:
        """The site holds the weights after the run's last round."""
        total = self.total_rounds
        return bool(total) and self._held_round >= total

    def is_last_round(self, round_number: int) -> bool:
        total = self.total_rounds
        return bool(total) and round_number + 1 >= total

    @property
    def finished(self) -> bool:
        """The coordinator's run is over (or the site holds its last round's weights)."""
        return self._finished

    @property
    def rounds_trained(self) -> int:
        return self._rounds_trained

    @property
    def rounds_included(self) -> int:
        return self._rounds_included

    def knows_round(self, round_number: int) -> bool:
        """Whether the latest round info (seed, deadline) is that of ``round_number``."""
        return self._round_info.round == round_number

    def round_seed(self, round_number: int) -> int:
        """The coordinator's seed of round ``round_number`` (from its ``RoundInfo``)."""
        if self._round_info.round != round_number:
            raise SiteAgentError(
                f"internal error: training round {round_number} without its round seed "
                f"(latest round info is for round {self._round_info.round})"
            )
        return int(self._round_info.round_seed)

    def uplink_codec(self, round_number: int) -> str:
        """This site's uplink codec for ``round_number`` from its ``RoundInfo`` (adaptive
        uplink codecs); empty: the run's ``uplink_codec``."""
        return self._round_info.uplink_codec if self._round_info.round == round_number else ""

    # ---------------------------------------------------------------------------------------
    # Changing

    def adopt_run_config(self, config: pb.RunConfig) -> RunConfigChange:
        """Take the run config of a join; says which parts changed."""
        data = json.loads(config.config_json or "{}")
        algorithm = config_from_dict(AlgorithmConfig, data.get("algorithm", {}))
        privacy = config_from_dict(PrivacyConfig, data.get("privacy", {}))
        old, first = self._algorithm, self._algorithm is None
        change = RunConfigChange(
            first=first,
            algorithm=first or algorithm != old,
            privacy=first or privacy != self._privacy,
        )
        self._algorithm, self._privacy = algorithm, privacy
        self._run_config = config
        return change

    def joined(self, round_info: pb.RoundInfo) -> None:
        """A join's answer: the coordinator is at ``round_info.round``."""
        self._round_info = round_info
        self._coordinator_round = round_info.round

    def adopt_weights(self, flat: torch.Tensor, round_number: int) -> int | None:
        """Hold the full ``θ_round_number`` (fetched, or handed over by the leader rank);
        returns the round held before, or None when the site held no weights."""
        before = self._held_round if self._global is not None else None
        self._global = flat
        self._digest = weights_digest(flat)
        self._held_round = round_number
        return before

    def apply_broadcast(
        self, strategy: Strategy, round_number: int, downlink: Encoded, expected_digest: str,
        timings: dict[str, float] | None = None,
    ) -> bool:
        """Apply round ``round_number``'s downlink delta with the strategy's own addition; True
        (and the site holds ``θ_{round+1}``) when the result's digest is the coordinator's,
        False (nothing changed) when it is not and the full weights must be fetched.
        ``timings`` gets the seconds spent in ``apply`` and ``verify`` (the digest)."""
        started = time.monotonic()
        new = strategy.apply_downlink(self.global_weights, downlink, round_number)
        applied = time.monotonic()
        digest = weights_digest(new)
        if timings is not None:
            timings["apply"] = timings.get("apply", 0.0) + applied - started
            timings["verify"] = timings.get("verify", 0.0) + time.monotonic() - applied
        if digest != expected_digest:
            return False
        self._global, self._digest, self._held_round = new, digest, round_number + 1
        return True

    def apply_broadcast_in_place(
        self, strategy: Strategy, round_number: int, downlink: Encoded, expected_digest: str,
        timings: dict[str, float] | None = None,
    ) -> bool:
        """``apply_broadcast`` without a second model-sized vector: the delta is decoded piece
        by piece into the held weights themselves (``Codec.add_decoded_into``: the same sum, bit
        for bit, as ``strategy.apply_downlink``). The price is that a digest mismatch leaves
        nothing usable: the site then holds no weights (``has_weights`` is False, so the next
        join fetches them) and the caller fetches at once. Falls back to ``apply_broadcast``
        where the pieces would not give the same bits: a fragment of the model, weights that
        are not one contiguous fp32 vector, and sparse codecs (which leave the coordinates they
        did not select as they are, where the dense sum turns a ``-0.0`` into ``0.0``)."""
        held = self.global_weights
        codec = parse_codec(downlink.spec)
        if not (
            strategy.partition.is_whole and held.dtype == torch.float32 and held.is_contiguous()
            and downlink.dtype == torch.float32 and downlink.numel == held.numel()
            and isinstance(codec, PipelineCodec)
            and codec.sparsifier is None
        ):
            return self.apply_broadcast(strategy, round_number, downlink, expected_digest, timings)
        started = time.monotonic()
        codec.add_decoded_into(downlink, held.view(-1))
        applied = time.monotonic()
        digest = weights_digest(held)
        if timings is not None:
            timings["apply"] = timings.get("apply", 0.0) + applied - started
            timings["verify"] = timings.get("verify", 0.0) + time.monotonic() - applied
        if digest != expected_digest:
            self._global = self._digest = None
            return False
        self._digest, self._held_round = digest, round_number + 1
        return True

    def take_broadcast_header(self, header: pb.BroadcastHeader) -> None:
        """A broadcast's news: the coordinator's next round (and its seed), the run's end."""
        self._coordinator_round = max(header.next_round.round, self._held_round)
        if header.next_round.round == self._held_round:
            self._round_info = header.next_round
        if header.run_finished or self.at_end:
            self._finished = True

    def mark_finished(self) -> None:
        self._finished = True

    def count_round(self, *, included: bool) -> None:
        """One more round trained; ``included``: the coordinator aggregated its update."""
        self._rounds_trained += 1
        self._rounds_included += int(included)

    # ---------------------------------------------------------------------------------------
    # Saving and restoring (``geoloco.site_agent.persist``)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a restarted site needs to hold the same weights, rounds and run config."""
        tensors = {} if self._global is None else {"global": self._global}
        meta = {
            "held_round": self._held_round,
            "coordinator_round": self._coordinator_round,
            "digest": self._digest,
            "round_info": b64encode(self._round_info.SerializeToString()),
            "run_config": b64encode(self._run_config.SerializeToString()),
            "rounds_trained": self._rounds_trained,
            "rounds_included": self._rounds_included,
        }
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> None:
        """Take a ``snapshot`` back (a restarted site, before its first join)."""
        run_config = pb.RunConfig()
        run_config.ParseFromString(b64decode(meta["run_config"]))
        if run_config.config_json:
            self.adopt_run_config(run_config)
        round_info = pb.RoundInfo()
        round_info.ParseFromString(b64decode(meta["round_info"]))
        self._round_info = round_info
        flat = tensors.get("global")
        if flat is not None:
            digest = weights_digest(flat)
            if digest != meta["digest"]:
                raise SiteAgentError(
                    f"the saved global weights have digest {digest[:16]}..., their record says "
                    f"{str(meta['digest'])[:16]}...; the site state is damaged"
                )
            self._global, self._digest = flat.to(device), digest
        self._held_round = int(meta["held_round"])
        self._coordinator_round = int(meta["coordinator_round"])
        self._rounds_trained = int(meta["rounds_trained"])
        self._rounds_included = int(meta["rounds_included"])

    def take_leader_tally(self, *, finished: bool, rounds_trained: int, rounds_included: int) -> None:
        """A follower rank's end: the rounds it trained, and the leader's verdict on the run
        and on the site's updates."""
        self._finished = finished
        self._rounds_trained = rounds_trained
        self._rounds_included = rounds_included
