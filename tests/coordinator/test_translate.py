"""The translation between protobuf and the coordinator's domain objects."""

from __future__ import annotations

from _round_helpers import upload_manifest

from geoloco.coordinator import translate
from geoloco.coordinator.domain import RoundInfo, UploadProgress
from geoloco.protos import geoloco_pb2 as pb


def manifest(site: str = "a", data: bytes = b"\x01" * 100, weight: float = 1.0) -> pb.UploadManifest:
    return upload_manifest("s", 3, data, codec="none", numel=25, site=site, sample_weight=weight)


def test_upload_specs_are_equal_exactly_when_the_normalized_manifests_are() -> None:
    spec = translate.upload_spec(manifest(), "a")
    assert spec.wire.site == "a" and spec.round == 3 and spec.shape == (25,)
    # Naming the caller or leaving the site empty is the same manifest once normalized.
    assert translate.upload_spec(manifest(site=""), "a") == spec
    assert translate.upload_spec(manifest(data=b"\x02" * 100), "a") != spec, "another checksum"
    assert translate.upload_spec(manifest(weight=2.0), "a") != spec


def test_digests_and_site_phases() -> None:
    hex_digest = "ab" * 32
    assert translate.digest_hex(translate.checksum(hex_digest)) == hex_digest
    assert translate.digest_hex(pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, digest=b"1234")) is None
    assert translate.site_phase(pb.SITE_PHASE_TRAINING) == "training"
    assert translate.site_phase(pb.SITE_PHASE_UNSPECIFIED) == ""


def test_responses_carry_the_domain_answers() -> None:
    info = translate.round_info(RoundInfo(round=4, round_seed=7, deadline_remaining_s=1.25))
    assert (info.round, info.round_seed, info.deadline_remaining_ms) == (4, 7, 1250)
    folded = translate.upload_response(UploadProgress(complete=True, folded_late=True, missing=((2, 4),)))
    assert folded.complete and folded.folded_late and [(r.start, r.end) for r in folded.missing] == [(2, 4)]
    assert not translate.upload_status_response(UploadProgress(known=False)).known
