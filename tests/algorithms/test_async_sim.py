"""The event-driven simulator: the identities with the round-by-round simulator, goodput and
downtime on a hand-made failure schedule, staleness, Dynamic Local Updates, config checks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from geoloco.algorithms.async_merge import dynamic_local_steps
from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.simulation.async_sim import DecoupledSimulator, build_simulator
from geoloco.algorithms.simulation.chaos import ChaosSchedule
from geoloco.algorithms.simulation.clock import transfer_time
from geoloco.algorithms.simulation.sim_config import SimulatorConfig
from geoloco.algorithms.simulation.simulator import Simulator

INSTANT = {"latency_s": 0.0, "uplink_bps": math.inf, "downlink_bps": math.inf}
"""Links that take no time: an upload arrives, and a broadcast reaches every site, at once."""


def _config(**sections: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "algorithm": {"inner_steps": 4},
        "inner_optimizer": {"lr": 0.02},
        "sites": {"count": 3},
        "simulation": {"rounds": 4, "eval_every": 2, "device": "cpu", "step_time_s": 0.1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return base


def test_synchronous_rounds_without_failures_are_the_simulators(make_workload) -> None:
    """Chaos on, nobody fails: the event-driven synchronous rule ends every round on the same
    weights and evaluations; its merge closes one broadcast before the record's end there."""
    workload = make_workload(hidden=8)
    plain = _config(algorithm={"uplink_codec": "int8"})
    reference = list(Simulator(SimulatorConfig.from_dict(plain), workload).run())
    events = _config(algorithm={"uplink_codec": "int8"}, simulation={"chaos": {"enabled": True}})
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(events), workload)
    got = list(simulator.run())
    assert [r.round for r in got] == [r.round for r in reference]
    assert [r.weights_digest for r in got] == [r.weights_digest for r in reference]
    assert [r.eval_loss for r in got] == [r.eval_loss for r in reference]
    download = transfer_time(reference[0].bytes_down["0"], 1e9, 0.05)
    assert [r.wall_clock_s + download for r in got] == pytest.approx([r.wall_clock_s for r in reference], abs=1e-12)
    assert simulator.ledger.goodput == 1.0 and got[-1].goodput == 1.0
    assert got[-1].global_downtime_s is not None and got[-1].global_downtime_s > 0  # uploads and broadcasts


def test_asynchronous_merges_of_every_site_on_instant_links_are_the_simulators(make_workload) -> None:
    """min_quorum = every site, uniform speeds, links that take no time: every merge holds every
    site's update computed from the newest model, so it is the synchronous run bit for bit."""
    workload = make_workload(hidden=8)
    reference = list(Simulator(SimulatorConfig.from_dict(_config(sites=INSTANT)), workload).run())
    config = _config(sites=INSTANT, algorithm={"asynchronous": {"enabled": True, "min_quorum": 3}})
    got = list(DecoupledSimulator(SimulatorConfig.from_dict(config), workload).run())
    assert [r.weights_digest for r in got] == [r.weights_digest for r in reference]
    assert [r.eval_loss for r in got] == [r.eval_loss for r in reference]
    assert [r.wall_clock_s for r in got] == [r.wall_clock_s for r in reference]
    assert all(r.staleness == {"0": 0, "1": 0, "2": 0} for r in got)
    assert got[-1].global_downtime_s == 0.0


def test_with_real_links_every_later_update_is_one_merge_stale(make_workload) -> None:
    """The tightest identity with latency: a site goes on from the model it holds while its
    update travels, so from the second merge on each update is computed one merge back."""
    config = _config(algorithm={"asynchronous": {"enabled": True, "min_quorum": 3}})
    got = list(DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8)).run())
    assert got[0].staleness == {"0": 0, "1": 0, "2": 0}
    assert all(r.staleness == {"0": 1, "1": 1, "2": 1} for r in got[1:])


