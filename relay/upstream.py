"""The relay's one connection to the coordinator, shared by every site it speaks for.

Every call names the site it is made for (the request's ``site`` field); the coordinator checks
it against the relay's ``[relays]`` list. An error the coordinator answers is passed on to the
site unchanged (status code, message and ``ErrorReason``), so a site behind a relay reacts to a
stale session, a closed round or a finished run exactly as it would talking to the coordinator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.errors import StatusError
from geoloco.protos.transport_endpoints import client_channel, coordinator_stub
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.wire_chunks import message_nbytes, upload_requests
from geoloco.relay.config import RelayConfig

__all__ = ["UPLOAD_ATTEMPTS", "Traffic", "Upstream", "passed_through"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
"""Deadline of a unary call to the coordinator."""
UPLOAD_ATTEMPTS = 5
"""Tries of the partial sum's upload (a resumed try sends only the missing chunks)."""
RETRY_PAUSE_S = 0.5


def passed_through(error: grpc.RpcError) -> StatusError:
    """The coordinator's answer, as the error the relay gives its site."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNAVAILABLE
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    return StatusError(f"coordinator: {details}", code=code, reason=error_reason(error))


class Traffic:
    """Bytes per link (serialized protobuf, as the coordinator counts them), per round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, link: str, nbytes: int) -> None:
        with self._lock:
            self._counts[link] = self._counts.get(link, 0) + nbytes

    def take(self) -> dict[str, int]:
        """The counts since the last ``take`` (one round's), sorted by link."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return dict(sorted(counts.items()))


class Upstream:
    """Calls to the coordinator on behalf of the relay's sites (module doc)."""

    def __init__(self, config: RelayConfig, traffic: Traffic) -> None:
        self.config = config
        self.traffic = traffic
        self._channel = client_channel(
            config.coordinator, tls=config.tls_files, insecure=config.insecure,
            server_name=config.coordinator_server_name,
        )
        self._stub = coordinator_stub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _sent(self, message: Any) -> None:
        self.traffic.add("relay->coordinator", message_nbytes(message))

    def _received(self, message: Any) -> None:
        self.traffic.add("coordinator->relay", message_nbytes(message))

    def unary(self, method: str, request: Any) -> Any:
        """One unary call (Join, Heartbeat, Leave, UploadStatus); errors passed through."""
        self._sent(request)
        try:
            response = getattr(self._stub, method)(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            raise passed_through(err) from None
        self._received(response)
        return response

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        """A server-streaming call (FetchModel, AwaitBroadcast), message by message."""
        self._sent(request)
        call = getattr(self._stub, method)(request)
        try:
            for message in call:
                self._received(message)
                yield message
        except grpc.RpcError as err:
            raise passed_through(err) from None
        finally:
            call.cancel()

    def upload(self, manifest: pb.UploadManifest, data: bytes | memoryview) -> pb.UploadResponse:
        """The partial sum's Upload; a broken stream is resumed (the coordinator keeps what
        arrived under the identical manifest), a refusal is raised at once."""
        missing: list[pb.IndexRange] | None = None
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            requests = upload_requests(manifest, data, missing=missing)
            try:
                response: pb.UploadResponse = self._stub.Upload(self._counted(requests), timeout=CALL_TIMEOUT_S * 4)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or attempt == UPLOAD_ATTEMPTS:
                    raise passed_through(err) from None
                logger.info(
                    "relay %s: upload of round %d broke (%s), retrying", self.config.name, manifest.round, err.code()
                )
                time.sleep(RETRY_PAUSE_S * attempt)
                continue
            self._received(response)
            if response.complete:
                return response
            missing = list(response.missing)
        raise StatusError(
            f"the partial sum of round {manifest.round} did not complete after {UPLOAD_ATTEMPTS} tries",
            code=grpc.StatusCode.UNAVAILABLE,
        )

    def _counted(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self._sent(request)
            yield request
