"""What a site behind a relay sees of the coordinator: its errors unchanged (code, message and
ErrorReason), and a clear refusal of what relays do not carry (secure aggregation)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _relay_helpers import Site, coordinator, make_certs, relay

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.transport import error_reason
from geoloco.relay import RelayServer


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def site(certs: Path) -> Iterator[Site]:
    server = coordinator(certs)
    eu: RelayServer = relay(certs, "eu", server.port)
    s = Site("site-a", certs, f"localhost:{eu.port}")
    yield s
    s.close()
    eu.stop(grace=0)
    server.stop(grace=0)


def test_the_coordinators_refusal_reaches_the_site_unchanged(site: Site) -> None:
    with pytest.raises(grpc.RpcError) as info:
        site.stub.Join(pb.JoinRequest(protocol_version=999), timeout=20)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason(info.value) == pb.ERROR_REASON_PROTOCOL_VERSION
    assert "protocol version 999" in (info.value.details() or "")


def test_a_stale_session_is_answered_like_the_coordinator_does(site: Site) -> None:
    site.join()
    with pytest.raises(grpc.RpcError) as info:
        site.stub.UploadStatus(pb.UploadStatusRequest(session_id="old", round=0), timeout=20)
    assert error_reason(info.value) == pb.ERROR_REASON_STALE_SESSION


def test_secure_aggregation_through_a_relay_is_refused_with_what_works(site: Site) -> None:
    site.join()
    with pytest.raises(grpc.RpcError) as info:
        site.stub.SecureStage(pb.SecureStageRequest(session_id=site.session, stage="advertise_keys"), timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "connect this site to the coordinator directly" in (info.value.details() or "")
