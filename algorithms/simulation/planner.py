"""The training-time planner: what a run will cost before anything trains.

From a model size (or its ``ParamLayout``), a step time per site, the sites' links and the
algorithm, ``plan`` predicts each round's virtual wall clock, every site's compute utilization,
the bytes on every link and a peak-memory estimate per process (``geoloco.algorithms.simulation.planner_memory``).

It is the simulator's clock without the training: the same functions advance the same times
(``geoloco.algorithms.simulation.clock``: compute is ``steps · step_time_s / speed_factor``, a transfer
``latency + 8 · bytes / bandwidth``; rounds close through the same round engine and ``RoundPolicy`` as the
simulator and the coordinator; Streaming DiLoCo sites follow ``streaming_site_time`` and, with
``adaptive_overlap``, choose τ and their rounds' steps with the simulator's ``OverlapMeter``; with
``[algorithm.adaptive_uplink]`` each site's codec comes from the same ``CodecPlans``), and the
bytes are the codecs' exact wire sizes (``Codec.encoded_nbytes``), which do not depend on the
values encoded. A secure round (flat or Streaming DiLoCo) is timed stage by stage as the
simulator times it (``geoloco.algorithms.simulation.secure_clock``), with each site's message
sizes from runs of the protocol on a one-element vector (``planner_sizes.secure_traffic``: only
the masked vector's length depends on the model, and none on the values; ``_SecureSizes`` says
how often it runs). With DP the plan stops, as the simulator does, before the round whose
release would pass ``epsilon_budget``. So for a fixed ``step_time_s`` the planner's times and
bytes equal the simulator's, round for round.

With ``[[regions]]`` or a shaped ``[coordinator_link]`` (``tiers``) the uploads and the broadcast
cross the simulator's ``TwoTierClock`` instead: each region's sites reach their relay, the relay's
partial sum goes up once all have, and the coordinator's link is shared fairly by the transfers on it; as
in the simulator, only rounds that wait for every site (no deadline, no streaming, no ddp).

Assumptions, stated once: aggregation and the outer step take no time; links are full duplex and
independent per site (no shared bottleneck at the coordinator unless ``tiers`` declares one);
without a layout, Streaming
DiLoCo's fragments are equal shares of the parameter count (a model's own layer groups, strided,
are usually within a few per cent of that).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from geoloco.algorithms.aggregation import CountingAggregation
from geoloco.algorithms.engine import UNSCREENED, RoundEngine
from geoloco.algorithms.link_codec import CodecPlans
from geoloco.algorithms.params import ParamLayout
from geoloco.algorithms.privacy.secagg_in_memory import SiteTraffic
from geoloco.algorithms.round import RoundPolicy
from geoloco.algorithms.simulation.clock import SiteConfig, download_ends, upload_arrivals
from geoloco.algorithms.simulation.planner_memory import MemoryEstimate, estimate_memory
from geoloco.algorithms.simulation.planner_sizes import PlanError, encoded_nbytes, fragment_numels, secure_traffic
from geoloco.algorithms.simulation.secure_clock import keys_held, masked_arrivals, unmasked_at
from geoloco.algorithms.simulation.sim_regions import TwoTierClock
from geoloco.algorithms.simulation.sim_uplinks import PrivacyBudget, simulation_session
from geoloco.algorithms.simulation.streaming_sim import streaming_site_time
from geoloco.algorithms.streaming import StreamingSchedule
from geoloco.algorithms.streaming_overlap import OverlapBounds, OverlapMeter
from geoloco.algorithms.time_budget import steps_in_budget
from geoloco.algorithms.training import TrainingConfig

__all__ = ["Plan", "PlanError", "PlannedRound", "encoded_nbytes", "fragment_numels", "plan", "rounds_for_steps"]


def rounds_for_steps(training: TrainingConfig, total_steps: int) -> int:
    """Rounds that cover ``total_steps`` inner steps per site (rounded up): ``H`` steps per round,
    ``H / P`` with Streaming DiLoCo (one fragment sync), ``H`` synchronous steps for ddp."""
    algo = training.algorithm
    per_round = algo.inner_steps
    if algo.streaming.enabled:
        per_round //= algo.streaming.fragments
    return max(1, math.ceil(total_steps / per_round))


@dataclass(slots=True)
class PlannedRound:
    """One predicted round, with the simulator's ``RoundRecord`` names for the same facts
    (per-site values in site order)."""

    round: int
    """From 0; -1 is the data-parallel warm-up."""
    phase: str
    """``"warmup"`` or ``"train"``."""
    inner_steps: int
    """Steps each site ran (the most any site ran, with time budgets)."""
    bytes_up: list[int]
    bytes_down: list[int]
    round_time_s: float
    """Seconds from the previous round's end to this one's."""
    wall_clock_s: float
    """When every site held the new weights."""
    compute_s: list[float]
    utilization: list[float]
    excluded: list[str] = field(default_factory=list)
    """Sites the deadline left out."""
    fragment: int | None = None


@dataclass(slots=True)
class Plan:
    """A whole predicted run."""

    sites: list[str]
    rounds: list[PlannedRound]
    memory: MemoryEstimate
    numel: int
    algorithm: str
    """``diloco``, ``streaming`` (Streaming DiLoCo), ``fedavg``, ``fedopt`` or ``ddp``."""

    @property
    def total_s(self) -> float:
        return self.rounds[-1].wall_clock_s if self.rounds else 0.0

    @property
    def train_rounds(self) -> list[PlannedRound]:
        return [r for r in self.rounds if r.phase == "train"]

    @property
    def mean_round_s(self) -> float:
        train = self.train_rounds
        return sum(r.round_time_s for r in train) / len(train) if train else 0.0

    @property
    def inner_steps_total(self) -> int:
        return sum(r.inner_steps for r in self.rounds)

    def site_bytes(self) -> dict[str, tuple[int, int]]:
        """site -> (bytes up, bytes down) over the whole run."""
        return {
            name: (sum(r.bytes_up[k] for r in self.rounds), sum(r.bytes_down[k] for r in self.rounds))
            for k, name in enumerate(self.sites)
        }

    def site_utilization(self) -> dict[str, float]:
        """site -> its compute seconds over the whole run's wall clock."""
        total = self.total_s
        return {
            name: (sum(r.compute_s[k] for r in self.rounds) / total if total > 0 else 1.0)
            for k, name in enumerate(self.sites)
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "numel": self.numel,
            "sites": self.sites,
            "total_s": self.total_s,
            "mean_round_s": self.mean_round_s,
            "rounds": len(self.train_rounds),
            "utilization": self.site_utilization(),
            "bytes": {k: {"up": up, "down": down} for k, (up, down) in self.site_bytes().items()},
            "memory": self.memory.to_dict(),
        }


