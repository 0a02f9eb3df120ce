"""Helpers shared by the coordinator tests: a tiny model, a fake clock, uploads without sockets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from geoloco.algorithms.params import ParamLayout
from geoloco.compression import Encoded, parse_codec
from geoloco.coordinator import translate
from geoloco.coordinator.rounds import RoundStateMachine, WaitResult
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.protocol_version import PROTOCOL_VERSION
from geoloco.protos.wire_chunks import upload_requests
from geoloco.protos.wire_manifests import blob_manifest


@dataclass
class FakeClock:
    """Monotonic seconds that only move when a test says so."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def tiny_weights() -> tuple[torch.Tensor, ParamLayout]:
    model = tiny_model()
    layout = ParamLayout.from_model(model)
    return layout.flatten(model), layout


def encode_update(update: torch.Tensor, codec: str = "none", *, seed: int = 0) -> tuple[bytes, str]:
    """Wire bytes and canonical spec. Non-finite values, which codecs refuse to encode, are
    packed by hand into a lossless ``Encoded`` (what a buggy or hostile site could send)."""
    if codec == "none" and not bool(torch.isfinite(update).all()):
        raw = update.detach().to(torch.float32).contiguous().view(torch.uint8).clone()
        return Encoded("none", tuple(update.shape), torch.float32, raw).to_bytes(), "none"
    encoded = parse_codec(codec).encode(update, seed=seed)
    return encoded.to_bytes(), encoded.spec


def upload_manifest(
    session_id: str,
    round_number: int,
    data: bytes,
    *,
    codec: str,
    numel: int,
    site: str = "",
    sample_weight: float = 1.0,
    chunk_size: int = 64,
    shape: list[int] | None = None,
    dtype: str = "float32",
) -> pb.UploadManifest:
    return pb.UploadManifest(
        site=site,
        session_id=session_id,
        round=round_number,
        sample_weight=sample_weight,
        blob=blob_manifest(
            data, codec=codec, shape=[numel] if shape is None else shape, dtype=dtype,
            chunk_size=chunk_size,
        ),
    )


def chunk_requests(manifest: pb.UploadManifest, data: bytes) -> Iterator[pb.UploadRequest]:
    """The chunk messages of an Upload stream (its manifest message left out)."""
    stream = upload_requests(manifest, data)
    next(stream)
    return stream


def upload(
    rounds: RoundStateMachine,
    site: str,
    update: torch.Tensor,
    *,
    round_number: int | None = None,
    codec: str = "none",
    sample_weight: float = 1.0,
) -> pb.UploadResponse:
    """Everything the servicer does for one complete Upload stream."""
    data, spec = encode_update(update, codec)
    manifest = upload_manifest(
        rounds.session_id,
        rounds.round if round_number is None else round_number,
        data,
        codec=spec,
        numel=rounds.numel,
        site=site,
        sample_weight=sample_weight,
    )
    return send(rounds, site, manifest, data)


def send(rounds: RoundStateMachine, site: str, manifest: pb.UploadManifest, data: bytes) -> pb.UploadResponse:
    """One complete Upload stream of ``data`` under ``manifest``, as the servicer runs it."""
    progress = rounds.receive_upload(
        site, translate.upload_spec(manifest, site), translate.upload_chunks(chunk_requests(manifest, data))
    )
    return translate.upload_response(progress)


def join(
    rounds: RoundStateMachine, site: str, *, weights_digest: pb.Checksum | None = None, **kwargs: object
) -> pb.JoinResponse:
    """Join as the servicer does, answered with the wire's ``JoinResponse``."""
    result = rounds.join(
        site, protocol_version=PROTOCOL_VERSION, weights_digest=translate.digest_hex(weights_digest),
        **kwargs,  # type: ignore[arg-type]
    )
    return translate.join_response(
        result,
        config=translate.run_config(
            rounds.config, inner_steps=rounds.strategy.inner_steps, uplink_codec=rounds.uplink_codec,
            downlink_codec=rounds.downlink_codec,
        ),
        layout=translate.model_layout(rounds.layout),
    )


def heartbeat(rounds: RoundStateMachine, site: str, session_id: str, **kwargs: object) -> pb.HeartbeatResponse:
    return translate.heartbeat_response(rounds.heartbeat(site, session_id, **kwargs))  # type: ignore[arg-type]


@dataclass
class WireWait:
    """``WaitResult`` as the wire carries it."""

    header: pb.BroadcastHeader | None
    progress: pb.RoundProgress | None


def wait_broadcast(
    rounds: RoundStateMachine, site: str, session_id: str, round_number: int, **kwargs: object
) -> WireWait:
    result: WaitResult = rounds.wait_broadcast(site, session_id, round_number, **kwargs)  # type: ignore[arg-type]
    return WireWait(
        header=None if result.header is None else translate.broadcast_header(result.header),
        progress=None if result.progress is None else translate.round_progress(result.progress),
    )


def upload_status(
    rounds: RoundStateMachine, site: str, session_id: str, round_number: int, fragment: int
) -> pb.UploadStatusResponse:
    return translate.upload_status_response(rounds.upload_status(site, session_id, round_number, fragment))
