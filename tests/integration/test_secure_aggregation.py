"""Secure aggregation and differential privacy in the real system: gRPC, mutual TLS, real sites.

* ``test_four_sites_secure_dp_one_site_killed_after_uploading``: a coordinator (in this process,
  so the test sees its events) and four sites: three ``SiteAgent`` threads and one real
  ``geoloco site`` process, all on loopback with mutual TLS, secure aggregation and distributed
  (Skellam) DP on. The site process is SIGKILLed the moment its round-1 masked upload completes
  (inside the coordinator's "update aggregated" event, before the upload's response leaves), so
  it never answers the unmasking. Round 1 still completes with its update in the sum (3 of 4
  answer, the threshold is 3); the remaining rounds run with three sites; every round reports
  the accountant's epsilon, which grows.
* ``test_coordinator_never_holds_an_individual_update``: while a secure round runs, every array,
  tensor and byte string reachable from the coordinator's state is compared with each site's
  plain encoded update: none matches (only masked sums exist), and the round's mean is right.
* ``test_secure_diloco_matches_plain_diloco_over_grpc``: the same three-site DiLoCo run with and
  without secure aggregation (no DP): final eval losses agree within the fixed-point error.
"""

from __future__ import annotations

import gc
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cluster import AgentThread, Run, make_certs
from _processes import SITE_JOINED, Processes

from geoloco.algorithms.config import ConfigError
from geoloco.algorithms.privacy.private_aggregation import PrivacyAccountant, PrivacyConfig, PrivateUpdateEncoder
from geoloco.algorithms.record import RoundRecord
from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator import events as ev
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_status import HTTPStatusConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.scenarios.workloads import build_workload

SITES = ["0", "1", "2", "3"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), SITES)


def _run(rounds: int, num_sites: int, codec: str = "none") -> Run:
    return Run(
        workload=build_workload("mlp"), num_sites=num_sites, rounds=rounds, seed=5,
        algorithm=AlgorithmConfig(inner_steps=3, uplink_codec=codec, downlink_codec="none"),
    )


def test_four_sites_secure_dp_one_site_killed_after_uploading(certs: Path, tmp_path: Path) -> None:
    run = _run(rounds=3, num_sites=4)
    privacy = PrivacyConfig(
        secure_aggregation=True, clip_norm=1.0, dp="distributed", noise_multiplier=1.0, chunk_size=4096
    )
    metrics_path = tmp_path / "metrics.jsonl"
    killed = threading.Event()
    (tmp_path / "logs").mkdir()
    with Processes(tmp_path / "logs") as processes:
        holder: dict[str, Any] = {}

        def kill_after_upload(event: ev.RoundEvent) -> None:
            if event.kind == ev.UPDATE_AGGREGATED and event.site == "3" and event.round == 1:
                holder["process"].kill(signal.SIGKILL)
                killed.set()

        server = run.start_coordinator(
            certs, privacy=privacy, min_sites=3, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0,
            metrics_path=str(metrics_path), workload={"name": "mlp"}, allowed_sites=SITES,
            http=HTTPStatusConfig(enabled=True, port=0),
        )
        server.rounds.events.add_listener(kill_after_upload)
        try:
            holder["process"] = site = processes.start(
                "site-3", "site", "--coordinator", f"localhost:{server.port}", "--name", "3",
                "--certs", str(certs), "--device", "cpu", "--backoff-max", "0.5",
            )
            site.wait_line(SITE_JOINED, what="site 3 joined")
            threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(3)]
            for thread in threads:
                thread.start()
            summaries = [thread.finish(timeout_s=150) for thread in threads]
            assert killed.is_set()
            assert server.http_status is not None
            status = server.http_status.status()
            prometheus = server.http_status.metrics.render().decode()
        finally:
            server.stop()
    records = read_metrics(metrics_path)
    assert [r["round"] for r in records] == [0, 1, 2]
    # Round 0 may start before a slow in-process site joins (min_sites = 3 on a loaded machine).
    assert "3" in records[0]["participants"] and len(records[0]["participants"]) >= 3
    assert sorted(records[1]["participants"]) == SITES  # its upload is in the sum
    assert records[1]["privacy"]["dropped_after_upload"] == ["3"]
    assert sorted(records[2]["participants"]) == ["0", "1", "2"]
    epsilons = [r["epsilon"] for r in records]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2]
    assert all(r["privacy_delta"] == privacy.delta for r in records)
    assert status["rounds"][-1]["epsilon"] == pytest.approx(epsilons[-1])
    assert f'privacy_epsilon_spent{{delta="1e-05"}} {epsilons[-1]}' in prometheus
    assert all(s.run_finished and s.weights_digest == records[-1]["weights_digest"] for s in summaries)