@dataclass(slots=True)
class _SiteClock:
    ready_s: float = 0.0
    """When the site holds the newest weights (plain rounds) or finished its last step (streaming)."""
    broadcast_s: float | None = None
    """Streaming: when the broadcast it merges next reached it."""


def _close_round(
    policy: RoundPolicy, number: int, open_s: float, names: list[str], arrivals: list[float]
) -> tuple[float, list[str], float | None]:
    """Close a round opened at ``open_s`` whose uploads arrive at ``arrivals`` through the round
    engine, as the simulator does (``admit_arrivals``) but counting arrivals only, and let the
    policy learn from it: (close time, excluded, deadline)."""
    engine = RoundEngine(None, policy, None)
    round_ = engine.open(number, CountingAggregation(), open_s)
    engine.maybe_start(round_, open_s, members=len(names))
    nothing = torch.empty(0)
    closed = engine.admit_arrivals(
        round_, sites=names, arrivals=arrivals, payloads=[nothing] * len(names), weights=[1.0] * len(names),
        screen=lambda _: UNSCREENED,
    )
    outcome = engine.close(round_, now=closed, expected=names)
    return closed, list(outcome.excluded), outcome.deadline_s


def plan(
    training: TrainingConfig,
    *,
    numel: int,
    sites: Sequence[SiteConfig],
    step_time_s: float,
    warmup_steps: int | None = None,
    layout: ParamLayout | None = None,
    tiers: TwoTierClock | None = None,
) -> Plan:
    """Predict ``training.rounds`` rounds (plus the algorithm's warm-up; fewer when DP's
    ``epsilon_budget`` stops the run first) of a model of ``numel`` parameters on ``sites``, a
    reference site taking ``step_time_s`` per inner step. ``tiers``: the regions' relays and the
    coordinator's shared link (``SimulatorConfig.tier_clock``)."""
    if numel < 1:
        raise PlanError(f"the model needs at least one parameter, got numel = {numel}")
    if not sites:
        raise PlanError("at least one site is needed")
    if not (math.isfinite(step_time_s) and step_time_s >= 0):
        raise PlanError(f"step time must be >= 0 seconds, got {step_time_s}")
    if training.rounds < 1:
        raise PlanError(f"the plan needs rounds >= 1, got {training.rounds}")
    if training.privacy.secure_aggregation and tiers is not None:
        raise PlanError(
            "the planner times secure rounds stage by stage for sites linked straight to the "
            "coordinator: drop [[regions]]/[coordinator_link] to plan it, or measure with `geoloco "
            "simulate` (which charges those rounds' protocol as one upload)"
        )
    if training.privacy.secure_aggregation and training.algorithm.adaptive_uplink.enabled:
        raise PlanError(
            "a secure sum adds every site's masked update in one codec, so the simulator and the "
            "coordinator refuse [algorithm.adaptive_uplink] with it: disable one of the two"
        )
    if training.algorithm.asynchronous.enabled:
        raise PlanError(
            "the planner predicts synchronous rounds, and asynchronous merges have no round "
            "barrier; predict them with `geoloco simulate` (its event-driven simulator reports "
            "merges, staleness and each site's utilization), or plan the synchronous run from the file "
            "with [algorithm.asynchronous] enabled = false"
        )
    algo = training.algorithm
    if tiers is not None and (
        algo.name == "ddp" or algo.streaming.enabled or training.deadline_enabled
    ):
        raise PlanError(
            "with regions or a shaped coordinator link the planner, like the simulator's two-tier "
            "clock, predicts rounds that wait for every site: drop the round deadline, streaming "
            "and the ddp baseline, or drop [[regions]] and [coordinator_link] to plan the flat network"
        )
    names = [site.name or f"site-{k}" for k, site in enumerate(sites)]
    clocks = [_SiteClock() for _ in sites]
    policy = training.round_policy(len(sites))
    records: list[PlannedRound] = []
    warmup = algo.warmup_steps if warmup_steps is None else warmup_steps
    open_s = 0.0
    if warmup > 0:
        record, open_s = _data_parallel(
            clocks, sites, step_time_s, warmup, "none", "none", numel, -1, "warmup", 0.0
        )
        records.append(record)
    if algo.name == "ddp":
        for r in range(training.rounds):
            previous = records[-1].wall_clock_s if records else 0.0
            record, open_s = _data_parallel(
                clocks, sites, step_time_s, algo.inner_steps, algo.uplink_codec,
                algo.downlink_codec, numel, r, "train", previous,
            )
            records.append(record)
    elif algo.streaming.enabled:
        records.extend(
            _streaming(training, clocks, sites, names, step_time_s, numel, layout, policy, records, open_s)
        )
    else:
        records.extend(_plain(training, clocks, sites, names, step_time_s, numel, policy, records, open_s, tiers))
    fragments = (
        fragment_numels(numel, algo.streaming.fragments, layout=layout, split=algo.streaming.split)
        if algo.streaming.enabled else [numel]
    )
    label = "streaming" if algo.streaming.enabled else algo.name
    return Plan(
        sites=names,
        rounds=records,
        memory=estimate_memory(training, numel=numel, fragment_numel=max(fragments), num_sites=len(sites)),
        numel=numel,
        algorithm=label,
    )


