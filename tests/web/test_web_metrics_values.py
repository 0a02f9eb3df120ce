"""Metric values and status-board contents after a scripted sequence of rounds, rejects and faults.

The round state machine runs without sockets on a fake clock, so every duration is exact; the
metrics are read back through the Prometheus parser, as a scraper would see them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _round_helpers import FakeClock, chunk_requests, encode_update, join, tiny_weights, upload, upload_manifest
from prometheus_client.parser import text_string_to_metric_families

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import translate
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_status import STATE_DOWN, CoordinatorStatus, HTTPStatusConfig
from geoloco.coordinator.rounds import RoundStateMachine
from geoloco.protos.errors import InvalidUpdateError

HEARTBEAT_S = 1.0
TIMEOUT_S = 20.0
DEADLINE_S = 30.0
EVAL_LOSSES = (2.0, 1.5, 1.25, 1.0, 0.9)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape[(name, tuple(sorted(labels.items())))]


def update(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.01


@pytest.fixture
def scripted(tmp_path: Path) -> tuple[RoundStateMachine, CoordinatorStatus, FakeClock, list[dict]]:
    """Three rounds: all three sites; a NaN update from a and c a straggler; c dropped."""
    clock = FakeClock()
    weights, layout = tiny_weights()
    config = CoordinatorConfig(
        algorithm=AlgorithmConfig(inner_steps=2),
        insecure=True,
        total_rounds=10,
        min_sites=1,
        round_deadline_s=DEADLINE_S,
        heartbeat_interval_s=HEARTBEAT_S,
        heartbeat_timeout_s=TIMEOUT_S,
        checkpoint_dir=str(tmp_path / "ckpt"),
        http=HTTPStatusConfig(enabled=True, port=0),
    )
    losses = iter(EVAL_LOSSES)
    rounds = RoundStateMachine(config, weights, layout, clock=clock, eval_fn=lambda w: next(losses))
    status = CoordinatorStatus(config, rounds)
    records: list[dict] = []
    n = rounds.numel
    for site in ("a", "b", "c"):
        join(rounds, site)
    rounds.count_bytes_down("a", 1000)  # what FetchModel counts per message

    # Round 0: everyone; b's upload takes 2.5 s between its manifest and its last chunk.
    upload(rounds, "a", update(1, n))
    data, spec = encode_update(update(2, n))
    manifest = upload_manifest(rounds.session_id, 0, data, codec=spec, numel=n, site="b")

    def slow_chunks():  # opened, then 2.5 s until the chunks arrive
        clock.advance(2.5)
        yield from translate.upload_chunks(chunk_requests(manifest, data))

    rounds.receive_upload("b", translate.upload_spec(manifest, "b"), slow_chunks())
    upload(rounds, "c", update(3, n))
    records.append(rounds.poll())

    # Round 1: a sends NaN (rejected), b uploads, c heartbeats but never uploads (straggler).
    with pytest.raises(InvalidUpdateError):
        upload(rounds, "a", torch.full((n,), float("nan")))
    upload(rounds, "b", update(4, n))
    for _ in range(3):
        clock.advance(DEADLINE_S / 3 + 0.1)
        for site in ("a", "b", "c"):
            rounds.heartbeat(site, rounds.session_id, round_number=1, phase="training")
    records.append(rounds.poll())

    # Round 2: c goes silent and is dropped; a and b finish the round.
    for _ in range(2):
        clock.advance(TIMEOUT_S / 2 + 1)
        for site in ("a", "b"):
            rounds.heartbeat(site, rounds.session_id, round_number=2, phase="waiting")
    upload(rounds, "a", update(5, n))
    upload(rounds, "b", update(6, n))
    records.append(rounds.poll())
    assert all(r is not None for r in records)
    return rounds, status, clock, [r.to_dict() for r in records]


def test_metrics_after_rounds_rejects_and_faults(scripted) -> None:
    rounds, status, clock, records = scripted
    assert [r["participants"] for r in records] == [["a", "b", "c"], ["b"], ["a", "b"]]
    assert records[1]["excluded"] == ["c"] and records[1]["rejected"] == ["a"]
    assert "c" in records[2]["departed"] or "c" not in records[2]["members"]

    clock.advance(7.0)
    m = samples(status.metrics.render().decode())
    assert value(m, "geoloco_coordinator_round") == 3
    assert value(m, "geoloco_coordinator_rounds_completed_total") == 3
    assert value(m, "geoloco_coordinator_round_duration_seconds_count") == 3
    assert value(m, "geoloco_coordinator_round_duration_seconds_sum") == pytest.approx(
        sum(r["round_time_s"] for r in records)
    )
    # Rounds took 2.5 s (b's slow upload), 30.3 s (to the deadline) and 22 s (c's drop).
    assert [r["round_time_s"] for r in records] == pytest.approx([2.5, 30.3, 22.0])
    buckets = {"1.0": 0, "2.5": 1, "10.0": 1, "30.0": 2, "60.0": 3, "+Inf": 3}
    for le, count in buckets.items():
        assert value(m, "geoloco_coordinator_round_duration_seconds_bucket", le=le) == count, le
    assert value(m, "geoloco_coordinator_sites_connected") == 2  # c was dropped
    assert value(m, "geoloco_coordinator_sites_participating") == 2
    assert value(m, "geoloco_coordinator_sites_excluded") == 0  # of the last round
    for site in ("a", "b", "c"):
        wire = sum(r["bytes_up"].get(site, 0) for r in records)
        assert wire > 0
        assert value(m, "geoloco_coordinator_site_bytes_received_total", site=site) == wire
    assert value(m, "geoloco_coordinator_site_bytes_sent_total", site="a") == 1000
    assert value(m, "geoloco_coordinator_site_upload_duration_seconds_sum", site="b") == pytest.approx(2.5)
    assert value(m, "geoloco_coordinator_site_upload_duration_seconds_count", site="b") == 3
    assert value(m, "geoloco_coordinator_site_updates_aggregated_total", site="a") == 2
    assert value(m, "geoloco_coordinator_site_updates_aggregated_total", site="c") == 1
    assert value(m, "geoloco_coordinator_update_norm") == pytest.approx(records[-1]["update_norm"])
    assert value(m, "geoloco_coordinator_eval_loss") == records[-1]["eval_loss"] == 1.25
    assert value(m, "geoloco_coordinator_checkpoint_age_seconds") == pytest.approx(7.0)
    # Differential privacy is off: no epsilon series at all, until the accountant reports one.
    assert not any(name.startswith("geoloco_coordinator_privacy_epsilon") for name, _ in m)
    status.metrics.set_privacy_epsilon(1.25, 1e-5)
    m = samples(status.metrics.render().decode())
    assert value(m, "geoloco_coordinator_privacy_epsilon_spent", delta="1e-05") == 1.25
    with pytest.raises(ValueError, match="epsilon"):
        status.metrics.set_privacy_epsilon(float("nan"), 1e-5)


def test_fresh_metrics_say_unknown_rather_than_zero(tmp_path: Path) -> None:
    weights, layout = tiny_weights()
    config = CoordinatorConfig(insecure=True, http=HTTPStatusConfig(enabled=True, port=0))
    rounds = RoundStateMachine(config, weights, layout, clock=FakeClock())
    m = samples(CoordinatorStatus(config, rounds).metrics.render().decode())
    assert math.isnan(value(m, "geoloco_coordinator_eval_loss"))
    assert math.isnan(value(m, "geoloco_coordinator_checkpoint_age_seconds"))
    assert value(m, "geoloco_coordinator_rounds_completed_total") == 0


def test_status_board_tracks_states_events_and_rounds(scripted) -> None:
    rounds, status, clock, records = scripted
    snap = status.status()
    sites = {s["name"]: s for s in snap["sites"]}
    assert set(sites) == {"a", "b", "c"}
    assert sites["c"]["state"] == STATE_DOWN and not sites["c"]["member"]
    assert sites["a"]["state"] == sites["b"]["state"] == "waiting"
    assert [sites[s]["rounds_joined"] for s in "abc"] == [2, 3, 1]
    assert sites["a"]["bytes_down"] == 1000
    assert sites["b"]["bytes_up"] == sum(r["bytes_up"]["b"] for r in records)
    assert [r["round"] for r in snap["rounds"]] == [0, 1, 2]
    assert [r["eval_loss"] for r in snap["rounds"]] == [2.0, 1.5, 1.25]
    assert [r["participants"] for r in snap["rounds"]] == [3, 1, 2]
    assert snap["rounds"][1]["excluded"] == ["c"]
    assert all(r["bytes_up"] > 0 for r in snap["rounds"])
    kinds = [e["kind"] for e in reversed(snap["events"])]
    texts = " | ".join(e["text"] for e in snap["events"])
    assert kinds.count("join") == 3
    assert "a's update for round 1 was rejected" in texts
    assert "round 1 closed without c (stragglers)" in texts
    assert "c dropped after" in texts

    # c comes back: a recovery, and its state follows its heartbeats again.
    join(rounds, "c")
    rounds.heartbeat("c", rounds.session_id, round_number=3, phase="training")
    snap = status.status()
    assert {s["name"]: s["state"] for s in snap["sites"]}["c"] == "training"
    assert snap["events"][0]["kind"] == "recovery" and "c is back" in snap["events"][0]["text"]

    # A member that stops heartbeating is shown down before the coordinator drops it...
    clock.advance(3 * HEARTBEAT_S + 0.5)
    for site in ("a", "b"):
        rounds.heartbeat(site, rounds.session_id, round_number=3, phase="training")
    snap = status.status()
    assert {s["name"]: s["state"] for s in snap["sites"]} == {"a": "training", "b": "training", "c": STATE_DOWN}
    assert snap["events"][0]["kind"] == "fault" and "c silent for" in snap["events"][0]["text"]
    # ...and up again at its next heartbeat.
    rounds.heartbeat("c", rounds.session_id, round_number=3, phase="uploading")
    snap = status.status()
    assert {s["name"]: s["state"] for s in snap["sites"]}["c"] == "uploading"
    assert snap["events"][0]["kind"] == "recovery"


def test_silence_before_the_first_heartbeat_is_not_a_fault(scripted) -> None:
    """The site CLI joins once to learn the settings, builds its model, then joins again: that
    gap is not shown as an outage (the coordinator's own drop still would be)."""
    rounds, status, clock, _ = scripted
    join(rounds, "d")
    clock.advance(10 * HEARTBEAT_S)
    for site in ("a", "b"):
        rounds.heartbeat(site, rounds.session_id, round_number=3, phase="training")
    snap = status.status()
    assert {s["name"]: s["state"] for s in snap["sites"]}["d"] == "joined"
    assert not any(e["site"] == "d" and e["kind"] == "fault" for e in snap["events"])


def test_run_summary_names_streaming_privacy_and_the_deadline_policy() -> None:
    from geoloco.algorithms.async_merge import AsyncConfig
    from geoloco.algorithms.deadline import AdaptiveDeadlineConfig
    from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig
    from geoloco.algorithms.streaming import StreamingConfig
    from geoloco.coordinator.http_status import config_summary

    weights, layout = tiny_weights()
    plain = CoordinatorConfig(insecure=True, algorithm=AlgorithmConfig(inner_steps=4))
    summary = config_summary(plain, RoundStateMachine(plain, weights, layout))
    assert summary["streaming"] is None and summary["privacy"] is None
    assert summary["adaptive_deadline"] is None and summary["weighting"] == "uniform"

    config = CoordinatorConfig(
        insecure=True,
        min_sites=3,
        algorithm=AlgorithmConfig(
            inner_steps=4, streaming=StreamingConfig(enabled=True, fragments=2, overlap_steps=1)
        ),
        privacy=PrivacyConfig(secure_aggregation=True, clip_norm=1.0, dp="distributed", epsilon_budget=8.0),
    )
    summary = config_summary(config, RoundStateMachine(config, weights, layout))
    assert summary["streaming"] == {"fragments": 2, "overlap_steps": 1, "mix": 0.0}
    assert summary["privacy"]["secure_aggregation"] and summary["privacy"]["dp"] == "distributed"
    assert summary["privacy"]["epsilon_budget"] == 8.0
    timed = CoordinatorConfig(
        insecure=True,
        algorithm=AlgorithmConfig(round_time_budget_s=2.0, weighting="steps"),
        adaptive_deadline=AdaptiveDeadlineConfig(enabled=True, min_s=2.0, max_s=90.0),
    )
    summary = config_summary(timed, RoundStateMachine(timed, weights, layout))
    assert summary["adaptive_deadline"] == {"min_s": 2.0, "max_s": 90.0}
    assert summary["round_time_budget_s"] == 2.0 and summary["weighting"] == "steps"
    assert summary["asynchronous"] is None

    merge = AsyncConfig(enabled=True, min_quorum=2, adaptive_grace=True)
    merging = CoordinatorConfig(insecure=True, algorithm=AlgorithmConfig(asynchronous=merge))
    summary = config_summary(merging, RoundStateMachine(merging, weights, layout))
    assert summary["asynchronous"] == {
        "min_quorum": 2, "grace": "adaptive", "max_staleness": None, "discount_per_version": 1.0,
        "dynamic_local_updates": False,
    }