def _hand_made(rule: dict[str, Any], workload: Any) -> tuple[DecoupledSimulator, list[Any]]:
    """Two sites, 1 s steps, H = 4, instant links; site 0 is down over [2.5, 4), site 1 over
    [3, 5); the run stops at 10 s."""
    rule = dict(rule)
    merge = {"asynchronous": rule.pop("asynchronous")} if "asynchronous" in rule else {}
    config = _config(
        algorithm={"inner_steps": 4, **merge}, sites={"count": 2, **INSTANT},
        simulation={"rounds": 100, "eval_every": 100, "step_time_s": 1.0, "max_wall_clock_s": 10.0, **rule},
    )
    schedule = ChaosSchedule.fixed({0: [(2.5, 4.0)], 1: [(3.0, 5.0)]})
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), workload, schedule=schedule)
    return simulator, list(simulator.run())


def test_goodput_and_downtime_on_a_hand_made_schedule_asynchronous(make_workload) -> None:
    """Site 0 loses 2 steps at 2.5 s, site 1 loses 3 at 3 s; repaired, they train [4, 8] and
    [5, 9] from version 0 and merge at 8 s and 9 s (site 1 one merge stale), then train on.
    Useful 8 of 13 computed steps; nobody trains usefully before 4 s: downtime 4 s."""
    simulator, records = _hand_made(
        {"asynchronous": {"enabled": True}, "chaos": {"enabled": True}}, make_workload(hidden=8)
    )
    merged = [r for r in records if r.participants]
    assert [(r.wall_clock_s, r.participants, r.staleness) for r in merged] == [
        (8.0, ["0"], {"0": 0}), (9.0, ["1"], {"1": 1})
    ]
    assert simulator.ledger.lost_by_reason["failed"] == 5 and simulator.ledger.useful_steps == 8
    last = records[-1]
    assert last.wall_clock_s == 10.0 and last.aborted is not None  # the run's end, a merge open
    assert last.goodput == pytest.approx(8 / 13) and last.inner_steps_lost == 5
    assert last.global_downtime_s == pytest.approx(4.0)


def test_goodput_and_downtime_on_a_hand_made_schedule_synchronous(make_workload) -> None:
    """The same failures, synchronous: the round waits for both repaired sites and closes at
    9 s; the same steps are lost. With the lock-step rule, site 0's failure at 2.5 s voids
    site 1's 2 steps too (and site 1's failure at 3 s finds its restarted phase 0 steps in)."""
    simulator, records = _hand_made({"chaos": {"enabled": True}}, make_workload(hidden=8))
    assert [(r.wall_clock_s, r.participants) for r in records if r.participants] == [(9.0, ["0", "1"])]
    assert records[-1].goodput == pytest.approx(8 / 13) and records[-1].global_downtime_s == pytest.approx(4.0)
    simulator, records = _hand_made(
        {"chaos": {"enabled": True, "sync_on_failure": "restart"}}, make_workload(hidden=8)
    )
    lost = simulator.ledger.lost_by_reason
    assert (lost["failed"], lost["restarted"]) == (2, 2)
    assert records[-1].goodput == pytest.approx(8 / 12) and records[-1].global_downtime_s == pytest.approx(4.0)


def test_rebase_takes_a_merge_into_the_running_phase_at_its_next_step_boundary(make_workload) -> None:
    """The hand-made schedule with ``rebase``: site 1 trains [5, 9] from version 0; version 1
    (site 0's update, merged at 8 s on instant links) reaches it after 3 of its 4 steps, so its
    update is measured from version 1 and enters merge 2 fresh, where it was one merge stale.
    The same steps count; the weights differ from the run without rebase."""
    workload = make_workload(hidden=8)
    _, plain = _hand_made({"asynchronous": {"enabled": True}, "chaos": {"enabled": True}}, workload)
    simulator, rebased = _hand_made(
        {"asynchronous": {"enabled": True, "rebase": True}, "chaos": {"enabled": True}}, workload
    )
    merged = [r for r in rebased if r.participants]
    assert [(r.wall_clock_s, r.participants, r.staleness) for r in merged] == [
        (8.0, ["0"], {"0": 0}), (9.0, ["1"], {"1": 0})
    ]
    assert simulator.ledger.useful_steps == 8 and rebased[-1].goodput == pytest.approx(8 / 13)
    plain_merged = [r for r in plain if r.participants]
    assert merged[0].weights_digest == plain_merged[0].weights_digest
    assert merged[1].weights_digest != plain_merged[1].weights_digest


