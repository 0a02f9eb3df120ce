"""What a site behind a relay sees of the coordinator: its errors unchanged (code, message and
ErrorReason), secure-aggregation stage calls included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _relay_helpers import Site, coordinator, make_certs, relay

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.transport_errors import error_reason
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


def test_a_secure_stage_call_reaches_the_coordinator_for_the_site(site: Site) -> None:
    # The coordinator's own refusal of a malformed stage call comes back through the relay
    # unchanged: the relay passed the call upward instead of refusing secure stages itself.
    site.join()
    with pytest.raises(grpc.RpcError) as info:
        site.stub.SecureStage(pb.SecureStageRequest(session_id=site.session, stage="advertise_keys"), timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(info.value) == pb.ERROR_REASON_BAD_STAGE_MESSAGE
    assert (info.value.details() or "").startswith("coordinator: SecureStage 'advertise_keys' carries no message")
