"""gRPC options, deadlines and server sizing, each with the reason for it.

Every gRPC option geoloco sets lives here, so the coordinator and the site agent cannot drift
apart (``geoloco.protos.transport_endpoints`` applies them to servers and channels).
"""

from __future__ import annotations

import json
from typing import Any

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos.wire_buffers import MAX_CHUNK_SIZE, MiB

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
"""``geoloco.v1.Coordinator``."""

# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = MAX_CHUNK_SIZE + 12 * MiB
"""Largest single message either side sends or accepts (16 MiB). Big buffers are chunked, so
this only has to fit one chunk (``MAX_CHUNK_SIZE``) plus framing, and the largest non-chunk
message: a JoinResponse whose ModelLayout lists every parameter (~50 bytes each, so 12 MiB of
headroom covers models with ~200k named tensors). gRPC's default receive limit of 4 MiB would
refuse a 4 MiB chunk plus its framing."""

KEEPALIVE_TIME_MS = 30_000
"""Ping an idle connection every 30 s: AwaitBroadcast can block for a whole round, and NATs and
firewalls between data centers drop silent TCP connections after a few minutes; pings also
detect a dead peer long before the TCP timeout (~15 min)."""

KEEPALIVE_TIMEOUT_MS = 10_000
"""A ping unanswered this long closes the connection (calls fail UNAVAILABLE and are retried)."""

MIN_PING_INTERVAL_MS = 10_000
"""Servers accept client pings this often (gRPC's default 5 min would answer our 30 s pings with
GOAWAY "too_many_pings"); must stay below KEEPALIVE_TIME_MS."""

RECONNECT_BACKOFF_INITIAL_MS = 500
RECONNECT_BACKOFF_MAX_MS = 10_000
"""Reconnect quickly after a coordinator restart (gRPC's default max backoff is 2 min)."""

RETRY_METHODS = ("Join", "Heartbeat", "UploadStatus", "Leave")
"""Unary, idempotent RPCs that gRPC itself retries on UNAVAILABLE (a restarting coordinator);
the streaming RPCs resume at the application level (UploadStatus, start_chunk)."""

_RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE_NAME, "method": m} for m in RETRY_METHODS],
                "retryPolicy": _RETRY_POLICY,
            }
        ]
    }
)

_COMMON_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Keep pinging while a call is open but silent (a blocked AwaitBroadcast); the default (2)
    # stops pinging after two pings without data.
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = _COMMON_OPTIONS + (  # noqa: RUF005
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    # A second coordinator on the same port must fail to bind, not silently share the traffic.
    ("grpc.so_reuseport", 0),
)
"""Options of every geoloco gRPC server. No message compression anywhere: payloads are already
compressed (or are fp32 noise that gzip barely shrinks), so gzip would only burn CPU. HTTP/2
flow control keeps its default BDP probing, which sizes windows to each link's
bandwidth-delay product on long WAN paths."""

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = _COMMON_OPTIONS + (  # noqa: RUF005
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_INITIAL_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
)
"""Options of every site -> coordinator channel."""

# ---------------------------------------------------------------------------------------------
# Deadlines (seconds)
# ---------------------------------------------------------------------------------------------

JOIN_TIMEOUT_S = 30.0
"""Join may wait for the coordinator to load a checkpoint after a restart."""
HEARTBEAT_TIMEOUT_S = 10.0
UPLOAD_STATUS_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 10.0
SECURE_STAGE_TIMEOUT_S = 15.0
"""Deadline of one SecureStage call (the coordinator holds it at most about a second)."""
CONNECT_TIMEOUT_S = 30.0
"""How long ``wait_for_channel`` waits for the first connection."""

TRANSFER_BASE_S = 30.0
"""Fixed allowance of every streaming transfer (connection, manifest, checksum)."""
DEFAULT_MIN_TRANSFER_RATE = 1_000_000
"""Bytes/s below which a transfer counts as stuck (8 Mbit/s). Emulated slow links should pass
their own rate to ``transfer_timeout``."""

SHUTDOWN_GRACE_S = 5.0
"""On shutdown, running RPCs get this long to finish before they are cancelled. An upload cut
off here resumes after the restart (UploadStatus), so a short grace loses nothing."""


def transfer_timeout(nbytes: int, *, min_bytes_per_s: float = DEFAULT_MIN_TRANSFER_RATE) -> float:
    """Deadline for streaming ``nbytes``: a fixed allowance plus the time at the slowest
    acceptable rate."""
    if min_bytes_per_s <= 0:
        raise ValueError(f"min_bytes_per_s must be positive, got {min_bytes_per_s}")
    return TRANSFER_BASE_S + nbytes / min_bytes_per_s


def server_workers(max_sites: int) -> int:
    """Thread-pool size for a coordinator expecting up to ``max_sites`` sites.

    A blocked AwaitBroadcast holds a worker thread for the whole round, and each site may have
    an Upload, a Heartbeat and a UploadStatus open beside it.
    """
    return 4 * max(1, max_sites) + 8
