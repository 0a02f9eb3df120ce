#!/usr/bin/env bash
# Checks the committed protobuf/gRPC code in protos/:
#  1. regenerating geoloco.proto with the pinned grpcio-tools (protos/regenerate.py) gives exactly
#     the committed files (a diff and exit 1 otherwise);
#  2. the generated code, the wire helpers and the transport work under the oldest and newest
#     protobuf/grpcio releases we support, each in a clean virtual environment (no system site
#     packages): import, message round trip, and a real gRPC call streaming 3 MiB over mutual TLS.
#
# Virtual environments are cached under ~/.cache/geoloco (pip's wheel cache too), so reruns take
# seconds. Needs PyPI. Usage: bash .ci/check_protos.sh [--regen-only | --compat-only]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/geoloco/protos-compat"
MODE="${1:-all}"

# Supported ends. Lowest: protobuf 3.20.3 is the first line whose runtime has the
# `internal.builder` API the pinned generator (protoc 25.1) emits; grpcio 1.60 is pyproject's floor.
# Highest: the newest releases below the next protobuf major (pyproject says protobuf<8), resolved
# at run time, plus the newest protobuf 6 (stacks such as Flower pin protobuf<7).
COMBOS=(
  "protobuf==3.20.3 grpcio==1.60.0"
  "protobuf>=6,<7 grpcio"
  "protobuf<8 grpcio"
)

if [ "$MODE" != "--compat-only" ]; then
  echo "== regenerate protos/ and compare with the committed files"
  "$PYTHON" protos/regenerate.py --check
fi
[ "$MODE" = "--regen-only" ] && exit 0

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# geoloco.protos without installing geoloco (whose other dependencies, e.g. torch, are not under
# test here): a namespace package `geoloco` holding a link to protos/.
mkdir -p "$WORK/shim/geoloco"
ln -s "$ROOT/protos" "$WORK/shim/geoloco/protos"

cat > "$WORK/compat_check.py" <<'PY'
"""Runs inside a clean venv: generated code + wire + transport, end to end over mutual TLS."""
import importlib.util
import sys
import warnings

warnings.simplefilter("error")  # gencode/runtime version warnings count as failures
import google.protobuf
import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.protos.transport_endpoints import (
    add_coordinator_servicer,
    build_server,
    client_channel,
    coordinator_stub,
    stop_server,
)
from geoloco.protos.transport_errors import error_reason
from geoloco.protos.transport_tls import TLSFiles, resolve_site
from geoloco.protos.wire_assembly import (
    Download,
    UploadAssembler,
    read_model_stream,
    read_upload_manifest,
    upload_chunks,
)
from geoloco.protos.wire_buffers import ManifestError
from geoloco.protos.wire_chunks import as_messages, model_responses, upload_requests
from geoloco.protos.wire_manifests import blob_manifest
from google.protobuf.internal import api_implementation

warnings.simplefilter("default")
print(f"protobuf {google.protobuf.__version__} ({api_implementation.Type()}), grpcio {grpc.__version__}")

spec = importlib.util.spec_from_file_location("certs_standalone", sys.argv[2])
certs = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = certs
spec.loader.exec_module(certs)
pki = sys.argv[1]
certs.init_ca(pki, force=True)
certs.issue_coordinator(pki, force=True)
certs.issue_site(pki, "site-a", force=True)

message = pb.UploadRequest(manifest=pb.UploadManifest(site="x", round=3, metrics={"loss": 1.5}))
assert pb.UploadRequest.FromString(message.SerializeToString()) == message

MODEL = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB, not a multiple of the chunk size


class Servicer(pb_grpc.CoordinatorServicer):
    def __init__(self):
        self.sites = []

    def Upload(self, requests, context):
        manifest = read_upload_manifest(requests)
        self.sites.append(resolve_site(context, manifest.site, insecure=False))
        assembler = UploadAssembler(manifest)
        assembler.consume(upload_chunks(requests))
        assert bytes(assembler.finish()) == MODEL
        return assembler.upload_response()

    def FetchModel(self, request, context):
        manifest = pb.ModelManifest(round=1, blob=blob_manifest(MODEL, chunk_size=1 << 18))
        yield from model_responses(manifest, MODEL)

    def Heartbeat(self, request, context):
        raise ManifestError("reason travels")


server, port = build_server(tls=TLSFiles.from_dir(pki, "coordinator"))
servicer = Servicer()
add_coordinator_servicer(servicer, server)
server.start()
try:
    channel = client_channel(
        f"localhost:{port}", tls=TLSFiles.from_dir(pki, "site-a")
    )
    stub = coordinator_stub(channel)  # chunk fast path
    manifest = pb.UploadManifest(round=1, blob=blob_manifest(MODEL))
    response = stub.Upload(upload_requests(manifest, MODEL), timeout=60)
    assert response.complete and response.received_bytes == len(MODEL), response
    plain = pb_grpc.CoordinatorStub(channel)  # the bare generated stub, protobuf messages
    manifest.round = 2
    requests = as_messages(upload_requests(manifest, MODEL), pb.UploadRequest)
    assert plain.Upload(requests, timeout=60).complete
    assert servicer.sites == ["site-a", "site-a"], servicer.sites
    download = Download()
    read_model_stream(stub.FetchModel(pb.FetchModelRequest(), timeout=60), download)
    assert bytes(download.result()) == MODEL
    try:
        stub.Heartbeat(pb.HeartbeatRequest(), timeout=10)
        raise AssertionError("Heartbeat should have failed")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert error_reason(e) == pb.ERROR_REASON_BAD_MANIFEST, e.trailing_metadata()
finally:
    stop_server(server, grace_s=1.0)
print("ok: import, round trip, TLS upload (fast path and generated stub), download, error reasons")
PY

status=0
for combo in "${COMBOS[@]}"; do
  key="$(echo "$combo" | tr -c 'A-Za-z0-9.\n' '_')"
  venv="$CACHE/$key"
  echo "== $combo"
  if [ ! -x "$venv/bin/python" ] || [ -n "${GEOLOCO_FRESH_VENVS:-}" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
  fi
  # shellcheck disable=SC2086  # the combo is a list of requirement specifiers
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade \
    $combo "cryptography>=42"
  if ! PYTHONPATH="$WORK/shim" "$venv/bin/python" "$WORK/compat_check.py" \
      "$WORK/pki-$key" "$ROOT/scenarios/certs.py"; then
    echo "FAILED under: $combo" >&2
    status=1
  fi
done
exit $status