def _reachable_arrays(root: object) -> list[np.ndarray]:
    """Every ndarray, tensor (as ndarray) and bytes-like object reachable from ``root``."""
    seen: set[int] = set()
    out: list[np.ndarray] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None), threading.Thread)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            out.append(obj.reshape(-1))
        elif isinstance(obj, torch.Tensor):
            out.append(obj.detach().cpu().reshape(-1).numpy())
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            if len(obj) % 4 == 0 and len(obj) >= 64:
                out.append(np.frombuffer(bytes(obj), dtype="<u4"))
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            ours = type(obj).__module__.startswith(("geoloco", "_thread", "threading"))
            if ours or hasattr(obj, "__dataclass_fields__"):
                stack.extend(getattr(obj, "__dict__", {}).values())
                for name in getattr(type(obj), "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return out


def _holds(array: np.ndarray, needle: np.ndarray) -> bool:
    """Whether ``needle`` sits contiguously in ``array`` at any offset: integers compared modulo
    2**32 (the masking ring), floats as float32 values or as their bit patterns in raw bytes."""
    n = needle.size
    if array.size < n:
        return False
    if needle.dtype.kind == "f":
        if array.dtype.kind == "f":
            hay, pin = array.astype(np.float32), needle.astype(np.float32)
        elif array.dtype == np.uint32:
            hay, pin = array, needle.astype(np.float32).view(np.uint32)
        else:
            return False
    elif array.dtype.kind in "iu":
        hay, pin = array.astype(np.int64) % (1 << 32), needle.astype(np.int64) % (1 << 32)
    else:
        return False
    starts = np.flatnonzero(hay[: hay.size - n + 1] == pin[0])
    return any(np.array_equal(hay[i : i + n], pin) for i in starts[:10_000])


def test_coordinator_never_holds_an_individual_update(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(rounds=1, num_sites=3, codec="randk:0.5")
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=100.0, chunk_size=1024)
    plain: dict[int, np.ndarray] = {}
    floats: dict[int, np.ndarray] = {}
    encode = PrivateUpdateEncoder.encode

    def recording_encode(self: PrivateUpdateEncoder, update: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        floats[id(self)] = update.detach().cpu().numpy().astype(np.float32).copy()
        chunks = [c.copy() for c in encode(self, update, *args, **kwargs)]
        plain[id(self)] = np.concatenate(chunks)
        return iter(chunks)

    monkeypatch.setattr(PrivateUpdateEncoder, "encode", recording_encode)
    server = run.start_coordinator(certs, privacy=privacy, min_sites=3, metrics_path=str(tmp_path / "m.jsonl"))
    snapshots: list[list[np.ndarray]] = []

    def inspect(event: ev.RoundEvent) -> None:
        if event.kind == ev.UPDATE_AGGREGATED:  # under the coordinator's lock: a consistent view
            snapshots.append([a.copy() for a in _reachable_arrays(server.rounds)])

    server.rounds.events.add_listener(inspect)
    try:
        threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.finish(timeout_s=120)
        gc.collect()
        snapshots.append(_reachable_arrays(server.rounds))
    finally:
        server.stop()
    assert len(plain) == 3 and len(floats) == 3 and len(snapshots) == 4
    numel = next(iter(plain.values())).size
    # The walk reaches the protocol's running sum (so it would see a stored update too).
    assert any(a.dtype == np.uint32 and a.size == numel for a in snapshots[0])
    # ...and the check finds an update where one is: a copy at an odd offset, as ints or floats.
    ints0, floats0 = next(iter(plain.values())), next(iter(floats.values()))
    assert _holds(np.concatenate([np.ones(3, np.int64), ints0.astype(np.int64)]), ints0)
    assert _holds(np.concatenate([np.ones(5), floats0.astype(np.float64)]), floats0)
    assert _holds(np.frombuffer(b"\0" * 12 + floats0.tobytes(), dtype="<u4"), floats0)
    for held in snapshots:
        for array in held:
            for site_ints, site_floats in zip(plain.values(), floats.values()):
                assert not _holds(array, site_ints)
                assert not _holds(array, site_floats)
    record = read_metrics(tmp_path / "m.jsonl")[0]
    assert sorted(record["participants"]) == ["0", "1", "2"]
    assert record["privacy"]["secure_aggregation"] is True


def _final(run: Run, certs: Path, **overrides: Any) -> tuple[float, torch.Tensor, list[RoundRecord]]:
    events: list[RoundRecord] = []
    server = run.start_coordinator(certs, min_sites=3, on_round_end=events.append, **overrides)
    try:
        threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(run.num_sites)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.finish(timeout_s=120)
        weights = server.rounds.weights
    finally:
        server.stop()
    model = run.workload.build_model(run.seed)
    server.rounds.layout.load_(model, weights)
    return float(run.workload.eval_loss(model)), weights, events


def test_secure_diloco_matches_plain_diloco_over_grpc(certs: Path) -> None:
    run = _run(rounds=3, num_sites=3)
    # clip_norm far above the update norms: nothing is clipped, only rounded. The fixed-point
    # scale gives each mean coordinate an error below 1/scale per round (stochastic rounding of
    # each site's value, averaged); with clip 10, 3 sites and 32 bits the scale is about 2^20,
    # so every round's mean update is within ~1e-6 per coordinate of the plain mean.
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=10.0, chunk_size=8192)
    plain, plain_weights, plain_records = _final(run, certs)
    secure, secure_weights, secure_records = _final(run, certs, privacy=privacy)
    assert plain_records[0].privacy is None
    assert secure_records[0].privacy is not None and secure_records[0].privacy["secure_aggregation"]
    initial = float(run.workload.eval_loss(run.workload.build_model(run.seed)))
    assert plain < initial
    # Rounding made the weights differ, but only by the fixed-point error (< 1/scale ~ 1e-6 per
    # coordinate of each round's mean) carried through three outer steps: measured 3e-8 at most,
    # and eval losses equal to float32 precision.
    difference = float((secure_weights - plain_weights).abs().max())
    assert 0 < difference < 1e-5, difference
    assert abs(secure - plain) <= 1e-5 * abs(plain), (secure, plain)
    # The protocol is on the links too: each site's stage calls (keys, shares, survivor list,
    # signature, unmask answer) come on top of its masked upload (4 bytes a value at 32 bits, as
    # the plain fp32 upload) and of the broadcast (the same codec both ways).
    for plain_round, secure_round in zip(plain_records, secure_records, strict=True):
        for site, up in plain_round.bytes_up.items():
            assert secure_round.bytes_up[site] > up + 500, (plain_round.bytes_up, secure_round.bytes_up)
            assert secure_round.bytes_down[site] > plain_round.bytes_down[site] + 500


def test_central_dp_without_secure_aggregation_stops_at_the_epsilon_budget(certs: Path, tmp_path: Path) -> None:
    run = _run(rounds=6, num_sites=3)
    accountant = PrivacyAccountant(1e-5)
    accountant.step(1.0)
    two_rounds = accountant.step(1.0)
    privacy = PrivacyConfig(dp="central", clip_norm=1.0, noise_multiplier=1.0, epsilon_budget=two_rounds * 1.001)
    metrics_path = tmp_path / "metrics.jsonl"
    server = run.start_coordinator(certs, privacy=privacy, metrics_path=str(metrics_path))
    try:
        threads = [AgentThread(run.agent(certs, server.port, i)) for i in range(3)]
        for thread in threads:
            thread.start()
        summaries = [thread.finish(timeout_s=120) for thread in threads]
    finally:
        server.stop()
    records = read_metrics(metrics_path)
    # A third round would exceed the budget: the run ends after two, and every site knows it.
    assert [r["round"] for r in records] == [0, 1]
    assert records[-1]["run_finished"] and records[-1]["privacy"]["budget_exhausted"]
    assert records[-1]["epsilon"] == pytest.approx(two_rounds)
    assert records[0]["privacy"]["secure_aggregation"] is False
    assert all(s.run_finished and s.rounds_trained == 2 for s in summaries)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"min_sites": 2}, r"at least 3 sites \(with 2 the sum reveals"),
        ({"min_sites": 3, "algorithm": {"uplink_codec": "topk:0.01"}}, "use 'randk:F'"),
        ({"min_sites": 3, "algorithm": {"weighting": "samples"}}, "uniform"),
        ({"min_sites": 3, "allowed_sites": ["a", "b"]}, "min_sites"),
        ({"min_sites": 3, "privacy": {"chunk_size": 1 << 21}}, "wire chunk limit"),
    ],
)
def test_secure_coordinator_config_errors(settings: dict[str, Any], match: str) -> None:
    privacy = {"secure_aggregation": True, "clip_norm": 1.0, **settings.pop("privacy", {})}
    data = {"insecure": True, "privacy": privacy, **settings}
    with pytest.raises(ConfigError, match=match):
        CoordinatorConfig.from_dict(data)
