"""A site's absurd update never stops the run, over real gRPC with mutual TLS.

Values near the float32 maximum pass a finiteness check, and a huge ``sample_weight`` is a
finite number: either used to overflow the aggregate (and the checkpoint), or to raise an error
the site saw as UNKNOWN while the round waited for it forever. Here a raw client sends each to a
coordinator on a loopback port; the update must be refused with INVALID_ARGUMENT and a reason,
or the round aborted with the model unchanged, the reason must be in metrics.jsonl and on the
status page, no checkpoint may hold non-finite or overflowed weights, and the next round must
still be aggregated by the same, still running coordinator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from _round_helpers import chunk_requests, encode_update, tiny_weights, upload_manifest

from geoloco.algorithms.strategy import AlgorithmConfig
from geoloco.coordinator.checkpoint import load_latest_checkpoint
from geoloco.coordinator.config import CoordinatorConfig
from geoloco.coordinator.http_config import HTTPStatusConfig
from geoloco.coordinator.metrics import read_metrics
from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_tls import TLSFiles
from geoloco.scenarios.certs import init_ca, issue_coordinator, issue_site

SITES = ["a", "b"]
F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    issue_coordinator(directory)
    for name in SITES:
        issue_site(directory, name)
    return directory


class Client:
    """A raw gRPC client holding one site's certificate."""

    def __init__(self, certs: Path, port: int, name: str) -> None:
        self.channel = client_channel(f"localhost:{port}", tls=TLSFiles.from_dir(certs, name))
        self.stub = coordinator_stub(self.channel)
        self.session = ""

    def join(self) -> None:
        response = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
        self.session = response.session_id

    def upload(
        self, round_number: int, update: torch.Tensor, *, inner_steps: int = 0, **manifest: Any
    ) -> pb.UploadResponse:
        data, spec = encode_update(update)
        message = upload_manifest(self.session, round_number, data, codec=spec, numel=update.numel(), **manifest)
        message.inner_steps = inner_steps

        def stream() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(manifest=message)
            yield from chunk_requests(message, data)

        return self.stub.Upload(stream(), timeout=30)

    def close(self) -> None:
        self.channel.close()


class Run:
    """A coordinator with two joined raw clients, its metrics file and checkpoint folder."""

    def __init__(self, certs: Path, tmp_path: Path, **overrides: Any) -> None:
        weights, layout = tiny_weights()
        settings: dict[str, Any] = {
            "algorithm": AlgorithmConfig(inner_steps=1),
            "certs_dir": str(certs),
            "allowed_sites": SITES,
            "min_sites": 1,
            "total_rounds": 4,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "metrics_path": str(tmp_path / "metrics.jsonl"),
            "http": HTTPStatusConfig(enabled=True, port=0),
        }
        settings.update(overrides)
        self.config = CoordinatorConfig(**settings)
        self.server = CoordinatorServer(self.config, weights, layout)
        self.server.start()
        self.clients = {name: Client(certs, self.server.port, name) for name in SITES}
        for client in self.clients.values():
            client.join()

    @property
    def numel(self) -> int:
        return self.server.rounds.numel

    def wait_round(self, round_number: int, timeout_s: float = 60.0) -> None:
        """Wait until ``round_number`` is open and the previous round's record is in
        metrics.jsonl; fails if the round driver died meanwhile."""
        deadline = time.monotonic() + timeout_s

        def done() -> bool:
            if self.server.rounds.round < round_number:
                return False
            records = self.metrics()
            return bool(records) and records[-1]["round"] >= round_number - 1

        while not done():
            self.alive()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"round {round_number} never opened: {self.server.rounds.status()}"
            self.server.rounds.wait_for_change(min(remaining, 0.1))
        self.alive()

    def alive(self) -> None:
        driver = self.server._driver
        assert self.server._driver_error is None, f"the round driver failed: {self.server._driver_error!r}"
        assert driver is not None and driver.is_alive(), "the round driver thread exited"

    def metrics(self) -> list[dict[str, Any]]:
        path = Path(self.config.metrics_path or "")
        return read_metrics(path) if path.exists() else []

    def status(self) -> dict[str, Any]:
        assert self.server.http_status is not None
        return self.server.http_status.status()

    def checkpoint_weights(self) -> torch.Tensor:
        checkpoint = load_latest_checkpoint(self.config.checkpoint_dir or "")
        assert checkpoint is not None
        return checkpoint.tensors["weights"]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.server.stop(grace=0)


