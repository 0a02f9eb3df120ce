"""The single-process simulator: N sites in a loop on a virtual network clock, same math as the real system.

The sites take turns on one shared model (``geoloco.algorithms.simulation.sim_state``); rounds run through
the same round engine as the coordinator's (``geoloco.algorithms.engine``: admission with the
update guard, the close policy, late folding, the guarded outer step with abort), uploads
are encoded and aggregated through one interface whatever the privacy settings
(``geoloco.algorithms.simulation.sim_uplinks``), and Streaming DiLoCo rounds run in
``geoloco.algorithms.simulation.streaming_sim``.

Time is virtual (``geoloco.algorithms.simulation.clock``): compute is ``step_time_s / speed_factor`` per
step (or the measured wall time of the real steps with ``step_time_s = "measure"``) and every
transfer costs ``latency + 8 · nbytes / bandwidth``, from the bytes really produced by the codecs
(or the secure aggregation protocol, whose stage calls and barriers are timed by
``geoloco.algorithms.simulation.secure_clock``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from geoloco.algorithms.config import require
from geoloco.algorithms.device import resolve_device
from geoloco.algorithms.diloco import batch_size, compute_gradient, pseudo_gradient
from geoloco.algorithms.engine import RoundEngine
from geoloco.algorithms.finite import WITHHELD_NON_FINITE, all_finite, withheld_reason
from geoloco.algorithms.link_codec import CodecPlans, switch_codec
from geoloco.algorithms.lr_schedule import InnerLRSchedule
from geoloco.algorithms.optimizers import (
    load_optimizer_state_,
    optimizer_state_tensors,
    split_flat_optimizer_state,
)
from geoloco.algorithms.params import ParamLayout, weights_digest
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.round import Round, RoundPolicy
from geoloco.algorithms.simulation.clock import download_ends, upload_arrivals
from geoloco.algorithms.simulation.robust_attack import parse_attack
from geoloco.algorithms.simulation.secure_clock import masked_arrivals, unmasked_at
from geoloco.algorithms.simulation.sim_config import MEASURE, SimulationConfig, SimulatorConfig
from geoloco.algorithms.simulation.sim_state import LateUpdate, SimSite, SimTrainer
from geoloco.algorithms.simulation.sim_uplinks import (
    Payload,
    PrivacyBudget,
    build_uplinks,
    drop_refused,
    keep_aborted,
    simulation_session,
)
from geoloco.algorithms.simulation.streaming_sim import StreamingRounds
from geoloco.algorithms.strategy import UPDATE_GRADIENT, AlgorithmConfig, DataParallel, Strategy, build_strategy
from geoloco.algorithms.streaming import FragmentUplink
from geoloco.algorithms.update_guard import UpdateGuard
from geoloco.algorithms.workload import Workload
from geoloco.compression import Encoded

__all__ = [
    "MEASURE",
    "SimulationConfig",
    "Simulator",
    "SimulatorConfig",
    "resolve_device",
    "simulate",
]

logger = logging.getLogger(__name__)


class Simulator:
    """A simulated run; iterate ``run()`` for records. ``global_flat`` holds the current weights."""

    def __init__(self, config: SimulatorConfig, workload: Workload) -> None:
        self.config = config
        self.workload = workload
        sim = config.simulation
        algo = config.algorithm
        self.device = resolve_device(sim.device, "simulation.device")
        self.model = workload.build_model(sim.seed).to(self.device)
        self.layout = ParamLayout.from_model(self.model)
        self.global_flat = self.layout.flatten(self.model)
        def new_strategy() -> Strategy:
            return build_strategy(
                algo,
                numel=self.layout.numel,
                outer_optimizer=config.outer_optimizer,
                inner_optimizer=config.inner_optimizer,
                seed=sim.seed,
                device=self.device,
                layout=self.layout,
            )

        self.strategy: Strategy = new_strategy()
        self.data_parallel = self.strategy.update_kind == UPDATE_GRADIENT
        self.trainer = SimTrainer(
            self.model, self.layout, workload, device=self.device, step_time_s=sim.step_time_s,
            grad_clip_norm=config.inner_optimizer.grad_clip_norm, partial=self.strategy.partial,
        )
        num_sites = len(config.sites)
        names = [str(k) for k in range(num_sites)]
        self.uplinks, site_uplinks = build_uplinks(
            self.strategy, config.privacy, names, uplink_codec=algo.uplink_codec,
            error_feedback=algo.error_feedback, session=simulation_session(sim.seed),
            attacks={
                names[k]: parse_attack(site.attack)
                for k, site in enumerate(config.sites) if site.attack is not None
            },
        )
        self.sites = [
            SimSite(
                index=k,
                name=names[k],
                config=site,
                batches=workload.site_batches(k, num_sites, sim.seed),
                optimizer=None if self.data_parallel else config.inner_optimizer.build(
                    self.model.parameters()
                ),
                uplink=site_uplinks.get(names[k]),
            )
            for k, site in enumerate(config.sites)
        ]
        # Inner lr schedule (geoloco.algorithms.lr_schedule): one per site, over its cumulative
        # inner steps of the rounds (the data-parallel warm-up runs at the constant lr); for the
        # ddp baseline, one over the shared optimizer's steps. Horizon: rounds x inner steps per
        # round (a Streaming DiLoCo round is one fragment sync: H / fragments inner steps; a ddp
        # round reports H synchronous steps).
        horizon = {"total_rounds": config.run_rounds, "inner_steps": config.steps_per_round}
        for site in self.sites:
            if site.optimizer is not None:
                site.lr_schedule = config.inner_optimizer.build_schedule(site.optimizer, **horizon)
        self.ddp_lr_schedule: InnerLRSchedule | None = None
        if self.data_parallel:
            self.ddp_lr_schedule = config.inner_optimizer.build_schedule(self.strategy.outer.optimizer, **horizon)
        self.privacy_budget = PrivacyBudget(
            config.privacy, algo.uplink_codec, update_numel=self.strategy.update_numel, num_sites=num_sites,
        )
        self.accountant = self.privacy_budget.accountant
        self.policy: RoundPolicy = config.training.round_policy(num_sites)
        self.engine = RoundEngine(
            self.strategy, self.policy, UpdateGuard(config.update_guard), fresh_strategy=new_strategy
        )
        """The rounds' lifecycle, the coordinator's (``geoloco.algorithms.engine``), on the virtual clock."""
        self.clock_s = 0.0
        self.open_s = 0.0
        self.tiers = config.tier_clock()
        """Regions / the coordinator's shared link (``geoloco.algorithms.simulation.sim_regions``), or None."""
        self.bytes_up_total = 0
        self.bytes_down_total = 0
        self.inner_steps_total = 0
        adaptive = algo.adaptive_uplink
        require(
            not (adaptive.enabled and config.privacy.secure_aggregation), "algorithm.adaptive_uplink.enabled",
            "a secure sum adds every site's masked update in one codec; disable adaptive_uplink or "
            "[privacy] secure_aggregation",
        )
        self.link_codecs = CodecPlans(adaptive, algo.uplink_codec) if adaptive.enabled else None
        """Per-site uplink codecs (``geoloco.algorithms.link_codec``), measured on the virtual clock."""
        self.streaming: StreamingRounds | None = (
            StreamingRounds(self.strategy, self.trainer, self.uplinks, self.engine, self.sites)
            if algo.streaming.enabled else None
        )
        """Streaming DiLoCo (``geoloco.algorithms.simulation.streaming_sim``): per-site weights and overlap."""

    def _evaluate(self) -> float:
        return self.trainer.evaluate(self.global_flat)

    # -- data-parallel steps (the ddp baseline and the warm-up) ------------------------------

    def _data_parallel_steps(
        self, strategy: Strategy, uplinks: list[FragmentUplink], steps: int, first_round: int
    ) -> dict[str, Any]:
        """``steps`` synchronous DDP steps through ``strategy`` (a ``DataParallel``)."""
        n = len(self.sites)
        bytes_up = [0] * n
        bytes_down = [0] * n
        compute = [0.0] * n
        starts0 = [s.ready_s for s in self.sites]
        losses: list[float] = []
        trainer = self.trainer
        for step in range(steps):
            plan = strategy.configure_round(first_round + step, [s.name for s in self.sites])
            aggregator = strategy.new_aggregator(plan.round)
            trainer.load(self.global_flat)
            step_compute = []
            upload_sizes = []
            for site, uplink in zip(self.sites, uplinks, strict=True):
                trainer.sync_device()
                t0 = time.perf_counter()
                batch = next(site.batches)
                grad, loss = compute_gradient(self.model, self.layout, batch, self.workload.loss)
                trainer.sync_device()
                seconds = trainer.step_seconds(site, 1, time.perf_counter() - t0)
                encoded = uplink.encode(grad, seed=plan.uplink_seed(site.name))
                aggregator.add(encoded, strategy.site_weight(batch_size(batch)), site=site.name)
                losses.append(loss)
                step_compute.append(seconds)
                upload_sizes.append(encoded.nbytes)
            update = strategy.aggregate_round(self.global_flat, aggregator, plan)
            self.global_flat = update.global_flat
            if strategy is self.strategy and self.ddp_lr_schedule is not None:
                self.ddp_lr_schedule.step()
            arrivals = upload_arrivals(
                [s.ready_s for s in self.sites], step_compute, upload_sizes,
                [s.config for s in self.sites],
            )
            aggregate_s = max(arrivals)  # data-parallel: every site, every step
            ends = download_ends(
                aggregate_s, arrivals, update.downlink.nbytes, [s.config for s in self.sites]
            )
            self.open_s = aggregate_s
            for k, site in enumerate(self.sites):
                site.ready_s = ends[k]
                compute[k] += step_compute[k]
                bytes_up[k] += upload_sizes[k]
                bytes_down[k] += update.downlink.nbytes
        spans = [s.ready_s - start for s, start in zip(self.sites, starts0, strict=True)]
        return {
            "train_loss": sum(losses) / len(losses),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "compute_s": compute,
            "utilization": [c / span if span > 0 else 1.0 for c, span in zip(compute, spans, strict=True)],
        }

    # -- one DiLoCo-family round -------------------------------------------------------------

    def round_noise_multiplier(self, round_number: int) -> float:
        """What the accountant composes for round ``round_number``: one release of its update
        (with streaming, of its fragment's)."""
        return self.privacy_budget.noise_multiplier(round_number)

    def _diloco_round(self, round_number: int) -> dict[str, Any]:
        """Every site trains from ``θ_t`` and uploads; the round closes by the policy on the
        virtual clock; late uploads are folded next round or kept in the site's residual."""
        strategy = self.strategy
        plan = strategy.configure_round(round_number, [s.name for s in self.sites])
        engine = self.engine
        round_ = engine.open(plan.round, self.uplinks.begin(plan), self.open_s)
        engine.maybe_start(round_, self.open_s, members=len(self.sites))
        payloads: list[Payload | None] = []
        weights: list[float] = []
        site_steps: list[int] = []
        compute: list[float] = []
        losses: list[float] = []
        known: dict[int, int] = {}
        held_for_abort: dict[str, Payload] = {}
        for k, site in enumerate(self.sites):
            self.trainer.load(self.global_flat)
            result, seconds = self._inner_steps(site, plan.inner_steps)
            steps = len(result.losses)
            pseudo = pseudo_gradient(self.global_flat, self.trainer.flatten())
            self._use_assigned_codec(site, plan.round, plan.fragment)
            if not all_finite(pseudo):
                # Sends nothing and says so with its wait: rejected, not waited for (no bytes).
                self._withhold(site, round_, plan.fragment)
                del pseudo
                weights.append(0.0)
                site_steps.append(steps)
                compute.append(seconds)
                known[k] = 0
                payloads.append(None)
                continue
            encoded = self.uplinks.encode(site.name, pseudo, plan, round_.aggregation)
            del pseudo
            weights.append(strategy.site_weight(result.samples, steps))
            site_steps.append(steps)
            compute.append(seconds)
            losses.extend(result.losses)
            size = self.uplinks.nbytes_now(encoded)
            held: Payload | None = encoded
            if size is not None:
                known[k] = size
                (arrival,) = upload_arrivals([site.ready_s], [seconds], [size], [site.config])
                if engine.admit_if_on_time(
                    round_, site.name, encoded, weights[k], screen=self.uplinks.screen(encoded), arrival=arrival
                ):
                    held = None
                    if self.uplinks.keeps(site.name, plan.fragment):
                        held_for_abort[site.name] = encoded
            del encoded
            payloads.append(held)
        # The other sizes are known once every site has encoded (the secure protocol's messages).
        upload_sizes = []
        for k, (s, p) in enumerate(zip(self.sites, payloads, strict=True)):
            if k in known:
                upload_sizes.append(known[k])
            else:
                assert p is not None  # an update whose size was not known is still held
                upload_sizes.append(self.uplinks.nbytes(s.name, p, round_.aggregation))
        traffic = [self.uplinks.traffic(s.name, round_.aggregation) for s in self.sites]
        secure = [t for t in traffic if t is not None]
        configs = [s.config for s in self.sites]
        if self.tiers is not None:
            finished = [s.ready_s + c for s, c in zip(self.sites, compute, strict=True)]
            masked = [None if t is None else t.masked_up for t in traffic]
            arrivals = self.tiers.arrivals(finished, upload_sizes, self.layout.numel, masked)
        elif len(secure) == len(self.sites):  # a secure round: its stages on the clock
            arrivals = masked_arrivals([s.ready_s for s in self.sites], compute, secure, configs)
        else:
            arrivals = upload_arrivals([s.ready_s for s in self.sites], compute, upload_sizes, configs)
        names = [s.name for s in self.sites]
        aggregate_s = engine.admit_arrivals(
            round_, sites=names, arrivals=arrivals, payloads=payloads, weights=weights, screen=self.uplinks.screen
        )
        # Last round's late updates arrived before this round's uploads: folded (and measured) first.
        self._fold_late_updates(round_, aggregate_s)
        if self.link_codecs is not None:  # what the coordinator measures: the uploads it admitted
            for k, site in enumerate(self.sites):
                if site.name in round_.contributed:
                    self.link_codecs.observe_upload(
                        site.name, upload_sizes[k], arrivals[k] - site.ready_s - compute[k]
                    )
        outcome = engine.close(round_, now=aggregate_s, expected=names)
        # The others go back to the sites' residuals (with error feedback) so their work arrives
        # next round, or wait to be folded into the next round's average.
        for k, site in enumerate(self.sites):
            if site.name not in outcome.excluded:
                continue
            payload = payloads[k]
            assert payload is not None  # only updates in the round were added early
            if self.policy.folds_late_updates:
                assert isinstance(payload, Encoded)  # privacy rounds never fold
                site.late = LateUpdate(
                    payload, weights[k], arrivals[k], plan.fragment, nbytes=upload_sizes[k],
                    upload_s=arrivals[k] - site.ready_s - compute[k],
                )
            else:
                self.uplinks.keep(site.name, payload, plan.fragment)
        stepped = engine.step(round_, self.global_flat, plan, list(outcome.contributors))
        drop_refused(self.uplinks, outcome, plan.fragment)
        if stepped.aborted is not None:
            keep_aborted(self.uplinks, outcome, plan.fragment, early=held_for_abort, names=names, payloads=payloads)
        del held_for_abort
        update = stepped.result.update
        self.global_flat = update.global_flat
        if self.tiers is None and len(secure) == len(self.sites):  # the broadcast waits for the unmasking
            aggregate_s = unmasked_at(
                aggregate_s, arrivals, secure, configs,
                [k for k, name in enumerate(names) if name in outcome.contributors],
            )
        utilization = self._close_round_clock(aggregate_s, arrivals, update.downlink.nbytes, compute)
        return {
            "train_loss": sum(losses) / len(losses) if losses else math.nan,
            "bytes_up": upload_sizes,
            # A secure round's protocol messages come down besides the broadcast.
            "bytes_down": [update.downlink.nbytes + (0 if t is None else t.down) for t in traffic],
            "compute_s": compute,
            "utilization": utilization,
            "site_inner_steps": site_steps,
            "peak_bytes_in_flight": [max(up, update.downlink.nbytes) for up in upload_sizes],
            "closed": (outcome, stepped),
        }

    def _withhold(self, site: SimSite, round_: Round, fragment: int) -> None:
        """A non-finite pseudo-gradient, as the site agent handles it (``RoundRunner._withhold``):
        the fragment's error-feedback residual and the inner optimizer's state are reset, and the
        round rejects the site with the words the coordinator records."""
        if site.uplink is None:
            raise ValueError(
                f"site {site.name}'s pseudo-gradient of round {round_.number} has NaN/Inf values; the "
                "simulated secure aggregation cannot leave a site out of a round's sum (a real site "
                "withdraws from it): lower the inner lr, or clip gradients ([inner_optimizer] "
                "grad_clip_norm)"
            )
        logger.warning(
            "site %s: the pseudo-gradient of round %d has NaN/Inf values; it sends nothing and "
            "resets its error-feedback residual and inner optimizer state", site.name, round_.number,
        )
        self.uplinks.drop(site.name, fragment)
        if site.optimizer is not None:
            site.optimizer.state.clear()
        round_.reject(site.name, withheld_reason(WITHHELD_NON_FINITE))

    def _use_assigned_codec(self, site: SimSite, round_number: int, fragment: int) -> None:
        """Adaptive uplink codecs: switch the site's encoder to its codec for this round (its
        error-feedback residual carries over), as the site agent does."""
        if self.link_codecs is None or site.uplink is None:
            return
        algo = self.config.algorithm
        spec = self.link_codecs.codec_for(site.name, round_number, self.strategy.update_numel(round_number))
        encoders = site.uplink.encoders
        encoders[fragment] = switch_codec(
            encoders[fragment], spec, error_feedback=algo.error_feedback, decay=algo.error_feedback_decay
        )

    def _inner_steps(self, site: SimSite, inner_steps: int) -> tuple[Any, float]:
        """One site's inner steps of a round: ``inner_steps``, or as many as fit in the time
        budget on the virtual clock. Returns the ``InnerResult`` and the virtual seconds."""
        budget_s = self.config.algorithm.round_time_budget_s
        if budget_s is not None:
            return self.trainer.steps_within(site, budget_s)
        result, seconds = self.trainer.steps(site, inner_steps)
        assert result is not None
        return result, seconds

    def _fold_late_updates(self, round_: Round, aggregate_s: float) -> None:
        """Offer last round's late updates that arrived before this round aggregated to the
        engine (folded with the staleness discount, or refused by the guard and dropped, as the
        real site drops a refused update); those that did not arrive go back into their site's
        residual (the real coordinator accepts an update exactly one round late, no later)."""
        for site in self.sites:
            late, site.late = site.late, None
            if late is None:
                continue
            if late.arrival_s <= aggregate_s:
                folded = self.engine.fold_late(
                    round_, site.name, late.encoded, late.weight, screen=self.uplinks.screen(late.encoded)
                )
                if not folded.ok:
                    self.uplinks.drop(site.name, late.fragment)
                elif self.link_codecs is not None:  # the coordinator measures a late upload it folds
                    self.link_codecs.observe_upload(site.name, late.nbytes, late.upload_s)
            else:
                self.uplinks.keep(site.name, late.encoded, late.fragment)

    def _close_round_clock(
        self, aggregate_s: float, arrivals: list[float], downlink_bytes: int, compute: list[float]
    ) -> list[float]:
        """Advance every site to the end of its broadcast download and the round clock to
        ``aggregate_s``; returns each site's compute share of its round (utilization)."""
        if self.tiers is not None:
            ends = self.tiers.ends(aggregate_s, downlink_bytes)
        else:
            ends = download_ends(aggregate_s, arrivals, downlink_bytes, [s.config for s in self.sites])
        utilization = []
        for k, site in enumerate(self.sites):
            span = ends[k] - site.ready_s
            utilization.append(compute[k] / span if span > 0 else 1.0)
            site.ready_s = ends[k]
        self.open_s = aggregate_s
        return utilization

    # -- the run ------------------------------------------------------------------------------

    def _record(self, round_number: int, phase: str, steps: int, stats: dict[str, Any],
                eval_loss: float | None) -> RoundRecord:
        self.bytes_up_total += sum(stats["bytes_up"])
        self.bytes_down_total += sum(stats["bytes_down"])
        self.inner_steps_total += steps
        names = [s.name for s in self.sites]

        def by_site(values: list[Any] | None) -> dict[str, Any] | None:
            return None if values is None else dict(zip(names, values, strict=True))

        end = stats.get("end_s", max(s.ready_s for s in self.sites))
        host = dict(
            phase=phase,
            inner_steps=by_site(stats.get("site_inner_steps", [steps] * len(self.sites))) or {},
            inner_steps_total=self.inner_steps_total,
            train_loss=stats["train_loss"],
            eval_loss=eval_loss,
            bytes_up=by_site(stats["bytes_up"]) or {},
            bytes_down=by_site(stats["bytes_down"]) or {},
            bytes_up_total=self.bytes_up_total,
            bytes_down_total=self.bytes_down_total,
            round_time_s=end - self.clock_s,
            wall_clock_s=end,
            compute_s=by_site(stats["compute_s"]) or {},
            utilization=by_site(stats["utilization"]) or {},
            epsilon=None if self.accountant is None else self.accountant.epsilon(),
            peak_bytes_in_flight=by_site(stats.get("peak_bytes_in_flight")),
            fragment=stats.get("fragment"),
        )
        closed = stats.get("closed")
        if closed is not None:
            record = RoundRecord.closed(*closed, **host)
        else:  # data-parallel steps: every site, no engine round to close
            record = RoundRecord(
                round=round_number, participants=names, weights_digest=weights_digest(self.global_flat), **host
            )
        self.clock_s = end
        return record

    def run(self) -> Iterator[RoundRecord]:
        """Warm-up (if any), then rounds until the run length (``rounds`` or
        ``total_inner_steps``) or ``target_eval_loss`` is reached."""
        sim = self.config.simulation
        algo = self.config.algorithm
        # Dropout and anything else drawing from the global generator; seeded when the run starts
        # (not at construction), so runs consumed one after another in a process are identical.
        torch.manual_seed(sim.seed)
        if algo.warmup_steps > 0:
            warmup = DataParallel(
                AlgorithmConfig(name="ddp", inner_steps=1),
                numel=self.layout.numel,
                inner_optimizer=self.config.inner_optimizer,
                seed=sim.seed,
                device=self.device,
            )
            stats = self._data_parallel_steps(
                warmup, [warmup.build_uplink() for _ in self.sites], algo.warmup_steps, 0
            )
            self._seed_site_optimizers(warmup)
            yield self._record(-1, "warmup", algo.warmup_steps, stats, self._evaluate())
        for round_number in range(self.config.run_rounds):
            if self.data_parallel:
                stats = self._data_parallel_steps(
                    self.strategy, [s.uplink for s in self.sites if s.uplink is not None],
                    algo.inner_steps, round_number * algo.inner_steps,
                )
            else:
                if not self.privacy_budget.allows(round_number):
                    return
                if self.streaming is not None:
                    self.global_flat, self.open_s, stats = self.streaming.round(
                        round_number, self.global_flat, self.open_s
                    )
                else:
                    stats = self._diloco_round(round_number)
            # Streaming rounds report their steps too (adaptive overlap may stretch them).
            steps = max(stats["site_inner_steps"]) if stats.get("site_inner_steps") else algo.inner_steps
            due = self.config.evaluates_after(
                round_number, self.inner_steps_total, self.inner_steps_total + steps
            )
            eval_loss = self._evaluate() if due else None
            yield self._record(round_number, "train", steps, stats, eval_loss)
            if (
                sim.target_eval_loss is not None
                and eval_loss is not None
                and eval_loss <= sim.target_eval_loss
            ):
                logger.info(
                    "eval loss %.4f reached target %.4f after round %d",
                    eval_loss, sim.target_eval_loss, round_number,
                )
                return

    def _seed_site_optimizers(self, warmup: Strategy) -> None:
        """Give every site the warm-up's shared optimizer state (as if each had run it)."""
        tensors, meta = optimizer_state_tensors(warmup.outer.optimizer)
        entries = [(e.offset, e.shape) for e in self.layout.entries]
        per_param, per_meta = split_flat_optimizer_state(tensors, meta, entries)
        for site in self.sites:
            assert site.optimizer is not None
            load_optimizer_state_(site.optimizer, per_param, per_meta)
            if site.lr_schedule is not None:
                site.lr_schedule.seek(0)  # the loaded param groups carry the warm-up's lr


def simulate(config: SimulatorConfig, workload: Workload) -> Iterator[RoundRecord]:
    """Run ``config`` on ``workload`` and yield one ``RoundRecord`` per round (warm-up first)."""
    return Simulator(config, workload).run()
