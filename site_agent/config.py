"""Settings of one site agent, and the hooks a user plugs into its rounds.

What the *run* does (H, codecs, seeds, deadlines) is the coordinator's to decide and arrives in
``RunConfig`` at Join; ``SiteAgentConfig`` says how this site trains, how patiently it talks to
the coordinator, and the one thing it must not take on the coordinator's word: the least
secure-aggregation threshold it accepts (``colluding_sites``, ``min_threshold``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from geoloco.algorithms.config import config_from_dict, config_to_dict, require
from geoloco.algorithms.device import resolve_device
from geoloco.algorithms.privacy.secagg_crypto import DEFAULT_COLLUDING_SITES, ThresholdPolicy
from geoloco.protos.transport_options import DEFAULT_MIN_TRANSFER_RATE
from geoloco.protos.wire_buffers import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE
from geoloco.site_agent.client_streams import parse_parallel_streams

__all__ = ["JoinInfo", "RoundResult", "SiteAgentConfig", "SiteHooks", "resolve_device"]


@dataclass(kw_only=True, slots=True)
class SiteAgentConfig:
    """How a site trains and how it retries, and the least secure-aggregation threshold it
    accepts; the run itself is configured by the coordinator."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains: ``"auto"`` picks CUDA when available. Ignored for multi-rank sites,
    whose device comes from their ``IntraSiteGroup``."""
    autocast_bf16: bool = False
    """Run the forward pass under ``torch.autocast(dtype=bfloat16)`` (weights, optimizer state and
    pseudo-gradients stay fp32)."""
    grad_clip_norm: float | None = None
    """Clip each inner step's gradient to this global L2 norm; unset = no clipping."""
    give_up_after_s: float = 300.0
    """Stop retrying (and raise ``CoordinatorUnreachableError``) after this long without a
    successful call; covers coordinator restarts, which take seconds to minutes."""
    backoff_initial_s: float = 0.2
    """First retry delay; it doubles per failure up to ``backoff_max_s``, with random jitter so
    that many sites do not reconnect in lockstep."""
    backoff_max_s: float = 10.0
    """Longest delay between two retries."""
    backoff_round_fraction: float = 0.25
    """Once the site has seen a round's duration, retries are at most this fraction of it apart
    (never less than ``backoff_initial_s``): a short link cut then costs a fraction of a round,
    not several rounds."""
    reconnect_max_s: float = 1.0
    """Longest gRPC waits between two connection attempts while the coordinator is unreachable;
    a retry sleeping meanwhile is woken the moment a connection succeeds."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Bytes per upload chunk."""
    min_transfer_rate: float = DEFAULT_MIN_TRANSFER_RATE
    """Bytes/s below which a transfer counts as stuck and is retried (sets call deadlines)."""
    await_timeout_s: float = 600.0
    """Deadline of one AwaitBroadcast call; a round that takes longer is simply waited for again."""
    max_upload_attempts: int = 20
    """Upload streams tried for one update before giving up (each resumes where the last broke)."""
    parallel_streams: int | str = "auto"
    """Concurrent streams (one TCP connection each) that share one transfer's chunks (uploads,
    FetchModel, broadcasts), so a long fat link is not bounded by one connection's window:
    ``"auto"`` picks one per 64 MiB of payload, at most 4 (one up to 64 MiB; a broadcast is
    sized by the previous one); an integer 1..32 fixes it (``geoloco.site_agent.client_streams``)."""
    state_dir: str | None = None
    """Folder where the site saves its state at every round boundary (global weights, inner
    optimizer, error-feedback residuals, data position, lr schedule, the update awaiting its
    broadcast), so a site killed and restarted with the same folder goes on as if it never
    stopped (``geoloco.site_agent.persist``). One folder per site and run; unset: not saved
    (a restarted site fetches the weights and starts its optimizer and data afresh)."""
    colluding_sites: int = DEFAULT_COLLUDING_SITES
    """Secure aggregation: sites this site assumes collude with a hostile coordinator. The site
    refuses (shares no keys, sends no masked update) a round whose threshold ``t`` of ``h`` share
    holders breaks ``2 t > h + colluding_sites``: the coordinator's own ``colluding_sites`` is
    its word only, and a hostile one declares 0. The default 1 accepts the default thresholds
    (3 of 4, 4 of 5, 5 of 7) and needs all three sites of a 3-site round."""
    min_threshold: int | None = None
    """Secure aggregation: refuse a round whose threshold is lower than this, whatever the share
    holders (unset: only the ``colluding_sites`` bound)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require(
            self.device in ("auto", "cpu", "cuda"),
            "device",
            f"got {self.device!r}; allowed values: 'auto', 'cpu', 'cuda'",
        )
        require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            "grad_clip_norm",
            f"must be > 0 or unset, got {self.grad_clip_norm}",
        )
        require(
            math.isfinite(self.give_up_after_s) and self.give_up_after_s > 0,
            "give_up_after_s",
            f"must be > 0 seconds, got {self.give_up_after_s}",
        )
        require(
            0 < self.backoff_initial_s <= self.backoff_max_s,
            "backoff_initial_s",
            f"must be > 0 and <= backoff_max_s ({self.backoff_max_s}), got {self.backoff_initial_s}",
        )
        require(
            0 < self.backoff_round_fraction <= 1,
            "backoff_round_fraction",
            f"must be in (0, 1], got {self.backoff_round_fraction}",
        )
        require(
            math.isfinite(self.reconnect_max_s) and self.reconnect_max_s > 0,
            "reconnect_max_s",
            f"must be > 0 seconds, got {self.reconnect_max_s}",
        )
        require(
            0 < self.chunk_size <= MAX_CHUNK_SIZE,
            "chunk_size",
            f"must be in 1..{MAX_CHUNK_SIZE} bytes, got {self.chunk_size}",
        )
        require(
            self.min_transfer_rate > 0,
            "min_transfer_rate",
            f"must be > 0 bytes/s, got {self.min_transfer_rate}",
        )
        require(self.await_timeout_s > 0, "await_timeout_s", f"must be > 0, got {self.await_timeout_s}")
        require(
            self.state_dir is None or bool(str(self.state_dir).strip()),
            "state_dir",
            "must be a folder path or unset, got an empty string",
        )
        try:
            self.parallel_streams = parse_parallel_streams(self.parallel_streams)
        except ValueError as error:
            require(False, "parallel_streams", str(error).removeprefix("parallel_streams "))
        require(
            self.max_upload_attempts >= 1,
            "max_upload_attempts",
            f"must be >= 1, got {self.max_upload_attempts}",
        )
        require(self.colluding_sites >= 0, "colluding_sites", f"must be >= 0, got {self.colluding_sites}")
        require(
            self.min_threshold is None or self.min_threshold >= 2,
            "min_threshold",
            f"must be >= 2 or unset, got {self.min_threshold}",
        )

    def threshold_policy(self) -> ThresholdPolicy:
        """The least secure-aggregation threshold this site accepts (checked every round)."""
        return ThresholdPolicy(colluding_sites=self.colluding_sites, min_threshold=self.min_threshold)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SiteAgentConfig:
        return config_from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


@dataclass(frozen=True, slots=True)
class JoinInfo:
    """What the coordinator told the site when it (re-)joined."""

    session_id: str
    round: int
    inner_steps: int
    uplink_codec: str
    downlink_codec: str
    total_rounds: int
    fetched_model: bool
    config: dict[str, Any]
    """The coordinator's whole configuration (``RunConfig.config_json``)."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """One round as this site saw it, passed to ``SiteHooks.on_round_end``."""

    round: int
    """The round trained for (the site held ``θ_round`` and now holds the next weights)."""
    train_loss: float
    """Mean inner-step loss (over all ranks of a multi-rank site)."""
    samples: int
    """Samples trained on this round (all ranks)."""
    inner_steps: int
    included: bool
    """Whether the coordinator aggregated this site's update (false: late, rejected)."""
    num_contributors: int
    resynced: bool
    """The site fetched the full weights instead of applying a delta."""
    bytes_up: int
    """Upload bytes sent this round (serialized messages, retries included)."""
    bytes_down: int
    """Broadcast and model bytes received this round."""
    inner_time_s: float
    round_time_s: float
    weights_digest: str
    """SHA-256 of the global weights the site holds now (equal on every replica)."""
    next_round: int
    """The round the site works on next."""


@dataclass(kw_only=True, slots=True)
class SiteHooks:
    """Callbacks into the agent's loop (run on the leader rank, in the training thread).

    ``on_round_end`` runs after the new global weights are loaded into the model, so it can
    evaluate or checkpoint them; keep it short, the next round waits for it.
    """

    on_join: Callable[[JoinInfo], None] | None = None
    on_round_end: Callable[[RoundResult], None] | None = None