@pytest.fixture
def run_factory(certs: Path, tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def make(**overrides: Any) -> Run:
        run = Run(certs, tmp_path, **overrides)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def _good(seed: int, numel: int) -> torch.Tensor:
    return 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _expect_invalid(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{error.code().name}: {error.details()}"
    return error.details()


def _sane(weights: torch.Tensor, bound: float) -> None:
    assert bool(torch.isfinite(weights).all()), "non-finite weights"
    assert float(weights.abs().max()) <= bound, f"weights up to {float(weights.abs().max()):.3g}"


def test_float32_max_update_is_rejected_and_the_run_goes_on(run_factory: Callable[..., Run]) -> None:
    run = run_factory()
    a, b = run.clients["a"], run.clients["b"]
    huge = torch.full((run.numel,), F32_MAX)
    details = _expect_invalid(lambda: a.upload(0, huge))
    assert "norm" in details and "update_guard" in details, details
    assert b.upload(0, _good(2, run.numel)).complete
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["round"] == 0 and record["participants"] == ["b"]
    assert record["rejected"] == ["a"] and "norm" in record["rejected_reasons"]["a"]
    assert record["aborted"] is None
    assert any(e["site"] == "a" and "norm" in e["text"] for e in run.status()["events"])
    _sane(run.checkpoint_weights(), 10.0)
    # The next round runs normally with both sites.
    assert a.upload(1, _good(3, run.numel)).complete
    assert b.upload(1, _good(4, run.numel)).complete
    run.wait_round(2)
    assert sorted(run.metrics()[-1]["participants"]) == ["a", "b"]
    _sane(run.checkpoint_weights(), 10.0)


@pytest.mark.parametrize("deadline", [None, 4.0], ids=["no-deadline", "deadline-4s"])
def test_a_rejection_that_leaves_the_quorum_unreachable_aborts_the_round_instead_of_stalling(
    run_factory: Callable[..., Run], deadline: float | None
) -> None:
    """min_sites = every site and one update refused: the refused site cannot resend this round,
    so waiting cannot reach the quorum; the round aborts (model unchanged) and the next runs."""
    run = run_factory(min_sites=len(SITES), round_deadline_s=deadline)
    theta = run.server.rounds.weights.clone()
    a, b = run.clients["a"], run.clients["b"]
    assert b.upload(0, _good(2, run.numel)).complete
    _expect_invalid(lambda: a.upload(0, torch.full((run.numel,), float("nan"))))
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["rejected"] == ["a"] and record["participants"] == []
    assert record["aborted"] and "quorum of 2 updates can no longer be met" in record["aborted"], record
    assert torch.equal(run.server.rounds.weights, theta)
    assert a.upload(1, _good(3, run.numel)).complete
    assert b.upload(1, _good(4, run.numel)).complete
    run.wait_round(2)
    assert sorted(run.metrics()[-1]["participants"]) == ["a", "b"]


def test_float32_max_updates_that_overflow_the_sum_abort_the_round_with_the_model_unchanged(
    run_factory: Callable[..., Run],
) -> None:
    # A norm bound too large to stop them: each update passes, their sum overflows float32.
    from geoloco.algorithms.update_guard import UpdateGuardConfig

    run = run_factory(update_guard=UpdateGuardConfig(norm_floor=1e300))
    theta = run.server.rounds.weights.clone()
    huge = torch.full((run.numel,), F32_MAX)
    for name in SITES:
        assert run.clients[name].upload(0, huge).complete
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["round"] == 0 and record["aborted"], record
    assert "not finite" in record["aborted"]
    assert record["participants"] == []
    assert torch.equal(run.server.rounds.weights, theta), "an aborted round changed the model"
    assert torch.equal(run.checkpoint_weights(), theta)
    assert any("round 0 aborted" in e["text"] for e in run.status()["events"])
    assert run.status()["rounds"][-1]["aborted"] is True
    for name, seed in (("a", 5), ("b", 6)):
        assert run.clients[name].upload(1, _good(seed, run.numel)).complete
    run.wait_round(2)
    assert run.metrics()[-1]["aborted"] is None
    _sane(run.checkpoint_weights(), 10.0)


@pytest.mark.parametrize("weight", [1e38, 1e300])
def test_huge_sample_weight_is_invalid_argument_and_the_round_still_closes(
    run_factory: Callable[..., Run], weight: float
) -> None:
    run = run_factory(algorithm=AlgorithmConfig(inner_steps=1, weighting="samples"))
    theta = run.server.rounds.weights.clone()
    a, b = run.clients["a"], run.clients["b"]
    update = 4.0 + torch.rand(run.numel, generator=torch.Generator().manual_seed(1))
    details = _expect_invalid(lambda: a.upload(0, update, sample_weight=weight))
    assert "sample_weight" in details and "max_sample_weight" in details, details
    assert torch.equal(run.server.rounds.weights, theta)
    # A refused manifest is a rejection like any other: the site is not waited for this round
    # (its next upload for it is refused too) and the record lists it with the reason.
    with pytest.raises(grpc.RpcError) as again:
        a.upload(0, _good(1, run.numel), sample_weight=50.0)
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was rejected" in (again.value.details() or "")
    assert b.upload(0, _good(2, run.numel), sample_weight=100.0).complete
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["participants"] == ["b"] and record["aborted"] is None
    assert record["rejected"] == ["a"] and "max_sample_weight" in record["rejected_reasons"]["a"]
    # The next round takes the site's sane update again.
    assert a.upload(1, _good(1, run.numel), sample_weight=50.0).complete
    _sane(run.checkpoint_weights(), 10.0)


def test_new_weights_beyond_max_abs_weight_abort_the_round(run_factory: Callable[..., Run]) -> None:
    from geoloco.algorithms.update_guard import UpdateGuardConfig

    run = run_factory(update_guard=UpdateGuardConfig(max_abs_weight=5.0))
    theta = run.server.rounds.weights.clone()
    for name in SITES:
        assert run.clients[name].upload(0, torch.full((run.numel,), 50.0)).complete
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["aborted"] and "max_abs_weight" in record["aborted"], record
    assert torch.equal(run.server.rounds.weights, theta)
    assert torch.equal(run.checkpoint_weights(), theta)
    for name, seed in (("a", 5), ("b", 6)):
        assert run.clients[name].upload(1, _good(seed, run.numel)).complete
    run.wait_round(2)
    assert run.metrics()[-1]["aborted"] is None


def test_plain_intake_adds_uploads_without_a_dense_decoded_copy(
    run_factory: Callable[..., Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running sum decodes each upload piece by piece into its buffer, and the guard's norm
    and finiteness checks read the encoded update the same way: no model-sized decoded tensor
    besides the sum (issue #13), while a NaN update is still refused and the mean is exact."""
    from geoloco.compression.codec import PipelineCodec

    run = run_factory()
    dense_decodes: list[int] = []
    original = PipelineCodec._decode

    def counting(self: PipelineCodec, encoded: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread().name.startswith("geoloco-verify"):  # the intake's verifier
            dense_decodes.append(encoded.numel)
        return original(self, encoded, **kwargs)

    monkeypatch.setattr(PipelineCodec, "_decode", counting)
    a, b = run.clients["a"], run.clients["b"]
    before = run.server.rounds.weights.clone()
    broken = _good(1, run.numel)
    broken[3] = float("nan")
    assert "NaN or Inf" in _expect_invalid(lambda: a.upload(0, broken))
    update = _good(2, run.numel)
    assert b.upload(0, update).complete
    run.wait_round(1)
    assert dense_decodes == []
    record = run.metrics()[-1]
    assert record["participants"] == ["b"] and record["rejected"] == ["a"]
    assert record["update_norm"] == pytest.approx(float(torch.linalg.vector_norm(update)), rel=1e-5)
    assert not torch.equal(run.server.rounds.weights, before)


def _scaled(seed: int, numel: int, norm: float) -> torch.Tensor:
    """An update of L2 norm ``norm`` (exact in float32 up to rounding)."""
    update = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return update * (norm / float(torch.linalg.vector_norm(update)))


@pytest.mark.parametrize("clip", [None, 2.0], ids=["mean", "clip_to_median_norm"])
def test_a_weight_far_above_the_other_sites_is_refused_even_as_the_rounds_first_arrival(
    run_factory: Callable[..., Run], clip: float | None
) -> None:
    """weighting = "samples": 1e12 samples against honest hundreds is within max_sample_weight
    and would take 99.99999998 % of the mean (clipping norms does nothing to weights). After one
    round of history it is refused against the other site's weights, even before that site's
    upload of the round arrives, and the round is the honest site's alone."""
    run = run_factory(
        algorithm=AlgorithmConfig(inner_steps=1, weighting="samples", clip_to_median_norm=clip)
    )
    a, b = run.clients["a"], run.clients["b"]
    assert a.upload(0, _good(1, run.numel), sample_weight=100.0).complete
    assert b.upload(0, _good(2, run.numel), sample_weight=300.0).complete
    run.wait_round(1)
    assert sorted(run.metrics()[-1]["participants"]) == ["a", "b"]
    details = _expect_invalid(lambda: b.upload(1, _good(3, run.numel), sample_weight=1e12))
    assert "weight_factor" in details and "other sites" in details, details
    assert a.upload(1, _good(4, run.numel), sample_weight=100.0).complete
    run.wait_round(2)
    record = run.metrics()[-1]
    assert record["participants"] == ["a"] and record["rejected"] == ["b"], record
    assert "weight_factor" in record["rejected_reasons"]["b"]
    # An honest weight (its usual 300, within weight_factor x a's 100) is taken again.
    assert b.upload(2, _good(5, run.numel), sample_weight=300.0).complete
    assert a.upload(2, _good(6, run.numel), sample_weight=100.0).complete
    run.wait_round(3)
    assert sorted(run.metrics()[-1]["participants"]) == ["a", "b"]


def test_inner_steps_beyond_the_rounds_h_are_refused_under_steps_weighting(run_factory: Callable[..., Run]) -> None:
    """weighting = "steps" with H = 1: a site reporting 1e12 inner steps would weigh 1e12 (within
    max_sample_weight); no round of this run runs more than H steps, so it is refused from round 0."""
    run = run_factory(algorithm=AlgorithmConfig(inner_steps=1, weighting="steps"))
    a, b = run.clients["a"], run.clients["b"]
    details = _expect_invalid(lambda: a.upload(0, _good(1, run.numel), inner_steps=10**12))
    assert "inner_steps 1000000000000" in details and "at most 1" in details, details
    assert b.upload(0, _good(2, run.numel), inner_steps=1).complete
    run.wait_round(1)
    record = run.metrics()[-1]
    assert record["participants"] == ["b"] and record["rejected"] == ["a"], record
    assert record["inner_steps"] == {"b": 1}
    assert a.upload(1, _good(3, run.numel), inner_steps=1).complete


def test_with_two_sites_an_update_growing_every_round_is_refused_at_norm_factor_times_the_other(
    run_factory: Callable[..., Run],
) -> None:
    """The pooled median of two sites follows the one that grows: at 1.4x a round it was never
    refused (2,296x the honest norm after 24 rounds). Held to norm_factor x the other site's
    norms it is refused from round 14 (0.1 x 1.4^14 = 11.1 > 100 x 0.1) on."""
    from geoloco.algorithms.update_guard import UpdateGuardConfig

    run = run_factory(update_guard=UpdateGuardConfig(norm_floor=1.0), total_rounds=24)
    a, b = run.clients["a"], run.clients["b"]
    refused = []
    for t in range(24):
        assert a.upload(t, _scaled(2 * t, run.numel, 0.1)).complete
        try:
            b.upload(t, _scaled(2 * t + 1, run.numel, 0.1 * 1.4**t))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            refused.append(t)
        run.wait_round(t + 1)
    assert refused == list(range(14, 24)), refused
    records = run.metrics()
    assert "set by the other sites" in records[14]["rejected_reasons"]["b"]
    assert all(r["aborted"] is None for r in records)
