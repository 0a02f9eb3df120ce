"""The committed generated code imports under the installed protobuf/grpcio and round-trips.

The same check at the oldest and newest supported protobuf/grpcio versions runs in clean venvs
in ``.ci/check_protos.sh`` (too slow for the unit suite), which also regenerates and diffs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import google.protobuf
import grpc

import geoloco.protos

PROTO_DIR = Path(geoloco.protos.__file__).parent

EXPECTED_RPCS = {
    # name: (client streaming, server streaming)
    "Join": (False, False),
    "FetchModel": (False, True),
    "Upload": (True, False),
    "UploadStatus": (False, False),
    "AwaitBroadcast": (False, True),
    "Heartbeat": (False, False),
    "Leave": (False, False),
    "SecureStage": (False, False),
}


def test_generated_modules_import_without_version_warnings():
    # A fresh interpreter with warnings as errors: a gencode/runtime version warning, or an
    # import that only works because something else imported first, fails here.
    code = (
        "from geoloco.protos import geoloco_pb2_grpc, geoloco_pb2 as pb\n"
        "assert pb.DESCRIPTOR.package == 'geoloco.v1'\n"
        "assert pb.DESCRIPTOR.name == 'geoloco/protos/geoloco.proto'\n"
        "assert geoloco_pb2_grpc.CoordinatorStub and geoloco_pb2_grpc.CoordinatorServicer\n"
        "m = pb.Chunk(index=3, data=b'xyz')\n"
        "assert pb.Chunk.FromString(m.SerializeToString()) == m\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert google.protobuf.__version__ and grpc.__version__


def test_grpc_module_uses_package_imports_and_no_version_gate():
    source = (PROTO_DIR / "geoloco_pb2_grpc.py").read_text()
    assert "from geoloco.protos import geoloco_pb2" in source
    assert "\nimport geoloco_pb2" not in source
    # Stubs from grpcio-tools >= 1.63 refuse older grpcio at import; the pinned generator's don't.
    assert "GRPC_GENERATED_VERSION" not in source
    assert "ValidateProtobufRuntimeVersion" not in (PROTO_DIR / "geoloco_pb2.py").read_text()


def test_service_shape_and_message_naming():
    from geoloco.protos import geoloco_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == set(EXPECTED_RPCS)
    for name, (client_streaming, server_streaming) in EXPECTED_RPCS.items():
        method = methods[name]
        assert method.input_type.name == f"{name}Request"
        assert method.output_type.name == f"{name}Response"
        if hasattr(method, "client_streaming"):  # protobuf >= 4.22
            assert (method.client_streaming, method.server_streaming) == (
                client_streaming,
                server_streaming,
            )


def test_messages_round_trip():
    from geoloco.protos import geoloco_pb2 as pb

    manifest = pb.UploadManifest(
        site="eu-west",
        session_id="abc",
        round=12,
        fragment=1,
        sample_weight=4096.0,
        blob=pb.BlobManifest(
            total_bytes=3,
            chunk_size=2,
            num_chunks=2,
            checksum=pb.Checksum(algorithm=pb.CHECKSUM_ALGORITHM_CRC32, digest=b"\x01\x02\x03\x04"),
            codec="topk:0.01|int4",
            shape=[10, 4],
            dtype="float32",
        ),
        metrics={"loss": 3.25},
    )
    for message in (
        pb.UploadRequest(manifest=manifest),
        pb.UploadRequest(chunk=pb.Chunk(index=1, data=b"\x00\xff")),
        pb.JoinResponse(
            session_id="s",
            config=pb.RunConfig(
                inner_steps=500, uplink_codec="int8", weighting=pb.WEIGHTING_SAMPLES
            ),
            layout=pb.ModelLayout(tensors=[pb.TensorLayout(name="w", shape=[2], numel=2)], numel=2),
        ),
        pb.AwaitBroadcastResponse(
            header=pb.BroadcastHeader(
                action=pb.BROADCAST_ACTION_RESYNC, next_round=pb.RoundInfo(round=3)
            )
        ),
    ):
        parsed = type(message).FromString(message.SerializeToString())
        assert parsed == message
    assert (
        pb.UploadRequest.FromString(
            pb.UploadRequest(manifest=manifest).SerializeToString()
        ).manifest.metrics["loss"]
        == 3.25
    )
    assert pb.ErrorReason.Name(pb.ERROR_REASON_STALE_SESSION) == "ERROR_REASON_STALE_SESSION"
