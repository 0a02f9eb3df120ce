"""The round record: one type for what a round cost and achieved, from every host.

The coordinator writes it to ``metrics.jsonl`` (and hands it to ``on_round_end``, the status
page and TensorBoard); the simulators yield it; the sweeps, reports and plots read it. Every
host builds it through ``RoundRecord.closed``, which takes the facts the round engine decided
(who counted, who was excluded, rejected or folded, the deadline, the abort, the new digest)
from the engine's own ``RoundOutcome`` and ``Stepped``, so those cannot mean one thing at the
coordinator and another in its prediction.

Every field is present in every host's record, under the same key with the same type. A fact
only one host can know (a simulator's virtual ``wall_clock_s``, a coordinator's
``session_id``) is ``None`` in the other host's record; each field's ``host`` metadata says
who fills it (``SHARED_RECORD_KEYS``: every host). Flat rather than nested per host, so a
reader of ``metrics.jsonl`` (pandas, the status page, Prometheus, the emulator's report) finds
a fact at one key whichever host wrote the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from geoloco.algorithms.config import config_to_dict

if TYPE_CHECKING:
    from geoloco.algorithms.engine import Stepped
    from geoloco.algorithms.round import RoundOutcome

__all__ = ["RECORD_HOSTS", "SHARED_RECORD_KEYS", "RoundRecord"]

RecordHost = Literal["every host", "coordinator", "simulator"]
RECORD_HOSTS: tuple[RecordHost, ...] = ("every host", "coordinator", "simulator")


EVERY: dict[str, RecordHost] = {"host": "every host"}
COORDINATOR: dict[str, RecordHost] = {"host": "coordinator"}
SIMULATOR: dict[str, RecordHost] = {"host": "simulator"}


@dataclass(slots=True, kw_only=True)
class RoundRecord:
    """What one round (or the simulator's warm-up, ``round = -1``) cost and achieved.

    Rounds count from 0; sites are named; per-site values are ``{site: value}`` tables.
    ``round_time_s`` is the one shared name whose span differs by host: the coordinator's round
    is open to closed, the simulator's spans from the previous record's end to this one's (the
    broadcast's download included)."""

    # -- decided by the round engine (``RoundRecord.closed``) --------------------------------------
    round: int = field(metadata=EVERY)
    """Round number from 0, as on the wire; -1 is the simulator's data-parallel warm-up."""
    participants: list[str] = field(metadata=EVERY)
    """Sites whose updates entered the aggregate, by name (for ddp/warm-up: every site)."""
    sample_weights: dict[str, float] = field(default_factory=dict, metadata=EVERY)
    """site -> the weight its update entered the aggregate with (folded late ones included)."""
    excluded: list[str] = field(default_factory=list, metadata=EVERY)
    """Sites left out by the round deadline (stragglers), by name."""
    rejected: list[str] = field(default_factory=list, metadata=EVERY)
    """Sites whose update the update guard refused this round."""
    rejected_reasons: dict[str, str] = field(default_factory=dict, metadata=EVERY)
    """site -> why its update was refused (NaN or Inf values, its norm beyond the bound), or why
    the site sent none ("the site sent no update: ...", e.g. its own NaN/Inf values)."""
    folded_late: dict[str, float] = field(default_factory=dict, metadata=EVERY)
    """site -> discounted weight of its previous round's late update folded into this round."""
    deadline_s: float | None = field(default=None, metadata=EVERY)
    """The round deadline in force (seconds after the round opened); ``None``: none."""
    deadline_hit: bool = field(default=False, metadata=EVERY)
    """Whether the round closed on its deadline rather than on every awaited update."""
    arrival_s: dict[str, float] = field(default_factory=dict, metadata=EVERY)
    """site -> seconds after the round opened its counted update was complete."""
    update_norm: float | None = field(default=None, metadata=EVERY)
    """L2 norm of the mean update the outer step applied (0 for an aborted round)."""
    aborted: str | None = field(default=None, metadata=EVERY)
    """Why the round was aborted with the model unchanged (its mean or new weights out of the
    update guard's bounds); ``None``: it was not."""
    weights_digest: str = field(metadata=EVERY)
    """``weights_digest`` of the global weights after the round."""
    # -- measured by the host, the same meaning everywhere ----------------------------------------
    fragment: int | None = field(default=None, metadata=EVERY)
    """Streaming DiLoCo: the fragment this round synchronised; ``None`` otherwise."""
    inner_steps: dict[str, int] = field(metadata=EVERY)
    """site -> the training steps of its update (the simulator: of this record; they differ with
    ``round_time_budget_s`` and adaptive overlap; the coordinator: as each counted update says)."""
    train_loss: float | None = field(default=None, metadata=EVERY)
    """Mean of the sites' inner-step losses (the coordinator: of the counted sites' reported
    ``train_loss``; ``None`` when none reported one)."""
    eval_loss: float | None = field(default=None, metadata=EVERY)
    """Held-out loss of the global weights after the round (``None`` when not evaluated)."""
    bytes_up: dict[str, int] = field(metadata=EVERY)
    """site -> bytes it uploaded in this round."""
    bytes_down: dict[str, int] = field(metadata=EVERY)
    """site -> bytes it downloaded in this round."""
    bytes_up_total: int = field(metadata=EVERY)
    """Cumulative upload bytes of all sites since the start."""
    bytes_down_total: int = field(metadata=EVERY)
    """Cumulative download bytes of all sites since the start."""
    round_time_s: float = field(metadata=EVERY)
    """The round's length in seconds (real or virtual; class doc for the span)."""
    staleness: dict[str, int] | None = field(default=None, metadata=EVERY)
    """Asynchronous merges: site -> merges between the model its update was computed from and
    the one it was merged into (0: fresh); ``None`` for synchronous rounds."""
    epsilon: float | None = field(default=None, metadata=EVERY)
    """Accounted epsilon (at ``privacy.delta``) after this round; ``None`` without DP."""
    # -- the simulator's own -----------------------------------------------------------------------
    phase: Literal["warmup", "train"] = field(default="train", metadata=SIMULATOR)
    """``"warmup"`` for the synchronous warm-up, ``"train"`` for algorithm rounds."""
    inner_steps_total: int | None = field(default=None, metadata=SIMULATOR)
    """Cumulative inner steps per site since the start, warm-up included (for ``ddp`` every
    synchronous step counts one): the x axis that compares runs of different H."""
    wall_clock_s: float | None = field(default=None, metadata=SIMULATOR)
    """Virtual time when every site held the new weights."""
    compute_s: dict[str, float] | None = field(default=None, metadata=SIMULATOR)
    """site -> virtual seconds it spent computing in this record."""
    utilization: dict[str, float] | None = field(default=None, metadata=SIMULATOR)
    """site -> the share of its round spent computing (``compute_s`` / its round span)."""
    peak_bytes_in_flight: dict[str, int] | None = field(default=None, metadata=SIMULATOR)
    """site -> the largest single transfer of this record (one upload or one broadcast): the
    whole model's update in plain DiLoCo, one fragment's with streaming; ``None`` where not
    tracked (the ddp baseline and the warm-up)."""
    goodput: float | None = field(default=None, metadata=SIMULATOR)
    """Event-driven simulator: the share of the inner steps computed so far whose update reached
    the global model (``geoloco.algorithms.simulation.chaos``)."""
    inner_steps_lost: int | None = field(default=None, metadata=SIMULATOR)
    """Event-driven simulator: inner steps computed so far that never reached the global model
    (failed, stale, refused, aborted, restarted)."""
    global_downtime_s: float | None = field(default=None, metadata=SIMULATOR)
    """Event-driven simulator, last record only: virtual seconds of the run during which no site
    computed steps that reached the global model."""
    # -- the coordinator's own ---------------------------------------------------------------------
    session_id: str | None = field(default=None, metadata=COORDINATOR)
    """The coordinator process's session: a restart shows as a new one in the file."""
    members: list[str] | None = field(default=None, metadata=COORDINATOR)
    """Sites joined when the round's broadcast was published."""
    departed: list[str] | None = field(default=None, metadata=COORDINATOR)
    """Sites that left or were dropped during the round."""
    partial_uploads: list[str] | None = field(default=None, metadata=COORDINATOR)
    """Sites whose upload had begun but was not complete when the round closed."""
    downlink_bytes: int | None = field(default=None, metadata=COORDINATOR)
    """Bytes of the broadcast delta (one copy)."""
    wait_for_quorum_s: float | None = field(default=None, metadata=COORDINATOR)
    """Seconds from the round's opening until it had its quorum and started."""
    aggregate_time_s: float | None = field(default=None, metadata=COORDINATOR)
    """Seconds from the close to the published broadcast: the wait for the previous round's
    background snapshot, outer step, downlink encode, the round's durable write and the publication
    (``phases_s`` splits them; a replayed record has none)."""
    next_deadline_s: float | None = field(default=None, metadata=COORDINATOR)
    """The deadline the next round opens with (``None``: none)."""
    site_metrics: dict[str, dict[str, float]] | None = field(default=None, metadata=COORDINATOR)
    """site -> the metrics its counted upload carried (``train_loss``, phase seconds, ...)."""
    site_phases_s: dict[str, dict[str, float]] | None = field(default=None, metadata=COORDINATOR)
    """site -> seconds per site phase (``geoloco.protos.round_phases``), from ``site_metrics``."""
    phases_s: dict[str, float] | None = field(default=None, metadata=COORDINATOR)
    """Seconds per coordinator phase of the round (``geoloco.coordinator.round_timing``)."""
    round_wall_s: float | None = field(default=None, metadata=COORDINATOR)
    """Seconds from the round's opening to its broadcast's publication."""
    run_finished: bool | None = field(default=None, metadata=COORDINATOR)
    """This was the run's last round (``total_rounds`` reached or the privacy budget spent)."""
    privacy: dict[str, Any] | None = field(default=None, metadata=COORDINATOR)
    """The round's privacy facts (noise, clipping, accounting) with DP or secure aggregation."""
    privacy_delta: float | None = field(default=None, metadata=COORDINATOR)
    """The delta ``epsilon`` is accounted at (with DP)."""
    replayed: bool | None = field(default=None, metadata=COORDINATOR)
    """True for a record a restarted coordinator wrote from the round's durable state (the
    process that closed the round died before writing it), False for one written live."""

    @classmethod
    def closed(cls, outcome: RoundOutcome, stepped: Stepped, **host: Any) -> RoundRecord:
        """The record of a closed and stepped round: the engine's facts, and the ``host``'s
        measurements by field name. Every host builds its record here."""
        return cls(
            round=outcome.round,
            participants=list(stepped.result.contributors),
            sample_weights=dict(outcome.weights),
            excluded=list(outcome.excluded),
            rejected=list(outcome.rejected),
            rejected_reasons=dict(outcome.rejected),
            folded_late=dict(outcome.folded),
            deadline_s=outcome.deadline_s,
            deadline_hit=outcome.deadline_hit,
            arrival_s=dict(outcome.arrivals_s),
            update_norm=stepped.result.update_norm,
            aborted=stepped.aborted,
            weights_digest=stepped.result.update.digest,
            **host,
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (the form ``metrics.jsonl`` and the sweeps' files hold)."""
        return config_to_dict(self)


SHARED_RECORD_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(RoundRecord) if f.metadata["host"] == "every host"
)
"""The facts every host's record fills, with the same meaning (the others are ``None`` where the
host cannot know them)."""