def test_rebase_changes_nothing_when_no_merge_arrives_mid_phase(make_workload) -> None:
    """Every site in every merge on instant links: each phase starts from the newest model and
    no merge lands while one runs, so ``rebase`` keeps the synchronous run bit for bit."""
    workload = make_workload(hidden=8)
    reference = list(Simulator(SimulatorConfig.from_dict(_config(sites=INSTANT)), workload).run())
    merge = {"enabled": True, "min_quorum": 3, "rebase": True}
    got = list(DecoupledSimulator(SimulatorConfig.from_dict(_config(sites=INSTANT, algorithm={"asynchronous": merge})),
                                  workload).run())
    assert [r.weights_digest for r in got] == [r.weights_digest for r in reference]


def test_with_rebase_and_real_links_no_update_is_stale(make_workload) -> None:
    """The case where, without rebase, every later update is one merge stale: the merge's
    broadcast reaches each site one step into its next phase and is taken in there, so every
    update is measured from the model it is merged into; the versions held stay few."""
    config = _config(algorithm={"asynchronous": {"enabled": True, "min_quorum": 3, "rebase": True}})
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    got = list(simulator.run())
    assert all(r.staleness == {"0": 0, "1": 0, "2": 0} for r in got)
    assert simulator.memory()["peak_versions"] <= 3


def test_too_stale_updates_are_dropped_and_their_steps_lost(make_workload) -> None:
    """A 0.25x site's update is several merges behind the fast sites' (quorum 1): with
    max_staleness 0 it is dropped and its steps lost. Not a rejection on the record: the real
    coordinator refuses such an update at its manifest (WRONG_ROUND) and records nothing, and the
    simulator's records are the coordinator's."""
    sites = [{"speed_factor": 1.0}, {"speed_factor": 1.0}, {"speed_factor": 0.25}]
    config = _config(
        sites=sites, simulation={"rounds": 12},
        algorithm={"asynchronous": {"enabled": True, "max_staleness": 0}},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    records = list(simulator.run())
    assert simulator.ledger.lost_by_reason["stale"] > 0
    assert all("2" not in r.rejected_reasons for r in records)
    assert all(s == 0 for r in records for s in (r.staleness or {}).values())


def test_dynamic_local_updates_size_phases_by_speed(make_workload) -> None:
    assert dynamic_local_steps(20, None, None) == 20
    assert dynamic_local_steps(20, 0.4, 0.1) == 5
    assert dynamic_local_steps(20, 10.0, 0.1) == 1
    sites = [{"speed_factor": 1.0}, {"speed_factor": 0.5}, {"speed_factor": 0.25}]
    config = _config(
        algorithm={"inner_steps": 8, "asynchronous": {"enabled": True, "dynamic_local_updates": True}},
        sites=sites, simulation={"rounds": 12},
    )
    records = list(DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8)).run())
    steps = {site: n for r in records[4:] for site, n in r.inner_steps.items()}
    assert steps == {"0": 8, "1": 4, "2": 2}


def test_the_event_driven_simulator_refuses_what_it_does_not_model(make_workload) -> None:
    with pytest.raises(ConfigError, match="algorithm.asynchronous.*Streaming"):
        SimulatorConfig.from_dict(_config(
            algorithm={"streaming": {"enabled": True, "fragments": 2}, "asynchronous": {"enabled": True}},
        ))
    with pytest.raises(ConfigError, match="max_wall_clock_s"):
        SimulatorConfig.from_dict(_config(simulation={"max_wall_clock_s": 10.0}))
    with pytest.raises(ConfigError, match="max_wall_clock_s"):
        SimulatorConfig.from_dict(_config(simulation={"chaos": {"enabled": True, "mtbf_s": 5.0}}))
    with pytest.raises(ConfigError, match="min_quorum"):
        SimulatorConfig.from_dict(_config(algorithm={"asynchronous": {"enabled": True, "min_quorum": 4}}))
    workload = make_workload()
    assert isinstance(build_simulator(SimulatorConfig.from_dict(_config()), workload), Simulator)
    chaos = SimulatorConfig.from_dict(_config(simulation={"chaos": {"enabled": True}}))
    assert isinstance(build_simulator(chaos, workload), DecoupledSimulator)