def _measure_uploads(
    link_codecs: CodecPlans, names: list[str], ups: list[int], arrivals: list[float], starts: list[float],
    compute: list[float], excluded: list[str], late: dict[int, tuple[int, float, float]], closed: float,
    policy: RoundPolicy,
) -> dict[int, tuple[int, float, float]]:
    """Feed the link meter what the coordinator measures, in the simulator's order: last round's
    late uploads (``late``: site -> bytes, transfer seconds, arrival) that arrived before this
    round closed at ``closed`` and were folded, then this round's on-time uploads. Returns this
    round's late uploads, kept to be folded next round when the policy folds them."""
    for k, (nbytes, seconds, arrival) in sorted(late.items()):
        if arrival <= closed:
            link_codecs.observe_upload(names[k], nbytes, seconds)
    kept: dict[int, tuple[int, float, float]] = {}
    for k, name in enumerate(names):
        seconds = arrivals[k] - starts[k] - compute[k]
        if name not in excluded:
            link_codecs.observe_upload(name, ups[k], seconds)
        elif policy.folds_late_updates:
            kept[k] = (ups[k], seconds, arrivals[k])
    return kept


class _SecureSizes:
    """Round ``r``'s secure-aggregation bytes per site and stage (``secure_traffic``). The
    messages write the round number and site numbers as decimal text: on the full graph every
    site's neighbours are the same every round, so the sizes change only with the round number's
    length and the protocol runs once per length; SecAgg+ draws each round's neighbours anew, so
    with more than ten sites (two-digit numbers) it runs once per round (about 2 s a round at
    256 sites on one core)."""

    def __init__(self, training: TrainingConfig, num_sites: int) -> None:
        self.training = training
        self.num_sites = num_sites
        self._every_round = training.privacy.neighbours != "full" and num_sites > 10
        self._cached: dict[tuple[int, int], list[SiteTraffic]] = {}

    def __call__(self, round_number: int, numel: int) -> list[SiteTraffic]:
        """The sizes of round ``round_number``'s secure sum of ``numel`` values (a Streaming
        DiLoCo round's: its fragment's)."""
        key = (numel, round_number if self._every_round else len(str(round_number)))
        if key not in self._cached:
            if self._every_round:
                self._cached.clear()
            self._cached[key] = secure_traffic(
                self.training.privacy, self.training.algorithm.uplink_codec, numel=numel,
                num_sites=self.num_sites, session=simulation_session(self.training.seed), round_index=round_number,
            )
        return self._cached[key]


