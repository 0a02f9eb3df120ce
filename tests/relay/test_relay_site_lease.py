"""Behind a relay, a replaced site process is refused by the relay itself.

A site name is a lease held by one process (``JoinRequest.instance_id``; the coordinator's side
is ``tests/coordinator/test_site_lease_grpc.py``). The relay answers uploads, UploadStatus and
AwaitBroadcast without asking the coordinator, so it follows the Joins it passes on: once a newer
process of a site joined through it, the older one's requests there are refused with
``ERROR_REASON_SITE_REPLACED`` at once (not only its next heartbeat at the coordinator), and its
update never takes the site's place in the relay's partial sum.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from _relay_helpers import Site, coordinator, make_certs, relay

from geoloco.coordinator.server import CoordinatorServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.transport_errors import error_reason
from geoloco.relay import RelayServer

OLD, NEW = "0ld0ld0ld0ld", "n3wn3wn3wn3w"
"""Instance ids of the two processes of site "site-a"."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def servers(certs: Path) -> Iterator[tuple[CoordinatorServer, RelayServer]]:
    server = coordinator(certs)  # round 0 waits for all four sites: it stays open
    eu = relay(certs, "eu", server.port, progress_interval_s=0.2)
    yield server, eu
    eu.stop(grace=0)
    server.stop(grace=0)


def _replaced(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    assert error_reason(error) == pb.ERROR_REASON_SITE_REPLACED, error.trailing_metadata()
    return error.details() or ""


def _upload_status(site: Site) -> pb.UploadStatusResponse:
    request = pb.UploadStatusRequest(session_id=site.session, round=0, instance_id=site.instance)
    response: pb.UploadStatusResponse = site.stub.UploadStatus(request, timeout=20)
    return response


def test_the_relay_refuses_what_a_replaced_process_asks_of_it(
    servers: tuple[CoordinatorServer, RelayServer], certs: Path
) -> None:
    server, eu = servers
    target = f"localhost:{eu.port}"
    old, new = Site("site-a", certs, target, instance=OLD), Site("site-a", certs, target, instance=NEW)
    try:
        old.join()
        assert not _upload_status(old).known
        # The older process waits for round 0's broadcast at the relay (progress messages come).
        waited: list[grpc.RpcError | None] = []
        waiting = threading.Event()

        def wait() -> None:
            request = pb.AwaitBroadcastRequest(session_id=old.session, round=0, instance_id=OLD)
            try:
                for response in old.stub.AwaitBroadcast(request, timeout=30):
                    if response.WhichOneof("kind") == "progress":
                        waiting.set()
                waited.append(None)
            except grpc.RpcError as error:
                waited.append(error)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        assert waiting.wait(30)

        new.join()
        update = torch.zeros(server.rounds.numel)
        details = _replaced(functools.partial(old.upload, update, "none"))
        assert "relay 'eu'" in details and NEW[:8] in details and OLD[:8] in details, details
        _replaced(functools.partial(_upload_status, old))
        waiter.join(30)
        assert len(waited) == 1 and isinstance(waited[0], grpc.RpcError), waited
        assert error_reason(waited[0]) == pb.ERROR_REASON_SITE_REPLACED
        _replaced(functools.partial(old.await_broadcast, 0))
        with eu.hub.cond:
            assert "site-a" not in eu.hub.round.assemblers  # nothing of the older process's update
        assert not _upload_status(new).known  # the newer process is served
    finally:
        old.close()
        new.close()