def test_the_old_simulation_asynchronous_table_is_read_with_a_deprecation_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = SimulatorConfig.from_dict(_config(simulation={"asynchronous": {"enabled": True, "min_quorum": 2}}))
    assert old.algorithm.asynchronous.enabled and old.algorithm.asynchronous.min_quorum == 2
    assert "rename the table to [algorithm.asynchronous]" in caplog.text
    with pytest.raises(ConfigError, match="simulation.asynchronous.*keep only"):
        SimulatorConfig.from_dict(_config(
            simulation={"asynchronous": {"enabled": True}}, algorithm={"asynchronous": {"enabled": True}},
        ))


def test_a_pseudo_gradient_with_nan_is_withheld_and_the_site_goes_on(make_workload, monkeypatch) -> None:
    """As the real asynchronous site does: a phase whose pseudo-gradient has NaN/Inf values is
    not sent, its steps are lost, its residual and inner optimizer state are reset, and the site
    trains its next phase. The simulator used to stop with an encoding error."""
    import geoloco.algorithms.simulation.async_sim as async_sim

    real = async_sim.pseudo_gradient
    calls = [0]

    def second_is_nan(base: Any, local: Any) -> Any:
        calls[0] += 1
        update = real(base, local)
        return update * math.nan if calls[0] == 2 else update

    monkeypatch.setattr(async_sim, "pseudo_gradient", second_is_nan)
    config = _config(algorithm={"uplink_codec": "int8", "asynchronous": {"enabled": True}}, simulation={"rounds": 6})
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    records = list(simulator.run())
    assert [r.round for r in records] == list(range(6))
    assert simulator.ledger.lost_by_reason["non_finite"] == 4  # one phase of inner_steps 4
    assert all(math.isfinite(r.train_loss) for r in records if r.train_loss is not None)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_an_aborted_merge_gives_its_updates_back_to_the_residuals(make_workload, error_feedback: bool) -> None:
    """A merge the update guard aborts (site 1 scales its updates far beyond max_abs_weight):
    with error feedback the merged updates go back into their sites' residuals, as the real
    site keeps an update its merge did not take, so no step is lost to the abort; without it
    they are lost."""
    config = _config(
        algorithm={"uplink_codec": "int8", "error_feedback": error_feedback, "asynchronous": {"enabled": True}},
        sites=[{}, {"attack": "scale:1000"}, {}],
        update_guard={"max_abs_weight": 2.0},
        simulation={"rounds": 4},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    records = list(simulator.run())
    assert any(r.aborted for r in records)
    lost = simulator.ledger.lost_by_reason["aborted"]
    assert (lost == 0) if error_feedback else (lost > 0)


def test_an_aborted_merge_does_not_give_back_the_update_of_a_site_that_failed_since(make_workload) -> None:
    """Sites fail and come back (chaos) while site 1's updates make merges abort: a failed
    site's new process has a fresh residual, so the update its old process sent is lost with
    the failure, not given back (which stopped the run: no residual to restore into)."""
    config = _config(
        algorithm={"uplink_codec": "int8", "asynchronous": {"enabled": True, "min_quorum": 2, "grace_window_s": 0.5}},
        sites=[{}, {"attack": "scale:1000"}, {}, {}],
        update_guard={"max_abs_weight": 2.0},
        run={"max_wall_clock_s": 60.0},
        simulation={"rounds": 20, "chaos": {"enabled": True, "seed": 0, "mtbf_s": 1.0, "repair_s": 0.3}},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    records = list(simulator.run())
    assert any(r.aborted for r in records)
    assert simulator.ledger.lost_by_reason["failed"] > 0


def test_the_fastest_site_that_sets_phase_lengths_is_one_that_is_up(make_workload) -> None:
    """Dynamic Local Updates size a phase by the fastest site's speed; the coordinator takes the
    fastest of its members. A fast site that failed kept shortening the others' phases in the
    simulator until it came back."""
    config = _config(
        algorithm={"inner_steps": 8, "asynchronous": {"enabled": True, "dynamic_local_updates": True}},
        run={"max_wall_clock_s": 600.0},
        simulation={"chaos": {"enabled": True, "seed": 0, "mtbf_s": 1e9}},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    next(iter(simulator.run()))
    fast, middle, slow = simulator.sites
    for site, step_s in ((fast, 0.05), (middle, 0.2), (slow, 0.4)):
        simulator._measured(site, step_s)
    assert simulator._fastest_step_s == 0.05
    simulator._fail(simulator.clock_s, fast)
    assert simulator._fastest_step_s == 0.2
    simulator._repair(simulator.clock_s, fast)
    assert simulator._fastest_step_s == 0.05


def test_steps_given_back_by_an_aborted_merge_are_lost_with_a_dropped_residual(make_workload, monkeypatch) -> None:
    """Merge 0 aborts (the first update is 1000 times too large): the sites' updates go back
    into their residuals, their steps carried. Site 0's next phase is not finite, so its
    residual is dropped, and the 4 steps it carried with it: they are lost, not counted as
    useful when the site's next update merges."""
    import geoloco.algorithms.simulation.async_sim as async_sim

    real = async_sim.pseudo_gradient
    calls = [0]

    def poisoned(base: Any, local: Any) -> Any:
        calls[0] += 1
        update = real(base, local)
        return update * 1000.0 if calls[0] == 1 else update * math.nan if calls[0] == 4 else update

    monkeypatch.setattr(async_sim, "pseudo_gradient", poisoned)
    config = _config(
        algorithm={"uplink_codec": "int8", "asynchronous": {"enabled": True, "min_quorum": 3}},
        update_guard={"max_abs_weight": 2.0},
        simulation={"rounds": 8},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    records = list(simulator.run())
    assert [r.round for r in records if r.aborted] == [0]
    assert simulator.ledger.lost_by_reason["non_finite"] == 8  # the NaN phase and the 4 steps carried


def test_a_failed_processs_held_update_leaves_its_successors_residual_alone(make_workload) -> None:
    """An update held for the next merge still enters it after its site failed (the coordinator
    holds it); refused there, it used to drop the residual and take the carried steps of the
    site's new process, which never sent it."""
    import torch

    from geoloco.algorithms.simulation.async_sim import _Upload
    from geoloco.compression import parse_codec

    config = _config(
        algorithm={"uplink_codec": "int8", "asynchronous": {"enabled": True}},
        run={"max_wall_clock_s": 600.0},
        simulation={"chaos": {"enabled": True, "seed": 0, "mtbf_s": 1e9}},
    )
    simulator = DecoupledSimulator(SimulatorConfig.from_dict(config), make_workload(hidden=8))
    next(iter(simulator.run()))
    site = simulator.sites[0]
    encoder = simulator.uplinks.uplinks[site.name].encoders[0]  # type: ignore[attr-defined]
    assert encoder.residual is not None
    residual = encoder.residual.clone()
    site.carried = [(4, 0.0, 0.4)]
    huge = parse_codec("int8").encode(torch.full((simulator.layout.numel,), 1e6), seed=0)
    stale = _Upload(
        site=0, incarnation=site.incarnation - 1, token=0, payload=huge, weight=1.0, base=simulator.version,
        steps=4, start=0.0, finish=0.4, nbytes=huge.nbytes, loss=0.0,
    )
    simulator._admit(simulator.clock_s, site, stale, staleness=0, weight=1.0)  # refused: beyond the norm floor
    assert simulator.ledger.lost_by_reason["rejected"] == 4
    assert site.carried == [(4, 0.0, 0.4)]
    assert simulator.uplinks.uplinks[site.name].encoders[0] is encoder  # type: ignore[attr-defined]
    assert torch.equal(encoder.residual, residual)