def _data_parallel(
    clocks: list[_SiteClock], sites: Sequence[SiteConfig], step_time_s: float, steps: int,
    up_codec: str, down_codec: str, numel: int, number: int, phase: str, previous_end: float,
) -> tuple[PlannedRound, float]:
    """``steps`` synchronous steps: every site uploads a gradient, the coordinator waits for all
    and broadcasts (``Simulator._data_parallel_steps``). Returns the record and when the last
    step aggregated (the next round opens then)."""
    up = encoded_nbytes(up_codec, numel)
    down = encoded_nbytes(down_codec, numel)
    n = len(sites)
    # One step's seconds, summed step by step: the simulator's arithmetic, to the last bit.
    step_s = [1 * step_time_s / s.speed_factor for s in sites]
    compute = [0.0] * n
    starts = [c.ready_s for c in clocks]
    aggregate_s = 0.0
    for _ in range(steps):
        arrivals = upload_arrivals([c.ready_s for c in clocks], step_s, [up] * n, sites)
        aggregate_s = max(arrivals)
        ends = download_ends(aggregate_s, arrivals, down, sites)
        for k, (clock, end) in enumerate(zip(clocks, ends, strict=True)):
            clock.ready_s = end
            compute[k] += step_s[k]
    spans = [c.ready_s - s for c, s in zip(clocks, starts, strict=True)]
    end = max(c.ready_s for c in clocks)
    record = PlannedRound(
        round=number, phase=phase, inner_steps=steps, bytes_up=[up * steps] * n,
        bytes_down=[down * steps] * n, round_time_s=end - previous_end, wall_clock_s=end,
        compute_s=compute,
        utilization=[c / sp if sp > 0 else 1.0 for c, sp in zip(compute, spans, strict=True)],
    )
    return record, aggregate_s


def _site_steps(training: TrainingConfig, step_s: float) -> int:
    budget = training.algorithm.round_time_budget_s
    if budget is None:
        return training.algorithm.inner_steps
    return steps_in_budget(budget, step_s, max_steps=None if step_s > 0 else 1)


def _plain(
    training: TrainingConfig, clocks: list[_SiteClock], sites: Sequence[SiteConfig], names: list[str],
    step_time_s: float, numel: int, policy: RoundPolicy, done: list[PlannedRound], open_s: float,
    tiers: TwoTierClock | None = None,
) -> list[PlannedRound]:
    """DiLoCo/FedAvg/FedOpt rounds (``Simulator._diloco_round``'s clock), the first opened at
    ``open_s``. With ``[algorithm.adaptive_uplink]`` each site's codec comes from the same
    ``CodecPlans`` the simulator and the coordinator use, fed each upload's time on the clock.
    With ``tiers`` the transfers cross the relays and the coordinator's shared link."""
    algo = training.algorithm
    up = encoded_nbytes(algo.uplink_codec, numel)
    down = encoded_nbytes(algo.downlink_codec, numel)
    link_codecs = CodecPlans(algo.adaptive_uplink, algo.uplink_codec) if algo.adaptive_uplink.enabled else None
    n = len(sites)
    secure = _SecureSizes(training, n) if training.privacy.secure_aggregation else None
    budget = PrivacyBudget(
        training.privacy, training.algorithm.uplink_codec, update_numel=lambda r: numel, num_sites=n
    )
    late: dict[int, tuple[int, float, float]] = {}
    out: list[PlannedRound] = []
    end = done[-1].wall_clock_s if done else 0.0
    for r in range(training.rounds):
        if not budget.allows(r):
            break
        steps = [_site_steps(training, step_time_s / s.speed_factor) for s in sites]
        # ``steps · step_time_s / speed_factor``: the simulator's order of operations.
        compute = [k * step_time_s / s.speed_factor for k, s in zip(steps, sites, strict=True)]
        starts = [c.ready_s for c in clocks]
        traffic = secure(r, numel) if secure is not None else None
        if traffic is not None:
            ups = [t.up for t in traffic]
        elif link_codecs is None:
            ups = [up] * n
        else:
            ups = [encoded_nbytes(link_codecs.codec_for(name, r, numel), numel) for name in names]
        if tiers is not None:
            arrivals = tiers.arrivals([s + c for s, c in zip(starts, compute, strict=True)], ups, numel)
        elif traffic is not None:
            arrivals = masked_arrivals(starts, compute, traffic, sites)
        else:
            arrivals = upload_arrivals(starts, compute, ups, sites)
        closed, excluded, _ = _close_round(policy, r, open_s, names, arrivals)
        if link_codecs is not None:  # what the coordinator measures: the uploads it admits
            late = _measure_uploads(link_codecs, names, ups, arrivals, starts, compute, excluded, late, closed, policy)
        if traffic is not None:  # the broadcast waits for the unmasking
            closed = unmasked_at(closed, arrivals, traffic, sites, [k for k in range(n) if names[k] not in excluded])
        ends = tiers.ends(closed, down) if tiers is not None else download_ends(closed, arrivals, down, sites)
        spans = [e - s for e, s in zip(ends, starts, strict=True)]
        for clock, e in zip(clocks, ends, strict=True):
            clock.ready_s = e
        open_s = closed
        new_end = max(ends)
        out.append(
            PlannedRound(
                round=r, phase="train", inner_steps=max(steps), bytes_up=ups,
                bytes_down=[down] * n if traffic is None else [down + t.down for t in traffic],
                round_time_s=new_end - end, wall_clock_s=new_end, compute_s=compute,
                utilization=[c / sp if sp > 0 else 1.0 for c, sp in zip(compute, spans, strict=True)],
                excluded=excluded,
            )
        )
        end = new_end
    return out


def _streaming(
    training: TrainingConfig, clocks: list[_SiteClock], sites: Sequence[SiteConfig], names: list[str],
    step_time_s: float, numel: int, layout: ParamLayout | None, policy: RoundPolicy,
    done: list[PlannedRound], open_s: float,
) -> list[PlannedRound]:
    """Streaming DiLoCo rounds (``StreamingRounds.round``'s clock): one fragment per round, the
    site training on through ``overlap_steps`` before it must merge the previous broadcast. With
    ``adaptive_overlap`` every site chooses its τ and its round's steps from what its clock
    measured, with the simulator's meter and rule in the simulator's order."""
    algo = training.algorithm
    stream = algo.streaming
    schedule = StreamingSchedule.from_config(algo.inner_steps, stream)
    bounds = OverlapBounds.from_config(algo.inner_steps, stream)
    sizes = fragment_numels(numel, stream.fragments, layout=layout, split=stream.split)
    n = len(sites)
    meters = [OverlapMeter() for _ in sites]
    choices = [bounds.fixed] * n
    budget = PrivacyBudget(
        training.privacy, algo.uplink_codec, update_numel=lambda r: sizes[schedule.fragment_for_round(r)],
        num_sites=n,
    )
    secure = _SecureSizes(training, n) if training.privacy.secure_aggregation else None
    out: list[PlannedRound] = []
    end = done[-1].wall_clock_s if done else 0.0
    for r in range(training.rounds):
        if not budget.allows(r):
            break
        p = schedule.fragment_for_round(r)
        traffic = secure(r, sizes[p]) if secure is not None else None
        up = encoded_nbytes(algo.uplink_codec, sizes[p])
        ups = [up] * n if traffic is None else [t.up for t in traffic]
        down = encoded_nbytes(algo.downlink_codec, sizes[p])
        times = []
        steps = []
        computed = []
        for k, (site, clock) in enumerate(zip(sites, clocks, strict=True)):
            overlap = choices[k].overlap_steps if r > 0 else 0
            rest = choices[k].round_steps - overlap
            first_s = overlap * step_time_s / site.speed_factor
            rest_s = rest * step_time_s / site.speed_factor
            meters[k].record_steps(overlap + rest, first_s + rest_s)
            choices[k] = meters[k].choose(bounds)  # when its upload starts, as the site does
            steps.append(overlap + rest)
            computed.append((first_s, rest_s))
            times.append(
                streaming_site_time(
                    start_s=clock.ready_s, overlap_compute_s=first_s, rest_compute_s=rest_s,
                    previous_broadcast_s=clock.broadcast_s, upload_bytes=ups[k], site=site,
                )
            )
        if traffic is not None:  # the masked uploads wait for the key stages (``streaming_sim``)
            keys_at = keys_held(
                [t.start_s + first_s + t.stall_s for t, (first_s, _) in zip(times, computed, strict=True)],
                traffic, sites,
            )
            times = [
                streaming_site_time(
                    start_s=clock.ready_s, overlap_compute_s=first_s, rest_compute_s=rest_s,
                    previous_broadcast_s=clock.broadcast_s, upload_bytes=t.masked_up, site=site, keys_held_s=h,
                )
                for clock, (first_s, rest_s), t, h, site in zip(clocks, computed, traffic, keys_at, sites, strict=True)
            ]
        arrivals = [t.arrival_s for t in times]
        closed, excluded, _ = _close_round(policy, r, open_s, names, arrivals)
        if traffic is not None:  # the broadcast waits for the unmasking
            closed = unmasked_at(closed, arrivals, traffic, sites, [k for k in range(n) if names[k] not in excluded])
        ends = download_ends(closed, arrivals, down, sites)
        for meter, clock, timing, e in zip(meters, clocks, times, ends, strict=True):
            meter.record_transfer(e - timing.upload_s)
            clock.broadcast_s = e
            clock.ready_s = timing.upload_s
        open_s = closed
        new_end = max(ends)
        out.append(
            PlannedRound(
                round=r, phase="train", inner_steps=max(steps), bytes_up=ups,
                bytes_down=[down] * n if traffic is None else [down + t.down for t in traffic],
                round_time_s=new_end - end, wall_clock_s=new_end,
                compute_s=[t.compute_s for t in times], utilization=[t.utilization for t in times],
                excluded=excluded, fragment=p,
            )
        )
        end = new_end
    return out
